"""One experiment from a validated run config: strategy, model, evaluation, outputs.

The Flower ServerApp (:mod:`flwr_gsgm.server_app`) and any other driver (tests, the
sweep runner) call :func:`run_experiment` with their grid, so every way of running
uses the same code.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from logging import INFO
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, FedAvgM

from clients.datasets import load_dataset
from clients.models import build_model
from clients.training import evaluate
from flwr_gsgm import run_outputs
from flwr_gsgm.async_engine import EngineSettings
from flwr_gsgm.async_strategy import AsyncStrategy
from flwr_gsgm.run_config import SYNC_STRATEGIES, optimizer_params_from
from flwr_gsgm.strategies import STRATEGIES
from flwr_gsgm.virtual_clock import VirtualClock

__all__ = ["build_strategy", "make_evaluate_fn", "run_experiment", "run_dir_for"]


def _none_if_zero(value: float) -> float | None:
    return value if value else None


def virtual_clock_from(cfg: Mapping[str, Any]) -> VirtualClock:
    """The run's :class:`VirtualClock` from its run config."""
    return VirtualClock(
        seed=cfg["seed"],
        base_duration=cfg["base-duration"],
        slow_fraction=cfg["slow-fraction"],
        slow_factor=cfg["slow-factor"],
        jitter=cfg["jitter"],
    )


def build_strategy(cfg: Mapping[str, Any], run_dir: Path | None = None) -> AsyncStrategy:
    """Build the asynchronous strategy a validated run config asks for.

    Checkpoints (``checkpoint-every``, ``resume``) go to ``run_dir/checkpoint.pt``.

    Raises
    ------
    ValueError
        If ``cfg["strategy"]`` is not an asynchronous strategy.
    """
    name = cfg["strategy"]
    if name not in STRATEGIES:
        raise ValueError(
            f"strategy {name!r} is not asynchronous; expected one of {sorted(STRATEGIES)}"
        )
    engine = EngineSettings(
        message_ttl=cfg["message-ttl"],
        reply_timeout=cfg["reply-timeout"],
        poll_interval=cfg["poll-interval"],
        min_nodes=cfg["min-nodes"],
        max_consecutive_rejections=cfg["max-consecutive-rejections"],
        checkpoint_every=cfg["checkpoint-every"],
        checkpoint_path=(run_dir / "checkpoint.pt") if run_dir is not None else None,
        resume=cfg["resume"],
        max_in_flight=cfg["max-in-flight"] or None,
        dispatch=cfg["dispatch"],
    )
    # The rule's declared parameters, from their run config keys (0 = none -> None).
    params = optimizer_params_from(cfg, name)
    return STRATEGIES[name](
        server_learning_rate=params.pop(
            "lr", None
        ),  # absent: server-learning-rate = 0, the rule's default
        client_mode=cfg["client-mode"],
        batch_size=cfg["batch-size"],
        local_batches=cfg["local-batches"],
        local_steps=cfg["local-steps"],
        local_lr=cfg["local-lr"],
        virtual_clock=virtual_clock_from(cfg) if cfg["virtual-clock"] else None,
        engine=engine,
        seed=cfg["seed"],
        **params,
    )


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


def run_dir_for(cfg: Mapping[str, Any]) -> Path:
    """``<output-dir>/<run-name>``; an empty run-name becomes ``<strategy>-<UTC time>``."""
    name = cfg["run-name"] or f"{cfg['strategy']}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    return Path(cfg["output-dir"]).expanduser().resolve() / name


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
        A run config validated by :func:`flwr_gsgm.run_config.parse_run_config`.
    run_dir : Path, optional
        Output folder; default :func:`run_dir_for`.
    """
    torch.set_num_threads(cfg["client-threads"])
    run_dir = run_dir or run_dir_for(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    run_outputs.write_config(run_dir, cfg)
    evaluate_fn = make_evaluate_fn(cfg)
    initial = _initial_arrays(cfg)
    log(INFO, "[flwr-gsgm] run folder %s", run_dir)
    t0 = time.monotonic()
    if cfg["strategy"] in SYNC_STRATEGIES:
        rows, counters = _run_synchronous(grid, cfg, initial, evaluate_fn)
        summary = run_outputs.summarize(
            rows,
            counters,
            {},
            0.0,
            0,
            time.monotonic() - t0,
            rows[-1]["virtual_time"] if rows else 0.0,
        )
    else:
        result = build_strategy(cfg, run_dir).start(
            grid,
            initial,
            max_updates=cfg["max-updates"],
            max_seconds=_none_if_zero(cfg["max-seconds"]),
            evaluate_fn=evaluate_fn,
            eval_every=cfg["eval-every"],
        )
        rep = result.report
        rows = result.rows
        run_outputs.write_model(run_dir, result.arrays)
        summary = run_outputs.summarize(
            rows,
            rep.counters,
            rep.rejections,
            rep.staleness_mean,
            rep.staleness_max,
            rep.wall_seconds,
            rep.virtual_seconds,
        )
    run_outputs.write_metrics(run_dir, rows)
    run_outputs.write_summary(run_dir, summary)
    run_outputs.plot_accuracy(run_dir, rows, _title(cfg, summary, len(list(grid.get_node_ids()))))
    log(
        INFO,
        "[flwr-gsgm] final accuracy %.4f, MASD %.4f -> %s",
        summary["final_accuracy"],
        summary["masd"],
        run_dir,
    )
    return summary


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


def _recording_sampled(cls: type, sampled: dict[int, list[int]]) -> type:
    """``cls`` (FedAvg or FedAvgM) noting each round's partition-ids from its train replies."""

    class Recording(cls):  # type: ignore[misc, valid-type]
        def aggregate_train(self, server_round, replies):
            replies = list(replies)
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


def _run_synchronous(grid: Grid, cfg: Mapping[str, Any], initial: ArrayRecord, evaluate_fn):
    """Flower's own FedAvg / FedAvgM with the same ClientApp ("weights" mode).

    ``max-in-flight`` = m with 0 < m < nodes samples m nodes per round
    (``fraction_train = m / nodes``, FedBuff's synchronous setting); otherwise every
    node trains every round. Rounds are ``max-updates // nodes-per-round``, so the
    client computations equal ``max-updates`` (rounded down). A round's virtual
    duration is that of its slowest node among those that trained in it: every node
    with full participation; with sampling, the partition-ids of the round's train
    replies (Flower samples with the unseeded ``random`` module, so which nodes train
    is read from the replies, not predicted; a sampled node whose reply failed does
    not count). Node p's duration in round r is the clock's draw for
    ``(p, dispatch index r - 1)``.
    """
    num_nodes = len(list(grid.get_node_ids()))
    limit = cfg["max-in-flight"]
    per_round = limit if 0 < limit < num_nodes else num_nodes
    rounds = max(1, cfg["max-updates"] // per_round)
    sampled: dict[int, list[int]] = {}
    common = {
        "fraction_train": per_round / num_nodes,
        "fraction_evaluate": 0.0,
        "min_available_nodes": num_nodes,
    }
    if per_round < num_nodes:
        # min_train_nodes = m: Flower samples max(int(n * m / n), min_train_nodes) nodes,
        # and int() of the float product may round m down.
        common["min_train_nodes"] = per_round
    fedavgm = cfg["strategy"] == "fedavgm"
    cls = _recording_sampled(FedAvgM if fedavgm else FedAvg, sampled)
    if fedavgm:
        # server-learning-rate 0 = the strategy's default: Flower's FedAvgM default.
        lr = (
            {"server_learning_rate": cfg["server-learning-rate"]}
            if cfg["server-learning-rate"]
            else {}
        )
        strategy = cls(server_momentum=cfg["beta"], **lr, **common)
    else:
        strategy = cls(**common)
    train_config = ConfigRecord(
        {
            "mode": "weights",
            "batch-size": cfg["batch-size"],
            "local-steps": cfg["local-steps"],
            "local-lr": cfg["local-lr"],
        }
    )
    clock = virtual_clock_from(cfg)
    speeds = clock.speed_factors(list(range(num_nodes)))
    t0 = time.monotonic()
    rows: list[dict[str, Any]] = []
    vtime = {0: 0.0}

    def virtual_time(r: int) -> float:
        """Virtual seconds at the end of round r (rounds 1..r-1 known by then)."""
        for k in range(len(vtime), r + 1):
            trained = sampled.get(k, []) if per_round < num_nodes else range(num_nodes)
            vtime[k] = vtime[k - 1] + max(
                (clock.duration(speeds[p], p, k - 1) for p in trained if p in speeds), default=0.0
            )
        return vtime[r]

    def due(server_round: int) -> bool:
        # Evaluate where the count of client computations crosses a multiple of eval-every.
        every = cfg["eval-every"]
        crossed = (server_round * per_round) // every != ((server_round - 1) * per_round) // every
        return server_round in (0, rounds) or crossed

    def eval_and_record(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        vt = virtual_time(server_round)  # every round, so no sampled round is missed
        if not due(server_round):
            return None
        res = evaluate_fn(server_round, arrays)
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
        return res

    strategy.start(
        grid,
        initial,
        num_rounds=rounds,
        train_config=train_config,
        evaluate_fn=eval_and_record,
        timeout=cfg["reply-timeout"],
    )
    return rows, {"updates_received": rounds * per_round, "steps_applied": rounds}
