"""A hostile node: every kind of bad reply is rejected, logged with its reason and
counted, and the global weights end equal to those of a run where it sent nothing."""

from __future__ import annotations

from collections import Counter

import numpy as np
from flwr.app import MetricRecord

from flwr_gsgm.async_engine import EngineSettings
from flwr_gsgm.inprocess_grid import InProcessGrid
from flwr_gsgm.strategies import ASGD, GSGM
from flwr_gsgm.virtual_clock import VirtualClock
from tests.engine.quadratic_app import initial_arrays, make_app

CLOCK = VirtualClock(seed=5)
HOSTILE = 3
MAX_NORM = 100.0


def _nan(g, m):
    g["w"] = np.array([np.nan, 1.0], np.float32)
    return g, m


def _inf(g, m):
    g["b"] = np.array([np.inf], np.float32)
    return g, m


def _shape(g, m):
    g["w"] = np.zeros(3, np.float32)
    return g, m


def _dtype(g, m):
    g["w"] = g["w"].astype(np.float64)
    return g, m


def _num_arrays(g, m):
    return {"w": g["w"]}, m


def _missing_metrics(g, m):
    return g, MetricRecord({"num-examples": 1})


def _foreign_partition(g, m):
    m["partition-id"] = 42
    return g, m


def _norm(g, m):
    g["w"] = np.array([1e4, 0.0], np.float32)
    return g, m


# Each kind of bad reply and the reason it must be counted under.
KINDS = [
    (_nan, "non-finite"),
    (_inf, "non-finite"),
    (_shape, "shape"),
    (_dtype, "dtype"),
    (_num_arrays, "array-keys"),
    (_missing_metrics, "missing-metrics"),
    (_foreign_partition, "partition-id"),
    (_norm, "norm"),
]


def hostile():
    """Cycle through KINDS; every third reply instead replays its first bad reply (a duplicate)."""
    state = {"calls": 0, "replay": None}

    def misbehave(pid, grad, metrics):
        state["calls"] += 1
        if state["calls"] % 3 == 0 and state["replay"] is not None:
            return dict(state["replay"]), metrics
        kind, _ = KINDS[(state["calls"] - state["calls"] // 3) % len(KINDS)]
        grad, metrics = kind(grad, metrics)
        if state["replay"] is None and kind is _nan:
            state["replay"] = dict(grad)
        return grad, metrics

    return misbehave


def run(grid):
    # Keep the hostile node (never evict it) so that it sends every kind of bad reply.
    strategy = ASGD(
        server_lr=0.1,
        virtual_clock=CLOCK,
        max_norm=MAX_NORM,
        engine=EngineSettings(max_consecutive_rejections=0),
    )
    return strategy.start(grid, initial_arrays(), max_updates=10_000, max_seconds=60.0)


def test_every_bad_reply_is_rejected_counted_and_never_touches_the_model(caplog):
    with_hostile = run(InProcessGrid(make_app(misbehave={HOSTILE: hostile()}), 4, run_config={}))

    honest_only = InProcessGrid(make_app(), 4, run_config={})
    honest_only.remove_node(HOSTILE + 1)  # partition 3 of 4 never exists: it sends nothing
    without = run(honest_only)

    rejections = Counter(with_hostile.report.rejections)
    expected = {reason for _, reason in KINDS} | {"duplicate"}
    assert set(rejections) == expected
    hostile_replies = (
        with_hostile.report.counters["updates_received"]
        - without.report.counters["updates_received"]
    )
    assert sum(rejections.values()) == hostile_replies > len(KINDS)
    for key in ("w", "b"):
        assert np.array_equal(with_hostile.arrays[key].numpy(), without.arrays[key].numpy())
    logged = [
        r.getMessage()
        for r in caplog.records
        if "rejected update from partition 3" in r.getMessage()
    ]
    assert len(logged) == hostile_replies
    assert any("(duplicate)" in line for line in logged)


def test_a_node_of_another_partitioning_is_refused():
    grid = InProcessGrid(make_app(), 3, run_config={})
    grid.add_node({"partition-id": 7, "num-partitions": 8})  # not one of 3 partitions
    result = ASGD(server_lr=0.1, virtual_clock=CLOCK).start(grid, initial_arrays(), max_updates=30)
    assert result.report.counters["nodes_refused"] == 1
    assert result.report.counters["updates_received"] == 30


def test_a_node_sending_only_garbage_is_evicted_and_does_not_stall_gsgm():
    # Strict GSGM cycles wait for every active node: a node whose updates are always
    # rejected would hold every cycle open, so after 10 rejections in a row it is lost.
    grid = InProcessGrid(
        make_app(misbehave={HOSTILE: lambda pid, g, m: _nan(g, m)}), 4, run_config={}
    )
    result = GSGM(server_lr=0.1, virtual_clock=CLOCK, cycle_quorum=1.0).start(
        grid, initial_arrays(), max_updates=200
    )
    c = result.report.counters
    assert result.report.rejections == {"non-finite": 10}
    assert c["nodes_lost"] == 1
    # Stalled, the run would stay at the 3 steps taken before the first cycle blocked;
    # evicted, cycles keep closing with the three honest nodes (one of them 4x slower,
    # so most fast-node updates are averaged into slots: about one step per 3 updates).
    assert c["steps_applied"] > 50


def test_an_all_zero_update_may_recur():
    zero = lambda pid, g, m: ({k: np.zeros_like(v) for k, v in g.items()}, m)  # noqa: E731
    grid = InProcessGrid(make_app(misbehave={0: zero}), 2, run_config={})
    result = ASGD(server_lr=0.1, virtual_clock=CLOCK).start(grid, initial_arrays(), max_updates=20)
    assert result.report.rejections == {}
