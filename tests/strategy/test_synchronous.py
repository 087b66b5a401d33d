"""SynchronousRun: Flower's FedAvg round by round on the engine's clock, budget and rows.

Four nodes in weights mode; node p moves w halfway to its target t_p, so FedAvg's
round is w' = w / 2 + mean(t) / 2 with mean(t) = (0.25, 1.0), exact in float32:
w1 = (0.125, 0.5), w2 = (0.1875, 0.75), w3 = (0.21875, 0.875). The time model is
``uniform`` with no jitter: one step lasts 1 s and the seeded slow node (a quarter of
4) 4 s, so each round lasts 4 virtual seconds.
"""

from __future__ import annotations

import math

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from flwr_gsgm.engine.clock import VirtualTime
from flwr_gsgm.simulation.inprocess_grid import InProcessGrid
from flwr_gsgm.simulation.virtual_clock import VirtualClock
from flwr_gsgm.strategy.synchronous import SynchronousRun

TARGETS = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 2.0]], dtype=np.float32)
HAND = [(0.0, 0.0), (0.125, 0.5), (0.1875, 0.75), (0.21875, 0.875)]

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    pid = int(context.node_config["partition-id"])
    w = msg.content["arrays"]["w"].numpy()
    moved = (w + np.float32(0.5) * (TARGETS[pid] - w)).astype(np.float32)
    metrics = MetricRecord({"num-examples": 1, "partition-id": pid})
    return Message(
        RecordDict({"arrays": ArrayRecord({"w": Array(moved)}), "metrics": metrics}),
        reply_to=msg,
    )


def run(
    max_seconds: float | None = None,
    loss_at: dict[int, float] | None = None,
    strategy: FedAvg | None = None,
):
    """3 rounds of 4 nodes (12 trainings), a row every round; ``evaluate_fn`` reports
    w[0] as the accuracy and ``loss_at[updates]`` (else 1.0) as the loss."""
    seen: list[tuple[int, list[float]]] = []

    def evaluate_fn(updates: int, arrays: ArrayRecord) -> MetricRecord:
        w = arrays["w"].numpy()
        seen.append((updates, [float(x) for x in w]))
        loss = (loss_at or {}).get(updates, 1.0)
        return MetricRecord({"accuracy": float(w[0]), "loss": loss})

    if strategy is None:
        strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=4)
    sync = SynchronousRun(
        strategy,
        VirtualTime(VirtualClock(seed=0, jitter=0.0), max_seconds),
        max_updates=12,
        per_round=4,
        num_nodes=4,
        eval_every=4,
        federated_eval_every=0,
        seed=0,
        timeout=60.0,
        model_bytes=0,
        train_config=ConfigRecord({"mode": "weights", "local-steps": 1}),
    )
    initial = ArrayRecord({"w": Array(np.zeros(2, np.float32))})
    with InProcessGrid(app, 4, run_config={}) as grid:
        report = sync.start(grid, initial, evaluate_fn)
    return report, seen


def test_rounds_average_as_fedavg_and_take_the_slowest_nodes_time():
    report, seen = run()
    assert [w for _, w in seen] == [list(w) for w in HAND]
    assert [int(r["updates"]) for r in report.rows] == [0, 4, 8, 12]
    assert [int(r["version"]) for r in report.rows] == [0, 1, 2, 3]
    assert [r["virtual_time"] for r in report.rows] == [0.0, 4.0, 8.0, 12.0]
    assert [r["accuracy"] for r in report.rows] == [w[0] for w in HAND]
    # a synchronous round has no staleness, rejection or deferral: the same columns
    assert {r["staleness_max"] for r in report.rows} == {0}
    assert {r["rejected"] for r in report.rows} == {0}
    assert math.isnan(report.rows[-1]["train_loss"])
    assert report.counters == {
        "updates_received": 12,
        "updates_applied": 12,
        "steps_applied": 3,
        "lost_in_flight": 0,
        "dispatch_timeouts": 0,
    }
    assert report.rounds == 3 and report.diverged is None


def test_a_round_that_ends_past_the_virtual_budget_is_not_applied():
    report, seen = run(max_seconds=10.0)  # rounds end at 4, 8, 12 s: the third is past
    assert [r["virtual_time"] for r in report.rows] == [0.0, 4.0, 8.0]
    assert [w for _, w in seen] == [list(w) for w in HAND[:3]]
    assert report.counters == {
        "updates_received": 8,
        "updates_applied": 8,
        "steps_applied": 2,
        "lost_in_flight": 0,
        "dispatch_timeouts": 0,
    }


def test_a_diverged_row_ends_the_run_there():
    report, _ = run(loss_at={8: math.nan})
    assert [int(r["updates"]) for r in report.rows] == [0, 4, 8]
    assert report.diverged is not None and "loss" in report.diverged
    assert report.counters == {
        "updates_received": 8,
        "updates_applied": 8,
        "steps_applied": 2,
        "lost_in_flight": 0,
        "dispatch_timeouts": 0,
        "diverged": 1,
    }


def test_flowers_robust_strategies_run_from_the_run_config():
    from flwr.serverapp.strategy import FedMedian, FedTrimmedAvg

    from flwr_gsgm.config.build import _sync_strategy
    from flwr_gsgm.config.run_config import parse_run_config

    median = _sync_strategy(parse_run_config({"strategy": "fedmedian"}), 4, 4)
    trimmed = _sync_strategy(parse_run_config({"strategy": "fedtrimmedavg"}), 10, 10)
    assert type(median) is FedMedian and type(trimmed) is FedTrimmedAvg
    assert trimmed.beta == 0.2  # Flower's default: int(0.2 x 10) = 2 cut at each end
    # FedMedian, per coordinate (numpy's median of 4: the mean of the middle two).
    # Round 1 from 0: moved = t / 2 -> x in {0.5, 0, 0.5, -0.5}: 0.25; y {0, .5, .5, 1}: 0.5.
    # Round 2 from (0.25, 0.5): x {0.625, 0.125, 0.625, -0.375}: 0.375;
    # y {0.25, 0.75, 0.75, 1.25}: 0.75.
    report, seen = run(strategy=median)
    assert [w for _, w in seen][:3] == [[0.0, 0.0], [0.25, 0.5], [0.375, 0.75]]
    assert [r["virtual_time"] for r in report.rows] == [0.0, 4.0, 8.0, 12.0]
