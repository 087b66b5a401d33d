"""The asynchronous engine on the in-process grid with a quadratic ClientApp.

Node p returns g = w - target_p, so every number here can be followed by hand.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from flwr.app import MetricRecord

from flwr_gsgm.engine.async_engine import EngineSettings
from flwr_gsgm.simulation.inprocess_grid import InProcessGrid
from flwr_gsgm.simulation.virtual_clock import VirtualClock
from flwr_gsgm.strategy.strategies import ASGD, GSGM
from tests.engine.quadratic_app import TARGETS, initial_arrays, make_app

CLOCK = VirtualClock(seed=3, base_duration=1.0, slow_fraction=0.25, slow_factor=4.0, jitter=0.1)


def run(strategy, num_nodes=3, max_updates=60, app=None, grid=None, **start):
    grid = grid or InProcessGrid(app or make_app(), num_nodes, run_config={})
    return strategy.start(grid, initial_arrays(), max_updates=max_updates, **start), grid


def weights(result) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in result.arrays.items()}


def test_asgd_converges_to_mean_target_and_counts_every_update():
    result, _ = run(
        ASGD(server_learning_rate=0.1, virtual_clock=CLOCK), num_nodes=3, max_updates=300
    )
    rep = result.report
    assert rep.counters["updates_received"] == 300
    assert rep.counters["updates_applied"] == 300
    assert rep.counters["steps_applied"] == 300
    # The optimum of sum_p 0.5||w - t_p||^2 over p = 0, 1, 2 is mean(t) = (2/3, 2/3);
    # with a fast node 4x more frequent, ASGD is biased toward the fast nodes' targets,
    # but stays within 0.25 of the optimum and b converges to 0.5.
    w = weights(result)
    assert np.abs(w["w"] - TARGETS[:3].mean(axis=0)).max() < 0.25
    assert w["b"][0] == pytest.approx(0.5, abs=1e-3)


def test_replies_are_applied_in_virtual_finish_order():
    calls: list[tuple[int, int]] = []
    run(
        ASGD(server_learning_rate=0.1, virtual_clock=CLOCK),
        num_nodes=4,
        max_updates=40,
        app=make_app(calls=calls),
    )
    speeds = CLOCK.speed_factors([0, 1, 2, 3])
    slow = [p for p, f in speeds.items() if f > 1]
    assert len(slow) == 1  # a quarter of 4 nodes
    per_node = {p: sum(1 for q, _ in calls if q == p) for p in range(4)}
    # A node 4x slower computes about a quarter as often as each fast one.
    fast_mean = np.mean([per_node[p] for p in range(4) if p not in slow])
    assert per_node[slow[0]] <= fast_mean / 2.5


def test_same_seed_gives_identical_rows_and_weights():
    a, _ = run(
        GSGM(server_learning_rate=0.1, beta=0.5, virtual_clock=CLOCK),
        max_updates=90,
        eval_every=10,
        evaluate_fn=lambda step, arr: MetricRecord(
            {"accuracy": float(arr["w"].numpy()[0]), "loss": 0.0}
        ),
    )
    b, _ = run(
        GSGM(server_learning_rate=0.1, beta=0.5, virtual_clock=CLOCK),
        max_updates=90,
        eval_every=10,
        evaluate_fn=lambda step, arr: MetricRecord(
            {"accuracy": float(arr["w"].numpy()[0]), "loss": 0.0}
        ),
    )
    strip = lambda rows: [{k: v for k, v in r.items() if k != "wall_time"} for r in rows]  # noqa: E731
    assert strip(a.rows) == strip(b.rows)
    assert len(a.rows) == 10  # at 0, 10, ..., 90 updates
    for k in ("w", "b"):
        assert np.array_equal(weights(a)[k], weights(b)[k])


def test_gsgm_applies_fewer_steps_than_updates_received_with_a_slow_node():
    # strict cycles with slot averaging: a fast node's extra updates wait in its slot
    strategy = GSGM(
        server_learning_rate=0.1, beta=0.5, cycle_quorum=1.0, averaging="slot", virtual_clock=CLOCK
    )
    result, _ = run(strategy, num_nodes=4, max_updates=80)
    c = result.report.counters
    assert c["updates_received"] == 80
    assert c["updates_applied"] + c.get("updates_deferred", 0) == 80
    assert c.get("updates_deferred", 0) > 0  # fast nodes' extra updates went into slots


def test_error_replies_exclude_the_node_and_the_run_finishes_with_the_others():
    app = make_app(raise_for={1})
    result, _ = run(
        ASGD(server_learning_rate=0.1, virtual_clock=CLOCK), num_nodes=3, max_updates=50, app=app
    )
    c = result.report.counters
    assert c["error_replies"] == 5  # max-node-failures (tests/nodes/test_failing_nodes.py)
    assert c["nodes_excluded"] == 1 and c["nodes_lost"] == 0
    assert c["updates_received"] == 50


def test_a_node_that_vanishes_is_lost_after_dispatch_timeout():
    grid = InProcessGrid(make_app(), 3, run_config={})
    strategy = ASGD(
        server_learning_rate=0.1,
        virtual_clock=None,
        engine=EngineSettings(dispatch_timeout=0.3, poll_interval=0.001),
    )
    vanished = {}

    def evaluate_fn(step, arrays):
        if step == 10 and not vanished:  # node of partition 2 goes away mid-run
            vanished["node"] = 3
            grid.remove_node(3)
        return MetricRecord({"accuracy": 0.0, "loss": 0.0})

    result, _ = run(strategy, grid=grid, max_updates=40, evaluate_fn=evaluate_fn, eval_every=10)
    c = result.report.counters
    assert vanished == {"node": 3}
    assert c["nodes_lost"] == 1
    assert c["lost_in_flight"] == 1
    assert c["updates_received"] == 40


def _nan_update(pid, grad, metrics):
    grad["w"] = np.array([np.nan, 0.0], np.float32)
    return grad, metrics


def _wrong_partition(pid, grad, metrics):
    metrics["partition-id"] = 7
    return grad, metrics


def _no_metrics(pid, grad, metrics):
    # Without num-examples, the one metric a reply must carry (Flower's standard reply).
    return grad, MetricRecord({"partition-id": pid, "train-loss": 0.5})


@pytest.mark.parametrize(
    "bad, reason",
    [
        (_nan_update, "non-finite"),
        (_wrong_partition, "partition-id"),
        (_no_metrics, "missing-metrics"),
    ],
)
def test_rejected_replies_are_counted_and_never_touch_the_model(bad, reason):
    # Same run twice: node 2 misbehaving vs node 2 ... also misbehaving but in a way we
    # can compare: its rejected updates must leave w as if it had sent nothing.
    result, _ = run(
        ASGD(server_learning_rate=0.1, virtual_clock=CLOCK),
        num_nodes=3,
        max_updates=30,
        app=make_app(misbehave={2: bad}),
    )
    rep = result.report
    assert rep.rejections[reason] > 0
    assert rep.counters["updates_applied"] + rep.rejections[reason] == 30
    w = weights(result)
    assert np.all(np.isfinite(w["w"]))
    # Only partitions 0 and 1 moved w: both pull toward x + y <= 1 (targets (1,0), (0,1)).
    assert w["w"].sum() <= 1.0 + 1e-5
    assert not math.isnan(rep.staleness_mean)


def test_time_budget_in_virtual_seconds():
    result, _ = run(
        ASGD(server_learning_rate=0.1, virtual_clock=CLOCK),
        num_nodes=3,
        max_updates=10_000,
        max_seconds=20.0,
    )
    assert result.report.virtual_seconds <= 20.0
    # Two fast nodes (about 1 s each) and one 4x slower: about 2*20 + 20/4 = 45 updates.
    assert 38 <= result.report.counters["updates_received"] <= 52


def test_a_restarted_node_rejoins_under_its_partition_id_and_contributes_again():
    calls: list[tuple[int, int]] = []
    grid = InProcessGrid(make_app(calls=calls), 3, run_config={})
    strategy = GSGM(
        server_learning_rate=0.1,
        virtual_clock=None,
        cycle_quorum=0.5,
        engine=EngineSettings(dispatch_timeout=0.3, poll_interval=0.001, node_refresh_interval=0.0),
    )
    events = []

    def evaluate_fn(step, arrays):
        if step == 20:  # the SuperNode of partition 1 dies ...
            grid.remove_node(2)
            events.append("killed")
        if step == 40 and "killed" in events:  # ... and comes back with a new node id
            events.append(grid.add_node({"partition-id": 1, "num-partitions": 3}))
        return MetricRecord({"accuracy": 0.0, "loss": 0.0})

    result, _ = run(strategy, grid=grid, max_updates=80, evaluate_fn=evaluate_fn, eval_every=20)
    c = result.report.counters
    assert events == ["killed", 4]  # new node id 4
    assert c["nodes_lost"] == 1 and c["nodes_joined"] == 1
    assert c["updates_received"] == 80
    # Partition 1 trained before it died and again after it rejoined.
    # Partition 1 trained before it died, was absent a while, then trained again.
    versions = [v for pid, v in calls if pid == 1]
    gap = max(range(1, len(versions)), key=lambda i: versions[i] - versions[i - 1])
    assert versions[gap] - versions[gap - 1] >= 10
    assert len(versions[gap:]) >= 5


def test_a_rejoined_node_is_new_to_the_norm_bound_so_a_large_first_update_is_accepted():
    # Back after it was lost, a node meets a model that moved without its data: its
    # first update can be far above its old scale. Scaled here 30x, it passes the new
    # node's bound (10 x max-norm-ratio) and would not pass its old own median's.
    events: list = []

    def larger_once_back(pid, grad, metrics):
        if len(events) == 2 and "scaled" not in events:
            events.append("scaled")
            grad = {k: v * 30.0 for k, v in grad.items()}
        return grad, metrics

    grid = InProcessGrid(make_app(misbehave={1: larger_once_back}), 3, run_config={})
    strategy = ASGD(
        server_learning_rate=0.1,
        virtual_clock=None,
        engine=EngineSettings(dispatch_timeout=0.3, poll_interval=0.001, node_refresh_interval=0.0),
    )

    def evaluate_fn(step, arrays):
        if step == 20 and not events:
            grid.remove_node(2)
            events.append("killed")
        if step == 40 and len(events) == 1:
            events.append(grid.add_node({"partition-id": 1, "num-partitions": 3}))
        return MetricRecord({"accuracy": 0.0, "loss": 0.0})

    result, _ = run(strategy, grid=grid, max_updates=80, evaluate_fn=evaluate_fn, eval_every=20)
    c = result.report.counters
    assert events == ["killed", 4, "scaled"]
    assert c["nodes_lost"] == 1 and c["nodes_joined"] == 1
    assert dict(result.report.rejections) == {} and c["updates_received"] == 80


def test_two_nodes_claiming_one_partition_at_start_keep_the_first():
    grid = InProcessGrid(make_app(), 3, run_config={})
    grid.add_node({"partition-id": 1, "num-partitions": 3})  # node 4 claims partition 1 too
    result, _ = run(ASGD(server_learning_rate=0.1, virtual_clock=CLOCK), grid=grid, max_updates=30)
    assert result.report.counters["nodes_refused"] == 1
    assert result.report.counters["updates_received"] == 30


def test_an_evaluate_fn_without_loss_or_returning_none_is_not_divergence():
    for fn in (lambda step, arrays: None, lambda step, arrays: MetricRecord({"accuracy": 0.5})):
        result, _ = run(
            ASGD(server_learning_rate=0.1, virtual_clock=CLOCK),
            max_updates=30,
            evaluate_fn=fn,
            eval_every=10,
        )
        assert result.report.counters["updates_received"] == 30
        assert result.report.counters["diverged"] == 0


def test_a_node_back_under_its_old_node_id_rejoins():
    # A SuperNode restarted with the same authentication key keeps its node id.
    calls: list[tuple[int, int]] = []
    grid = InProcessGrid(make_app(calls=calls), 3, run_config={})
    strategy = ASGD(
        server_learning_rate=0.1,
        virtual_clock=None,
        engine=EngineSettings(dispatch_timeout=0.2, poll_interval=0.001, node_refresh_interval=0.0),
    )
    state = {}

    def evaluate_fn(step, arrays):
        if step == 20:
            grid.remove_node(3)  # partition 2 goes silent ...
            state["removed"] = True
        elif step == 30:
            time.sleep(0.3)  # ... longer than dispatch-timeout: it will be lost
        elif step == 40:
            grid.add_node({"partition-id": 2, "num-partitions": 3}, node_id=3)
            state["back"] = True
        return MetricRecord({"accuracy": 0.0, "loss": 0.0})

    result, _ = run(strategy, grid=grid, max_updates=120, evaluate_fn=evaluate_fn, eval_every=10)
    c = result.report.counters
    assert state == {"removed": True, "back": True}
    assert c["nodes_lost"] == 1 and c["nodes_joined"] == 1
    versions = [v for pid, v in calls if pid == 2]
    gap = max(range(1, len(versions)), key=lambda i: versions[i] - versions[i - 1])
    assert len(versions[gap:]) >= 5  # it trained again after it came back


def test_with_worker_threads_the_engine_waits_for_replies_instead_of_sleeping(monkeypatch):
    """A poll interval of an hour: any whole-interval sleep would be recorded here."""
    slept = []
    real_sleep = time.sleep
    monkeypatch.setattr(time, "sleep", lambda s: slept.append(s) if s >= 3600 else real_sleep(s))
    hourly = EngineSettings(poll_interval=3600.0)
    with InProcessGrid(make_app(), 3, run_config={}, workers=2) as grid:
        threaded, _ = run(
            ASGD(server_learning_rate=0.1, virtual_clock=CLOCK, engine=hourly), grid=grid
        )
    assert slept == []
    on_pull, _ = run(ASGD(server_learning_rate=0.1, virtual_clock=CLOCK))
    assert threaded.report.counters["updates_received"] == 60
    for key, value in weights(on_pull).items():
        np.testing.assert_array_equal(weights(threaded)[key], value)
