"""Models with buffers: arrays matched by name, the rule on the trainable arrays only,
floating buffers averaged over the nodes' latest reports, integer arrays kept as
reported (dtype and shape), all of it in replies, checkpoints and the final model."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord

from flwr_gsgm.checkpoint import files as checkpoint
from flwr_gsgm.core import REASONS, UpdateRejected
from flwr_gsgm.engine.async_engine import AsyncEngine, EngineSettings
from flwr_gsgm.model.buffers import ModelBuffers
from flwr_gsgm.model.layout import ModelLayout
from flwr_gsgm.model.optimizer import ModelOptimizer
from flwr_gsgm.simulation.inprocess_grid import InProcessGrid
from flwr_gsgm.simulation.virtual_clock import VirtualClock
from flwr_gsgm.strategy.strategies import ASGD, GSGM
from tests.engine import quadratic_app
from tests.model import buffer_app

CLOCK = VirtualClock(seed=3)
BN_KEYS = ["0.weight", "0.bias", "1.weight", "1.bias"]
BN_BUFFERS = ["1.running_mean", "1.running_var", "1.num_batches_tracked"]


def bn_record() -> ArrayRecord:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2))
    return ArrayRecord(model.state_dict())


def record(**arrays) -> ArrayRecord:
    return ArrayRecord({k: Array(np.asarray(v)) for k, v in arrays.items()})


# ----------------------------------------------------------------- the layout
def test_a_torch_state_dict_with_int64_num_batches_tracked_is_accepted_and_split():
    layout, arrays = ModelLayout.from_record(bn_record())
    assert layout.keys == BN_KEYS + BN_BUFFERS
    assert layout.trainable_keys == BN_KEYS
    assert layout.buffer_keys == BN_BUFFERS
    count = arrays[-1]
    assert count.dtype == np.int64 and count.shape == () and int(count) == 0


def test_an_explicit_list_of_trainable_keys_overrides_the_default():
    layout, _ = ModelLayout.from_record(bn_record(), trainable_keys=["0.weight", "1.bias"])
    assert layout.trainable_keys == ["0.weight", "1.bias"]
    assert layout.buffer_keys == ["0.bias", "1.weight"] + BN_BUFFERS


@pytest.mark.parametrize(
    "trainable, message",
    [
        (
            ["0.weight", "2.weight"],
            "trainable_keys names ['2.weight'], which the model does not have",
        ),
        (["1.num_batches_tracked"], "trainable array '1.num_batches_tracked' has dtype int64"),
        ([], "the model has no trainable array"),
    ],
)
def test_a_bad_list_of_trainable_keys_fails_naming_the_key(trainable, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ModelLayout.from_record(bn_record(), trainable_keys=trainable)


def test_a_float64_parameter_is_refused_at_start_with_what_to_change():
    rec = record(w=np.zeros(2, np.float64), b=np.zeros(1, np.float32))
    with pytest.raises(ValueError, match=r"trainable array 'w' has dtype float64.*model.float\(\)"):
        ModelLayout.from_record(rec)


# ------------------------------------------------------------ matching replies
def reply_of(layout: ModelLayout, arrays: list[np.ndarray], order=None, **changes):
    named = dict(zip(layout.keys, arrays))
    named.update(changes)
    keys = order or list(named)
    return record(**{k: named[k] for k in keys if named[k] is not None})


def test_a_reply_in_another_order_is_matched_by_name():
    layout, arrays = ModelLayout.from_record(bn_record())
    values = [np.full(a.shape, i + 1, a.dtype) for i, a in enumerate(arrays)]
    update = layout.match(reply_of(layout, values, order=list(reversed(layout.keys))))
    for key, got in zip(layout.trainable_keys, update.trainable):
        assert np.array_equal(got, values[layout.keys.index(key)]), key
    assert list(update.buffers) == BN_BUFFERS
    assert update.buffers["1.running_var"].tolist() == [6.0, 6.0]
    count = update.buffers["1.num_batches_tracked"]
    assert count.dtype == np.int64 and count.shape == () and int(count) == 7


@pytest.mark.parametrize(
    "changes, reason, message",
    [
        ({"2.weight": np.zeros(2, np.float32)}, "array-keys", "reply has array(s) ['2.weight']"),
        ({"0.bias": None}, "array-keys", "reply lacks trainable array(s) ['0.bias']"),
        (
            {"1.num_batches_tracked": np.array(3.0, np.float32)},
            "dtype",
            "array '1.num_batches_tracked' has dtype float32, the model's is int64",
        ),
        (
            {"1.running_var": np.ones(2, np.float64)},
            "dtype",
            "array '1.running_var' has dtype float64, the model's is float32",
        ),
        (
            {"1.running_mean": np.ones(3, np.float32)},
            "shape",
            "array '1.running_mean' has shape (3,), the model's is (2,)",
        ),
        (
            {"1.running_var": np.array([1.0, np.nan], np.float32)},
            "non-finite",
            "buffer '1.running_var' holds NaN or infinity",
        ),
    ],
)
def test_a_reply_that_does_not_match_by_name_is_rejected_naming_the_key(changes, reason, message):
    layout, arrays = ModelLayout.from_record(bn_record())
    with pytest.raises(UpdateRejected) as info:
        layout.match(reply_of(layout, arrays, **changes))
    assert info.value.reason == reason and reason in REASONS
    assert message in info.value.message


def test_a_reply_without_a_buffer_is_accepted_and_reports_nothing_for_it():
    layout, arrays = ModelLayout.from_record(bn_record())
    update = layout.match(reply_of(layout, arrays, **{"1.running_mean": None}))
    assert list(update.buffers) == ["1.running_var", "1.num_batches_tracked"]


# ------------------------------------------------------------------ the buffers
def test_floating_buffers_are_the_mean_of_the_latest_reports_integers_the_latest():
    layout = ModelLayout.from_arrays(
        ["w", "var", "count"],
        [np.zeros(2, np.float32), np.ones(2, np.float32), np.array(0, np.int64)],
        trainable_keys=["w"],
    )
    buffers = ModelBuffers(layout, {"var": np.ones(2, np.float32), "count": np.array(0)})
    buffers.record(0, {"var": np.array([1.0, 3.0], np.float32), "count": np.array(5)})
    buffers.record(1, {"var": np.array([3.0, 5.0], np.float32), "count": np.array(2)})
    assert buffers.values["var"].tolist() == [2.0, 4.0]
    assert int(buffers.values["count"]) == 2  # the latest report, not the max
    buffers.record(0, {"var": np.array([5.0, 5.0], np.float32)})  # node 0's latest replaces
    assert buffers.values["var"].tolist() == [4.0, 5.0]
    assert int(buffers.values["count"]) == 2  # node 0 did not report it this time
    buffers.forget(1)
    assert buffers.values["var"].tolist() == [5.0, 5.0]
    buffers.forget(0)  # nobody left: the last mean stays
    assert buffers.values["var"].tolist() == [5.0, 5.0]
    assert buffers.values["var"].dtype == np.float32
    count = buffers.values["count"]
    assert count.dtype == np.int64 and count.shape == ()


def test_the_rule_never_sees_the_buffers_and_a_rejected_update_leaves_them_unchanged():
    layout, arrays = ModelLayout.from_record(bn_record())
    seen = {}

    def factory(weights, pids, concurrency):
        seen["shapes"] = [w.shape for w in weights]
        return ASGD(server_learning_rate=0.5).rule_spec(weights, pids, concurrency)

    opt = ModelOptimizer(layout, arrays, factory, [0])
    assert seen["shapes"] == [(2, 1, 3, 3), (2,), (2,), (2,)]
    before = [w.copy() for w in opt.weights]
    bad = layout.match(reply_of(layout, arrays, **{"1.running_var": np.full(2, 9.0, np.float32)}))
    bad.trainable[0] = np.full((2, 1, 3, 3), np.inf, np.float32)
    with pytest.raises(UpdateRejected, match="non-finite"):
        opt.on_update(0, bad, 0)
    assert all(np.array_equal(a, b) for a, b in zip(opt.weights, before))
    good = layout.match(reply_of(layout, arrays, **{"1.running_var": np.full(2, 9.0, np.float32)}))
    good.trainable = [np.ones_like(a) for a in good.trainable]
    opt.on_update(0, good, 0)
    after = dict(zip(layout.keys, opt.weights))
    assert np.allclose(after["0.bias"], before[1] - 0.5)  # w - lr * g
    assert after["1.running_var"].tolist() == [9.0, 9.0]  # a value, not stepped
    assert after["1.num_batches_tracked"].dtype == np.int64


def test_model_optimizer_state_holds_the_buffers_and_loads_all_or_nothing():
    layout, arrays = ModelLayout.from_record(bn_record())
    make = ASGD(server_learning_rate=0.5).rule_spec
    opt = ModelOptimizer(layout, arrays, make, [0, 1])
    update = layout.match(reply_of(layout, arrays, **{"1.num_batches_tracked": np.array(4)}))
    opt.on_update(1, update, 0)
    state = opt.state_dict()
    fresh = ModelOptimizer(layout, arrays, make, [0, 1])
    fresh.load_state_dict(state)
    assert all(np.array_equal(a, b) for a, b in zip(fresh.weights, opt.weights))
    assert int(fresh.buffers.values["1.num_batches_tracked"]) == 4
    assert sorted(fresh.buffers.latest) == [1]
    broken = {**state, "rule": {**state["rule"], "name": "gsgm"}}
    other = ModelOptimizer(layout, arrays, make, [0, 1])
    with pytest.raises(ValueError, match="cannot be loaded"):
        other.load_state_dict(broken)
    assert int(other.buffers.values["1.num_batches_tracked"]) == 0  # unchanged


# ------------------------------------------------------------- through the engine
def run_buffers(strategy, app, max_updates=60, num_nodes=3):
    grid = InProcessGrid(app, num_nodes, run_config={})
    return strategy.start(grid, buffer_app.initial_arrays(), max_updates=max_updates)


def test_buffers_through_the_engine_replies_in_reverse_order():
    seen: list[int] = []
    result = run_buffers(
        ASGD(server_learning_rate=0.1, virtual_clock=CLOCK), buffer_app.make_app(seen_counts=seen)
    )
    plain = quadratic_app.make_app()
    reference = ASGD(server_learning_rate=0.1, virtual_clock=CLOCK).start(
        InProcessGrid(plain, 3, run_config={}), quadratic_app.initial_arrays(), max_updates=60
    )
    assert result.report.rejections == {}
    final = {k: v.numpy() for k, v in result.arrays.items()}
    assert list(final) == ["w", "b", "bn.running_var", "bn.num_batches_tracked"]
    # The rule saw exactly what it sees without buffers: bit-identical weights.
    for key in ("w", "b"):
        assert np.array_equal(final[key], reference.arrays[key].numpy()), key
    # Every node reported: the mean of [p + 1, 2 (p + 1)] over p = 0, 1, 2.
    assert final["bn.running_var"].tolist() == [2.0, 4.0]
    count = final["bn.num_batches_tracked"]
    assert count.dtype == np.int64 and count.shape == ()
    # Each reply is (count received) + 1; the final value is the latest applied one.
    assert int(count) in {c + 1 for c in seen} and int(count) >= 1


@pytest.mark.parametrize(
    "edit, reason, named",
    [
        (lambda out: {**out, "extra": np.zeros(1, np.float32)}, "array-keys", "['extra']"),
        (lambda out: {k: v for k, v in out.items() if k != "b"}, "array-keys", "['b']"),
        (
            lambda out: {**out, "bn.num_batches_tracked": np.array(1.0, np.float32)},
            "dtype",
            "'bn.num_batches_tracked' has dtype float32",
        ),
    ],
)
def test_a_node_whose_replies_do_not_match_is_rejected_and_never_touches_the_model(
    caplog, edit, reason, named
):
    caplog.set_level(logging.WARNING)
    strategy = ASGD(server_learning_rate=0.1, virtual_clock=CLOCK)
    result = run_buffers(strategy, buffer_app.make_app(edit={2: edit}), max_updates=30)
    rejected = result.report.rejections
    assert list(rejected) == [reason] and rejected[reason] > 0
    final = {k: v.numpy() for k, v in result.arrays.items()}
    # Only nodes 0 and 1 reported buffers.
    assert final["bn.running_var"].tolist() == [1.5, 3.0]
    logged = [
        r.getMessage()
        for r in caplog.records
        if "rejected update from node 3 (partition 2)" in r.getMessage()
    ]
    assert len(logged) == rejected[reason] and all(named in line for line in logged)


def test_checkpoint_and_resume_keep_the_buffers(tmp_path):
    """Stopped at 20 updates (as on SIGTERM) and resumed: the run ends as the whole run."""

    def engine(max_updates, resume, stop_at=None):
        strategy = GSGM(server_learning_rate=0.1, virtual_clock=CLOCK)
        settings = EngineSettings(
            max_updates=max_updates,
            eval_every=10,
            checkpoint_every=10,
            checkpoint_path=tmp_path / "checkpoint.pt",
            resume=resume,
            virtual_clock=CLOCK,
            dispatch="random",
        )
        holder = {}

        def evaluate_fn(step, arrays):
            if step == stop_at:
                holder["engine"].stop_requested = True
            return None

        holder["engine"] = AsyncEngine(
            InProcessGrid(buffer_app.make_app(), 3, run_config={}),
            buffer_app.initial_arrays(),
            strategy.rule_spec,
            ConfigRecord({"mode": "gradient"}),
            settings,
            evaluate_fn,
        )
        return holder["engine"]

    whole = engine(40, resume=False).run()
    (tmp_path / "checkpoint.pt").unlink()
    with pytest.raises(SystemExit, match=r"checkpoint saved at \d+ updates"):
        engine(40, resume=False, stop_at=20).run()
    saved = checkpoint.load(tmp_path / "checkpoint.pt")
    values = saved["optimizer"]["buffers"]["values"]
    assert values["bn.num_batches_tracked"].dtype == np.int64
    assert values["bn.num_batches_tracked"].shape == ()
    resumed = engine(40, resume=True).run()
    for key in whole.arrays.keys():
        a, b = whole.arrays[key].numpy(), resumed.arrays[key].numpy()
        assert a.dtype == b.dtype and np.array_equal(a, b), key


def test_the_strategy_takes_trainable_keys_and_refuses_a_bad_one_before_any_message():
    grid = InProcessGrid(buffer_app.make_app(), 3, run_config={})
    with pytest.raises(ValueError, match=r"trainable_keys names \['v'\]"):
        ASGD(trainable_keys=["w", "v"]).start(grid, buffer_app.initial_arrays(), max_updates=5)
    assert grid.pending == {}  # nothing was sent
    with pytest.raises(ValueError, match="a list of array names, got the string 'w'"):
        ASGD(trainable_keys="w")
