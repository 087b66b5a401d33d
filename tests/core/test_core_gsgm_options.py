"""GSGM options lr_scaling and averaging with hand-computed numbers; the deleted options.

Unless stated otherwise: lr = 0.5, beta = 0.5, w0 = [0, 0], nodes {1, 2, 3}, the
arrival sequence of test_core_gsgm.py. Every number is a small dyadic fraction,
exact in float32, so the expectations are compared exactly.
"""

from __future__ import annotations

import pickle

import pytest
import test_core_gsgm
from core_testutil import GSGM_STRICT, assert_bits_equal, assert_state_equal, f32

from flwr_gsgm.core import GSGMRule


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

# --------------------------------------------------------------- a. lr_scaling
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
        (dict(lr_scaling="node"), "lr_scaling"),
        (dict(averaging="row"), "averaging"),
        # deleted options (docs/GSGM.md, "Deleted options"): unknown parameters now
        (dict(apply="arrival"), "apply"),
        (dict(table_max_age=3), "table_max_age"),
        (dict(cycle_max_updates=4), "cycle_max_updates"),
        (dict(cycle_max_seconds=2.0), "cycle_max_seconds"),
        (dict(start_time=0.0), "start_time"),
    ],
)
def test_constructor_rejects_bad_options_naming_them(kw, name):
    with pytest.raises(ValueError) as info:
        make(**kw)
    assert name in str(info.value)


def test_defaults_are_the_tuned_choice():
    p = GSGMRule([f32(0, 0)], [1]).params
    assert (p["lr"], p["momentum_form"], p["beta"], p["cycle_quorum"]) == (0.1, "ema", 0.5, 0.5)
    assert (p["lr_scaling"], p["averaging"], p["scheduling"]) == ("cycle", "auto", True)
    assert not {"apply", "table_max_age", "cycle_max_updates", "cycle_max_seconds"} & set(p)


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


# ------------------------------------------------------------ b. averaging = "auto"
@pytest.mark.parametrize(
    "nodes,concurrency,expected",
    [(10, None, "table"), (10, 10, "table"), (10, 20, "table"), (100, 20, "slot"), (3, 2, "slot")],
)
def test_auto_averaging_is_slot_only_when_a_limit_leaves_nodes_idle(nodes, concurrency, expected):
    assert GSGMRule.auto_averaging(nodes, concurrency) == expected
    opt = make(range(nodes), averaging="auto", concurrency=concurrency)
    assert opt.averaging_in_use == expected
    assert opt.params["averaging"] == "auto"  # what was asked for, in every layer
    assert opt.resolved_choices() == {"averaging": expected, "apply_at": "arrival"}
    explicit = make(range(nodes), averaging=expected, concurrency=concurrency, apply_at="arrival")
    assert explicit.resolved_choices() == {}


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


# ------------------------------------------------------- c. states of deleted options
def old_state(opt, **retired):
    """``opt``'s state as the code before the deletions (issue 25) wrote it: the
    retired params and the fields of the deleted options, no ``apply_at``."""
    state = opt.state_dict()
    params = {k: v for k, v in state["params"].items() if k not in ("apply_at", "displacement")}
    state["params"] = dict(params, start_time=None, **retired)
    state["slot_versions"] = [0] * len(state["slot_nodes"])
    state["table_versions"] = [0] * len(state["table_nodes"])
    state.update(cycle_start=3.0, cycle_arrivals=1)
    return state


@pytest.mark.parametrize(
    "retired",
    [
        dict(apply="arrival", table_max_age=None, cycle_max_updates=None, cycle_max_seconds=None),
        dict(apply="cycle", cycle_max_seconds=1.5),
    ],
)
def test_a_state_written_before_the_deletions_is_refused_naming_its_parameters(retired):
    # Not upgraded, even when it ran today's rule: such states are no longer supported.
    opt = make()
    for node, g in ARRIVALS[:4]:  # a slot pending, k = 2
        opt.on_update(node, [f32(*g)], opt.version)
    fresh = make()
    before = fresh.state_dict()
    unknown = ", ".join(sorted([*retired, "start_time"]))
    with pytest.raises(
        ValueError,
        match=rf"'gsgm' does not declare: {unknown}; no value of apply_at, displacement "
        "cannot be loaded: it was written by another version of the rule",
    ):
        fresh.load_state_dict(old_state(opt, **retired))
    assert_state_equal(before, fresh.state_dict())
