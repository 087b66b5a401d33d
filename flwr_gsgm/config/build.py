"""The strategy a validated run config asks for: asynchronous, or a synchronous run.

For a ServerApp of your own that reads the library's run config keys
(:data:`flwr_gsgm.config.run_config.RUN_CONFIG`; your app's own keys are returned
as given, for it to read)::

    cfg = parse_run_config(context.run_config)
    result = build_strategy(cfg).start(grid, ArrayRecord(model.state_dict()))

The project's own ServerApp (``serverapp/experiment.py``, the app layer) uses the
same functions; nothing here imports the app layer (``clients/``, ``serverapp/``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord
from flwr.serverapp.strategy import FedAvg, FedAvgM, FedMedian, FedTrimmedAvg

from flwr_gsgm.checkpoint.resume import parse_allowed
from flwr_gsgm.config.run_config import SYNC_STRATEGIES, optimizer_params_from
from flwr_gsgm.engine.clock import make_clock
from flwr_gsgm.engine.federated_evaluation import FederatedEvaluation
from flwr_gsgm.engine.settings import EngineSettings
from flwr_gsgm.simulation.virtual_clock import VirtualClock
from flwr_gsgm.strategy.async_strategy import AsyncStrategy
from flwr_gsgm.strategy.fednova import FedNova
from flwr_gsgm.strategy.strategies import STRATEGIES
from flwr_gsgm.strategy.synchronous import SynchronousRun
from flwr_gsgm.strategy.time_budget_fedavg import TimeBudgetFedAvg

__all__ = [
    "build_strategy",
    "build_synchronous",
    "engine_settings_from",
    "federated_evaluation_from",
    "virtual_clock_from",
]


def virtual_clock_from(
    cfg: Mapping[str, Any], partition_examples: Mapping[int, int] | None = None
) -> VirtualClock:
    """The run's :class:`VirtualClock` (time model) from its run config (``seed``,
    ``base-duration``, ``slow-fraction``, ``slow-factor``, ``jitter``,
    ``device-profile``, ``step-seconds``, ``latency-seconds``, ``server-seconds``,
    ``availability``, ``offline-detection-seconds``, ``speed-variance``,
    ``device-power``).

    ``partition_examples`` (partition-id -> training examples) is needed to time
    epoch work (``local-epochs`` > 0); the app layer computes it from the split.
    """
    return VirtualClock(
        seed=cfg["seed"],
        base_duration=cfg["base-duration"],
        slow_fraction=cfg["slow-fraction"],
        slow_factor=cfg["slow-factor"],
        jitter=cfg["jitter"],
        device_profile=cfg["device-profile"],
        step_seconds=cfg["step-seconds"],
        latency_seconds=cfg["latency-seconds"],
        server_seconds=cfg["server-seconds"],
        partition_examples=partition_examples,
        availability=cfg["availability"],
        offline_detection_seconds=cfg["offline-detection-seconds"],
        speed_variance=cfg["speed-variance"],
        device_power=cfg["device-power"],
    )


def engine_settings_from(cfg: Mapping[str, Any], run_dir: Path | None = None) -> EngineSettings:
    """The engine keys of a validated run config as :class:`EngineSettings`.

    Every key the engine declares (:meth:`EngineSettings.from_run_config`: budgets,
    deadlines, limits, checkpoints; ``0`` = none read there), plus what this layer
    derives from other keys: the checkpoint path ``run_dir/checkpoint.pt``, the run
    config a resume compares, and ``resume-allow-changes`` as a tuple. The clock and
    seed are set by :meth:`AsyncStrategy.start`, as are budgets it is given.

    Raises
    ------
    ValueError
        ``checkpoint-every`` or ``resume`` without a ``run_dir``; a
        ``resume-allow-changes`` naming a key ``cfg`` does not have.
    KeyError
        ``cfg`` was not parsed (:func:`~flwr_gsgm.config.run_config.parse_run_config`).
    """
    return EngineSettings.from_run_config(
        cfg,
        checkpoint_path=(run_dir / "checkpoint.pt") if run_dir is not None else None,
        run_config=dict(cfg),
        resume_allow_changes=parse_allowed(cfg["resume-allow-changes"], cfg),
    )


def federated_evaluation_from(cfg: Mapping[str, Any]) -> FederatedEvaluation | None:
    """``federated-eval-every`` and ``fraction-evaluate`` as :class:`FederatedEvaluation`
    (None when ``federated-eval-every`` is 0)."""
    every = cfg["federated-eval-every"]
    if not every:
        return None
    return FederatedEvaluation(every=every, fraction_evaluate=cfg["fraction-evaluate"])


def build_strategy(
    cfg: Mapping[str, Any],
    run_dir: Path | None = None,
    partition_examples: Mapping[int, int] | None = None,
) -> AsyncStrategy:
    """Build the asynchronous strategy a validated run config asks for.

    ``cfg`` comes from :func:`flwr_gsgm.config.run_config.parse_run_config`; the rule's
    parameters come from their run config keys (``0`` = none, or the rule's own
    default for ``server-learning-rate``). Checkpoints go to
    ``run_dir/checkpoint.pt``. ``partition_examples``: see :func:`virtual_clock_from`.

    Raises
    ------
    ValueError
        If ``cfg["strategy"]`` is not an asynchronous strategy (``fedavg`` and
        ``fedavgm`` are Flower's own, run by the app layer).
    """
    name = cfg["strategy"]
    if name not in STRATEGIES:
        raise ValueError(
            f"strategy {name!r} is not asynchronous; expected one of {sorted(STRATEGIES)}"
        )
    params = optimizer_params_from(cfg, name)
    return STRATEGIES[name](
        # absent (server-learning-rate = 0): the rule's declared default
        server_learning_rate=params.pop("lr", None),
        client_mode=cfg["client-mode"],
        batch_size=cfg["batch-size"],
        local_batches=cfg["local-batches"],
        local_steps=cfg["local-steps"],
        local_epochs=cfg["local-epochs"],
        local_lr=cfg["local-lr"],
        local_momentum=cfg["local-momentum"],
        virtual_clock=(
            virtual_clock_from(cfg, partition_examples) if cfg["virtual-clock"] else None
        ),
        engine=engine_settings_from(cfg, run_dir),
        seed=cfg["seed"],
        federated_evaluation=federated_evaluation_from(cfg),
        **params,
    )


def _sync_strategy(cfg: Mapping[str, Any], num_nodes: int, per_round: int) -> FedAvg:
    """The synchronous strategy ``cfg["strategy"]`` names (:data:`SYNC_STRATEGIES`),
    sampling ``per_round`` of ``num_nodes`` nodes a round (FedBuff's synchronous
    setting where fewer than all), with Flower's own federated evaluation where
    ``federated-eval-every`` asks for it."""
    common: dict[str, Any] = {
        "fraction_train": per_round / num_nodes,
        "fraction_evaluate": cfg["fraction-evaluate"] if cfg["federated-eval-every"] else 0.0,
        "min_evaluate_nodes": 1,
        # Every node, as a round waits for the fleet to connect; under the time model's
        # availability Flower's own default (2): a fleet that churns is never all
        # online at once, and a user's FedAvg samples among the nodes that are.
        "min_available_nodes": num_nodes if cfg["availability"] == "always" else min(2, num_nodes),
    }
    if per_round < num_nodes:
        # min_train_nodes = m: Flower samples max(int(n * m / n), min_train_nodes) nodes,
        # and int() of the float product may round m down.
        common["min_train_nodes"] = per_round
    # server-learning-rate 0 = the strategy's default (Flower's FedAvgM's, FedNova's 1.0).
    lr = cfg["server-learning-rate"]
    rate = {"server_learning_rate": lr} if lr else {}
    name = cfg["strategy"]
    if name == "fedavgm":
        return FedAvgM(server_momentum=cfg["beta"], **rate, **common)
    if name == "fednova":
        return FedNova(local_momentum=cfg["local-momentum"], **rate, **common)
    if name == "time-budget-fedavg":
        return TimeBudgetFedAvg(**common)
    if name == "fedmedian":
        return FedMedian(**common)
    if name == "fedtrimmedavg":
        # Flower's default beta 0.2: int(0.2 n) updates cut at each end, per coordinate.
        return FedTrimmedAvg(**common)
    return FedAvg(**common)


def build_synchronous(
    cfg: Mapping[str, Any],
    num_nodes: int,
    model_bytes: int,
    partition_examples: Mapping[int, int] | None = None,
) -> SynchronousRun:
    """The synchronous run a validated run config asks for (``strategy`` one of
    :data:`~flwr_gsgm.config.run_config.SYNC_STRATEGIES`): Flower's FedAvg or FedAvgM,
    or a time-budget anchor, on the engine's clock, budgets and evaluation rows
    (:class:`~flwr_gsgm.strategy.synchronous.SynchronousRun`).

    ``max-in-flight`` = m with 0 < m < ``num_nodes`` samples m nodes a round,
    otherwise every node trains every round; ``max-seconds`` is a virtual budget under
    the virtual clock, a wall-clock one without it. ``model_bytes``: the bytes of the
    model sent (the time model's communication); ``partition_examples``: see
    :func:`virtual_clock_from`.

    Raises
    ------
    ValueError
        If ``cfg["strategy"]`` is not synchronous, or ``num_nodes`` < 1.
    """
    name = cfg["strategy"]
    if name not in SYNC_STRATEGIES:
        raise ValueError(f"strategy {name!r} is not synchronous; expected one of {SYNC_STRATEGIES}")
    if num_nodes < 1:
        raise ValueError(f"a synchronous run needs nodes; the grid has {num_nodes}")
    # The engine's own settings of the keys a round reads, so that "0 = none" and the
    # choice of clock are made where the asynchronous runs make them.
    settings = EngineSettings(
        max_seconds=cfg["max-seconds"],
        max_in_flight=cfg["max-in-flight"],
        dispatch_timeout=cfg["dispatch-timeout"],
        message_ttl=cfg["message-ttl"],
        virtual_clock=virtual_clock_from(cfg, partition_examples) if cfg["virtual-clock"] else None,
    )
    limit = settings.max_in_flight
    per_round = limit if limit is not None and limit < num_nodes else num_nodes
    return SynchronousRun(
        _sync_strategy(cfg, num_nodes, per_round),
        make_clock(settings),
        max_updates=cfg["max-updates"],
        per_round=per_round,
        num_nodes=num_nodes,
        eval_every=cfg["eval-every"],
        federated_eval_every=cfg["federated-eval-every"],
        seed=cfg["seed"],
        timeout=settings.dispatch_timeout,
        model_bytes=model_bytes,
        train_config=ConfigRecord(
            {
                "mode": "weights",
                "batch-size": cfg["batch-size"],
                "local-steps": cfg["local-steps"],
                "local-epochs": cfg["local-epochs"],
                "local-lr": cfg["local-lr"],
                "local-momentum": cfg["local-momentum"],
            }
        ),
    )
