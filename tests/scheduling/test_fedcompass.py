"""FedCompass on the engine: 3 nodes at 1, 2 and 4 virtual seconds per step (a profile
file, no jitter, free communication) under the virtual clock; groups form and their
members arrive together; a ClientApp without train-steps falls back to buffering; and
nodes whose 7 s latency dwarfs their compute still form a group (APPFL's speeds)."""

from __future__ import annotations

import pytest

from flwr_gsgm.engine.async_engine import EngineSettings
from flwr_gsgm.simulation.inprocess_grid import InProcessGrid
from flwr_gsgm.simulation.virtual_clock import VirtualClock
from flwr_gsgm.strategy.strategies import STRATEGIES
from tests.engine.quadratic_app import initial_arrays, make_app
from tests.scheduling.test_work_scheduling import stepping_app

FLEET = "partition-id,step-seconds,bandwidth,latency-seconds\n0,1,inf,0\n1,2,inf,0\n2,4,inf,0\n"


def run(tmp_path, app, max_updates: int, **params):
    path = tmp_path / "fleet.csv"
    path.write_text(FLEET)
    # Q_min = 4 and Q_max = 20 steps, given: APPFL's defaults (20 and 100) are for
    # 100-step messages; these, the former own-work-relative bounds of a node whose
    # own work is 20 steps, keep the hand-computed sequence below as it was. Free
    # communication: a message's whole time (APPFL's speed) is its training time.
    params = {"min_local_steps": 4, "max_local_steps": 20, **params}
    strategy = STRATEGIES["fedcompass"](
        **params,
        client_mode="delta",
        local_steps=20,
        local_lr=0.1,
        virtual_clock=VirtualClock(device_profile=str(path), jitter=0.0),
        engine=EngineSettings(max_norm_ratio=None, eval_every=1),
    )
    grid = InProcessGrid(app, 3, run_config={})
    return strategy.start(grid, initial_arrays(), max_updates=max_updates)


def test_groups_form_and_their_members_arrive_together(tmp_path):
    received: list[tuple[int, int]] = []
    result = run(tmp_path, stepping_app(received), max_updates=13)
    steps = {p: [s for q, s in received if q == p] for p in range(3)}
    # Own work 20 steps, Q_max = 20, Q_min = 4. By hand (APPFL's rules, lambda 1.5):
    # t=20 node 0 back alone -> group A (20 steps, E=40, L=50); t=40 node 1 back alone:
    # joining A gives 0 steps -> group B timed for A's node 0 sent at 50 with 20 steps
    # (back at 70): floor(30 / 2) = 15 steps; node 0 back in A -> A aggregated; node 0
    # cannot join B (30 > 20) -> group C (20 steps, E=60); t=60 C aggregated, node 0
    # joins B with floor(10 / 1) = 10 steps; t=70 nodes 1 and 0 arrive together (B).
    # Node 0 (fastest first) then creates D (20 steps, E=90), node 1 joins it (10).
    # t=80 node 2 back alone -> group E timed for D's node 0 sent at L=100: 10 steps
    # (E=120); t=90 D back together; node 0 -> F (20 steps, E=110), node 1 joins E
    # (15 steps); t=110 F back, node 0 joins E (10): t=120 all three arrive together.
    # (The budget of 13 updates sends nothing after t=120.)
    assert steps[0] == [20, 20, 20, 10, 20, 20, 10]
    assert steps[1] == [20, 15, 10, 15]
    assert steps[2] == [20, 10]
    rows = {r["updates"]: r for r in result.rows}
    together = {n: (rows[n]["virtual_time"], rows[n]["version"]) for n in (11, 12, 13)}
    # Group E: nodes 2, 1, 0 back at 120 s; one aggregation when the last is in.
    assert together == {11: (120.0, 8), 12: (120.0, 8), 13: (120.0, 9)}
    assert [rows[n]["virtual_time"] for n in (5, 6)] == [70.0, 70.0]  # group B
    assert result.report.work_scheduling == "compass"


def test_a_client_without_train_steps_falls_back_to_buffering(tmp_path):
    calls: list[tuple[int, int]] = []  # (partition, model-version) of each message
    result = run(tmp_path, make_app(calls=calls), max_updates=10)
    # Node 0's first reply (t=20) reports no train-steps: scheduling turns off, said
    # once, before the rule sees that reply; every message keeps the run's own work
    # and the rule aggregates every fedbuff-k = 5 arrivals: versions 0, 1, 2.
    assert result.report.work_scheduling.startswith(
        "compass, turned off: node 1 (partition 0)'s reply reports no train-steps"
    )
    assert [r["version"] for r in result.rows if r["updates"] in (4, 5, 9, 10)] == [0, 1, 1, 2]
    assert {v for _, v in calls} == {0, 1}  # nothing is sent after the 10th update


# Communication dwarfs computation (as under the loopback profile): 7 s of latency per
# message against 0.02, 0.04 and 0.08 s per step.
TALKATIVE = (
    "partition-id,step-seconds,bandwidth,latency-seconds\n"
    "0,0.02,inf,7\n1,0.04,inf,7\n2,0.08,inf,7\n"
)


def test_nodes_whose_round_trip_dwarfs_their_compute_form_a_group(tmp_path):
    # APPFL's defaults (Q_min 20, Q_max 100, lambda 1.5, momentum 0.9). First messages
    # (20 steps, sent at 0) take 7.4, 7.8 and 8.6 s: APPFL's speeds (whole message /
    # steps) 0.37, 0.39 and 0.43 s per step; each first update is applied alone.
    # t=7.4 node 0 creates group 0 with Q_max = 100: E = 7.4 + 37 = 44.4, L = 62.9.
    # t=7.8 node 1 joins it: floor((44.4 - 7.8) / 0.39) = floor(93.85) = 93 steps.
    # t=8.6 node 2 joins it: floor((44.4 - 8.6) / 0.43) = floor(83.26) = 83 steps.
    # (The former round trip + steps x training-seconds prediction gave each node a
    # group of its own.) Their messages take 7 + 2.0, 7 + 3.72 and 7 + 6.64 s: back at
    # 16.4 and 18.52 (buffered, waiting) and 22.24, when the group is complete and
    # aggregated once: versions 3, 3, 4.
    path = tmp_path / "fleet.csv"
    path.write_text(TALKATIVE)
    received: list[tuple[int, int]] = []
    strategy = STRATEGIES["fedcompass"](
        client_mode="delta",
        local_steps=20,
        local_lr=0.1,
        virtual_clock=VirtualClock(device_profile=str(path), jitter=0.0),
        engine=EngineSettings(max_norm_ratio=None, eval_every=1),
    )
    grid = InProcessGrid(stepping_app(received), 3, run_config={})
    result = strategy.start(grid, initial_arrays(), max_updates=6)
    steps = {p: [s for q, s in received if q == p] for p in range(3)}
    assert steps == {0: [20, 100], 1: [20, 93], 2: [20, 83]}
    rows = {r["updates"]: (r["virtual_time"], r["version"]) for r in result.rows}
    assert [rows[n][1] for n in (1, 2, 3, 4, 5, 6)] == [1, 2, 3, 3, 3, 4]
    assert [rows[n][0] for n in (4, 5, 6)] == pytest.approx([16.4, 18.52, 22.24])


def test_a_group_deadline_acts_at_its_time_as_appfls_timer(tmp_path, monkeypatch):
    # The fleet of the first test, with node 1's second message (group B's: 15 steps,
    # sent at 40 s) 3x slower: back at 40 + 3 x 30 = 130 s, not 70. Group B (E = 70,
    # L = 40 + 1.5 x 15 x 2 = 85) has node 0 back at 70 and node 1 still out: at its
    # deadline, 85 s, it is aggregated without node 1 and node 0 gets its next message
    # then (just past 85 s), though no reply is due before node 2's at 120 s.
    original = VirtualClock.compute_seconds
    sends: list[tuple[int, float]] = []

    def slow(self, speed, pid, index, steps=1):
        seconds = original(self, speed, pid, index, steps)
        return 3 * seconds if (pid, index) == (1, 1) else seconds

    from flwr_gsgm.engine import clock as engine_clock

    stamp = engine_clock.VirtualTime.stamp

    def noted(self, config, speed, pid, index, message_bytes):
        sends.append((pid, self.now()))
        return stamp(self, config, speed, pid, index, message_bytes)

    monkeypatch.setattr(VirtualClock, "compute_seconds", slow)
    monkeypatch.setattr(engine_clock.VirtualTime, "stamp", noted)
    received: list[tuple[int, int]] = []
    run(tmp_path, stepping_app(received), max_updates=12)
    node0 = [t for p, t in sends if p == 0]
    assert node0[:4] == [0.0, 20.0, 40.0, 60.0]
    assert node0[4] == pytest.approx(85.0) and node0[4] > 85.0
