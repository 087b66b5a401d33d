"""A ClientApp written for Flower's FedAvg works with the asynchronous strategies.

Such a client returns its trained weights ("arrays" + "num-examples"), has no query
handler, and reports neither partition-id nor model-version: with
``client_mode="weights"`` the server forms the displacement ``w_sent - w_returned``
from the weights it sent in that dispatch (whatever the client's learning rate),
registers the node without the query, and takes the bookkeeping from its own
dispatch record.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

from flwr_gsgm.engine.async_engine import EngineSettings
from flwr_gsgm.simulation.inprocess_grid import InProcessGrid
from flwr_gsgm.simulation.virtual_clock import VirtualClock
from flwr_gsgm.strategy.strategies import ASGD, GSGM
from tests.engine.quadratic_app import TARGETS, answer_query, initial_arrays, make_app

CLOCK = VirtualClock(seed=3)


def fedavg_app(returned=None, train_loss: float = 0.25, query: str = "none") -> ClientApp:
    """A FedAvg-style ClientApp on the quadratic model.

    It takes one SGD step of ``local-lr`` on ``0.5 * ||w - target_p||^2`` (and
    ``0.5 * (b - 0.5)^2``) and returns the weights, or the constant weights
    ``returned[p]`` if given. Metrics: ``num-examples`` and Flower's ``train_loss``.
    ``query``: "none" (no handler), "raises", or "answers" (the protocol's reply).
    """
    app = ClientApp()

    if query == "raises":

        @app.query()
        def failing_query(msg: Message, context: Context) -> Message:
            raise RuntimeError("this node cannot say its partition-id")

    elif query == "answers":

        @app.query()
        def answering_query(msg: Message, context: Context) -> Message:
            return answer_query(msg, context)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        # The server's local-lr if it sends one; otherwise the client's own, 0.05.
        lr = float(msg.content["config"].get("local-lr", 0.05))
        w = msg.content["arrays"]["w"].numpy()
        b = msg.content["arrays"]["b"].numpy()
        if returned is not None:
            new = {"w": np.asarray(returned[pid], np.float32), "b": b}
        else:
            new = {
                "w": (w - np.float32(lr) * (w - TARGETS[pid % len(TARGETS)])).astype(np.float32),
                "b": (b - np.float32(lr) * (b - 0.5)).astype(np.float32),
            }
        metrics = MetricRecord({"num-examples": 1, "train_loss": train_loss})
        arrays = ArrayRecord({k: Array(v) for k, v in new.items()})
        return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)

    return app


def start(strategy, app, num_nodes=3, max_updates=60, grid=None, **kwargs):
    grid = grid or InProcessGrid(app, num_nodes, run_config={})
    return strategy.start(grid, initial_arrays(), max_updates=max_updates, **kwargs)


# ------------------------------------------------------------------ weights mode
@pytest.mark.parametrize("local_lr", [0.25, 0.05, 1.0])
@pytest.mark.parametrize(
    "updates, expected", [(1, [0.5, -0.5]), (2, [0.75, -0.75]), (3, [0.875, -0.875])]
)
def test_asgd_weights_mode_steps_a_fraction_of_the_displacement(updates, expected, local_lr):
    # One node, ASGD eta = 0.5 of the displacement, the node always returns (1, -1);
    # the client's local-lr does not enter (invariance).
    # Update 1: sent (0, 0): d = (0, 0) - (1, -1) = (-1, 1), w = (0, 0) - 0.5 d = (0.5, -0.5).
    # Update 2: sent (0.5, -0.5): d = (-0.5, 0.5), w = (0.75, -0.75).
    # Update 3: sent (0.75, -0.75): d = (-0.25, 0.25), w = (0.875, -0.875). All exact.
    strategy = ASGD(server_learning_rate=0.5, client_mode="weights", local_lr=local_lr)
    result = start(
        strategy, fedavg_app(returned={0: [1.0, -1.0]}), num_nodes=1, max_updates=updates
    )
    assert result.arrays["w"].numpy().tolist() == expected
    assert result.arrays["b"].numpy().tolist() == [0.0]  # returned unchanged: d = 0
    assert result.report.rejections == {}


@pytest.mark.parametrize("local_lr", [0.25, 0.05])
@pytest.mark.parametrize("updates", [1, 2, 3])
def test_gsgm_weights_mode_default_takes_fedavg_step_at_each_cycle_close(updates, local_lr):
    # GSGM's declared defaults in weights mode: apply_at "auto" -> "close", lr 1.0, quorum
    # 0.5 (docs/GSGM.md, "FedAvg parity per client training"). One node: a cycle closes
    # at its one contribution (ceil(0.5 * 1) = 1), staleness 0 (weight 1), and the model
    # steps by the whole displacement, as FedAvg takes the node's weights; the node always
    # returns (1, -1).
    # 1: sent (0, 0), d1 = (-1, 1): w = (0, 0) - 1.0 * d1 = (1, -1).
    # 2, 3: sent (1, -1), d = (0, 0): w stays (1, -1). Exact in float32.
    strategy = GSGM(client_mode="weights", local_lr=local_lr)
    assert strategy.server_learning_rate == 1.0
    assert strategy.server_learning_rate_source.startswith("the rule's default, weights mode")
    result = start(
        strategy, fedavg_app(returned={0: [1.0, -1.0]}), num_nodes=1, max_updates=updates
    )
    assert result.arrays["w"].numpy().tolist() == [1.0, -1.0]
    assert result.report.counters["steps_applied"] == updates
    assert result.report.server_learning_rate == 1.0


def test_gsgm_weights_mode_with_quorum_one_is_fedavg_on_every_node_in_flight():
    # Quorum 1.0, every node in flight: a cycle is one FedAvg round. Nodes return
    # c_0 = (1, 0), c_1 = (0, 1), c_2 = (2, 2) whatever they are sent.
    # Cycle 1 (all sent (0, 0)): d_p = -c_p, mean d = -(1, 1): w = (1, 1), FedAvg's mean.
    # Cycle 2 (all sent (1, 1), held until then): d = (0,1), (1,0), (-1,-1), mean (0, 0).
    returned = {0: [1.0, 0.0], 1: [0.0, 1.0], 2: [2.0, 2.0]}
    strategy = GSGM(client_mode="weights", cycle_quorum=1.0, virtual_clock=CLOCK)
    for updates, version in ((3, 1), (6, 2)):
        result = start(strategy, fedavg_app(returned=returned), max_updates=updates)
        assert result.arrays["w"].numpy().tolist() == [1.0, 1.0]
        assert result.report.counters["steps_applied"] == version


def test_gsgm_close_holds_a_node_until_its_cycle_closes():
    # apply_at = "close": a node that contributed gets no work until the cycle closes,
    # so each node's successive dispatches carry increasing model versions (without
    # the hold a fast node would be sent the same version again). A quarter of the
    # nodes are 4x slower; quorum 0.5 closes a cycle without them.
    clock = VirtualClock(seed=3, slow_fraction=0.25, slow_factor=4.0, jitter=0.1)
    sent: dict[int, list[int]] = {}
    inner = fedavg_app()

    def app(msg: Message, context: Context) -> Message:
        if msg.metadata.message_type == "train":
            pid = int(context.node_config["partition-id"])
            sent.setdefault(pid, []).append(int(msg.content["config"]["model-version"]))
        return inner(msg, context)

    for limit in (None, 2):
        sent.clear()
        strategy = GSGM(
            client_mode="weights", virtual_clock=clock, engine=EngineSettings(max_in_flight=limit)
        )
        result = start(strategy, app, num_nodes=4, max_updates=40)
        assert result.report.counters["steps_applied"] >= 10, limit
        for pid, versions in sent.items():
            assert all(a < b for a, b in zip(versions, versions[1:])), (limit, pid, versions)


def test_the_displacement_uses_the_weights_sent_in_that_dispatch():
    # Both nodes are sent w0 = (0, 0) and return c_0 = (1, 0), c_1 = (0, 1); eta 0.5
    # (local-lr 0.1: it does not enter). Whatever the order, the second reply was
    # computed on w0, so w2 = w0 - 0.5 (w0 - c_a) - 0.5 (w0 - c_b) = (0.5, 0.5). From
    # the current weights instead, it would be (0.25, 0.5) or (0.5, 0.25).
    strategy = ASGD(
        server_learning_rate=0.5, client_mode="weights", local_lr=0.1, virtual_clock=CLOCK
    )
    returned = {0: [1.0, 0.0], 1: [0.0, 1.0]}
    result = start(strategy, fedavg_app(returned=returned), num_nodes=2, max_updates=2)
    assert result.arrays["w"].numpy().tolist() == [0.5, 0.5]
    assert result.report.counters["steps_applied"] == 2


@pytest.mark.parametrize("strategy_class, rule", [(ASGD, {}), (GSGM, {"apply_at": "arrival"})])
def test_weights_mode_equals_gradient_mode_for_one_sgd_step(strategy_class, rule):
    # One local SGD step: the displacement w - (w - lr (w - t)) = lr (w - t), lr times
    # the gradient the quadratic app returns (up to float32 rounding): the server
    # learning rate eta / lr on displacements takes the gradient run's steps of eta.
    # (GSGM with the step on every arrival in both modes, gradient mode's default.)
    common = {"virtual_clock": CLOCK, "local_lr": 0.05, **rule}
    weights = start(
        strategy_class(client_mode="weights", server_learning_rate=0.1 / 0.05, **common),
        fedavg_app(query="none"),
    )
    gradient = start(
        strategy_class(client_mode="gradient", server_learning_rate=0.1, **common), make_app()
    )
    for key in ("w", "b"):
        np.testing.assert_allclose(
            weights.arrays[key].numpy(), gradient.arrays[key].numpy(), atol=2e-5
        )
    assert weights.report.counters == gradient.report.counters
    assert weights.report.rejections == {}
    assert [r["train_loss"] for r in weights.rows[1:]] == [0.25] * (len(weights.rows) - 1)


@pytest.mark.parametrize("mode", ["gradient", "delta", "weights"])
def test_each_rule_takes_its_declared_default_of_the_client_mode(mode):
    from flwr_gsgm.config.build import build_strategy
    from flwr_gsgm.core import declared_params
    from flwr_gsgm.strategy.strategies import STRATEGIES
    from serverapp.app_config import parse_app_config

    for name, cls in STRATEGIES.items():
        lr = next(p for p in declared_params(name) if p.name == "lr")
        expected = lr.default if mode == "gradient" else lr.displacement_default
        # local_lr: DC-ASGD reads displacements through it (refused without it in
        # weights mode, where the ClientApp's own is not known)
        assert cls(client_mode=mode, local_lr=0.05).server_learning_rate == expected, name
        # the run config's server-learning-rate = 0: the same default
        cfg = parse_app_config({"strategy": name, "client-mode": mode})
        assert build_strategy(cfg).server_learning_rate == expected, name
        given = parse_app_config(
            {"strategy": name, "client-mode": mode, "server-learning-rate": 0.3}
        )
        assert build_strategy(given).server_learning_rate == 0.3, name


def test_dcasgd_reads_displacements_through_the_client_learning_rate():
    from flwr_gsgm.strategy.strategies import DCASGD

    assert DCASGD(client_mode="weights", local_lr=0.01).optimizer_params["update_scale"] == 0.01
    assert DCASGD(client_mode="delta", local_lr=0.2).optimizer_params["update_scale"] == 0.2
    assert DCASGD(client_mode="gradient", local_lr=0.2).optimizer_params["update_scale"] is None
    with pytest.raises(ValueError, match="in weights mode estimates a gradient as the "):
        DCASGD(client_mode="weights")


def test_weights_mode_sends_only_the_client_work_it_was_given():
    from flwr_gsgm.strategy.strategies import GSGM

    assert GSGM(client_mode="weights").client_work == {}
    assert GSGM(client_mode="weights", local_lr=0.1).client_work == {"local-lr": 0.1}
    assert GSGM(client_mode="delta").client_work == {
        "batch-size": 32,
        "local-batches": 1,
        "local-steps": 1,
        "local-epochs": 0,
        "local-lr": 0.05,
        "local-momentum": 0.0,
    }


def test_local_epochs_and_momentum_are_sent_in_every_train_message():
    seen = []
    inner = fedavg_app()

    def app(msg: Message, context: Context) -> Message:
        if msg.metadata.message_type == "train":
            seen.append(dict(msg.content["config"]))
        return inner(msg, context)

    strategy = ASGD(client_mode="weights", local_epochs=2, local_momentum=0.9)
    start(strategy, app, num_nodes=2, max_updates=4)
    assert len(seen) >= 4
    assert all(c["local-epochs"] == 2 and c["local-momentum"] == 0.9 for c in seen)
    with pytest.raises(ValueError, match="local-momentum must be in \\[0, 1\\), got 1.0"):
        ASGD(client_mode="weights", local_momentum=1.0)
    with pytest.raises(ValueError, match="local-epochs must be an integer >= 0, got -1"):
        ASGD(client_mode="weights", local_epochs=-1)


# -------------------------------------------------------------- optional query
def mixed_app(calls: list) -> ClientApp:
    """Partition 0: no query handler; 1: its query raises; 2: answers it."""
    apps = {
        0: fedavg_app(query="none"),
        1: fedavg_app(query="raises"),
        2: fedavg_app(query="answers"),
    }

    def route(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        calls.append((pid, msg.metadata.message_type))
        reply = apps[pid](msg, context)
        if pid == 1 and msg.metadata.message_type == "train":
            # Reports its own partition-id, which is not its key: not compared.
            reply.content["metrics"]["partition-id"] = 1
        return reply

    return route


def test_nodes_without_a_query_answer_are_registered_at_once(caplog):
    caplog.set_level(logging.INFO)
    calls: list = []
    strategy = ASGD(
        server_learning_rate=0.1,
        client_mode="weights",
        virtual_clock=CLOCK,
        engine=EngineSettings(startup_timeout=300.0),
    )
    t0 = time.monotonic()
    grid = InProcessGrid(mixed_app(calls), 3, run_config={}, workers=2)
    with grid:
        result = start(strategy, None, max_updates=30, grid=grid)
    elapsed = time.monotonic() - t0
    # Waiting for the startup-timeout (300 s) would take 10x this generous bound.
    assert elapsed < 30.0, elapsed
    assert result.report.counters["updates_received"] == 30
    assert result.report.rejections == {}
    assert result.report.counters["nodes_refused"] == 0
    trained = {pid for pid, kind in calls if kind == "train"}
    assert trained == {0, 1, 2}
    # Partition 2 reported 2 of 3; the others are keyed after the partitions, by node id,
    # and named as Flower names them (issue 35 item 2): by node id, never by their key.
    logged = [r.getMessage() for r in caplog.records]
    assert "[async] node 1 registered without a partition-id" in logged
    assert "[async] node 2 registered without a partition-id" in logged
    started = "[async] 3 nodes: node 3 (partition 2), node 1, node 2; slow: "
    assert any(line.startswith(started) for line in logged)
    assert list(result.report.per_node) == ["node 3 (partition 2)", "node 1", "node 2"]
    assert [(n["node_id"], n["partition_id"]) for n in result.report.per_node.values()] == [
        (3, 2),
        (1, None),
        (2, None),
    ]
    assert not [line for line in logged if "partition 3" in line or "partition 4" in line]
    assert any(
        "node 2 cannot answer the query" in line and "cannot say its" in line for line in logged
    )


def test_without_a_virtual_clock_or_checkpoints_no_node_is_queried(caplog, tmp_path):
    # A FedAvg-written ClientApp has no query handler (under Flower's simulation engine
    # every query would log an ERROR traceback): by default the engine sends none and
    # keys the nodes by node id, in node-id order, saying so once.
    caplog.set_level(logging.INFO)
    calls: list = []

    def app(msg: Message, context: Context) -> Message:
        calls.append(msg.metadata.message_type)
        return fedavg_app(query="none")(msg, context)

    strategy = ASGD(server_learning_rate=0.1, client_mode="weights")
    result = start(strategy, None, max_updates=12, grid=InProcessGrid(app, 3, run_config={}))
    assert result.report.counters["updates_received"] == 12
    assert set(calls) == {"train"}
    logged = [r.getMessage() for r in caplog.records]
    said = [line for line in logged if "nodes keyed by node id" in line]
    assert len(said) == 1 and "set EngineSettings(query_partition_ids=True) if" in said[0]
    assert any("3 nodes: node 1, node 2, node 3;" in line for line in logged)
    # With a virtual clock (or checkpoints) the nodes are asked, as before.
    assert EngineSettings(virtual_clock=CLOCK).queries_partition_ids
    assert EngineSettings(checkpoint_path=tmp_path / "c.pt").queries_partition_ids
    assert not EngineSettings().queries_partition_ids
    assert EngineSettings(query_partition_ids=True).queries_partition_ids


def test_a_node_without_a_query_handler_joins_mid_run_under_the_next_free_key(caplog):
    caplog.set_level(logging.INFO)
    grid = InProcessGrid(fedavg_app(query="none"), 2, run_config={})
    added = {}

    def evaluate_fn(updates, arrays):
        if updates == 10 and not added:
            added["node"] = grid.add_node({"partition-id": 2, "num-partitions": 3})
        return None

    strategy = ASGD(
        server_learning_rate=0.1,
        client_mode="weights",
        engine=EngineSettings(node_refresh_interval=0.0, eval_every=10),
    )
    result = start(strategy, None, max_updates=60, grid=grid, evaluate_fn=evaluate_fn)
    assert result.report.counters["nodes_joined"] == 1
    logged = [r.getMessage() for r in caplog.records]
    assert f"[async] node {added['node']} registered without a partition-id" in logged
    assert f"[async] node {added['node']} joined" in logged
    assert result.report.rejections == {}


def test_a_query_error_other_than_a_client_exception_registers_nothing(caplog):
    caplog.set_level(logging.INFO)
    inner = fedavg_app(query="none")

    def app(msg: Message, context: Context) -> Message:
        if context.node_config["partition-id"] == 1 and msg.metadata.message_type == "query":
            return Message(Error(ErrorCode.LOAD_CLIENT_APP_EXCEPTION, "no app"), reply_to=msg)
        return inner(msg, context)

    strategy = ASGD(
        server_learning_rate=0.1,
        client_mode="weights",
        engine=EngineSettings(query_partition_ids=True),
    )
    result = start(strategy, None, max_updates=10, grid=InProcessGrid(app, 2, run_config={}))
    logged = [r.getMessage() for r in caplog.records]
    error = (
        "[async] node 2 answered its query with error code 1: the ClientApp failed to load: no app"
    )
    # Asked again (a failed query), then refused after max-node-failures (5) of them.
    assert logged.count(error) == 5
    assert any("1 nodes: node 1;" in line for line in logged)
    assert result.report.counters["updates_received"] == 10
    assert result.report.counters["nodes_refused"] == 1


def test_the_project_client_app_in_weights_mode_trains_as_in_delta_mode(tmp_path):
    # The same local work (3 SGD steps); delta mode forms the displacement on the node,
    # weights mode on the server, from the same float32 operands: the same runs.
    from clients.client_app import app
    from serverapp.app_config import parse_app_config
    from serverapp.experiment import run_experiment

    models = {}
    for mode in ("delta", "weights"):
        cfg = parse_app_config(
            {
                "client-mode": mode,
                "local-steps": 3,
                "max-updates": 40,
                "eval-every": 40,
                "eval-examples": 500,
                "run-name": mode,
                "output-dir": str(tmp_path),
            }
        )
        with InProcessGrid(app, 3, run_config=cfg, workers=2) as grid:
            summary = run_experiment(grid, cfg)
        assert summary["rejected"] == 0 and summary["updates_received"] == 40
        assert summary["server_learning_rate"] == 1.0  # GSGM's displacement-mode default
        models[mode] = torch.load(tmp_path / mode / "model.pt")
    assert list(models["weights"]) == list(models["delta"])
    for key, value in models["delta"].items():
        assert torch.equal(models["weights"][key], value), key
