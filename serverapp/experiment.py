"""One experiment from a validated run config: strategy, model, evaluation, outputs.

The app layer (not part of the ``flwr-gsgm`` wheel): the project's ServerApp
(:mod:`serverapp.server_app`) and every other driver (tests, the sweep runner)
call :func:`run_experiment` with their grid, so every way of running uses the same
code. It wires the library (:func:`flwr_gsgm.config.build.build_strategy` for the
asynchronous strategies, :func:`flwr_gsgm.config.build.build_synchronous` for Flower's
FedAvg / FedAvgM and the time-budget anchors, :mod:`flwr_gsgm.config.outputs`) to the
project's model and data (``clients/``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from logging import INFO, WARNING
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from flwr.app import ArrayRecord, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid

from clients.datasets import load_dataset
from clients.models import build_model
from clients.partitioning import PartitionConfig, check_partitioning, load_partition
from clients.training import evaluate
from flwr_gsgm.config import outputs as run_outputs
from flwr_gsgm.config.build import build_strategy, build_synchronous
from flwr_gsgm.config.outputs import run_dir_for
from flwr_gsgm.config.run_config import SYNC_STRATEGIES, unread_settings
from flwr_gsgm.engine.run_end import DIVERGED, RunDiverged, RunFailed
from flwr_gsgm.evaluation.stability import FINAL_WINDOW
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
        num_nodes = len(list(grid.get_node_ids()))
        model_bytes = sum(int(a.nbytes) for a in initial.to_numpy_ndarrays())
        run = build_synchronous(cfg, num_nodes, model_bytes, examples)
        sync = run.start(grid, initial, evaluate_fn)
        rows = sync.rows
        work = None  # summary.json's work_scheduling, for the time-budget anchors
        if isinstance(run.strategy, TimeBudgetFedAvg):
            work = SimpleNamespace(
                work_scheduling=run.strategy.work.describe(),
                work_nodes=run.strategy.work.nodes_report(),
            )
        summary = run_outputs.summarize(
            rows,
            sync.counters,
            {},
            0.0,
            0,
            time.monotonic() - t0,
            rows[-1]["virtual_time"] if rows else 0.0,
            report=work,
            warnings=warnings,
            status=sync.diverged and (DIVERGED, sync.diverged),
        )
        if sync.diverged is not None:
            _write_outputs(run_dir, cfg, rows, summary, grid)
            _log_diverged(run_dir, sync.diverged, None)
            raise RunDiverged(sync.diverged)
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
        "[flwr-gsgm] final accuracy %.4f (the mean of the last %d evaluations; the last "
        "%.4f), MASD %.4f -> %s",
        summary["final_accuracy"],
        FINAL_WINDOW,
        rows[-1]["accuracy"] if rows else float("nan"),
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


def _title(cfg: Mapping[str, Any], summary: Mapping[str, Any], num_nodes: int) -> str:
    split = {
        "pathological": f"{cfg['classes-per-node']} classes per node",
        "dirichlet": f"Dirichlet alpha {cfg['dirichlet-alpha']}",
        "iid": "IID",
    }[cfg["partitioner"]]
    return (
        f"{cfg['strategy'].upper()} on {cfg['dataset']} ({num_nodes} nodes, {split}, seed "
        f"{cfg['seed']}): "
        f"final accuracy {100 * summary['final_accuracy']:.1f}% (mean of the last "
        f"{FINAL_WINDOW}), MASD {summary['masd']:.4f}"
    )
