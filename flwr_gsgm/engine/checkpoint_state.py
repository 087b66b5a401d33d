"""The engine's checkpoint state: the file's top level, and what a resume must match.

The state is plain numpy/python values (:mod:`flwr_gsgm.checkpoint.files` writes the
file), composed by :meth:`AsyncEngine.state_dict
<flwr_gsgm.engine.async_engine.AsyncEngine.state_dict>` from each part's
``state_dict()``. Only checkpoints of the file's format
(:data:`flwr_gsgm.checkpoint.files.CHECKPOINT_FORMAT`) load; each has every one of
these top-level keys:

- ``keys`` (the model's), ``received`` (updates received) and ``fingerprint``
  (:func:`flwr_gsgm.checkpoint.resume.fingerprint`): the engine's own;
- under their own key: ``optimizer`` (the model optimizer), ``node_stats`` (the
  per-node counts), ``norm_bound``;
- at the top level, the entries of the parts whose state is several: membership
  (``nodes``, ``speeds``, ``num_partitions``), the ledger (``counters``,
  ``rejections``, ``window``), what is in flight (``in_flight``), the dispatcher
  (``seq``, ``dispatch``, ``work_scheduling``), how the run ends (``diverged``,
  ``divergence``), the clock (``clock_now``) and the evaluation rows (``rows``).

A resume (:func:`check_before_start`, :func:`check_after_start`) is refused, naming
the checkpoint and each key, if the run's settings differ from the checkpoint's in
what changes the result (:mod:`flwr_gsgm.checkpoint.resume`) or its nodes report
another number of partitions, unless run config ``resume-allow-changes`` lists the
key. Every node that answers at the restart is in the run again: one lost before the
checkpoint rejoins, one active then but silent now is lost until it comes back
(:meth:`Membership.reconcile <flwr_gsgm.engine.membership.Membership.reconcile>`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr_gsgm.checkpoint import files as checkpoint
from flwr_gsgm.checkpoint.resume import check_resume, fingerprint
from flwr_gsgm.engine.settings import EngineSettings

__all__ = [
    "REQUIRED",
    "check_after_start",
    "check_before_start",
    "run_fingerprint",
    "with_params",
]

#: Top-level keys checked before the resume starts (not an engine state without them).
REQUIRED = (
    "keys",
    "optimizer",
    "nodes",
    "speeds",
    "num_partitions",
    "in_flight",
    "rows",
    "fingerprint",
)


def run_fingerprint(
    settings: EngineSettings, train_config: Mapping[str, Any], params: Mapping[str, Any]
) -> dict[str, Any]:
    """What a resume must share with its checkpoint: the run config (or, without one,
    the rule's ``params`` and the ``train_config``)."""
    return fingerprint(settings.run_config, dict(params), dict(train_config))


def check_before_start(
    settings: EngineSettings, state: dict[str, Any], train_config: Mapping[str, Any]
) -> None:
    """Before any message: ``state`` is an engine state whose run config matches.

    Raises
    ------
    CheckpointError
        A key every engine state has is missing (not a checkpoint of this engine).
    ResumeRefused
        The run config differs in a key that changes the result and
        ``resume-allow-changes`` does not list it
        (:func:`flwr_gsgm.checkpoint.resume.check_resume`).
    """
    path = settings.checkpoint_path
    missing = [k for k in REQUIRED if k not in state]
    if missing:
        raise checkpoint.CheckpointError(
            f"checkpoint {path} is not an engine state of flwr-gsgm: it lacks {missing}"
        )
    if settings.run_config is None:
        return  # compared once the rule exists (check_after_start)
    check_resume(
        path,
        state["fingerprint"],
        run_fingerprint(settings, train_config, {}),
        settings.resume_allow_changes,
    )


def check_after_start(
    settings: EngineSettings,
    state: dict[str, Any],
    keys: list[str],
    current: dict[str, Any],
    num_partitions: int,
) -> None:
    """Once the nodes answered and the rule exists: ``state`` fits this run.

    ``keys`` are the model's, ``current`` this run's fingerprint with the rule's
    parameters (:func:`run_fingerprint`), ``num_partitions`` what the nodes report.

    Raises
    ------
    ValueError
        The model keys differ.
    ResumeRefused
        The nodes report another number of partitions (unless allowed), or (a
        strategy started without a run config) the rule's parameters or train
        config differ.
    """
    path = settings.checkpoint_path
    if state["keys"] != keys:
        raise ValueError(f"checkpoint model keys {state['keys'][:3]}... differ from the model's")
    if settings.run_config is None:
        check_resume(path, state["fingerprint"], current, settings.resume_allow_changes)
    check_resume(
        path,
        {"num-partitions": state["num_partitions"]},
        {"num-partitions": num_partitions},
        settings.resume_allow_changes,
    )


def with_params(optimizer_state: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """``optimizer_state`` (a ModelOptimizer's) with the rule's parameters replaced by
    ``params``."""
    return {**optimizer_state, "rule": {**optimizer_state["rule"], "params": dict(params)}}
