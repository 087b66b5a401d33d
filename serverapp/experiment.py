"""One experiment from a validated run config: strategy, model, evaluation, outputs.

The app layer (not part of the ``flwr-gsgm`` wheel): the project's ServerApp
(:mod:`serverapp.server_app`) and every other driver (tests, the sweep runner)
call :func:`run_experiment` with their grid, so every way of running uses the same
code. It wires the library (:func:`flwr_gsgm.config.build.build_strategy`,
:mod:`flwr_gsgm.config.outputs`) to the project's model and data (``clients/``), and
runs the synchronous baselines with Flower's own start(): Flower's FedAvg / FedAvgM,
and the time-budget anchors on Flower's FedAvg (time-budget FedAvg, FedNova).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable, Mapping
from logging import INFO, WARNING
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, FedAvgM

from clients.datasets import load_dataset
from clients.models import build_model
from clients.partitioning import PartitionConfig, check_partitioning, load_partition
from clients.training import evaluate
from flwr_gsgm.config import outputs as run_outputs
from flwr_gsgm.config.build import build_strategy, virtual_clock_from
from flwr_gsgm.config.outputs import run_dir_for
from flwr_gsgm.config.run_config import SYNC_STRATEGIES, unread_settings
from flwr_gsgm.engine.divergence import evaluation_divergence
from flwr_gsgm.engine.federated_evaluation import column_name
from flwr_gsgm.engine.run_end import DIVERGED, RunDiverged, RunFailed
from flwr_gsgm.strategy.fednova import FedNova
from flwr_gsgm.strategy.time_budget_fedavg import TimeBudgetFedAvg
from serverapp.app_config import parse_app_config
from serverapp.plot import plot_accuracy

__all__ = ["LAST_FINITE_MODEL", "MODEL", "make_evaluate_fn", "run_experiment"]

#: The app's model files: torch ``state_dict``s (``torch.load``), the model's own format
#: (the library's default is numpy's ``.npz``, :func:`flwr_gsgm.config.outputs.write_model`).
MODEL = "model.pt"
LAST_FINITE_MODEL = "model_last_finite.pt"


def make_evaluate_fn(cfg: Mapping[str, Any]):
    """Centralized evaluation on the data set's test split.

    Uses the whole test split, or a fixed subset of ``eval-examples`` images.
    Returns ``fn(step, arrays) -> MetricRecord{"accuracy": fraction, "loss": mean CE}``.
    Raises ``FileNotFoundError`` (with install instructions) if the data are missing.
    """
    _, test = load_dataset(cfg["dataset"], cfg["data-root"])
    if 0 < cfg["eval-examples"] < len(test.labels):
        # A fixed subset, the same for every seed and method (generator seed 0).
        rows = torch.randperm(len(test.labels), generator=torch.Generator().manual_seed(0))
        test = test.subset(rows[: cfg["eval-examples"]].sort().values)
    model = build_model(cfg["dataset"])

    def evaluate_fn(step: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, accuracy = evaluate(model, test.images, test.labels, threads=cfg["eval-threads"])
        return MetricRecord({"accuracy": float(accuracy), "loss": float(loss)})

    return evaluate_fn


def check_partitions(grid: Grid, cfg: Mapping[str, Any]) -> list[str]:
    """Compute the split the nodes will compute, before any message; return warnings.

    In a simulation (``virtual-clock`` on: Flower's simulation engine and the
    in-process grid) every node holds partition-id i of num-partitions = the number
    of nodes, cut from the data set by :mod:`clients.partitioning`, a pure function
    of the labels and the run config: the ServerApp computes the same split. In
    deployment nodes may hold their own data (node config ``data-dir``) and connect
    later, so a node reports an impossible split itself, in its error replies.

    Raises
    ------
    clients.partitioning.ImpossiblePartitioning
        Naming the key, the value, the smallest partition and what to change.
    """
    num_nodes = len(list(grid.get_node_ids()))
    if not cfg["virtual-clock"] or num_nodes == 0:
        return []
    found = check_partitioning(cfg["dataset"], cfg["data-root"], _partition_config(cfg, num_nodes))
    for warning in found:
        log(WARNING, "[flwr-gsgm] %s", warning)
    return found


def _partition_config(cfg: Mapping[str, Any], num_nodes: int) -> PartitionConfig:
    return PartitionConfig(
        partitioner=cfg["partitioner"],
        num_partitions=num_nodes,
        classes_per_node=cfg["classes-per-node"],
        dirichlet_alpha=cfg["dirichlet-alpha"],
        seed=cfg["seed"],
        examples_per_node=cfg["examples-per-node"],
    )


def partition_examples(grid: Grid, cfg: Mapping[str, Any]) -> dict[int, int] | None:
    """Training examples per partition-id of the split the nodes compute (simulation),
    for the virtual clock to time epoch work; None when it is not needed (no
    ``local-epochs`` > 0, or no virtual clock) or not known (no nodes)."""
    num_nodes = len(list(grid.get_node_ids()))
    if not cfg["virtual-clock"] or cfg["local-epochs"] <= 0 or num_nodes == 0:
        return None
    config = _partition_config(cfg, num_nodes)
    return {
        p: len(load_partition(cfg["dataset"], cfg["data-root"], config, p))
        for p in range(num_nodes)
    }


def _initial_arrays(cfg: Mapping[str, Any]) -> ArrayRecord:
    torch.manual_seed(cfg["seed"])
    state = build_model(cfg["dataset"]).state_dict()
    return ArrayRecord({key: tensor.contiguous() for key, tensor in state.items()})


def run_experiment(
    grid: Grid, cfg: Mapping[str, Any], run_dir: Path | None = None
) -> dict[str, Any]:
    """Run one experiment on ``grid`` and write its outputs; return the summary dict.

    Parameters
    ----------
    grid : Grid
        Flower grid (simulation, deployment or in-process).
    cfg : Mapping
        A run config: checked here first (:func:`serverapp.app_config.parse_app_config`:
        the library's keys and the app's, defaults filled in), so it may be one the
        library parsed alone, or ``context.run_config`` itself.
    run_dir : Path, optional
        Output folder; default :func:`run_dir_for`.

    Raises
    ------
    flwr_gsgm.engine.run_end.RunFailed
        If no node was left to train before the budget was spent, after the outputs
        (``status`` "failed" and ``status_reason`` in summary.json) are written.
    flwr_gsgm.engine.run_end.RunDiverged
        If the model diverged (:mod:`flwr_gsgm.engine.divergence`; for FedAvg and FedAvgM
        checks 2-3 on their evaluation rows), after the outputs (``status``
        "diverged") are written: no ``model.pt``, but ``model_last_finite.pt``, the
        model of the last evaluation before the divergence (asynchronous strategies).
    """
    cfg = parse_app_config(cfg)  # before anything: a typo fails here
    torch.set_num_threads(cfg["client-threads"])
    warnings = list(check_partitions(grid, cfg))  # an impossible split fails here, at once
    for warning in unread_settings(cfg):  # a setting the strategy ignores: say so
        log(WARNING, "[flwr-gsgm] %s", warning)
        warnings.append(warning)
    run_dir = run_dir or run_dir_for(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    run_outputs.write_config(run_dir, cfg)
    evaluate_fn = make_evaluate_fn(cfg)
    initial = _initial_arrays(cfg)
    log(INFO, "[flwr-gsgm] run folder %s", run_dir)
    t0 = time.monotonic()
    examples = partition_examples(grid, cfg)
    if cfg["strategy"] in SYNC_STRATEGIES:
        diverged: RunDiverged | None = None
        work: dict[str, Any] = {}  # summary.json's work_scheduling, for the anchors
        try:
            rows, counters = _run_synchronous(grid, cfg, initial, evaluate_fn, examples, work)
        except _SyncDiverged as err:
            rows, counters = err.rows, err.counters
            diverged = RunDiverged(err.reason)
        summary = run_outputs.summarize(
            rows,
            counters,
            {},
            0.0,
            0,
            time.monotonic() - t0,
            rows[-1]["virtual_time"] if rows else 0.0,
            report=SimpleNamespace(**work) if work else None,
            warnings=warnings,
            status=diverged and (DIVERGED, diverged.reason),
        )
        if diverged is not None:
            _write_outputs(run_dir, cfg, rows, summary, grid)
            _log_diverged(run_dir, diverged.reason, None)
            raise diverged
    else:
        failed: RunFailed | None = None
        try:
            result = build_strategy(cfg, run_dir, examples).start(
                grid,
                initial,
                max_updates=cfg["max-updates"],
                max_seconds=cfg["max-seconds"],  # 0 = none: EngineSettings reads it
                evaluate_fn=evaluate_fn,
                eval_every=cfg["eval-every"],
            )
        except RunFailed as err:  # write what the run did, then fail with the reason
            failed, result = err, err.result
        if result is None:  # failed before the engine had a report (out of memory at start)
            assert failed is not None
            summary = run_outputs.summarize(
                [],
                {},
                {},
                0.0,
                0,
                time.monotonic() - t0,
                0.0,
                warnings=warnings,
                status=(failed.status, failed.reason),
            )
            _write_outputs(run_dir, cfg, [], summary, grid)
            raise failed
        rep = result.report
        rows = result.rows
        if isinstance(failed, RunDiverged):
            # Not the diverged model as if it trained: the last finite one, named so.
            (run_dir / MODEL).unlink(missing_ok=True)
            if rep.last_finite is not None:
                run_outputs.write_model(run_dir, rep.last_finite[1], LAST_FINITE_MODEL)
        else:
            run_outputs.write_model(run_dir, result.arrays, MODEL)
        summary = run_outputs.summarize(
            rows,
            rep.counters,
            rep.rejections,
            rep.staleness_mean,
            rep.staleness_max,
            rep.wall_seconds,
            rep.virtual_seconds,
            report=rep,
            warnings=warnings,
        )
        if failed is not None:
            _write_outputs(run_dir, cfg, rows, summary, grid)
            if isinstance(failed, RunDiverged):
                _log_diverged(run_dir, failed.reason, rep.last_finite)
            raise failed
    _write_outputs(run_dir, cfg, rows, summary, grid)
    return summary


def _write_outputs(run_dir: Path, cfg: Mapping[str, Any], rows, summary, grid: Grid) -> None:
    """metrics.csv, summary.json and accuracy.png; the final log line."""
    run_outputs.write_metrics(run_dir, rows)
    run_outputs.write_summary(run_dir, summary)
    plot_accuracy(run_dir, rows, _title(cfg, summary, len(list(grid.get_node_ids()))))
    log(
        INFO,
        "[flwr-gsgm] final accuracy %.4f, MASD %.4f -> %s",
        summary["final_accuracy"],
        summary["masd"],
        run_dir,
    )


def _log_diverged(run_dir: Path, reason: str, last_finite: tuple[int, Any] | None) -> None:
    """The log line of a diverged run: why, and which model was kept."""
    kept = (
        f"{LAST_FINITE_MODEL} holds the model evaluated at {last_finite[0]} updates"
        if last_finite is not None
        else "no model written"
    )
    log(WARNING, "[flwr-gsgm] run diverged: %s; %s -> %s", reason, kept, run_dir)


class _SyncDiverged(Exception):
    """FedAvg's or FedAvgM's evaluation row showed divergence: the run stops there."""

    def __init__(self, reason: str, rows: list[dict[str, Any]], counters: dict[str, int]):
        super().__init__(reason)
        self.reason, self.rows, self.counters = reason, rows, counters


def _title(cfg: Mapping[str, Any], summary: Mapping[str, Any], num_nodes: int) -> str:
    split = {
        "pathological": f"{cfg['classes-per-node']} classes per node",
        "dirichlet": f"Dirichlet alpha {cfg['dirichlet-alpha']}",
        "iid": "IID",
    }[cfg["partitioner"]]
    return (
        f"{cfg['strategy'].upper()} on {cfg['dataset']} ({num_nodes} nodes, {split}, seed "
        f"{cfg['seed']}): "
        f"final accuracy {100 * summary['final_accuracy']:.1f}%, MASD {summary['masd']:.4f}"
    )


def _in_node_order(replies: Iterable[Message]) -> list[Message]:
    """The replies sorted by sending node id.

    Flower's FedAvg sums the replies in the order they are pulled, which depends on
    thread timing; float32 sums in another order differ in their last bits (a loss of
    2.29759836 in one run, 2.29759838 in the next). A fixed order makes runs repeat
    bit for bit."""
    return sorted(replies, key=lambda reply: reply.metadata.src_node_id)


class _WallBudgetSpent(Exception):
    """Raised by a synchronous strategy, instead of starting a round, once the wall-clock
    budget (``max-seconds`` without the virtual clock) is spent; ``last_round`` is the
    last round that ran."""

    def __init__(self, last_round: int) -> None:
        super().__init__(f"wall-clock budget spent after round {last_round}")
        self.last_round = last_round


def _recording_sampled(
    cls: type,
    sampled: dict[int, list[int]],
    federated_due: Callable[[int], bool],
    federated_nodes: dict[int, int],
    budget_spent: Callable[[], bool] = lambda: False,
    on_messages: Callable[[int, list[Message]], None] | None = None,
) -> type:
    """``cls`` (one of :data:`_SYNC_CLASSES`) noting each round's partition-ids from its
    train replies, with its federated evaluation only in the rounds ``federated_due``
    names (each such round's count of evaluate replies without error in
    ``federated_nodes``). It starts no round once ``budget_spent()``: it raises
    :class:`_WallBudgetSpent`. ``on_messages(round, messages)`` sees (and may edit the
    configs of) each round's train messages before they are sent."""

    class Recording(cls):  # type: ignore[misc, valid-type]
        federated_metrics: dict[int, MetricRecord]

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.federated_metrics = {}

        def configure_train(self, server_round, arrays, config, grid):
            if budget_spent():
                raise _WallBudgetSpent(server_round - 1)
            messages = super().configure_train(server_round, arrays, config, grid)
            if on_messages is None:
                return messages
            messages = list(messages)
            on_messages(server_round, messages)
            return messages

        def configure_evaluate(self, server_round, arrays, config, grid):
            if not federated_due(server_round):
                return []
            return super().configure_evaluate(server_round, arrays, config, grid)

        def aggregate_evaluate(self, server_round, replies):
            replies = _in_node_order(replies)
            if replies:
                federated_nodes[server_round] = sum(not r.has_error() for r in replies)
            metrics = super().aggregate_evaluate(server_round, replies)
            if metrics is not None:  # what Flower's Result keeps, for a run the budget ends
                self.federated_metrics[server_round] = metrics
            return metrics

        def aggregate_train(self, server_round, replies):
            replies = _in_node_order(replies)
            sampled[server_round] = sorted(
                int(r.content["metrics"]["partition-id"])
                for r in replies
                if not r.has_error()
                and "metrics" in r.content
                and "partition-id" in r.content["metrics"]
            )
            return super().aggregate_train(server_round, replies)

    Recording.__name__ = cls.__name__
    return Recording


#: The synchronous strategies by run config name: Flower's, and the time-budget anchors
#: (subclasses of Flower's FedAvg that set each node's local-steps).
_SYNC_CLASSES: dict[str, type] = {
    "fedavg": FedAvg,
    "fedavgm": FedAvgM,
    "time-budget-fedavg": TimeBudgetFedAvg,
    "fednova": FedNova,
}


def _partitions_of_nodes(grid: Grid, timeout: float) -> dict[int, int]:
    """node id -> partition-id, from each node's answer to the start-up ``query`` of
    the message protocol (clients/client_app.py); a node that cannot answer is left out."""
    messages = [
        Message(RecordDict({"config": ConfigRecord()}), node_id, "query")
        for node_id in grid.get_node_ids()
    ]
    found: dict[int, int] = {}
    for reply in grid.send_and_receive(messages, timeout=timeout):
        metrics = None if reply.has_error() else reply.content.get("metrics")
        if isinstance(metrics, MetricRecord) and "partition-id" in metrics:
            found[reply.metadata.src_node_id] = int(metrics["partition-id"])
    return found


def _run_synchronous(
    grid: Grid,
    cfg: Mapping[str, Any],
    initial: ArrayRecord,
    evaluate_fn,
    examples: Mapping[int, int] | None = None,
    work: dict[str, Any] | None = None,
):
    """A synchronous strategy (:data:`_SYNC_CLASSES`) with the same ClientApp
    ("weights" mode): Flower's FedAvg / FedAvgM, time-budget FedAvg or FedNova.

    ``max-in-flight`` = m with 0 < m < nodes samples m nodes per round
    (``fraction_train = m / nodes``, FedBuff's synchronous setting); otherwise every
    node trains every round. Rounds are ``max-updates // nodes-per-round``, so the
    client computations equal ``max-updates`` (rounded down). A round's virtual
    duration is that of its slowest node among those that trained in it: every node
    with full participation; with sampling, the partition-ids of the round's train
    replies (Flower samples with the module-level ``random``, seeded here with the run's
    ``seed``; which nodes train is read from the replies, not predicted, and a sampled
    node whose reply failed does not count). Node p's duration in round r is the time
    model's for ``(p, dispatch index r - 1)``: its local work in weights mode (``examples``:
    partition-id -> training examples, for epoch work) and the model's bytes each way, as
    the asynchronous engine charges a message.

    Time-budget FedAvg and FedNova set each node's ``local-steps`` per round: node p's
    duration in round r is then that of the steps its round-r message asked for. Under
    the virtual clock they first ask every node its partition-id (the protocol's
    ``query``), so that each train message carries ``virtual-train-seconds``, the
    compute part of its duration (what the simulated device reports as
    ``train-seconds``, from which the strategy measures the node's speed).
    ``work["work_scheduling"]`` is set to their scheduling's state at the end and
    ``work["work_nodes"]`` to each node's measured seconds per step and last local-steps
    (summary.json's ``work_scheduling``). FedAvg and FedAvgM send no query and their
    messages are Flower's own.

    With the virtual clock ``max-seconds`` > 0 is a virtual budget: the run ends with the
    last round that finished within it (a round that ends later is not applied).
    Without the virtual clock (deployment) ``max-seconds`` > 0 is a wall-clock budget, as
    for the asynchronous strategies: no round starts once that many seconds have passed
    since the start (the round running then finishes), and the last round's model is
    evaluated if its round was not an evaluation round.
    """
    num_nodes = len(list(grid.get_node_ids()))
    limit = cfg["max-in-flight"]
    per_round = limit if 0 < limit < num_nodes else num_nodes
    rounds = max(1, cfg["max-updates"] // per_round)
    sampled: dict[int, list[int]] = {}
    federated_nodes: dict[int, int] = {}
    common = {
        "fraction_train": per_round / num_nodes,
        # Flower's own federated evaluation, in the rounds that cross a multiple of
        # federated-eval-every (0: none).
        "fraction_evaluate": cfg["fraction-evaluate"] if cfg["federated-eval-every"] else 0.0,
        "min_evaluate_nodes": 1,
        "min_available_nodes": num_nodes,
    }
    if per_round < num_nodes:
        # min_train_nodes = m: Flower samples max(int(n * m / n), min_train_nodes) nodes,
        # and int() of the float product may round m down.
        common["min_train_nodes"] = per_round
    name = cfg["strategy"]
    scheduled = issubclass(_SYNC_CLASSES[name], TimeBudgetFedAvg)

    def crossed(server_round: int, every: int) -> bool:
        """The round's client computations cross a multiple of ``every``."""
        return (server_round * per_round) // every != ((server_round - 1) * per_round) // every

    def federated_due(server_round: int) -> bool:
        every = cfg["federated-eval-every"]
        return bool(every) and crossed(server_round, every)

    wall_budget = 0.0 if cfg["virtual-clock"] else cfg["max-seconds"]
    virtual_budget = cfg["max-seconds"] if cfg["virtual-clock"] else 0.0
    t0 = time.monotonic()

    def budget_spent() -> bool:
        return bool(wall_budget) and time.monotonic() - t0 >= wall_budget

    clock = virtual_clock_from(cfg, examples)
    speeds = clock.speed_factors(list(range(num_nodes)))
    model_bytes = sum(int(a.nbytes) for a in initial.to_numpy_ndarrays())
    # Steps each partition's message asked for, per round (scheduled strategies).
    sent_steps: dict[int, dict[int, int]] = {}
    partition_of: dict[int, int] = {}
    if scheduled and cfg["virtual-clock"]:
        partition_of = _partitions_of_nodes(grid, cfg["dispatch-timeout"])

    def message_steps(p: int, config: Mapping[str, Any]) -> int:
        """Steps of local work a train config asks of partition p (the time model's)."""
        return clock.work_steps(
            p,
            "weights",
            batch_size=cfg["batch-size"],
            local_batches=cfg["local-batches"],
            local_steps=int(config["local-steps"]),
            local_epochs=int(config["local-epochs"]),
        )

    def time_messages(server_round: int, messages: list[Message]) -> None:
        """Each message's steps, and its compute seconds as ``virtual-train-seconds``
        (node p's ``round - 1``-th draw, as :func:`seconds` times it)."""
        steps_now = sent_steps.setdefault(server_round, {})
        for message in messages:
            p = partition_of.get(message.metadata.dst_node_id)
            if p is None or p not in speeds:
                continue  # not known to the clock: timed as the run's own work
            config = message.content["config"]
            steps_now[p] = message_steps(p, config)
            config["virtual-train-seconds"] = clock.compute_seconds(
                speeds[p], p, server_round - 1, steps_now[p]
            )

    cls = _recording_sampled(
        _SYNC_CLASSES[name],
        sampled,
        federated_due,
        federated_nodes,
        budget_spent,
        time_messages if partition_of else None,
    )
    # server-learning-rate 0 = the strategy's default (Flower's FedAvgM's, FedNova's 1.0).
    lr = (
        {"server_learning_rate": cfg["server-learning-rate"]} if cfg["server-learning-rate"] else {}
    )
    if name == "fedavgm":
        strategy = cls(server_momentum=cfg["beta"], **lr, **common)
    elif name == "fednova":
        strategy = cls(local_momentum=cfg["local-momentum"], **lr, **common)
    else:
        strategy = cls(**common)
    train_config = ConfigRecord(
        {
            "mode": "weights",
            "batch-size": cfg["batch-size"],
            "local-steps": cfg["local-steps"],
            "local-epochs": cfg["local-epochs"],
            "local-lr": cfg["local-lr"],
            "local-momentum": cfg["local-momentum"],
        }
    )

    def seconds(p: int, index: int) -> float:
        """Virtual seconds of node p's ``index``-th training (compute + communication):
        the steps its message of round ``index + 1`` asked for, else the run's own work."""
        steps = sent_steps.get(index + 1, {}).get(p)
        if steps is None:
            steps = message_steps(p, train_config)
        return clock.duration(speeds[p], p, index, steps, model_bytes)

    rows: list[dict[str, Any]] = []
    vtime = {0: 0.0}

    def virtual_time(r: int) -> float:
        """Virtual seconds at the end of round r (rounds 1..r-1 known by then)."""
        for k in range(len(vtime), r + 1):
            trained = sampled.get(k, []) if per_round < num_nodes else range(num_nodes)
            vtime[k] = vtime[k - 1] + max(
                (seconds(p, k - 1) for p in trained if p in speeds), default=0.0
            )
        return vtime[r]

    def due(server_round: int) -> bool:
        # Evaluate where the count of client computations crosses a multiple of eval-every.
        return server_round in (0, rounds) or crossed(server_round, cfg["eval-every"])

    last: dict[str, Any] = {}  # the last round's number and model (a wall budget may end it)

    def eval_and_record(
        server_round: int, arrays: ArrayRecord, force: bool = False
    ) -> MetricRecord | None:
        vt = virtual_time(server_round)  # every round, so no sampled round is missed
        if virtual_budget and vt > virtual_budget:
            # The round ended past the budget: its model does not count (as the async
            # engine applies no reply that arrives after max-seconds).
            raise _WallBudgetSpent(server_round - 1)
        last.update(round=server_round, arrays=arrays)
        if not (force or due(server_round)):
            return None
        res = evaluate_fn(server_round, arrays)
        initial_loss = rows[0]["loss"] if rows else None
        rows.append(
            {
                "updates": server_round * per_round,
                "version": server_round,
                "virtual_time": round(vt, 6),
                "wall_time": round(time.monotonic() - t0, 3),
                "accuracy": res["accuracy"],
                "loss": res["loss"],
                "staleness_mean": 0.0,
                "staleness_max": 0,
                "train_loss": math.nan,
                "deferred": 0,
                "rejected": 0,
                "dropped": 0,
            }
        )
        reason = evaluation_divergence(
            server_round * per_round, arrays.to_numpy_ndarrays(), res["loss"], initial_loss
        )
        if reason is not None:  # stop Flower's strategy here (nothing is in flight)
            log(WARNING, "[flwr-gsgm] diverged at round %d; stopping: %s", server_round, reason)
            counters = {"updates_received": server_round * per_round, "steps_applied": server_round}
            raise _SyncDiverged(reason, rows, {**counters, "diverged": 1})
        return res

    # Flower's FedAvg samples a round's nodes with the module-level `random`
    # (strategy_utils.sample_nodes); seeded with the run's seed, the sampled rounds, and
    # so the run, are the same every time where node ids are fixed (simulation).
    random.seed(cfg["seed"])
    try:
        result = strategy.start(
            grid,
            initial,
            num_rounds=rounds,
            train_config=train_config,
            evaluate_fn=eval_and_record,
            timeout=cfg["dispatch-timeout"],
        )
        federated = result.evaluate_metrics_clientapp
    except _WallBudgetSpent as spent:
        log(
            INFO,
            "[flwr-gsgm] max-seconds=%s spent: no round after %d",
            wall_budget or virtual_budget,
            spent.last_round,
        )
        rounds = spent.last_round
        if rows and rows[-1]["version"] != rounds:  # the model of the last round, evaluated
            eval_and_record(last["round"], last["arrays"], force=True)
        federated = strategy.federated_metrics
    for row in rows:  # the federated columns of the async runs (run_outputs.metric_columns)
        metrics = federated.get(row["version"])
        if metrics is not None:
            row["federated_nodes"] = federated_nodes.get(row["version"], 0)
            row.update({column_name(k): v for k, v in metrics.items() if not isinstance(v, list)})
    if work is not None and isinstance(strategy, TimeBudgetFedAvg):
        work["work_scheduling"] = strategy.work.describe()
        work["work_nodes"] = strategy.work.nodes_report()
    return rows, {"updates_received": rounds * per_round, "steps_applied": rounds}
