"""The strategy's hooks for what a FedAvg subclass does (issue 24, item 3).

``train_config_fn`` (a per-dispatch train config, FedAvg's ``configure_train``
override) and ``on_evaluate`` (a callback on each server evaluation, FedAvg's
``aggregate_evaluate`` override or ``evaluate_fn`` side effects), on the in-process
grid under the virtual clock (a reproducible reply order): what each node actually
received, what the callback saw, and how a failing hook stops the run.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flwr_gsgm.engine.hooks import ENGINE_TRAIN_KEYS, HookFailed
from flwr_gsgm.simulation.inprocess_grid import InProcessGrid
from flwr_gsgm.simulation.virtual_clock import VirtualClock
from flwr_gsgm.strategy.strategies import ASGD
from tests.engine.quadratic_app import TARGETS, initial_arrays

NODES = 3


def recording_app(received: list[tuple[int, dict]]) -> ClientApp:
    """A FedAvg-style ClientApp (weights back, no query handler) that appends
    ``(context.node_id, config as a dict)`` of every train message to ``received``.

    It takes one SGD step of the ``local-lr`` it was sent on ``0.5 ||w - target||^2``.
    """
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        config = dict(msg.content["config"])
        received.append((context.node_id, config))
        pid = int(context.node_config["partition-id"])
        lr = np.float32(config["local-lr"])
        w = msg.content["arrays"]["w"].numpy()
        b = msg.content["arrays"]["b"].numpy()
        new = {
            "w": (w - lr * (w - TARGETS[pid])).astype(np.float32),
            "b": (b - lr * (b - 0.5)).astype(np.float32),
        }
        metrics = MetricRecord({"num-examples": 1, "train_loss": 0.25})
        arrays = ArrayRecord({k: Array(v) for k, v in new.items()})
        return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)

    return app


def run(received=None, max_updates=12, **strategy_kwargs):
    """ASGD in weights mode on ``NODES`` nodes, local lr 0.2, a ``"optimizer"`` key in
    the train config; returns the result."""
    start_kwargs = strategy_kwargs.pop("start_kwargs", {})
    strategy = ASGD(
        client_mode="weights",
        server_learning_rate=0.5,
        local_lr=0.2,
        virtual_clock=VirtualClock(seed=3),
        **strategy_kwargs,
    )
    grid = InProcessGrid(recording_app([] if received is None else received), NODES, {})
    return strategy.start(
        grid,
        initial_arrays(),
        max_updates=max_updates,
        train_config=ConfigRecord({"optimizer": "sgd"}),
        **start_kwargs,
    )


# --------------------------------------------------------------- train_config_fn
def test_train_config_fn_schedule_reaches_each_node():
    # A FedAvg schedule ported: local lr 0.1 for the first 6 updates, then halved.
    # Every call is recorded; "call" tags the message with the arguments it was built with.
    calls: list[tuple[int, int, int]] = []

    def schedule(node_id: int, model_version: int, updates_received: int) -> ConfigRecord:
        calls.append((node_id, model_version, updates_received))
        lr = 0.1 if updates_received < 6 else 0.05
        return ConfigRecord({"local-lr": lr, "call": len(calls) - 1})

    received: list[tuple[int, dict]] = []
    result = run(received, train_config_fn=schedule)
    assert result.report.counters["updates_received"] == 12

    # One call per train message: the first three at 0 updates in node order, then one
    # per reply while the budget leaves room (received + in flight < 12): after the
    # replies 1..9. ASGD applies each update: the version equals the updates received.
    assert [c[0] for c in calls[:NODES]] == [1, 2, 3]
    assert [(v, u) for _, v, u in calls] == [(0, 0)] * NODES + [(r, r) for r in range(1, 10)]
    assert len(received) == len(calls) == 12

    base = {
        "mode": "weights",
        # The client work the strategy was given (local_lr only: the rest is the
        # ClientApp's own and not sent) and start()'s train_config, kept.
        "optimizer": "sgd",
    }
    for node_id, config in received:
        hook_node, version, updates = calls[config["call"]]
        assert node_id == hook_node  # the message went to the node the hook was told
        assert config["model-version"] == version
        assert config["local-lr"] == (0.1 if updates < 6 else 0.05)  # over local_lr=0.2
        assert {k: config[k] for k in base} == base
        assert set(config) == {
            *base,
            "local-lr",
            "call",
            "model-version",
            "seed",
            "virtual-duration",
            "virtual-train-seconds",
        }
    assert sorted(c["call"] for _, c in received) == list(range(12))


def test_an_empty_train_config_changes_nothing():
    # The merge adds nothing of its own: a hook returning no key gives the run of no hook
    # (same messages, same model, same rows), so the hook costs no RNG draw either.
    plain: list[tuple[int, dict]] = []
    hooked: list[tuple[int, dict]] = []
    expected = run(plain)
    got = run(hooked, train_config_fn=lambda node_id, version, updates: ConfigRecord())
    assert hooked == plain
    assert got.arrays["w"].numpy().tolist() == expected.arrays["w"].numpy().tolist()
    strip = [{k: v for k, v in row.items() if k != "wall_time"} for row in expected.rows]
    assert [{k: v for k, v in r.items() if k != "wall_time"} for r in got.rows] == strip


def test_a_changed_local_steps_changes_that_messages_virtual_duration():
    # The virtual clock charges the work the message asks for, hook's keys included.
    plain: list[tuple[int, dict]] = []
    hooked: list[tuple[int, dict]] = []
    run(plain, max_updates=3)
    run(hooked, max_updates=3, train_config_fn=lambda n, v, u: ConfigRecord({"local-steps": 4}))
    # One step of 4 per message: compute is 4x, communication the same, so longer.
    for (_, p), (_, h) in zip(plain, hooked):
        assert h["local-steps"] == 4
        assert h["virtual-duration"] > p["virtual-duration"]


def test_a_raising_train_config_fn_stops_the_run_naming_it():
    def schedule(node_id, model_version, updates_received):
        if updates_received == 5:
            raise ValueError("no learning rate for update 5")
        return ConfigRecord({"local-lr": 0.1})

    with pytest.raises(HookFailed) as info:
        run(train_config_fn=schedule)
    message = str(info.value)
    assert message.startswith("train_config_fn(node_id=")
    assert ", model_version=5, updates_received=5) raised ValueError: no learning rate for " in (
        message
    )
    assert info.value.hook == "train_config_fn"
    assert isinstance(info.value.__cause__, ValueError)


@pytest.mark.parametrize(
    "returned, shown",
    [({"local-lr": 0.1}, "got dict {'local-lr': 0.1}"), (None, "got NoneType None")],
)
def test_a_train_config_fn_that_returns_no_config_record_is_a_type_error(returned, shown):
    with pytest.raises(TypeError, match="train_config_fn must return a ConfigRecord") as info:
        run(train_config_fn=lambda n, v, u: returned)
    assert shown in str(info.value)
    assert "(node_id=1, model_version=0, updates_received=0)" in str(info.value)


@pytest.mark.parametrize("key", ENGINE_TRAIN_KEYS)
def test_a_train_config_fn_may_not_set_the_engines_keys(key):
    value = "delta" if key == "mode" else 7
    with pytest.raises(ValueError, match=f"train_config_fn returned '{key}'; the engine sets"):
        run(train_config_fn=lambda n, v, u: ConfigRecord({key: value}))


# ------------------------------------------------------------------- on_evaluate
def test_on_evaluate_sees_every_evaluation_in_order():
    # evaluate_fn's accuracy rises with the updates; its extra key "f1" reaches the hook.
    def evaluate_fn(updates: int, arrays: ArrayRecord) -> MetricRecord:
        return MetricRecord({"accuracy": updates / 100, "loss": 1 - updates / 100, "f1": 0.5})

    seen: list[tuple[int, MetricRecord]] = []
    best: dict = {}

    def on_evaluate(updates: int, arrays: ArrayRecord, metrics: MetricRecord) -> None:
        seen.append((updates, metrics))
        if metrics["accuracy"] > best.get("accuracy", -1.0):  # a best-model checkpoint
            best.update(accuracy=metrics["accuracy"], arrays=arrays)

    result = run(
        max_updates=10,
        on_evaluate=on_evaluate,
        start_kwargs={"evaluate_fn": evaluate_fn, "eval_every": 4},
    )
    # At 0, every 4 updates, and at the end (10).
    assert [u for u, _ in seen] == [0, 4, 8, 10]
    assert [(m["accuracy"], m["loss"], m["f1"]) for _, m in seen] == [
        (0.0, 1.0, 0.5),
        (0.04, 0.96, 0.5),
        (0.08, 0.92, 0.5),
        (0.1, 0.9, 0.5),
    ]
    # metrics is the evaluation row (metrics.csv) plus evaluate_fn's other keys, less
    # the row's NaN train_loss at 0 updates (no reply yet: no value, left out).
    assert len(result.rows) == len(seen)
    assert math.isnan(result.rows[0]["train_loss"])  # metrics.csv keeps its NaN
    for row, (_, metrics) in zip(result.rows, seen):
        known = {k: v for k, v in row.items() if not (k == "train_loss" and math.isnan(v))}
        assert dict(metrics) == {**known, "f1": 0.5}
        assert isinstance(metrics["updates"], int) and isinstance(metrics["staleness_max"], int)
    assert [m["version"] for _, m in seen] == [0, 4, 8, 10]  # ASGD: a step per update
    # The last evaluation's arrays are the final model.
    assert best["accuracy"] == 0.1
    assert best["arrays"]["w"].numpy().tolist() == result.arrays["w"].numpy().tolist()


def test_on_evaluate_without_evaluate_fn_gets_no_accuracy():
    seen: list[tuple[int, MetricRecord]] = []
    run(max_updates=4, on_evaluate=lambda u, a, m: seen.append((u, m)))
    assert [u for u, _ in seen] == [0, 4]
    assert [(m.get("accuracy"), m.get("loss")) for _, m in seen] == [(None, None)] * 2


def test_the_first_on_evaluate_is_at_0_updates_without_train_loss_and_strict_json():
    # At 0 updates no reply has come: train_loss has no value. The hook gets none (a
    # MetricRecord holds no None: the key is left out), not NaN, so a port that writes
    # its rows with json.dump (advanced-pytorch's results.json) writes strict JSON.
    def evaluate_fn(updates: int, arrays: ArrayRecord) -> MetricRecord:
        return MetricRecord({"accuracy": 0.5, "loss": 1.0})

    seen: list[tuple[int, MetricRecord]] = []
    run(
        max_updates=4,
        on_evaluate=lambda u, a, m: seen.append((u, m)),
        start_kwargs={"evaluate_fn": evaluate_fn},
    )
    (first_updates, first), (_, last) = seen
    assert first_updates == 0
    assert first.get("train_loss") is None and "train_loss" not in first
    assert last["train_loss"] == 0.25  # the replies' train_loss, once there are some
    for _, metrics in seen:
        assert json.loads(json.dumps(dict(metrics), allow_nan=False)) == dict(metrics)
    wall = json.dumps(first["wall_time"])
    assert json.dumps(dict(first), allow_nan=False) == (
        f'{{"updates": 0, "version": 0, "virtual_time": 0.0, "wall_time": {wall}, '
        '"accuracy": 0.5, "loss": 1.0, "staleness_mean": 0.0, "staleness_max": 0, '
        '"deferred": 0, "rejected": 0, "dropped": 0}'
    )


def test_a_raising_on_evaluate_stops_the_run_naming_it():
    def on_evaluate(updates, arrays, metrics):
        if updates == 4:
            raise ConnectionError("wandb is unreachable")

    with pytest.raises(HookFailed) as info:
        run(on_evaluate=on_evaluate, start_kwargs={"eval_every": 4})
    assert str(info.value) == (
        "on_evaluate(updates=4) raised ConnectionError: wandb is unreachable; the run stopped"
    )
    assert info.value.hook == "on_evaluate"


@pytest.mark.parametrize("hook", ["train_config_fn", "on_evaluate"])
def test_a_hook_that_is_not_callable_is_refused_at_construction(hook):
    with pytest.raises(TypeError, match=f"^{hook} must be a callable or None, got dict"):
        ASGD(**{hook: {"local-lr": 0.1}})


def test_a_train_config_change_is_logged_once_per_change(caplog):
    # FedAvg's CustomFedAvg logs "Adjusted learning rate"; here the engine logs each
    # change of what train_config_fn returns, once, not once per message: over the
    # run's local-lr (0.2) at the first message, then the halving at 6 updates.
    calls: list[tuple[int, int]] = []

    def schedule(node_id: int, model_version: int, updates_received: int) -> ConfigRecord:
        calls.append((node_id, updates_received))
        return ConfigRecord({"local-lr": 0.1 if updates_received < 6 else 0.05})

    caplog.set_level("INFO")
    run(train_config_fn=schedule)
    lines = [r.getMessage() for r in caplog.records if "train_config_fn changed" in r.getMessage()]
    halved = next(n for n, u in calls if u >= 6)
    assert lines == [
        "[async] train_config_fn changed the train config at 0 updates received (node 1): "
        "local-lr 0.2 -> 0.1",
        f"[async] train_config_fn changed the train config at 6 updates received (node "
        f"{halved}): local-lr 0.1 -> 0.05",
    ]
    assert len(calls) == 12  # called for every message, logged twice


def test_a_train_config_fn_returning_the_run_config_logs_nothing(caplog):
    caplog.set_level("INFO")
    run(train_config_fn=lambda n, v, u: ConfigRecord({"optimizer": "sgd"}))
    assert not [r for r in caplog.records if "train_config_fn changed" in r.getMessage()]


def test_a_key_the_run_config_lacks_is_logged_as_set_from_unset(caplog):
    # advanced-pytorch's ClientApp reads "lr", a key the run's train config may lack.
    caplog.set_level("INFO")
    run(max_updates=4, train_config_fn=lambda n, v, u: ConfigRecord({"lr": 0.1}))
    lines = [r.getMessage() for r in caplog.records if "train_config_fn changed" in r.getMessage()]
    assert lines == [
        "[async] train_config_fn changed the train config at 0 updates received (node 1): "
        "lr unset -> 0.1"
    ]
