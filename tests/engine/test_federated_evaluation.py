"""Federated evaluation: the nodes evaluate the global model every N updates, in flight
beside training, aggregated as Flower's FedAvg does (weighted by num-examples).

The quadratic ClientApp gets an evaluate handler whose metrics are known per node:
``num-examples`` = 10 (p + 1), ``score`` = p and ``eval-loss`` = 0.5 ||w - target_p||^2
at the received w, so every aggregate can be computed here by hand.
"""

from __future__ import annotations

import csv
import math
import threading

import numpy as np
import pytest
from flwr.app import Context, Message, MetricRecord, RecordDict

from flwr_gsgm.config import outputs as run_outputs
from flwr_gsgm.engine.federated_evaluation import FederatedEvaluation
from flwr_gsgm.engine.settings import EngineSettings
from flwr_gsgm.simulation.inprocess_grid import InProcessGrid
from flwr_gsgm.simulation.virtual_clock import VirtualClock
from flwr_gsgm.strategy.strategies import ASGD, GSGM
from serverapp.app_config import parse_app_config
from tests.engine.quadratic_app import TARGETS, initial_arrays, make_app

CLOCK = VirtualClock(seed=3, base_duration=1.0, slow_fraction=0.25, slow_factor=4.0, jitter=0.1)


def examples(pid: int) -> int:
    return 10 * (pid + 1)


def node_loss(pid: int, w: np.ndarray) -> float:
    return float(0.5 * np.sum((w - TARGETS[pid % len(TARGETS)]) ** 2))


def app_with_evaluate(calls: list, bad: dict | None = None, before=None):
    """The quadratic app plus an evaluate handler; ``calls`` gets (pid, version, w)."""
    app = make_app()

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        if before is not None:
            before(pid)
        w = msg.content["arrays"]["w"].numpy()
        calls.append((pid, int(msg.content["config"]["model-version"]), w.copy()))
        metrics = {
            "num-examples": examples(pid),
            "score": float(pid),
            "eval-loss": node_loss(pid, w),
        }
        if bad and pid in bad:
            metrics = bad[pid](metrics)  # may raise
        return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)

    return app


def weights_at_rows():
    """An evaluate_fn noting the global w at each evaluation row."""
    seen: dict[int, np.ndarray] = {}

    def evaluate_fn(updates, arrays):
        seen[updates] = arrays["w"].numpy().copy()
        return MetricRecord({"accuracy": 0.0, "loss": 0.0})

    return seen, evaluate_fn


def read_metrics(tmp_path, rows) -> list[dict[str, str]]:
    run_outputs.write_metrics(tmp_path, rows)
    with open(tmp_path / "metrics.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def test_metrics_csv_holds_the_weighted_node_metrics_at_the_points(tmp_path):
    calls: list = []
    seen, evaluate_fn = weights_at_rows()
    strategy = ASGD(
        server_learning_rate=0.1,
        virtual_clock=CLOCK,
        federated_evaluation=FederatedEvaluation(every=20),
    )
    with InProcessGrid(app_with_evaluate(calls), 4, run_config={}, workers=2) as grid:
        result = strategy.start(
            grid, initial_arrays(), max_updates=40, eval_every=10, evaluate_fn=evaluate_fn
        )
    table = read_metrics(tmp_path, result.rows)
    assert list(table[0])[-4:] == [
        "dropped",
        "federated_nodes",
        "federated_eval_loss",
        "federated_score",
    ]
    assert [r["updates"] for r in table] == ["0", "10", "20", "30", "40"]
    for row in table:
        u = int(row["updates"])
        if u not in (20, 40):
            assert row["federated_nodes"] == row["federated_eval_loss"] == ""
            continue
        # Every node (fraction 1) evaluated the model of that row, w = seen[u]:
        # score = sum 10(p+1) p / sum 10(p+1) = (0 + 20 + 60 + 120) / 100 = 2.0.
        assert sorted(p for p, _, w in calls if np.array_equal(w, seen[u])) == [0, 1, 2, 3]
        loss = sum(examples(p) * node_loss(p, seen[u]) for p in range(4)) / 100
        assert row["federated_nodes"] == "4"
        assert float(row["federated_score"]) == pytest.approx(2.0, rel=1e-12)
        assert float(row["federated_eval_loss"]) == pytest.approx(loss, rel=1e-9)
        assert result.evaluate_metrics_clientapp[u]["eval-loss"] == pytest.approx(loss, rel=1e-9)
    assert sorted(result.evaluate_metrics_clientapp) == [20, 40]
    counters = result.report.counters
    assert (counters["federated_eval_sent"], counters["federated_eval_replies"]) == (8, 8)
    assert counters["federated_eval_failed"] == 0
    # The version each node was told is the version it evaluated.
    versions = {int(r["updates"]): int(r["version"]) for r in table}
    assert {v for _, v, _ in calls} == {versions[20], versions[40]}


def test_failed_and_invalid_replies_are_left_out_and_counted():
    calls: list = []
    seen, evaluate_fn = weights_at_rows()

    def fail(metrics):
        raise RuntimeError("evaluation fails on purpose")

    bad = {2: lambda m: {**m, "eval-loss": math.nan}, 3: fail}
    strategy = ASGD(
        server_learning_rate=0.1,
        virtual_clock=CLOCK,
        federated_evaluation=FederatedEvaluation(every=10),
    )
    grid = InProcessGrid(app_with_evaluate(calls, bad), 4, run_config={})
    result = strategy.start(
        grid, initial_arrays(), max_updates=20, eval_every=10, evaluate_fn=evaluate_fn
    )
    for u in (10, 20):
        # Only partitions 0 and 1 count: score = (0 * 10 + 1 * 20) / 30.
        row = next(r for r in result.rows if r["updates"] == u)
        loss = (10 * node_loss(0, seen[u]) + 20 * node_loss(1, seen[u])) / 30
        assert row["federated_nodes"] == 2
        assert row["federated_score"] == pytest.approx(20 / 30, rel=1e-12)
        assert row["federated_eval_loss"] == pytest.approx(loss, rel=1e-9)
    counters = result.report.counters
    assert (counters["federated_eval_sent"], counters["federated_eval_replies"]) == (8, 4)
    assert counters["federated_eval_failed"] == 4
    # Training is not touched: evaluate failures are not error replies of train messages.
    assert counters["error_replies"] == 0 and counters["nodes_lost"] == 0


def test_a_fraction_of_the_nodes_is_asked_and_the_same_ones_under_the_same_seed():
    def asked(seed: int) -> list[list[int]]:
        calls: list = []
        strategy = GSGM(
            virtual_clock=CLOCK,
            seed=seed,
            federated_evaluation=FederatedEvaluation(every=10, fraction_evaluate=0.5),
        )
        grid = InProcessGrid(app_with_evaluate(calls), 6, run_config={})
        result = strategy.start(grid, initial_arrays(), max_updates=60, eval_every=10)
        by_version: dict[int, list[int]] = {}
        for pid, version, _ in calls:
            by_version.setdefault(version, []).append(pid)
        assert [r["federated_nodes"] for r in result.rows if r["updates"]] == [3] * 6
        return [sorted(p) for _, p in sorted(by_version.items())]

    first = asked(0)
    assert [len(p) for p in first] == [3] * 6  # int(6 * 0.5) of 6 nodes at each point
    assert len({tuple(p) for p in first}) > 1  # a new draw at each point
    assert asked(0) == first


def test_training_goes_on_while_a_node_evaluates():
    # The node asked at 10 updates answers only once 30 train messages were computed
    # (or after 60 s, which the check below tells apart): an engine that waited for
    # the evaluation before training on would never get there.
    released = threading.Event()
    waited: list[tuple[bool, int]] = []
    trained: list[int] = []
    app = app_with_evaluate(
        [], before=lambda pid: waited.append((released.wait(timeout=60), len(trained)))
    )

    def client(msg: Message, context: Context) -> Message:
        if msg.metadata.message_type == "train":
            trained.append(1)
            if len(trained) >= 30:
                released.set()
        return app(msg, context)

    strategy = ASGD(
        server_learning_rate=0.1,
        virtual_clock=CLOCK,
        federated_evaluation=FederatedEvaluation(every=10, fraction_evaluate=0.25),
    )
    with InProcessGrid(client, 3, run_config={}, workers=3) as grid:
        result = strategy.start(grid, initial_arrays(), max_updates=40, eval_every=10)
    assert waited[0][0] is True  # released by training, not by the time-out
    assert waited[0][1] >= 30
    # int(3 * 0.25) = 0 < min_evaluate_nodes: one node at each point, each recorded.
    assert [r.get("federated_nodes") for r in result.rows] == [None, 1, 1, 1, 1]


def test_federated_points_must_fall_on_evaluation_rows():
    with pytest.raises(
        ValueError, match=r"federated-eval-every=15 must be a multiple of eval-every=10"
    ):
        EngineSettings(eval_every=10, federated_evaluation=FederatedEvaluation(every=15))
    with pytest.raises(
        ValueError,
        match=r"run config federated-eval-every=150: expected a multiple of eval-every=100",
    ):
        parse_app_config({"federated-eval-every": 150})
    with pytest.raises(ValueError, match=r"fraction-evaluate must be in \(0, 1\], got 0.0"):
        FederatedEvaluation(every=10, fraction_evaluate=0.0)
    with pytest.raises(ValueError, match=r"run config fraction-evaluate=1.5: expected in \(0, 1\]"):
        parse_app_config({"fraction-evaluate": 1.5})


def real_run(tmp_path, **overrides) -> tuple[dict, list[dict[str, str]]]:
    """A small run of the project's app on real Fashion-MNIST (4 nodes, in-process)."""
    from clients.client_app import app as client_app
    from serverapp.experiment import run_experiment

    cfg = parse_app_config(
        {
            "max-updates": 40,
            "eval-every": 20,
            "eval-examples": 500,
            "eval-max-examples": 200,
            "federated-eval-every": 40,
            "partitioner": "iid",
            **overrides,
        }
    )
    with InProcessGrid(client_app, 4, run_config=cfg, workers=2) as grid:
        run_experiment(grid, cfg, tmp_path / "run")
    with open(tmp_path / "run" / "metrics.csv", newline="") as fh:
        return cfg, list(csv.DictReader(fh))


def test_a_real_run_writes_the_nodes_weighted_evaluation_of_its_final_model(tmp_path):
    import torch
    from flwr.app import ArrayRecord

    from clients.client_app import app as client_app

    cfg, table = real_run(tmp_path)
    assert [r["federated_nodes"] for r in table] == ["", "", "4"]
    # By hand: every node evaluates the final model (model.pt) with its own
    # ClientApp evaluate handler; the aggregate is the mean weighted by num-examples.
    state = torch.load(tmp_path / "run" / "model.pt")
    grid = InProcessGrid(client_app, 4, run_config=cfg)
    content = RecordDict({"arrays": ArrayRecord(state)})
    mids = grid.push_messages(
        [Message(content, node_id, "evaluate") for node_id in grid.get_node_ids()]
    )
    replies = [r.content["metrics"] for r in grid.pull_messages(mids)]
    assert len(replies) == 4 and all(m["num-examples"] == 200 for m in replies)
    total = sum(m["num-examples"] for m in replies)
    for key in ("eval-accuracy", "eval-loss"):
        expected = sum(m["num-examples"] * m[key] for m in replies) / total
        assert float(table[-1][f"federated_{key.replace('-', '_')}"]) == pytest.approx(
            expected, rel=1e-9
        )
    summary = (tmp_path / "run" / "summary.json").read_text()
    assert '"federated_eval_replies": 4' in summary


def test_flowers_fedavg_runs_its_own_federated_evaluation_at_the_same_points(tmp_path):
    overrides = {"max-updates": 16, "eval-every": 4, "federated-eval-every": 8}
    _, table = real_run(tmp_path, strategy="fedavg", **overrides)
    # 4 nodes per round: rounds 1..4 end at 4, 8, 12, 16 updates; every node
    # evaluates in the rounds that reach a multiple of 8 updates.
    assert [r["updates"] for r in table] == ["0", "4", "8", "12", "16"]
    assert [r["federated_nodes"] for r in table] == ["", "", "4", "", "4"]
    accuracy = [float(table[i]["federated_eval_accuracy"]) for i in (2, 4)]
    assert all(0.0 < a <= 1.0 for a in accuracy) and accuracy[0] != accuracy[1]
