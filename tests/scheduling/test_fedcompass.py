"""FedCompass on the engine: 3 nodes at 1, 2 and 4 virtual seconds per step (a profile
file, no jitter, free communication) under the virtual clock; groups form and their
members arrive together; a ClientApp without train-steps falls back to buffering."""

from __future__ import annotations

from flwr_gsgm.engine.async_engine import EngineSettings
from flwr_gsgm.simulation.inprocess_grid import InProcessGrid
from flwr_gsgm.simulation.virtual_clock import VirtualClock
from flwr_gsgm.strategy.strategies import STRATEGIES
from tests.engine.quadratic_app import initial_arrays, make_app
from tests.scheduling.test_work_scheduling import stepping_app

FLEET = "partition-id,step-seconds,bandwidth,latency-seconds\n0,1,inf,0\n1,2,inf,0\n2,4,inf,0\n"


def run(tmp_path, app, max_updates: int):
    path = tmp_path / "fleet.csv"
    path.write_text(FLEET)
    strategy = STRATEGIES["fedcompass"](
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
    # Own work 20 steps: Q_max = 20, Q_min = 4. By hand (APPFL's rules, lambda 1.5):
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
