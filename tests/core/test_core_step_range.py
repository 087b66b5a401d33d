"""The result of a step is checked, for every rule (issue 12 item 5).

A finite update can still take the state out of range: 2e38 is a float32, but a
table row, a buffer or momentum holding it leaves no room for the sums the rules
keep, and ``w - lr * g`` with it is about -4e36. Every value of a state must stay
within +-2**100 (``STATE_LIMIT``); a step that would leave it is rejected with reason
``"step-range"`` and the state stays as it was, bit for bit.
"""

from __future__ import annotations

import logging
import pickle

import numpy as np
import pytest
from core_testutil import Engine, assert_bits_equal, assert_state_equal, f32

from flwr_gsgm.core import OPTIMIZERS, STATE_LIMIT, GSGMRule, UpdateRejected, make_optimizer
from flwr_gsgm.core.asgd import ASGDRule
from flwr_gsgm.core.range_guard import RangeGuard


def arrays(*values):
    return [f32(*values[:2]), np.array(values[2:], np.float32).reshape(2, 2)]


def busy(name, **kw):
    """A rule mid-run (defaults, no max_norm): momentum, slots, rows, buffers, copies."""
    opt = make_optimizer(name, arrays(1, 2, 3, 4, 5, 6), [1, 2, 3], lr=0.5, **kw)
    eng = Engine(opt, [1, 2, 3])
    for node, v in [(1, 1.0), (1, 2.0), (2, 0.5), (1, -1.0), (3, 0.25), (1, 3.0)]:
        eng.update(node, arrays(v, -v, 2 * v, v, 0.5, -0.5))
    return opt, eng


def rejected_unchanged(before, after):
    """``after`` is ``before`` with one more rejection and one more exact check."""
    expected = dict(before)
    expected["counters"] = dict(
        before["counters"],
        rejected=before["counters"]["rejected"] + 1,
        range_checks=before["counters"]["range_checks"] + 1,
    )
    assert_state_equal(expected, after)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_finite_2e38_update_is_rejected_by_every_rule_and_changes_nothing(name):
    opt, eng = busy(name)
    assert opt.counters["range_checks"] == 0  # ordinary updates take the fast path
    before = opt.state_dict()
    huge = arrays(2e38, 0, 0, 0, 0, 0)
    assert np.isfinite(huge[0]).all()
    with pytest.raises(UpdateRejected) as info:
        opt.on_update(2, huge, eng.sent[2], now=eng.now + 1)
    assert info.value.reason == "step-range"
    assert info.value.message.startswith(
        "the update of partition-id 2 (L2 norm 2e+38) would take the "
    )
    assert info.value.message.endswith(
        "beyond the state range +-2**100 (float32's largest value less a margin of 2**28 "
        "for sums); the state is unchanged"
    )
    rejected_unchanged(before, opt.state_dict())
    # The rule goes on as if the update had never come.
    twin, twin_eng = busy(name)
    for e in (eng, twin_eng):
        e.update(2, arrays(0.5, 0.5, 0.5, 0.5, 0.5, 0.5))
    a, b = opt.state_dict(), twin.state_dict()
    for s in (a, b):
        s["counters"] = {
            k: v for k, v in s["counters"].items() if k not in ("rejected", "range_checks")
        }
    assert_state_equal(a, b)


# ------------------------------------------------------- every rule has its bound
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_registered_rule_derives_its_step_bound(name):
    # Without one every step takes the slow path (a copy and a check of every value).
    cls = OPTIMIZERS[name]
    assert cls._step_bound is not RangeGuard._step_bound, (
        f"{cls.__module__}.{cls.__qualname__} defines no _step_bound"
    )


def test_a_rule_without_a_step_bound_takes_the_slow_path_and_says_so_once(caplog):
    class Unbounded(ASGDRule):  # not registered: no name of its own
        _step_bound = RangeGuard._step_bound

    opt = Unbounded([f32(0, 0)], [1, 2], lr=0.5)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        opt.on_update(1, [f32(2, 4)], 0)
        opt.on_update(2, [f32(2, 4)], 0)
        Unbounded([f32(0, 0)], [1], lr=0.5).on_update(1, [f32(1, 1)], 0)
    np.testing.assert_array_equal(opt.weights[0], f32(-2, -4))
    assert opt.counters["range_checks"] == 2  # both steps checked value by value
    warned = [r for r in caplog.records if "_step_bound" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in warned]
    assert warned[0].levelno == logging.WARNING
    assert "Unbounded (rule 'asgd') defines no _step_bound" in warned[0].getMessage()
    assert "slow path" in warned[0].getMessage()


def test_gsgm_defaults_reject_2e38_naming_what_would_leave_the_range():
    # The case: GSGM defaults (table averaging, ema, lr 0.1 per cycle), no
    # max-norm. The step w - (0.1 / ceil(0.5 * 3)) * 2e38 = -1e37 (and the table row,
    # 2e38) would leave the range; before, it was applied and w went to -inf.
    opt = GSGMRule([f32(0, 0)], [1, 2, 3])
    with pytest.raises(UpdateRejected) as info:
        opt.on_update(1, [f32(2e38, 1)], 0)
    assert info.value.message == (
        "the update of partition-id 1 (L2 norm 2e+38) would take the weights to -1e+37 at "
        "flat index 0, beyond the state range +-2**100 (float32's largest value less a "
        "margin of 2**28 for sums); the state is unchanged"
    )
    assert_bits_equal(opt.weights[0], f32(0, 0))
    assert opt.table == {} and opt.version == 0


def test_asgd_result_is_checked_not_the_input():
    # lr 1, w = 0: updates of -1e29 move w by +1e29 each. The input is always the
    # same and accepted while w stays within 2**100 = 1.2676506e30; the 13th would
    # take w to 13 * 1e29 = 1.3e30: rejected, naming the weights.
    g = f32(-1e29, 0)
    opt = ASGDRule([f32(0, 0)], [1], lr=1.0)
    for _ in range(12):
        opt.on_update(1, [g], opt.version)
    w = opt.weights[0].copy()
    assert w[0] == np.float32(12) * np.float32(1e29) and w[0] < STATE_LIMIT
    with pytest.raises(UpdateRejected) as info:
        opt.on_update(1, [g], opt.version)
    assert "would take the weights to 1.3e+30 at flat index 0" in info.value.message
    assert_bits_equal(opt.weights[0], w)
    assert opt.version == 12
    # The last steps came near the limit: they were checked value by value.
    assert 1 <= opt.counters["range_checks"] <= 13


def test_a_large_update_whose_step_stays_in_range_is_applied():
    # 1e31 is beyond the state range, but ASGD stores only w - lr * g = -1e28.
    opt = ASGDRule([f32(0, 0)], [1], lr=1e-3)
    opt.on_update(1, [f32(1e31, 0)], 0)
    assert_bits_equal(opt.weights[0], f32(0, 0) - np.float32(1e-3) * f32(1e31, 0))
    assert opt.counters["range_checks"] == 1  # near the limit: checked exactly
    opt.on_update(1, [f32(1, 1)], 1)
    assert opt.counters["range_checks"] == 1  # back to the fast path


def test_an_overflow_inside_the_step_is_rejected():
    # DC-ASGD's compensation lambda * g * g * (w_t - w_tau) overflows float32 for
    # g = 1e20 once w moved; nothing of it may stay behind.
    opt = make_optimizer("dcasgd", [f32(0, 0)], [1, 2], lr=0.5, dc_lambda=1.0)
    eng = Engine(opt, [1, 2])
    eng.update(1, [f32(1, 1)])  # w moves: node 2's copy is now stale
    before = opt.state_dict()
    with pytest.raises(UpdateRejected) as info:
        eng.update(2, [f32(1e20, 0)])
    assert info.value.reason == "step-range"
    assert "would take the state to inf" in info.value.message
    rejected_unchanged(before, opt.state_dict())


def test_a_checkpoint_with_a_weight_beyond_the_range_is_refused_by_field():
    # One changed byte of a checkpoint: a weight set to 2.1e38.
    opt, _ = busy("gsgm")
    state = pickle.loads(pickle.dumps(opt.state_dict()))
    state["weights"][3] = np.float32(2.1e38)
    target, _ = busy("gsgm")
    before = target.state_dict()
    with pytest.raises(ValueError) as info:
        target.load_state_dict(state)
    assert str(info.value) == (
        "state['weights'] holds 2.0999999227187906e+38 at flat index 3: not finite or beyond "
        "the state range +-2**100 (float32's largest value less a margin of 2**28 for sums)"
    )
    assert_state_equal(before, target.state_dict())
    state = opt.state_dict()
    state["table_values"][1][0] = np.nan
    with pytest.raises(ValueError, match=r"state\['table_values'\]\[1\] holds nan"):
        target.load_state_dict(state)


# ------------------------------------------------------------- property: soundness
# Each rule bounds what one call can compute from two tracked numbers and skips the
# value-by-value check below the bound: random updates of every magnitude up to
# float32's largest must never overflow unchecked (RuntimeError), never leave a
# state that was within the range out of it, and change nothing when rejected.
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_core_properties import configs  # noqa: E402

from flwr_gsgm.core.range_guard import max_abs  # noqa: E402

magnitudes = st.sampled_from([1.0, 1e3, 1e10, 1e20, 1e26, 1e28, 1e29, 1e30, 1e31, 1e34, 3e38])


def in_range(opt) -> bool:
    return all(max_abs(a) <= STATE_LIMIT for _, _, a in opt._named_arrays())


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    config=configs,
    lr=st.sampled_from([1e-6, 0.1, 1.0, 30.0]),
    evs=st.lists(
        st.tuples(
            st.sampled_from(["update"] * 8 + ["lost", "join"]),
            st.sampled_from([1, 1, 2, 2, 3, 4]),
            st.integers(0, 2**32 - 1),
            magnitudes,
        ),
        min_size=5,
        max_size=40,
    ),
)
def test_no_step_leaves_the_range_unchecked(config, lr, evs):
    name, params = config
    params = {k: v for k, v in params.items() if k != "max_norm"}
    opt = make_optimizer(name, [f32(0.5, -1, 2), f32(1, 1, 1, 1)], [1, 2, 3], lr=lr, **params)
    eng = Engine(opt, [1, 2, 3])
    for kind, node, seed, scale in evs:
        if kind == "lost":
            eng.lost(node, dt=1.0)
            continue
        if kind == "join":
            if node not in eng.sent:
                eng.joined(node, dt=1.0)
            continue
        if node not in eng.sent:
            continue
        rng = np.random.default_rng(seed)
        update = [
            (rng.standard_normal(n) * scale).clip(-3.4e38, 3.4e38).astype(np.float32)
            for n in (3, 4)
        ]
        update[1] = update[1].reshape(4)
        was_in_range = in_range(opt)
        before = opt.state_dict()
        try:
            eng.update(node, update)
        except UpdateRejected as err:
            assert err.reason == "step-range"
            rejected_unchanged(before, opt.state_dict())
            eng.dispatch(node)
            continue
        if was_in_range:
            assert in_range(opt)
