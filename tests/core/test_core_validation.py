"""Rejections leave the state bit-identical; state_dict round trips; registry."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from core_testutil import (
    GSGM_STRICT,
    Engine,
    assert_bits_equal,
    assert_state_equal,
    assert_unchanged_but_rejected,
    f32,
)

from flwr_gsgm.core import (
    OPTIMIZERS,
    GSGMRule,
    Outcome,
    UpdateRejected,
    make_optimizer,
    optimizer_params,
)

SHAPES = [(2,), (2, 2)]


def arrays(*values):
    """Two arrays shaped like SHAPES from 6 values."""
    return [f32(*values[:2]), np.array(values[2:], np.float32).reshape(2, 2)]


def with_strict(name, kw):
    """``kw`` over GSGM_STRICT for GSGM (mid-cycle slots need quorum 1.0)."""
    return {**GSGM_STRICT, **kw} if name == "gsgm" else dict(kw)


def busy(name, **kw):
    """An optimizer mid-run: momentum, slots, buffers, backups all non-trivial."""
    params = dict(lr=0.5, max_norm=100.0)
    params.update(with_strict(name, kw))
    opt = make_optimizer(name, arrays(1, 2, 3, 4, 5, 6), [1, 2, 3], **params)
    eng = Engine(opt, [1, 2, 3])
    for node, v in [(1, 1.0), (1, 2.0), (2, 0.5), (1, -1.0), (3, 0.25), (1, 3.0)]:
        eng.update(node, arrays(v, -v, 2 * v, v, 0.5, -0.5))
    return opt, eng


BAD = {
    "num-arrays": lambda: arrays(1, 1, 1, 1, 1, 1)[:1],
    "shape": lambda: [f32(1, 1), f32(1, 1, 1, 1)],
    "dtype": lambda: [np.array([1, 1], np.float64), np.ones((2, 2), np.float32)],
    "non-finite": lambda: arrays(1, 1, 1, np.nan, 1, 1),
    "norm": lambda: arrays(1000, 1, 1, 1, 1, 1),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("reason", sorted(BAD))
def test_each_reason_leaves_state_bit_identical(name, reason):
    opt, eng = busy(name)
    before = opt.state_dict()
    with pytest.raises(UpdateRejected) as info:
        opt.on_update(1, BAD[reason](), eng.sent[1], now=eng.now + 1)
    assert info.value.reason == reason
    assert isinstance(info.value, ValueError)
    assert_unchanged_but_rejected(before, opt.state_dict())


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_unknown_node_and_base_version(name):
    opt, eng = busy(name)
    good = arrays(1, 1, 1, 1, 1, 1)
    cases = [
        ("unknown-node", dict(partition_id=99, base_version=0)),
        ("unknown-node", dict(partition_id="1", base_version=0)),
        ("base-version", dict(partition_id=2, base_version=opt.version + 1)),
        ("base-version", dict(partition_id=2, base_version=-1)),
        ("base-version", dict(partition_id=2, base_version=1.0)),
    ]
    opt.on_node_lost(3)
    cases.append(("unknown-node", dict(partition_id=3, base_version=0)))
    for reason, kw in cases:
        before = opt.state_dict()
        with pytest.raises(UpdateRejected) as info:
            opt.on_update(update=good, **kw)
        assert info.value.reason == reason, (kw, info.value)
        assert_unchanged_but_rejected(before, opt.state_dict())
    assert opt.counters["rejected"] == len(cases)


def test_rejection_messages_name_value_and_expectation():
    opt = GSGMRule(arrays(0, 0, 0, 0, 0, 0), [1], lr=0.5, max_norm=1.0)
    msgs = {}
    for reason, make_bad in BAD.items():
        with pytest.raises(UpdateRejected) as info:
            opt.on_update(1, make_bad(), 0)
        msgs[reason] = str(info.value)
    assert "expected 2 arrays, got 1" in msgs["num-arrays"]
    assert "(4,)" in msgs["shape"] and "(2, 2)" in msgs["shape"]
    assert "<f8" in msgs["dtype"] and "float32" in msgs["dtype"]
    assert "nan" in msgs["non-finite"] and "index 1" in msgs["non-finite"]
    assert "max_norm 1" in msgs["norm"]
    with pytest.raises(UpdateRejected, match="got a single numpy.ndarray"):
        opt.on_update(1, f32(1, 2), 0)
    with pytest.raises(UpdateRejected, match="expected a numpy float32"):
        opt.on_update(1, [[1.0, 2.0], np.ones((2, 2), np.float32)], 0)


def test_infinity_and_float32_overflow_of_the_norm():
    opt = GSGMRule(arrays(0, 0, 0, 0, 0, 0), [1], lr=1e-30)
    with pytest.raises(UpdateRejected) as info:
        opt.on_update(1, arrays(1, -np.inf, 1, 1, 1, 1), 0)
    assert info.value.reason == "non-finite" and "-inf" in str(info.value)
    # 1e30 ** 2 overflows float32 but the value is finite: accepted.
    assert opt.on_update(1, arrays(1e30, 1, 1, 1, 1, 1), 0) is Outcome.APPLIED


def test_bad_now_is_a_caller_error_and_not_counted():
    opt = GSGMRule(arrays(0, 0, 0, 0, 0, 0), [1], lr=0.5)
    with pytest.raises(ValueError, match="now"):
        opt.on_update(1, arrays(1, 1, 1, 1, 1, 1), 0, now=float("nan"))
    assert opt.counters["rejected"] == 0 and opt.counters["arrivals"] == 0


# ------------------------------------------------------------------ checkpointing
GSGM_CONFIGS = [
    dict(),
    dict(momentum_form="ema", cycle_quorum=0.5),
    dict(averaging="table"),
    dict(scheduling=False),
    dict(momentum_form="ema", averaging="table", cycle_quorum=0.5),
    dict(lr_scaling="cycle", cycle_quorum=0.5),
    dict(averaging="table", scheduling=False),
]


def continue_run(opt, eng, steps=12):
    for i in range(steps):
        node = [1, 2, 1, 3, 1, 2][i % 6]
        if node not in eng.sent:  # lost
            continue
        v = 0.1 * (i + 1)
        eng.update(node, arrays(v, 1 - v, v * v, -v, 0.5, v), dt=0.75)
        if i == 5:
            eng.lost(2)
        if i == 8:
            eng.joined(2)


@pytest.mark.parametrize(
    "name,kw",
    [("gsgm", c) for c in GSGM_CONFIGS] + [(n, {}) for n in sorted(OPTIMIZERS) if n != "gsgm"],
)
def test_restored_mid_cycle_continues_bit_identically(name, kw):
    opt, eng = busy(name, **kw)
    if name == "gsgm" and kw.get("scheduling", True):
        assert opt.slots or opt.cycle_count  # genuinely mid-cycle
    blob = pickle.dumps(opt.state_dict())
    snap = eng.snapshot()
    continue_run(opt, eng)

    # Other params (the state's are restored), but the same mode (STATE_LAYOUT).
    layout = {k: v for k, v in with_strict(name, kw).items() if k in ("averaging", "scheduling")}
    fresh = make_optimizer(name, arrays(0, 0, 0, 0, 0, 0), [9], lr=0.25, **layout)
    views = fresh.weights
    fresh.load_state_dict(pickle.loads(blob))
    assert (
        fresh.params
        == make_optimizer(
            name, arrays(0, 0, 0, 0, 0, 0), [1], lr=0.5, max_norm=100.0, **with_strict(name, kw)
        ).params
    )
    assert all(np.shares_memory(v, fresh.flat_weights) for v in views)
    eng2 = Engine.__new__(Engine)
    eng2.restore(fresh, snap)
    continue_run(fresh, eng2)
    assert_state_equal(opt.state_dict(), fresh.state_dict())
    for a, b in zip(opt.weights, fresh.weights):
        assert_bits_equal(a, b)


def test_state_dict_is_a_deep_copy_of_plain_values():
    opt, _ = busy("gsgm")
    state = opt.state_dict()

    def plain(x):
        if isinstance(x, dict):
            return all(isinstance(k, str) and plain(v) for k, v in x.items())
        if isinstance(x, list):
            return all(plain(v) for v in x)
        return x is None or type(x) in (int, float, str, bool, np.ndarray)

    assert plain(state)
    state["weights"][:] = 123.0
    state["momentum"][:] = 123.0
    state["slot_values"][0][:] = 123.0
    assert not np.any(opt.flat_weights == 123.0)
    assert not np.any(opt.momentum == 123.0)
    assert not np.any(next(iter(opt.slots.values()))[0] == 123.0)


def test_state_dict_survives_torch_save():
    import io

    import torch

    opt, _ = busy("gsgm")
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    # torch >= 2.6 loads with weights_only=True by default: allow numpy arrays.
    allowed = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, np.dtypes.Float32DType]
    with torch.serialization.safe_globals(allowed):
        state = torch.load(buf)
    assert_state_equal(opt.state_dict(), state)


def test_load_state_dict_refuses_foreign_states_and_stays_unchanged():
    opt, _ = busy("gsgm")
    before = opt.state_dict()
    other, _ = busy("asgd")
    with pytest.raises(ValueError, match="asgd"):
        opt.load_state_dict(other.state_dict())
    small = GSGMRule([f32(0, 0)], [1], lr=0.5)
    with pytest.raises(ValueError, match="shapes"):
        opt.load_state_dict(small.state_dict())
    broken = opt.state_dict()
    broken["slot_values"] = [np.zeros(3, np.float32)] * len(broken["slot_nodes"])
    with pytest.raises(ValueError, match="slot_values"):
        opt.load_state_dict(broken)
    assert_state_equal(before, opt.state_dict())


# ----------------------------------------------------------------------- registry
def test_registry_names_and_building_every_optimizer():
    assert sorted(OPTIMIZERS) == [
        "ace",
        "asgd",
        "ca2fl",
        "daasgd",
        "dcasgd",
        "fedasync",
        "fedbuff",
        "fedcompass",
        "gsgm",
        "masgd",
    ]
    for name, cls in OPTIMIZERS.items():
        opt = make_optimizer(name, [f32(0, 0)], [1], lr=0.1)
        assert type(opt) is cls and opt.name == name
        assert "lr" in optimizer_params(name)


def test_registry_errors():
    with pytest.raises(ValueError) as info:
        make_optimizer("adam", [f32(0, 0)], [1], lr=0.1)
    msg = str(info.value)
    assert "'adam'" in msg and all(n in msg for n in OPTIMIZERS)
    with pytest.raises(ValueError) as info:
        make_optimizer("asgd", [f32(0, 0)], [1], lr=0.1, beta=0.5)
    assert "'beta'" in str(info.value) and "lr" in str(info.value)
    with pytest.raises(ValueError, match="'lr'"):
        make_optimizer("gsgm", [f32(0, 0)], [1])
    with pytest.raises(ValueError, match="twice"):
        make_optimizer("gsgm", [f32(0, 0)], [1], lr=0.1, cycle_quorum=0.5, **{"cycle-quorum": 0.5})


def test_registry_accepts_run_config_keys():
    opt = make_optimizer(
        "gsgm",
        [f32(0, 0)],
        [1, 2],
        **{"lr": 0.1, "momentum-form": "ema", "cycle-quorum": 0.5, "lr-scaling": "step"},
    )
    assert opt.params["momentum_form"] == "ema"
    assert opt.params["cycle_quorum"] == 0.5
    assert opt.params["lr_scaling"] == "step"


# ------------------------------------------------ float32 input checks (issue 12 C)
def test_weights_an_exact_float32_copy_would_change_are_refused_by_name():
    # An integer array is never cast (it would become float32: another dtype, and
    # above 2**24 other values), whether or not float32 holds its values exactly.
    for ints in (np.array([3, 2**24 + 1], np.int64), np.array([3, 2], np.int64)):
        with pytest.raises(ValueError) as info:
            GSGMRule([f32(0, 0), ints], [1])
        assert str(info.value) == (
            "weights[1] is an integer array (int64): the server rules step float32 weights "
            "and never cast an integer array (its float32 copy would change its dtype, and "
            "above 2**24 its values); keep integer arrays, such as BatchNorm's "
            "num_batches_tracked, out of the optimizer's weights"
        )
    with pytest.raises(ValueError) as info:
        GSGMRule([np.array([[0.5], [1e39]])], [1])
    assert str(info.value) == (
        "weights[0] holds 1e+39 (float64) at flat index 1: out of float32 range "
        "(|x| <= 3.4028235e+38)"
    )
    with pytest.raises(ValueError) as info:
        GSGMRule([f32(0, 0), f32(1, np.nan)], [1])
    assert "weights[1] holds nan at flat index 1" in str(info.value)
    assert "must be finite" in str(info.value)
    # Within float32 but beyond the state range (sums of the state must stay finite).
    with pytest.raises(ValueError) as info:
        GSGMRule([f32(0, -1e31)], [1])
    assert str(info.value) == (
        "weights[0] holds -9.999999848243207e+30 at flat index 1: beyond the state range "
        "+-2**100 (float32's largest value less a margin of 2**28 for sums)"
    )
    # A float64 in range is rounded to the nearest float32.
    opt = GSGMRule([np.array([0.1, 1e29]), f32(2**24, -3)], [1])
    assert_bits_equal(opt.weights[0], f32(0.1, 1e29))
    assert_bits_equal(opt.weights[1], f32(2**24, -3))


def test_a_float64_update_out_of_float32_range_names_the_real_reason():
    opt = GSGMRule(arrays(0, 0, 0, 0, 0, 0), [1], lr=0.5)
    before = opt.state_dict()
    with pytest.raises(UpdateRejected) as info:
        opt.on_update(1, [np.array([0.0, 1e39]), np.ones((2, 2), np.float32)], 0)
    assert info.value.reason == "dtype"
    assert info.value.message == (
        "array 0 has dtype <f8, expected float32 (<f4); it holds 1e+39 (float64) at flat "
        "index 1: out of float32 range (|x| <= 3.4028235e+38)"
    )
    assert "non-finite" not in str(info.value)
    assert_unchanged_but_rejected(before, opt.state_dict())


def test_an_update_viewing_the_weights_is_copied_before_the_gsgm_step():
    # Strict GSGM (heavy-ball, slots, lr per step), lr 0.5, beta 0.5, w = (1, 2).
    opt = GSGMRule([f32(1, 2)], [1, 2], lr=0.5, beta=0.5, **GSGM_STRICT)
    view = opt.weights[0]  # shares memory with w
    assert opt.on_update(1, [view], 0) is Outcome.APPLIED
    # u = (1, 2) as sent: w <- w - 0.5 * u = (0.5, 1); S <- S + u = (1, 2), not the
    # stepped (0.5, 1) a view read after the step would give.
    assert_bits_equal(opt.weights[0], f32(0.5, 1))
    assert_bits_equal(opt.cycle_sum, f32(1, 2))
    # Node 2's zero update closes the cycle: M <- S / k = (0.5, 1).
    assert opt.on_update(2, [f32(0, 0)], 0) is Outcome.APPLIED
    assert opt.cycle_index == 1
    assert_bits_equal(opt.momentum, f32(0.5, 1))
    assert_bits_equal(opt.weights[0], f32(0.5, 1))
    # Next cycle: node 1 sends the weights again: u = (0.5, 1),
    # w <- w - 0.5 * (u + 0.5 * M) = (0.5, 1) - 0.5 * (0.75, 1.5) = (0.125, 0.25).
    assert opt.on_update(1, [opt.weights[0]], 1) is Outcome.APPLIED
    assert_bits_equal(opt.weights[0], f32(0.125, 0.25))
    assert_bits_equal(opt.cycle_sum, f32(0.5, 1))


# ------------------------------------------- inconsistent states (issue 12 D)
def _set(key, value):
    def edit(state):
        state[key] = value

    return edit


def _table_rows_in_a_slot_state(state):
    table, _ = busy("gsgm", averaging="table")
    t = table.state_dict()
    for key in ("table_nodes", "table_values", "table_sum"):
        state[key] = t[key]


INCONSISTENT = [
    (_set("white_list", [2, 3, 7]), "state['white_list'] holds node 7, which is not active"),
    (_set("white_list", [1, 2, 3]), "state['white_list'] holds node(s) [1] that contributed"),
    (_set("slot_nodes", [4]), "state['slot_nodes'] holds node 4, which is not active"),
    (_set("active_nodes", [1, 2, 2, 3]), "state['active_nodes'] lists a node twice"),
    (_set("cycle_count", -1), "state['cycle_count'] is -1, expected an integer >= 0"),
    (_set("cycle_index", 1.5), "state['cycle_index'] is 1.5, expected an integer >= 0"),
    (_set("version", -4), "state['version'] is -4, expected an integer >= 0"),
    (_set("slot_counts", [0]), "state['slot_counts'][0] is 0, expected an integer >= 1"),
    (
        lambda s: s["counters"].update(applied=-3),
        "state['counters']['applied'] is -3, expected an integer >= 0",
    ),
    (
        _table_rows_in_a_slot_state,
        "hold table-averaging data, but the state's averaging is 'slot'",
    ),
]


@pytest.mark.parametrize("edit,message", INCONSISTENT)
def test_an_inconsistent_state_is_refused_by_field_and_changes_nothing(edit, message):
    opt, _ = busy("gsgm")  # strict: slot averaging, a slot pending for node 1
    target, _ = busy("gsgm")
    state = opt.state_dict()
    assert (state["version"], state["white_list"], state["contributed"]) == (4, [2, 3], [1])
    edit(state)
    before = target.state_dict()
    with pytest.raises(ValueError) as info:
        target.load_state_dict(state)
    assert message in str(info.value)
    assert_state_equal(before, target.state_dict())


def test_a_state_of_another_mode_is_refused_by_name_and_changes_nothing():
    # A table-averaging state into a slot-averaging optimizer: the state's buffers
    # (rows, their sum) mean nothing in slot mode, so the optimizer never switches.
    table, _ = busy("gsgm", averaging="table")
    slot, _ = busy("gsgm")
    before = slot.state_dict()
    with pytest.raises(ValueError) as info:
        slot.load_state_dict(table.state_dict())
    assert str(info.value) == (
        "state of a 'gsgm' optimizer with averaging='table' (the optimizer's: 'slot') cannot "
        "be loaded: the state's buffers belong to that mode; build the optimizer with the "
        "state's averaging"
    )
    assert_state_equal(before, slot.state_dict())
    once, _ = busy("gsgm", averaging="table", scheduling=False)
    with pytest.raises(ValueError) as info:
        slot.load_state_dict(once.state_dict())
    assert (
        "averaging='table' (the optimizer's: 'slot'), scheduling=False (the optimizer's: True)"
        in str(info.value)
    )
    assert str(info.value).endswith("build the optimizer with the state's averaging, scheduling")
    assert_state_equal(before, slot.state_dict())
