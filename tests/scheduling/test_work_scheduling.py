"""Work scheduling in the engine: each message's local-steps from its node's measured
speed, updates weighed by their steps, and a ClientApp that ignores local-steps."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flwr_gsgm import STRATEGIES
from flwr_gsgm.engine.async_engine import EngineSettings
from flwr_gsgm.simulation.inprocess_grid import InProcessGrid
from flwr_gsgm.simulation.virtual_clock import VirtualClock
from flwr_gsgm.strategy.strategies import ASGD
from tests.engine.quadratic_app import TARGETS, answer_query, initial_arrays

# One virtual second per step, no jitter: a slow node (factor 4) takes 4 s per step.
CLOCK = VirtualClock(seed=3, jitter=0.0, slow_fraction=0.25, slow_factor=4.0)


def stepping_app(received: list[tuple[int, int]], honours: bool = True) -> ClientApp:
    """Delta mode on 0.5 * ||w - target_p||^2: ``local-steps`` SGD steps (5 if it does
    not honour them), reporting ``train-steps`` and the simulated ``train-seconds``."""
    app = ClientApp()

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        return answer_query(msg, context)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        config = msg.content["config"]
        asked = int(config["local-steps"])
        received.append((pid, asked))
        steps = asked if honours else 5
        w0, b0 = msg.content["arrays"].to_numpy_ndarrays()
        w, b = w0.copy(), b0.copy()
        for _ in range(steps):
            w -= np.float32(0.1) * (w - TARGETS[pid % len(TARGETS)])
            b -= np.float32(0.1) * (b - 0.5)
        metrics = {
            "num-examples": steps,
            "partition-id": pid,
            "model-version": int(config["model-version"]),
            "train-steps": steps,
            "train-seconds": float(config["virtual-train-seconds"]),
        }
        arrays = ArrayRecord({"w": Array((w0 - w).astype(np.float32)), "b": Array(b0 - b)})
        return Message(
            RecordDict({"arrays": arrays, "metrics": MetricRecord(metrics)}), reply_to=msg
        )

    return app


def run(app: ClientApp, max_updates: int = 24):
    strategy = ASGD(
        client_mode="delta",
        local_steps=5,
        local_lr=0.1,
        virtual_clock=CLOCK,
        engine=EngineSettings(work_scheduling="equal-time", max_norm_ratio=None),
    )
    grid = InProcessGrid(app, 4, run_config={})
    return strategy.start(grid, initial_arrays(), max_updates=max_updates)


def test_each_node_computes_for_the_median_nodes_time():
    (slow,) = [p for p, f in CLOCK.speed_factors([0, 1, 2, 3]).items() if f == 4.0]
    received: list[tuple[int, int]] = []
    result = run(stepping_app(received))
    # First messages: the run's 5 steps each. The fast nodes then take 5 s for 5 steps,
    # the slow one 20 s: the target is the median, 5 s, so the fast nodes keep 5 steps
    # and the slow one gets round(5 / 4) = 1, raised to ceil(5 / 4) = 2.
    assert received[:4] == [(p, 5) for p in range(4)]
    later = {p: {s for q, s in received[4:] if q == p} for p in range(4)}
    assert later[slow] == {2}
    assert all(later[p] == {5} for p in range(4) if p != slow)
    assert result.report.work_scheduling == "equal-time"


def test_the_run_end_says_each_nodes_steps_and_speed(caplog):
    """The end-of-run log line and summary.json's work_scheduling, by hand: the virtual
    clock charges 1 s per step (the slow node 4 s), reported as train-seconds, so the
    measured speeds are exactly 1 and 4 s per step; every node's last message asked for
    the steps of the first test (5, the slow node 2)."""
    from flwr_gsgm.config.outputs import summarize

    (slow,) = [p for p, f in CLOCK.speed_factors([0, 1, 2, 3]).items() if f == 4.0]
    caplog.set_level("INFO")
    report = run(stepping_app([])).report
    nodes = {
        f"node {p + 1} (partition {p})": {
            "seconds_per_step": 4.0 if p == slow else 1.0,
            "local_steps_sent": 2 if p == slow else 5,
        }
        for p in range(4)
    }
    assert report.work_nodes == nodes
    line = ", ".join(
        f"node {p + 1} (partition {p}) "
        + ("2 steps at 4 s/step" if p == slow else "5 steps at 1 s/step")
        for p in range(4)
    )
    said = [
        r.getMessage()
        for r in caplog.records
        if "[async] work scheduling equal-time:" in r.getMessage()
    ]
    assert said == [f"[async] work scheduling equal-time: {line}"]
    summary = summarize(
        report.rows, report.counters, report.rejections, 0.0, 0, 0.0, 0.0, report=report
    )
    assert summary["work_scheduling"] == {"state": "equal-time", "nodes": nodes}


def test_a_client_that_ignores_local_steps_is_detected_and_the_run_goes_on(caplog):
    (slow,) = [p for p, f in CLOCK.speed_factors([0, 1, 2, 3]).items() if f == 4.0]
    received: list[tuple[int, int]] = []
    result = run(stepping_app(received, honours=False))
    assert result.report.status == "completed"
    assert result.report.counters["updates_received"] == 24
    assert result.report.work_scheduling == (
        f"equal-time, turned off: node {slow + 1} (partition {slow}) did 5 local steps where 2 were asked: "
        "its ClientApp ignores local-steps (docs/PORTING.md, 'Work scheduling'); every "
        "node keeps its own work"
    )
    # Said once; after it every message carries the run's own 5 steps again.
    assert sum("work scheduling off" in r.getMessage() for r in caplog.records) == 1
    asked_two = [i for i, (p, s) in enumerate(received) if s == 2]
    assert asked_two and all(s == 5 for _, s in received[asked_two[-1] + 1 :])


def test_gradient_mode_refuses_work_scheduling():
    with pytest.raises(ValueError, match="needs client-mode delta or weights, got 'gradient'"):
        ASGD(engine=EngineSettings(work_scheduling="equal-time"))


def client_work_line(strategy, caplog) -> str:
    """The "Client work" line of ``strategy``'s summary, as logged."""
    caplog.set_level("INFO")
    caplog.clear()
    strategy.summary()
    (line,) = [r.getMessage() for r in caplog.records if "Client work" in r.getMessage()]
    return line


def test_the_summary_says_work_scheduling_sets_local_steps(caplog):
    # Weights mode without client work: the strategy sends none and names no key of
    # the ClientApp's (a ported ClientApp may read none of the library's, e.g. "lr");
    # with work scheduling it sends local-steps (and local-epochs 0).
    none = (
        "\t├── Client work: mode=weights; the strategy sends no client work (the ClientApp "
        "trains with its own settings)"
    )
    scheduled = (
        "; work scheduling ({}) sends local-steps (and local-epochs 0) once a node's speed "
        "is measured by its first reply"
    )
    on = EngineSettings(work_scheduling="equal-time")
    assert client_work_line(ASGD(client_mode="weights", engine=on), caplog) == (
        none + scheduled.format("equal-time")
    )
    assert client_work_line(ASGD(client_mode="weights"), caplog) == none
    # FedCompass schedules with its own scheduler, work-scheduling off.
    compass = STRATEGIES["fedcompass"](client_mode="weights")
    assert client_work_line(compass, caplog) == none + scheduled.format("compass")
    # Client work given: what the strategy sends, the rest the ClientApp's own.
    assert client_work_line(ASGD(client_mode="weights", local_lr=0.2), caplog) == (
        "\t├── Client work: mode=weights; the strategy sends {'local-lr': 0.2} (the "
        "ClientApp's own settings for the rest)"
    )
