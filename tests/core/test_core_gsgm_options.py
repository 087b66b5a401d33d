"""GSGM options apply, table_max_age and lr_scaling with hand-computed numbers.

Unless stated otherwise: lr = 0.5, beta = 0.5, w0 = [0, 0], nodes {1, 2, 3}, the
arrival sequence of test_core_gsgm.py. Every number is a small dyadic fraction,
exact in float32, so the expectations are compared exactly.
"""

from __future__ import annotations

import pickle

import pytest
import test_core_gsgm
from core_testutil import GSGM_STRICT, assert_bits_equal, assert_state_equal, f32

from flwr_gsgm.core import GSGMRule, Outcome


def make(nodes=(1, 2, 3), **kw):
    # The hand-computed sequences start from strict GSGM (heavy-ball, quorum 1.0, slot).
    params = dict(lr=0.5, beta=0.5, **GSGM_STRICT)
    params.update(kw)
    return GSGMRule([f32(0, 0)], list(nodes), **params)


def check(opt, *, w, M, S, k, version, white=None, slots=None):
    assert_bits_equal(opt.weights[0], f32(*w), "w")
    assert_bits_equal(opt.momentum, f32(*M), "M")
    assert_bits_equal(opt.cycle_sum, f32(*S), "S")
    assert opt.cycle_count == k
    assert opt.version == version
    if white is not None:
        assert opt.white_list == frozenset(white)
    if slots is not None:
        assert {n: (p.tolist(), c) for n, (p, c) in opt.slots.items()} == slots


# the arrival sequence of test_core_gsgm.py
ARRIVALS = test_core_gsgm.ARRIVALS

# --------------------------------------------------------------- a. apply=cycle
# Contributions only accumulate S, k; the close steps once: w <- w - 0.5 M.
# a1: 1 in W: S = [2,0], k = 1, W = {2,3}; w unchanged.            DEFERRED
# a2: slot P1 = [4,2].                                              DEFERRED
# a3: 2 in W: S = [2,2], k = 2, W = {3}.                            DEFERRED
# a4: fold P1 = [4,2] + ([8,6] - [4,2]) / 2 = [6,4], n = 2.         DEFERRED
# a5: 3 in W: S = [3,6], k = 3 -> close: M = S/3 (+ 0.5 * 0) = [1,2];
#     w = -0.5 [1,2] = [-0.5,-1]; version 1; slot P1 joins the new cycle:
#     S = [6,4], k = 1, W = {2,3}.                                  APPLIED
# a6: 2 in W: S = [10,8], k = 2, W = {3}.                           DEFERRED
# a7: 3 in W: S = [12,9], k = 3 -> close:
#     heavy-ball M = [4,3] + 0.5 [1,2] = [4.5,4]; w = [-0.5,-1] - [2.25,2]
#     = [-2.75,-3];
#     ema (first close M = S/k = [1,2], same w after a5): M = 0.5 [1,2] +
#     0.5 [4,3] = [2.5,2.5]; w = [-0.5,-1] - [1.25,1.25] = [-1.75,-2.25].
#     version 2.                                                    APPLIED
CYCLE_COMMON = [
    # outcome, w, M, S, k, version, white list, slots
    ("deferred", (0, 0), (0, 0), (2, 0), 1, 0, {2, 3}, {}),
    ("deferred", (0, 0), (0, 0), (2, 0), 1, 0, {2, 3}, {1: ([4, 2], 1)}),
    ("deferred", (0, 0), (0, 0), (2, 2), 2, 0, {3}, {1: ([4, 2], 1)}),
    ("deferred", (0, 0), (0, 0), (2, 2), 2, 0, {3}, {1: ([6, 4], 2)}),
    ("applied", (-0.5, -1), (1, 2), (6, 4), 1, 1, {2, 3}, {}),
    ("deferred", (-0.5, -1), (1, 2), (10, 8), 2, 1, {3}, {}),
]
CYCLE_LAST = {
    "heavy-ball": ("applied", (-2.75, -3), (4.5, 4), (0, 0), 0, 2, {1, 2, 3}, {}),
    "ema": ("applied", (-1.75, -2.25), (2.5, 2.5), (0, 0), 0, 2, {1, 2, 3}, {}),
}


@pytest.mark.parametrize("form", ["heavy-ball", "ema"])
def test_apply_cycle_sequence(form):
    opt = make(momentum_form=form, apply="cycle")
    for (node, g), exp in zip(ARRIVALS, CYCLE_COMMON + [CYCLE_LAST[form]]):
        outcome = opt.on_update(node, [f32(*g)], opt.version)
        out, w, m, s, k, version, white, slots = exp
        assert outcome is Outcome(out)
        check(opt, w=w, M=m, S=s, k=k, version=version, white=white, slots=slots)
    c = opt.counters
    assert (c["arrivals"], c["applied"], c["deferred"]) == (7, 2, 5)
    assert (c["cycles"], c["slots_applied"]) == (2, 1)


def test_apply_cycle_staleness_counts_cycles():
    # version moves once per cycle: an update sent at version 0 and arriving in
    # the second cycle has staleness 1, whatever the number of contributions.
    opt = make(apply="cycle", max_staleness=0)
    for node in (1, 2, 3):
        opt.on_update(node, [f32(2, 2)], 0)  # close: M = [2,2]; w = [-1,-1]; v1
    assert opt.version == 1
    assert opt.on_update(1, [f32(2, 2)], 0) is Outcome.STALE
    assert opt.on_update(1, [f32(2, 2)], 1) is Outcome.DEFERRED


def test_apply_cycle_with_table_and_table_max_age():
    # nodes {1,2}, table averaging, table_max_age 0: at a close the step uses the
    # mean of the rows whose age (version - base) is 0.
    def start():
        opt = make(nodes=(1, 2), apply="cycle", averaging="table", table_max_age=0)
        # a1 node 1 [2,0] base 0: row 1 (b0); k = 1; no step.
        assert opt.on_update(1, [f32(2, 0)], 0) is Outcome.DEFERRED
        # a2 node 1 [4,4] base 0: slot P1 = [4,4] (b0).
        assert opt.on_update(1, [f32(4, 4)], 0) is Outcome.DEFERRED
        # a3 node 2 [0,2] base 0: row 2 (b0); k = 2 -> close at version 0: both
        # rows age 0; table mean [1,1]: M = [1,1]; w = [-0.5,-0.5]; version 1.
        # The slot joins the new cycle: row 1 <- [4,4] (b0); k = 1; W = {2}.
        assert opt.on_update(2, [f32(0, 2)], 0) is Outcome.APPLIED
        check(opt, w=(-0.5, -0.5), M=(1, 1), S=(0, 0), k=1, version=1, white={2})
        assert opt.table_versions == {1: 0, 2: 0}
        return opt

    opt = start()
    # a4 node 2 [2,2] base 1: row 2 (b1); k = 2 -> close at version 1: row 1
    # (b0, age 1 > 0) leaves; mean = [2,2]: M = [2,2] + 0.5 [1,1] = [2.5,2.5];
    # w = [-0.5,-0.5] - [1.25,1.25] = [-1.75,-1.75]; version 2.
    assert opt.on_update(2, [f32(2, 2)], 1) is Outcome.APPLIED
    check(opt, w=(-1.75, -1.75), M=(2.5, 2.5), S=(0, 0), k=0, version=2)
    assert {n: r.tolist() for n, r in opt.table.items()} == {2: [2, 2]}
    assert opt.counters["table_rows_expired"] == 1
    # a5 node 1 [8,8] base 0: staleness 2 > table_max_age 0: dropped.
    assert opt.on_update(1, [f32(8, 8)], 0) is Outcome.STALE
    check(opt, w=(-1.75, -1.75), M=(2.5, 2.5), S=(0, 0), k=0, version=2)

    # Other branch after a3: node 2 is lost, the cycle ({1} contributed) closes
    # at version 1; row 1 (b0, age 1) expires, row 2 left with its node: no row
    # is young enough, so no step: w, M, version unchanged (table_empty).
    opt = start()
    opt.on_node_lost(2)
    check(opt, w=(-0.5, -0.5), M=(1, 1), S=(0, 0), k=0, version=1, white={1})
    assert opt.table == {}
    c = opt.counters
    assert (c["table_empty"], c["table_rows_expired"], c["cycles"]) == (1, 1, 2)


# ------------------------------------------------------------ b. table_max_age
def test_table_max_age_arrival_mode():
    # heavy-ball, table averaging, table_max_age 1; base versions given explicitly.
    opt = make(averaging="table", table_max_age=1)
    # a1 node 1 [2,0] b0: row 1; d = [2,0]; w = [-1,0]; S = [2,0], k = 1; v1.
    assert opt.on_update(1, [f32(2, 0)], 0) is Outcome.APPLIED
    # a2 node 2 [0,2] b0 (staleness 1): rows 1, 2 (age 1 <= 1); d = [1,1];
    # w = [-1.5,-0.5]; S = [3,1], k = 2; v2.
    assert opt.on_update(2, [f32(0, 2)], 0) is Outcome.APPLIED
    check(opt, w=(-1.5, -0.5), M=(0, 0), S=(3, 1), k=2, version=2)
    # a3 node 1 [4,4] b1: slot P1 = [4,4] (b1).
    assert opt.on_update(1, [f32(4, 4)], 1) is Outcome.DEFERRED
    # a4 node 3 [8,8] b0: staleness 2 > 1: dropped; node 3 stays in W.
    assert opt.on_update(3, [f32(8, 8)], 0) is Outcome.STALE
    assert opt.white_list == {3}
    # a5 node 3 [3,5] b2: row 3 (b2); at version 2 rows 1, 2 (b0, age 2) expire:
    # d = [3,5]; w = [-1.5,-0.5] - [1.5,2.5] = [-3,-3]; S = [6,6], k = 3; v3 ->
    # close: M = [6,6] / 3 = [2,2]. Slot P1 (b1) becomes row 1: at version 3 row 3
    # (b2, age 1) stays; mean ([3,5] + [4,4]) / 2 = [3.5,4.5];
    # w = [-3,-3] - (0.5 [3.5,4.5] + 0.25 [2,2]) = [-3,-3] - [2.25,2.75]
    # = [-5.25,-5.75]; S = [3.5,4.5], k = 1; v4.
    assert opt.on_update(3, [f32(3, 5)], 2) is Outcome.APPLIED
    check(opt, w=(-5.25, -5.75), M=(2, 2), S=(3.5, 4.5), k=1, version=4, white={2, 3}, slots={})
    assert opt.table_versions == {3: 2, 1: 1}
    assert opt.counters["table_rows_expired"] == 2
    # a6 node 2 [0,2] b2: staleness 2 > 1: dropped.
    assert opt.on_update(2, [f32(0, 2)], 2) is Outcome.STALE
    # a7 node 2 [2,0] b4: row 2 (b4); at version 4, rows 3 (b2) and 1 (b1) are
    # older than 1: they leave; d = [2,0]; w = [-5.25,-5.75] - ([1,0] + [0.5,0.5])
    # = [-6.75,-6.25]; S = [5.5,4.5], k = 2; v5.
    assert opt.on_update(2, [f32(2, 0)], 4) is Outcome.APPLIED
    check(opt, w=(-6.75, -6.25), M=(2, 2), S=(5.5, 4.5), k=2, version=5)
    assert opt.table_versions == {2: 4}
    c = opt.counters
    assert (c["arrivals"], c["applied"], c["deferred"], c["stale"]) == (7, 4, 1, 2)
    assert c["table_rows_expired"] == 4

    # state_dict round trip of the new state (row and slot versions) is exact.
    state = opt.state_dict()
    assert state["table_versions"] == [4] and state["slot_versions"] == []
    fresh = make(lr=0.25, averaging="table")  # other params, the same mode
    fresh.load_state_dict(pickle.loads(pickle.dumps(state)))
    assert_state_equal(state, fresh.state_dict())
    for o in (opt, fresh):
        o.on_update(1, [f32(2, 2)], 5)
    assert_state_equal(opt.state_dict(), fresh.state_dict())


def test_slot_version_is_its_newest_update():
    opt = make(averaging="table", table_max_age=5)
    opt.on_update(1, [f32(2, 0)], 0)  # v1
    opt.on_update(1, [f32(2, 0)], 1)  # slot (b1)
    opt.on_update(2, [f32(2, 0)], 1)  # v2
    opt.on_update(1, [f32(2, 0)], 0)  # fold (b0): the slot keeps b1
    state = opt.state_dict()
    assert state["slot_nodes"] == [1] and state["slot_versions"] == [1]


# --------------------------------------------------------------- c. lr_scaling
# lr_scaling = "cycle", lr = 0.75, quorum 1, |A| = 3: c = 3, each step uses
# lr' = 0.25 (m_step = lr' * beta * M). Heavy-ball, same arrivals:
# a1: w = -0.25 [2,0] = [-0.5,0]; S = [2,0]; v1.      a2: slot P1 = [4,2].
# a3: w = [-0.5,-0.5]; S = [2,2]; v2.                  a4: P1 = [6,4], n = 2.
# a5: w = [-0.75,-1.5]; S = [3,6], k = 3 -> close: M = [1,2]; m_step =
#     0.125 [1,2] = [0.125,0.25]; slot: d = 0.25 [6,4] + [0.125,0.25]
#     = [1.625,1.25]; w = [-2.375,-2.75]; S = [6,4], k = 1; v4.
# a6: d = [1,1] + [0.125,0.25]: w = [-3.5,-4]; S = [10,8]; v5.
# a7: d = [0.5,0.25] + [0.125,0.25]: w = [-4.125,-4.5]; S = [12,9] -> close:
#     M = [4,3] + 0.5 [1,2] = [4.5,4]; v6.
LR_SCALED = [
    ((-0.5, 0), (0, 0), (2, 0), 1, 1),
    ((-0.5, 0), (0, 0), (2, 0), 1, 1),
    ((-0.5, -0.5), (0, 0), (2, 2), 2, 2),
    ((-0.5, -0.5), (0, 0), (2, 2), 2, 2),
    ((-2.375, -2.75), (1, 2), (6, 4), 1, 4),
    ((-3.5, -4), (1, 2), (10, 8), 2, 5),
    ((-4.125, -4.5), (4.5, 4), (0, 0), 0, 6),
]


def test_lr_scaling_cycle_sequence():
    opt = make(lr=0.75, lr_scaling="cycle")
    for (node, g), (w, m, s, k, version) in zip(ARRIVALS, LR_SCALED):
        opt.on_update(node, [f32(*g)], opt.version)
        check(opt, w=w, M=m, S=s, k=k, version=version)
    # Node 3 leaves: c = 2, lr' = 0.375; m_step = 0.375 * 0.5 * [4.5,4]
    # = [0.84375,0.75]. Node 1 [2,2]: d = 0.375 [2,2] + m_step = [1.59375,1.5];
    # w = [-5.71875,-6].
    opt.on_node_lost(3)
    opt.on_update(1, [f32(2, 2)], opt.version)
    check(opt, w=(-5.71875, -6), M=(4.5, 4), S=(2, 2), k=1, version=7)


def test_lr_scaling_cycle_uses_the_quorum_count():
    # quorum 0.5 of 4 nodes: c = ceil(2) = 2, lr' = 1 / 2: [2,2] -> w = [-1,-1].
    opt = make(nodes=(1, 2, 3, 4), lr=1.0, cycle_quorum=0.5, lr_scaling="cycle")
    opt.on_update(1, [f32(2, 2)], 0)
    assert_bits_equal(opt.weights[0], f32(-1, -1))
    # scheduling off: c = |A| = 4, lr' = 1 / 4: [4,8] -> w = [-1,-2].
    opt = make(nodes=(1, 2, 3, 4), lr=1.0, scheduling=False, lr_scaling="cycle")
    opt.on_update(1, [f32(4, 8)], 0)
    assert_bits_equal(opt.weights[0], f32(-1, -2))


# ------------------------------------------------------------------ parameters
@pytest.mark.parametrize(
    "kw,name",
    [
        (dict(apply="batch"), "apply"),
        (dict(lr_scaling="node"), "lr_scaling"),
        (dict(table_max_age=3), "table_max_age"),  # slot averaging
        (dict(averaging="table", table_max_age=-1), "table_max_age"),
        (dict(averaging="table", table_max_age=1.5), "table_max_age"),
    ],
)
def test_constructor_rejects_bad_options_naming_them(kw, name):
    with pytest.raises(ValueError) as info:
        make(**kw)
    assert name in str(info.value)


def test_defaults_are_the_tuned_choice():
    p = GSGMRule([f32(0, 0)], [1]).params
    assert (p["lr"], p["momentum_form"], p["beta"], p["cycle_quorum"]) == (0.1, "ema", 0.5, 0.5)
    # the tuned defaults: a step per arrival, lr per cycle, no table age bound
    assert (p["apply"], p["table_max_age"], p["lr_scaling"]) == ("arrival", None, "cycle")


def test_lr_scaling_is_moot_with_cycle_application():
    # apply = "cycle" steps once per cycle with lr: both lr_scalings are that rule.
    a, b = make(apply="cycle"), make(apply="cycle", lr_scaling="cycle")
    for node, g in ((1, (1, 2)), (2, (3, 4)), (1, (5, 6)), (3, (-1, 0)), (2, (2, 2))):
        assert a.on_update(node, [f32(*g)], 0) == b.on_update(node, [f32(*g)], 0)
    assert_bits_equal(a.weights[0], b.weights[0], "w")
    assert a.version == b.version == 1


def test_lr_per_cycle_counts_the_nodes_in_flight_when_concurrency_is_bounded():
    # 8 active nodes, quorum 0.5: c = ceil(0.5 * 8) = 4 -> step lr / 4 = 0.125;
    # with 2 in flight: c = ceil(0.5 * 2) = 1 -> step lr = 0.5 (heavy-ball, M = 0 still).
    nodes = range(1, 9)
    wide = make(nodes, lr_scaling="cycle", cycle_quorum=0.5)
    narrow = make(nodes, lr_scaling="cycle", cycle_quorum=0.5, concurrency=2)
    wide.on_update(1, [f32(1, -2)], 0)
    narrow.on_update(1, [f32(1, -2)], 0)
    assert_bits_equal(wide.weights[0], f32(-0.125, 0.25), "w (c = 4)")
    assert_bits_equal(narrow.weights[0], f32(-0.5, 1.0), "w (c = 1)")


# ------------------------------------------------------------ d. averaging = "auto"
@pytest.mark.parametrize(
    "nodes,concurrency,expected",
    [(10, None, "table"), (10, 10, "table"), (10, 20, "table"), (100, 20, "slot"), (3, 2, "slot")],
)
def test_auto_averaging_is_slot_only_when_a_limit_leaves_nodes_idle(nodes, concurrency, expected):
    assert GSGMRule.auto_averaging(nodes, concurrency) == expected
    opt = make(range(nodes), averaging="auto", concurrency=concurrency)
    assert opt.averaging_in_use == expected
    assert opt.params["averaging"] == "auto"  # what was asked for, in every layer
    assert opt.resolved_choices() == {"averaging": expected}
    assert make(range(nodes), averaging=expected, concurrency=concurrency).resolved_choices() == {}


# Nodes {1, 2}, heavy-ball, quorum 1.0, lr 0.5 per step: node 1 [2,0], node 1 [4,4],
# node 2 [0,2].
# - table (test_core_gsgm.test_table_variant_hand_computed): w = [-2.875,-2.125],
#   M = [1.5,0.5], S = [2,3], k = 1.
# - slot: a1 w = [-1,0], S = [2,0]; a2 slot P1 = [4,4]; a3 w = [-1,-1], S = [2,2],
#   k = 2 -> close: M = [1,1]; P1 applied: d = [4,4] + 0.5 [1,1] = [4.5,4.5]:
#   w = [-1,-1] - [2.25,2.25] = [-3.25,-3.25]; S = [4,4], k = 1.
AUTO_SEQUENCE = ((1, (2, 0)), (1, (4, 4)), (2, (0, 2)))


@pytest.mark.parametrize(
    "concurrency,w,M,S",
    [
        (None, (-2.875, -2.125), (1.5, 0.5), (2, 3)),  # every node in flight: table
        (1, (-3.25, -3.25), (1, 1), (4, 4)),  # 1 of 2 nodes in flight: slot
    ],
)
def test_auto_averaging_follows_the_hand_computed_variant(concurrency, w, M, S):
    opt = make((1, 2), averaging="auto", concurrency=concurrency)
    for version, (node, g) in enumerate(AUTO_SEQUENCE):
        opt.on_update(node, [f32(*g)], min(version, 1))
    check(opt, w=w, M=M, S=S, k=1, version=3)


def test_auto_slot_state_resumes_as_slot_whatever_the_rebuild_resolves():
    # A run that chose slot (1 of 2 nodes in flight) is checkpointed with its slot
    # pending; the optimizer rebuilt before loading knows no nodes (it would pick
    # table): the state's variant wins, and the run ends as the slot rule above.
    opt = make((1, 2), averaging="auto", concurrency=1)
    for node, g in AUTO_SEQUENCE[:2]:
        opt.on_update(node, [f32(*g)], 0)
    fresh = make((), averaging="auto")
    assert fresh.averaging_in_use == "table"
    fresh.load_state_dict(pickle.loads(pickle.dumps(opt.state_dict())))
    assert fresh.averaging_in_use == "slot"
    fresh.on_update(2, [f32(0, 2)], 1)
    check(fresh, w=(-3.25, -3.25), M=(1, 1), S=(4, 4), k=1, version=3)


def test_auto_slot_with_a_table_age_bound_is_refused_naming_the_choice():
    with pytest.raises(
        ValueError,
        match=r"table_max_age=4 needs averaging='table', got "
        r"averaging='auto' \(auto chose 'slot': concurrency 1 < 2 nodes\)",
    ):
        make((1, 2), averaging="auto", concurrency=1, table_max_age=4)
