"""The strategy's hooks for what a FedAvg subclass does: a per-dispatch train
configuration and a callback on each server and each federated evaluation.

- ``train_config_fn(node_id, model_version, updates_received) -> ConfigRecord`` is
  called for every train message the engine sends, just before it is built; its keys
  are merged over the run's train config (a learning-rate schedule, FedAvg's
  ``configure_train`` override).
- ``on_evaluate(updates, arrays, metrics) -> None`` is called after every server
  (centralized) evaluation (logging, e.g. to W&B; best-model checkpoints; FedAvg's
  ``evaluate_fn`` side effects or ``aggregate_evaluate`` override).
- ``on_federated_evaluate(updates, metrics) -> None`` is called when a federated
  evaluation's aggregate arrives (:mod:`flwr_gsgm.engine.federated_evaluation`): the nodes'
  metrics aggregated as Flower's FedAvg does (``aggregate_evaluate``'s
  ``evaluate_metrics_aggr_fn``), keyed by the ``updates`` the model was sent at, so a
  logger writes them live.

A hook that raises ends the run with :class:`HookFailed` (naming the hook and the
exception, the original chained as ``__cause__``): no further message is sent and
nothing waits on it. A hook not given costs nothing: no call, no copy, no RNG draw.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord

__all__ = [
    "ENGINE_TRAIN_KEYS",
    "HookFailed",
    "OnEvaluate",
    "OnFederatedEvaluate",
    "TrainConfigFn",
    "call_hook",
    "check_hook",
    "evaluation_metrics",
    "merge_train_config",
]

#: ``(node_id, model_version, updates_received) -> ConfigRecord``.
TrainConfigFn = Callable[[int, int, int], ConfigRecord]
#: ``(updates, arrays, metrics) -> None``.
OnEvaluate = Callable[[int, ArrayRecord, MetricRecord], Any]
#: ``(updates, metrics) -> None``.
OnFederatedEvaluate = Callable[[int, MetricRecord], Any]

#: Train config keys a ``train_config_fn`` may not set: the engine sets
#: ``model-version``, ``seed`` and ``virtual-duration`` for each dispatch, and the
#: server reads every reply in the strategy's ``mode``.
ENGINE_TRAIN_KEYS = ("mode", "model-version", "seed", "virtual-duration", "virtual-train-seconds")


class HookFailed(RuntimeError):
    """A strategy hook (``train_config_fn``, ``on_evaluate``, ``on_federated_evaluate``)
    raised; the run stopped.

    Attributes
    ----------
    hook : str
        The hook's name.
    """

    def __init__(self, hook: str, message: str) -> None:
        super().__init__(message)
        self.hook = hook


def check_hook(name: str, fn: Any) -> None:
    """Raise TypeError unless ``fn`` is None or callable (checked at construction)."""
    if fn is not None and not callable(fn):
        raise TypeError(f"{name} must be a callable or None, got {type(fn).__name__} {fn!r}")


def call_hook(name: str, fn: Callable[..., Any], **kwargs: Any) -> Any:
    """``fn(*kwargs.values())``; an exception becomes :class:`HookFailed`.

    The message names the hook, the arguments and the exception, so a run that stops
    in a hook says where without a debugger.
    """
    try:
        return fn(*kwargs.values())
    except Exception as err:
        args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items() if not _bulky(v))
        raise HookFailed(
            name, f"{name}({args}) raised {type(err).__name__}: {err}; the run stopped"
        ) from err


def _bulky(value: Any) -> bool:
    """True for the model and metric records: left out of the message."""
    return isinstance(value, (ArrayRecord, MetricRecord))


def merge_train_config(
    base: Mapping[str, Any],
    fn: TrainConfigFn,
    node_id: int,
    model_version: int,
    updates_received: int,
) -> ConfigRecord:
    """``base`` with the keys ``fn(node_id, model_version, updates_received)`` returned.

    Raises
    ------
    HookFailed
        If ``fn`` raised.
    TypeError
        If ``fn`` returned anything but a ConfigRecord (the message names its type).
    ValueError
        If it returned a key of :data:`ENGINE_TRAIN_KEYS`.
    """
    extra = call_hook(
        "train_config_fn",
        fn,
        node_id=node_id,
        model_version=model_version,
        updates_received=updates_received,
    )
    if not isinstance(extra, ConfigRecord):
        raise TypeError(
            f"train_config_fn must return a ConfigRecord, got {type(extra).__name__} "
            f"{extra!r} (node_id={node_id}, model_version={model_version}, "
            f"updates_received={updates_received}); e.g. return ConfigRecord({{'local-lr': 0.05}})"
        )
    reserved = sorted(k for k in extra if k in ENGINE_TRAIN_KEYS)
    if reserved:
        raise ValueError(
            f"train_config_fn returned {', '.join(repr(k) for k in reserved)}; the engine "
            f"sets {', '.join(ENGINE_TRAIN_KEYS)} itself (client mode: the strategy's "
            "client_mode); expected other keys"
        )
    config = ConfigRecord(dict(base))
    for key, value in extra.items():
        config[key] = value
    return config


def evaluation_metrics(row: Mapping[str, Any], evaluated: Mapping[str, Any] | None) -> MetricRecord:
    """What ``on_evaluate`` gets as ``metrics``: the evaluation row, then the other keys
    ``evaluate_fn`` returned.

    The row is the ``metrics.csv`` line of this evaluation (``updates``, ``version``,
    ``virtual_time``, ``wall_time``, ``accuracy``, ``loss``, the window's
    ``staleness_mean``, ``staleness_max``, ``train_loss``, ``deferred``, ``rejected``,
    ``dropped``); ``evaluated`` is ``evaluate_fn``'s MetricRecord (None: none), whose
    keys other than the row's are added as returned. A value the run does not have
    (NaN in ``metrics.csv``: ``train_loss`` at 0 updates or of a window whose replies
    reported no loss, ``accuracy`` and ``loss`` that ``evaluate_fn`` did not return) is
    left out, so ``metrics.get("train_loss")`` is None there (a MetricRecord holds no
    None) and ``json.dumps(dict(metrics), allow_nan=False)`` works; a NaN that
    ``evaluate_fn`` returned (a diverged model's loss) is kept.
    """
    out: dict[str, Any] = {k: v for k, v in dict(evaluated or {}).items() if k not in row}
    for key, value in row.items():
        if isinstance(value, float) and math.isnan(value) and key not in (evaluated or {}):
            continue  # no value, not a measured NaN: the hooks' JSON stays strict
        # numpy integers are no MetricRecord value; bool is an int here, as in the CSV
        out[key] = int(value) if isinstance(value, (int, np.integer)) else float(value)
    return MetricRecord(out)
