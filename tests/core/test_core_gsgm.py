"""GSGM with hand-computed numbers (docs/GSGM.md, steps 1-5).

Unless stated otherwise: lr = 0.5, beta = 0.5, heavy-ball, quorum 1.0, slot
averaging (``GSGM_STRICT``), w0 = [0, 0], nodes {1, 2, 3}. Every
number below is a small dyadic fraction, exact in float32, so the expectations are
compared exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
from core_testutil import GSGM_STRICT, Engine, assert_bits_equal, f32

from flwr_gsgm.core import ASGDRule, GSGMRule, Outcome


def make(nodes=(1, 2, 3), **kw):
    params = dict(GSGM_STRICT, lr=0.5, beta=0.5)
    params.update(kw)
    return GSGMRule([f32(0, 0)], list(nodes), **params)


def check(opt, *, w, white, slots, momentum, k=None, S=None, version=None, cycle=None):
    assert_bits_equal(opt.weights[0], f32(*w), "w")
    assert opt.white_list == frozenset(white)
    got_slots = {n: (p.tolist(), c) for n, (p, c) in opt.slots.items()}
    assert got_slots == slots
    assert list(opt.slots) == list(slots)  # order: oldest first
    assert opt.slot_counts == {n: c for n, (_, c) in slots.items()}
    assert_bits_equal(opt.momentum, f32(*momentum), "M")
    if k is not None:
        assert opt.cycle_count == k
    if S is not None:
        assert_bits_equal(opt.cycle_sum, f32(*S), "S")
    if version is not None:
        assert opt.version == version
    if cycle is not None:
        assert opt.cycle_index == cycle


# Arrivals 1, 1, 2, 1, 3, 2 (then 3 to close the second cycle), updates:
#   a1 node 1 [2, 0]   a2 node 1 [4, 2]   a3 node 2 [0, 2]   a4 node 1 [8, 6]
#   a5 node 3 [1, 4]   a6 node 2 [4, 4]   a7 node 3 [2, 1]
ARRIVALS = [
    (1, (2, 0)),
    (1, (4, 2)),
    (2, (0, 2)),
    (1, (8, 6)),
    (3, (1, 4)),
    (2, (4, 4)),
    (3, (2, 1)),
]

# heavy-ball: w <- w - 0.5 (u + 0.5 M); close: M <- S/k + 0.5 M.
# a1: 1 in W, d = [2,0]: w = [-1,0]; S = [2,0], k = 1; W = {2,3}.
# a2: 1 not in W: slot P1 = [4,2], n = 1.
# a3: 2 in W, d = [0,2]: w = [-1,-1]; S = [2,2], k = 2; W = {3}.
# a4: fold: P1 = [4,2] + ([8,6] - [4,2]) / 2 = [6,4], n = 2.
# a5: 3 in W, d = [1,4]: w = [-1.5,-3]; S = [3,6], k = 3; W = {} -> close:
#     M = [3,6]/3 + 0 = [1,2]; W = {1,2,3}; slot P1 applied: d = [6,4] + [0.5,1]
#     = [6.5,5]: w = [-1.5,-3] - [3.25,2.5] = [-4.75,-5.5]; S = [6,4], k = 1, W = {2,3}.
# a6: 2 in W, d = [4,4] + [0.5,1] = [4.5,5]: w = [-7,-8]; S = [10,8], k = 2, W = {3}.
# a7: 3 in W, d = [2,1] + [0.5,1] = [2.5,2]: w = [-8.25,-9]; S = [12,9], k = 3 ->
#     close: M = [12,9]/3 + 0.5 [1,2] = [4,3] + [0.5,1] = [4.5,4]; W = {1,2,3}.
HEAVY_BALL = [
    # outcome, w, white list, slots, M, k, S
    ("applied", (-1, 0), {2, 3}, {}, (0, 0), 1, (2, 0)),
    ("deferred", (-1, 0), {2, 3}, {1: ([4, 2], 1)}, (0, 0), 1, (2, 0)),
    ("applied", (-1, -1), {3}, {1: ([4, 2], 1)}, (0, 0), 2, (2, 2)),
    ("deferred", (-1, -1), {3}, {1: ([6, 4], 2)}, (0, 0), 2, (2, 2)),
    ("applied", (-4.75, -5.5), {2, 3}, {}, (1, 2), 1, (6, 4)),
    ("applied", (-7, -8), {3}, {}, (1, 2), 2, (10, 8)),
    ("applied", (-8.25, -9), {1, 2, 3}, {}, (4.5, 4), 0, (0, 0)),
]

# ema: w <- w - 0.5 d, d = u before the first close, then d = 0.5 u + 0.5 M;
# close: M <- S/k at the first close, then M <- 0.5 M + 0.5 S/k.
# a1..a4 as heavy-ball (M = 0 and d = u before the first close).
# a5: d = [1,4]: w = [-1.5,-3]; S = [3,6], k = 3 -> first close: M = S/3 = [1,2];
#     slot P1 = [6,4]: d = [3,2] + [0.5,1] = [3.5,3]: w = [-1.5,-3] - [1.75,1.5]
#     = [-3.25,-4.5]; S = [6,4], k = 1.
# a6: d = [2,2] + [0.5,1] = [2.5,3]: w = [-3.25,-4.5] - [1.25,1.5] = [-4.5,-6];
#     S = [10,8], k = 2.
# a7: d = [1,0.5] + [0.5,1] = [1.5,1.5]: w = [-5.25,-6.75]; S = [12,9], k = 3 ->
#     close: M = 0.5 [1,2] + 0.5 [4,3] = [2.5,2.5].
EMA = [
    ("applied", (-1, 0), {2, 3}, {}, (0, 0), 1, (2, 0)),
    ("deferred", (-1, 0), {2, 3}, {1: ([4, 2], 1)}, (0, 0), 1, (2, 0)),
    ("applied", (-1, -1), {3}, {1: ([4, 2], 1)}, (0, 0), 2, (2, 2)),
    ("deferred", (-1, -1), {3}, {1: ([6, 4], 2)}, (0, 0), 2, (2, 2)),
    ("applied", (-3.25, -4.5), {2, 3}, {}, (1, 2), 1, (6, 4)),
    ("applied", (-4.5, -6), {3}, {}, (1, 2), 2, (10, 8)),
    ("applied", (-5.25, -6.75), {1, 2, 3}, {}, (2.5, 2.5), 0, (0, 0)),
]


@pytest.mark.parametrize("form,expected", [("heavy-ball", HEAVY_BALL), ("ema", EMA)])
def test_arrival_sequence_1_1_2_1_3_2(form, expected):
    opt = make(momentum_form=form)
    versions = [1, 1, 2, 2, 4, 5, 6]
    cycles = [0, 0, 0, 0, 1, 1, 2]
    for (node, g), exp, version, cycle in zip(ARRIVALS, expected, versions, cycles):
        outcome = opt.on_update(node, [f32(*g)], opt.version)
        out, w, white, slots, m, k, s = exp
        assert outcome is Outcome(out)
        check(
            opt, w=w, white=white, slots=slots, momentum=m, k=k, S=s, version=version, cycle=cycle
        )
    c = opt.counters
    assert (c["arrivals"], c["applied"], c["deferred"], c["stale"]) == (7, 5, 2, 0)
    assert (c["cycles"], c["slots_applied"]) == (2, 1)
    assert opt.momentum_ready


def test_cycle_closed_by_quorum():
    opt = make(cycle_quorum=0.5)  # ceil(0.5 * 3) = 2 contributions close a cycle
    # node 1 [2,4]: w = [-1,-2]; node 2 [4,2]: w = [-1,-2] - [2,1] = [-3,-3];
    # S = [6,6], k = 2 -> quorum close: M = [3,3]; W = {1,2,3}.
    assert opt.on_update(1, [f32(2, 4)], 0) is Outcome.APPLIED
    check(opt, w=(-1, -2), white={2, 3}, slots={}, momentum=(0, 0), cycle=0)
    assert opt.on_update(2, [f32(4, 2)], 1) is Outcome.APPLIED
    check(opt, w=(-3, -3), white={1, 2, 3}, slots={}, momentum=(3, 3), k=0, cycle=1)
    assert opt.counters["cycles_quorum"] == 1
    # node 3 [2,2]: d = [2,2] + [1.5,1.5] = [3.5,3.5]: w = [-4.75,-4.75].
    opt.on_update(3, [f32(2, 2)], 2)
    check(opt, w=(-4.75, -4.75), white={1, 2}, slots={}, momentum=(3, 3), k=1)


def test_quorum_count_is_robust_to_float_rounding():
    # 0.7 * 10 = 7.000000000000001 in floating point: the quorum is still 7 nodes.
    opt = GSGMRule([f32(0, 0)], range(10), **{**GSGM_STRICT, "cycle_quorum": 0.7}, lr=0.5)
    for n in range(6):
        opt.on_update(n, [f32(1, 1)], opt.version)
    assert opt.cycle_index == 0
    opt.on_update(6, [f32(1, 1)], opt.version)
    assert opt.cycle_index == 1


def test_node_lost_mid_cycle():
    opt = make()
    # node 1 [2,4]: w = [-1,-2]; node 1 [4,0]: slot; node 2 [2,0]: w = [-2,-2];
    # S = [4,4], k = 2, W = {3}.
    opt.on_update(1, [f32(2, 4)], 0)
    opt.on_update(1, [f32(4, 0)], 1)
    opt.on_update(2, [f32(2, 0)], 1)
    check(opt, w=(-2, -2), white={3}, slots={1: ([4, 0], 1)}, momentum=(0, 0), k=2)
    # node 3 lost: W empty -> close: M = [2,2]; W = {1,2}; slot 1: d = [4,0] + [1,1]
    # = [5,1]: w = [-2,-2] - [2.5,0.5] = [-4.5,-2.5]; S = [4,0], k = 1, W = {2}.
    opt.on_node_lost(3)
    check(
        opt, w=(-4.5, -2.5), white={2}, slots={}, momentum=(2, 2), k=1, S=(4, 0), version=3, cycle=1
    )
    assert opt.active_nodes == {1, 2}
    # node 1 [2,2]: slot (it contributed this cycle). Then node 1 lost: slot dropped.
    assert opt.on_update(1, [f32(2, 2)], 3) is Outcome.DEFERRED
    opt.on_node_lost(1)
    check(opt, w=(-4.5, -2.5), white={2}, slots={}, momentum=(2, 2), k=1, cycle=1)
    assert opt.counters["slots_dropped"] == 1
    assert opt.contributed == {1}
    # node 2 [0,2]: d = [0,2] + [1,1] = [1,3]: w = [-5,-4]; S = [4,2], k = 2 ->
    # close: M = [2,1] + 0.5 [2,2] = [3,2]; W = {2}.
    opt.on_update(2, [f32(0, 2)], 3)
    check(opt, w=(-5, -4), white={2}, slots={}, momentum=(3, 2), k=0, cycle=2)
    # Losing a node twice, or an unknown one, is a no-op.
    before = opt.counters
    opt.on_node_lost(1)
    opt.on_node_lost(42)
    assert opt.counters == before


def test_node_joining_enters_the_next_cycle():
    opt = make(nodes=(1, 2))
    # node 1 [2,0]: w = [-1,0]; W = {2}.
    opt.on_update(1, [f32(2, 0)], 0)
    opt.on_node_joined(3)
    check(opt, w=(-1, 0), white={2}, slots={}, momentum=(0, 0))
    # node 3 joined mid-cycle: its update goes to its slot.
    assert opt.on_update(3, [f32(4, 4)], 1) is Outcome.DEFERRED
    # node 2 [0,2]: w = [-1,-1]; S = [2,2], k = 2 -> close: M = [1,1]; W = {1,2,3};
    # slot 3: d = [4,4] + [0.5,0.5] = [4.5,4.5]: w = [-3.25,-3.25]; W = {1,2}.
    assert opt.on_update(2, [f32(0, 2)], 1) is Outcome.APPLIED
    check(opt, w=(-3.25, -3.25), white={1, 2}, slots={}, momentum=(1, 1), k=1, S=(4, 4), cycle=1)
    # node 3 already contributed (through its slot): next update waits in a slot.
    assert opt.on_update(3, [f32(2, 2)], 3) is Outcome.DEFERRED


def test_a_member_lost_and_back_mid_cycle_neither_counts_nor_closes_the_cycle():
    # docs/GSGM.md "Members that rejoin mid-cycle": quorum 0.6 over nodes 0, 1, 2,
    # heavy-ball, lr 0.5, beta 0.5, slot averaging, one scalar weight w = 0.
    opt = GSGMRule([f32(0)], [0, 1, 2], **{**GSGM_STRICT, "cycle_quorum": 0.6}, lr=0.5, beta=0.5)
    # node 0 [2]: in W, w = 0 - 0.5 * 2 = -1; S = 2, k = 1; 1 of ceil(0.6 * 3) = 2.
    assert opt.on_update(0, [f32(2)], 0) is Outcome.APPLIED
    assert (opt.members, opt.white_list, opt.cycle_index) == ({0, 1, 2}, {1, 2}, 0)
    # node 0 lost: members {1, 2}; its contribution no longer counts: 0 of ceil(1.2) = 2.
    opt.on_node_lost(0)
    assert (opt.members, opt.white_list, opt.contributed) == ({1, 2}, {1, 2}, {0})
    # node 1 [4]: w = -1 - 0.5 * 4 = -3; S = 6, k = 2; 1 of 2.
    assert opt.on_update(1, [f32(4)], 1) is Outcome.APPLIED
    # node 0 rejoins: not a member of this cycle, so still 1 of 2: no close. (Counting
    # it made the join itself close the cycle, with M = 6 / 2 = 3.)
    opt.on_node_joined(0)
    assert opt.cycle_index == 0 and opt.counters["cycles"] == 0
    assert (opt.members, opt.white_list, opt.active_nodes) == ({1, 2}, {2}, {0, 1, 2})
    assert_bits_equal(opt.momentum, f32(0))
    # node 0 [10] after its rejoin: not in W, its slot waits for the next cycle.
    assert opt.on_update(0, [f32(10)], 2) is Outcome.DEFERRED
    assert_bits_equal(opt.weights[0], f32(-3))
    # node 2 [6]: w = -3 - 0.5 * 6 = -6; S = 12, k = 3 (node 0's early contribution
    # stays: it moved w); W is empty: the cycle closes, M = 12 / 3 = 4. The new cycle
    # (members 0, 1, 2) starts with node 0's slot: w = -6 - 0.5 * (10 + 0.5 * 4) = -12.
    assert opt.on_update(2, [f32(6)], 2) is Outcome.APPLIED
    assert opt.cycle_index == 1 and opt.counters["cycles_quorum"] == 0
    assert_bits_equal(opt.momentum, f32(4))
    assert_bits_equal(opt.weights[0], f32(-12))
    assert_bits_equal(opt.cycle_sum, f32(10))
    assert (opt.members, opt.white_list, opt.contributed) == ({0, 1, 2}, {1, 2}, {0})
    # The members survive a state round trip (checkpoints).
    fresh = GSGMRule([f32(0)], [0], **{**GSGM_STRICT, "cycle_quorum": 0.6}, lr=0.5, beta=0.5)
    fresh.load_state_dict(opt.state_dict())
    assert fresh.members == {0, 1, 2}


def test_join_into_a_cycle_without_members_restarts_it():
    opt = make(nodes=())
    assert opt.white_list == frozenset()
    opt.on_node_joined(7)
    assert opt.white_list == {7}
    opt.on_node_lost(7)
    opt.on_node_joined(8)
    assert opt.white_list == {8}
    assert opt.on_update(8, [f32(2, 2)], 0) is Outcome.APPLIED


def test_momentum_only_ablation_hand_computed():
    # scheduling off, nodes {1,2}: every arrival applied, M refreshed every |A| = 2.
    opt = make(nodes=(1, 2), scheduling=False)
    # node 1 [2,0]: w = [-1,0]; S = [2,0]. node 1 again [2,4]: applied, w = [-2,-2];
    # S = [4,4], k = 2 = |A| -> M = [2,2].
    assert opt.on_update(1, [f32(2, 0)], 0) is Outcome.APPLIED
    assert opt.on_update(1, [f32(2, 4)], 1) is Outcome.APPLIED
    check(opt, w=(-2, -2), white=set(), slots={}, momentum=(2, 2), k=0, cycle=1)
    # node 2 [0,2]: d = [0,2] + [1,1] = [1,3]: w = [-2.5,-3.5].
    opt.on_update(2, [f32(0, 2)], 2)
    check(opt, w=(-2.5, -3.5), white=set(), slots={}, momentum=(2, 2), k=1)


def test_table_variant_hand_computed():
    opt = make(nodes=(1, 2), averaging="table")
    # node 1 [2,0]: table {1: [2,0]}, mean d = [2,0]: w = [-1,0]; S = [2,0].
    opt.on_update(1, [f32(2, 0)], 0)
    check(opt, w=(-1, 0), white={2}, slots={}, momentum=(0, 0), S=(2, 0))
    # node 1 [4,4]: slot.
    assert opt.on_update(1, [f32(4, 4)], 1) is Outcome.DEFERRED
    # node 2 [0,2]: table {1: [2,0], 2: [0,2]}, d = [1,1]: w = [-1.5,-0.5];
    # S = [3,1], k = 2 -> close: M = [1.5,0.5]; slot 1 [4,4] replaces row 1:
    # mean = [2,3]; d = [2,3] + 0.5 [1.5,0.5] = [2.75,3.25]:
    # w = [-1.5,-0.5] - [1.375,1.625] = [-2.875,-2.125]; S = [2,3], k = 1.
    opt.on_update(2, [f32(0, 2)], 1)
    check(opt, w=(-2.875, -2.125), white={2}, slots={}, momentum=(1.5, 0.5), k=1, S=(2, 3), cycle=1)
    assert {n: r.tolist() for n, r in opt.table.items()} == {1: [4, 4], 2: [0, 2]}
    # Losing node 2 drops its row: the mean is node 1's row alone.
    opt.on_node_lost(2)
    assert set(opt.table) == {1}


def test_staleness_bound_drops_and_counts():
    opt = make(max_staleness=1)
    opt.on_update(1, [f32(2, 0)], 0)  # t = 1
    opt.on_update(2, [f32(0, 2)], 1)  # t = 2
    before = opt.weights[0].copy()
    assert opt.on_update(3, [f32(8, 8)], 0) is Outcome.STALE  # staleness 2 > 1
    assert_bits_equal(opt.weights[0], before)
    assert opt.white_list == {3}
    c = opt.counters
    assert (c["arrivals"], c["stale"], c["applied"]) == (3, 1, 2)
    assert opt.on_update(3, [f32(2, 2)], 1) is Outcome.APPLIED  # staleness 1


# ------------------------------------------------------------------- ablations
class ScheduledASGD:
    """Reference "scheduled ASGD": white list + slots, plain steps, no momentum."""

    def __init__(self, w, nodes, lr):
        self.w = [a.astype(np.float32).copy() for a in w]
        self.nodes = set(nodes)
        self.white = set(nodes)
        self.slots = {}
        self.lr = lr

    def arrive(self, node, g):
        if node in self.white:
            self.w = [w - self.lr * u for w, u in zip(self.w, g)]
            self.white.discard(node)
        elif node in self.slots:
            p, n = self.slots[node]
            n += 1
            self.slots[node] = ([a + (b - a) / n for a, b in zip(p, g)], n)
        else:
            self.slots[node] = ([b.copy() for b in g], 1)
        while not self.white:  # cycle close
            self.white = set(self.nodes)
            for j in list(self.slots):
                p, _ = self.slots.pop(j)
                self.w = [w - self.lr * u for w, u in zip(self.w, p)]
                self.white.discard(j)


def random_arrivals(seed, nodes, n=200, shapes=((3,), (2, 2))):
    rng = np.random.default_rng(seed)
    weights = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    speeds = rng.uniform(0.2, 1.0, len(nodes))
    seq = []
    for _ in range(n):
        node = nodes[int(rng.choice(len(nodes), p=speeds / speeds.sum()))]
        seq.append((node, [rng.standard_normal(s).astype(np.float32) for s in shapes]))
    return weights, seq


@pytest.mark.parametrize("form", ["heavy-ball", "ema"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_beta_zero_equals_scheduled_asgd(form, seed):
    nodes = [1, 2, 3, 4]
    weights, seq = random_arrivals(seed, nodes)
    ref = ScheduledASGD(weights, nodes, lr=0.1)
    opt = GSGMRule(weights, nodes, **{**GSGM_STRICT, "momentum_form": form}, lr=0.1, beta=0.0)
    for node, g in seq:
        opt.on_update(node, g, opt.version)
        ref.arrive(node, g)
        for a, b in zip(opt.weights, ref.w):
            assert_bits_equal(a, b)
    assert opt.counters["deferred"] > 0 and opt.cycle_index > 5


@pytest.mark.parametrize("form", ["heavy-ball", "ema"])
@pytest.mark.parametrize("seed", [0, 1])
def test_scheduling_off_beta_zero_equals_asgd(form, seed):
    nodes = [1, 2, 3]
    weights, seq = random_arrivals(seed, nodes)
    gsgm = GSGMRule(
        weights, nodes, **{**GSGM_STRICT, "momentum_form": form}, lr=0.1, beta=0.0, scheduling=False
    )
    asgd = ASGDRule(weights, nodes, lr=0.1)
    for node, g in seq:
        assert gsgm.on_update(node, g, gsgm.version) is Outcome.APPLIED
        asgd.on_update(node, g, asgd.version)
        for a, b in zip(gsgm.weights, asgd.weights):
            assert_bits_equal(a, b)
    assert gsgm.version == asgd.version == len(seq)


def test_arrays_spanning_several_chunks_match_reference(monkeypatch):
    # Chunks of 1000 elements: arrays cross chunk boundaries at odd offsets.
    import flwr_gsgm.core.base as base

    monkeypatch.setattr(base, "CHUNK", 1000)
    nodes = [1, 2, 3]
    weights, seq = random_arrivals(5, nodes, n=30, shapes=((7_001,), (3, 1_111), (5,)))
    ref = ScheduledASGD(weights, nodes, lr=0.1)
    opt = GSGMRule(weights, nodes, **GSGM_STRICT, lr=0.1, beta=0.0)
    assert opt._scr_a.size == 1000
    for node, g in seq:
        opt.on_update(node, g, opt.version)
        ref.arrive(node, g)
    for a, b in zip(opt.weights, ref.w):
        assert_bits_equal(a, b)
    # With momentum and the table variant, chunked and unchunked runs agree.
    runs = []
    for chunk in (1000, 1 << 18):
        monkeypatch.setattr(base, "CHUNK", chunk)
        for kw in (dict(beta=0.5), dict(beta=0.9, momentum_form="ema", averaging="table")):
            opt = GSGMRule(weights, nodes, **{**GSGM_STRICT, **kw}, lr=0.1)
            for node, g in seq:
                opt.on_update(node, g, opt.version)
            runs.append(opt.flat_weights.copy())
    assert_bits_equal(runs[0], runs[2])
    assert_bits_equal(runs[1], runs[3])


def test_weights_are_views_of_one_flat_buffer():
    w = [np.ones((2, 3), np.float64), np.zeros(4, np.float32)]
    opt = GSGMRule(w, [1], **GSGM_STRICT, lr=0.5)
    views = opt.weights
    assert [v.shape for v in views] == [(2, 3), (4,)]
    assert all(v.dtype == np.float32 for v in views)
    assert all(np.shares_memory(v, opt.flat_weights) for v in views)
    opt.on_update(1, [np.ones((2, 3), np.float32), np.ones(4, np.float32)], 0)
    assert_bits_equal(views[1], np.full(4, -0.5, np.float32))  # views follow w
    w[1][0] = 99.0  # the input was copied
    assert views[1][0] == -0.5


def test_memory_bound_is_documented():
    doc = GSGMRule.__doc__
    assert "Memory" in doc and "one\n    slot per node" in doc and "3 + 2 * |A|" in doc


@pytest.mark.parametrize(
    "kw",
    [
        dict(lr=0.0),
        dict(lr=-1.0),
        dict(lr=float("nan")),
        dict(beta=1.0),
        dict(beta=-0.1),
        dict(momentum_form="nesterov"),
        dict(cycle_quorum=0.0),
        dict(cycle_quorum=1.5),
        dict(averaging="mean"),
        dict(scheduling="yes"),
        dict(max_staleness=-1),
        dict(max_norm=0.0),
    ],
)
def test_constructor_rejects_bad_parameters_naming_them(kw):
    params = dict(lr=0.5)
    params.update(kw)
    with pytest.raises(ValueError) as info:
        GSGMRule([f32(0, 0)], [1], **params)
    assert next(iter(kw)) in str(info.value)


def test_engine_helper_round_trip():
    # Sanity check of the Engine stand-in used by the property tests.
    opt = make()
    eng = Engine(opt, [1, 2, 3])
    eng.update(1, [f32(2, 0)])
    eng.update(2, [f32(0, 2)])
    assert eng.sent == {1: 1, 2: 2, 3: 0}


# ------------------------------------------------------------ apply_at = "close"
# The displacement modes' default (docs/GSGM.md, "FedAvg parity per client training"):
# contributions are summed with their staleness weight a = 1 / sqrt(1 + s) and the
# model steps once per cycle, at its close: w <- w - lr * S / k.
# Nodes {1, 2, 3}, quorum 0.5 (ceil(0.5 * 3) = 2 contributions close a cycle), lr 0.5,
# w0 = [0, 0]; node 3 is slow: sent w at version 0, it replies when the version is 3
# (s = 3, a = 1 / sqrt(4) = 0.5, exact).
#   1: node 1 [4,0], s 0: S = [4,0], k 1 (deferred); 1 is held, 2 and 3 are not.
#   2: node 2 [0,4], s 0: S = [4,4], k 2 -> close: w = -0.5 [2,2] = [-1,-1], v 1.
#   3: node 1 [2,2] (sent v1), s 0: S = [2,2], k 1.
#   4: node 2 [2,-2] (v1): S = [4,0], k 2 -> close: w = [-1,-1] - 0.5 [2,0] = [-2,-1], v 2.
#   5: node 1 [0,8] (v2): S = [0,8], k 1.
#   6: node 2 [4,0] (v2): S = [4,8] -> close: w = [-2,-1] - 0.5 [2,4] = [-3,-3], v 3.
#   7: node 3 [8,8] (v0), s 3, a 0.5: S = [4,4], k 1; 3 is held.
#   8: node 1 [4,0] (v3): S = [8,4] -> close: w = [-3,-3] - 0.5 [4,2] = [-5,-4], v 4.
# beta, momentum_form and lr_scaling are the per-arrival step's: the same numbers with
# any of them, and M stays 0.
CLOSE_ARRIVALS = [
    # node, update, base version
    (1, (4, 0), 0),
    (2, (0, 4), 0),
    (1, (2, 2), 1),
    (2, (2, -2), 1),
    (1, (0, 8), 2),
    (2, (4, 0), 2),
    (3, (8, 8), 0),
    (1, (4, 0), 3),
]
CLOSE_STEPS = [
    # outcome, w, k, S, version, held
    ("deferred", (0, 0), 1, (4, 0), 0, {1}),
    ("applied", (-1, -1), 0, (0, 0), 1, set()),
    ("deferred", (-1, -1), 1, (2, 2), 1, {1}),
    ("applied", (-2, -1), 0, (0, 0), 2, set()),
    ("deferred", (-2, -1), 1, (0, 8), 2, {1}),
    ("applied", (-3, -3), 0, (0, 0), 3, set()),
    ("deferred", (-3, -3), 1, (4, 4), 3, {3}),
    ("applied", (-5, -4), 0, (0, 0), 4, set()),
]


@pytest.mark.parametrize(
    "momentum",
    [
        dict(beta=0.0),
        dict(beta=0.5, momentum_form="ema"),
        dict(beta=0.9, momentum_form="heavy-ball", lr_scaling="step"),
    ],
)
def test_close_sequence_steps_once_per_cycle_with_staleness_weights(momentum):
    opt = GSGMRule([f32(0, 0)], [1, 2, 3], lr=0.5, cycle_quorum=0.5, apply_at="close", **momentum)
    assert opt.apply_at_in_use == "close" and opt.averaging_in_use == "slot"
    for (node, g, base), exp in zip(CLOSE_ARRIVALS, CLOSE_STEPS):
        outcome = opt.on_update(node, [f32(*g)], base)
        out, w, k, s, version, held = exp
        assert outcome is Outcome(out)
        check(opt, w=w, white=opt.white_list, slots={}, momentum=(0, 0), k=k, S=s, version=version)
        assert {n for n in (1, 2, 3) if opt.holds(n)} == held
    c = opt.counters
    assert (c["arrivals"], c["applied"], c["deferred"], c["cycles"]) == (8, 4, 4, 4)
    assert opt.last_staleness == 0


def test_close_weights_a_stale_update_by_one_over_sqrt_of_one_plus_staleness():
    # Staleness 1: a = 1 / sqrt(2), rounded to float32 as the step computes it.
    opt = GSGMRule([f32(0, 0)], [1, 2], lr=1.0, beta=0.0, cycle_quorum=1.0, apply_at="close")
    opt.on_update(1, [f32(1, 1)], 0)
    opt.on_update(2, [f32(1, 1)], 0)  # close: w = -[1, 1], version 1
    opt.on_update(1, [f32(2, 0)], 0)  # s = 1
    a = np.float32(1.0 / np.sqrt(2.0))
    assert_bits_equal(opt.cycle_sum, f32(2, 0) * a, "S")
    opt.on_update(2, [f32(0, 0)], 1)  # close: w = -[1, 1] - (S + 0) / 2
    assert_bits_equal(opt.weights[0], f32(-1, -1) - (f32(2, 0) * a) / np.float32(2), "w")


def test_close_holds_only_in_close_mode_and_auto_follows_the_kind_of_update():
    # Quorum 0.5 of 3 nodes: 2 contributions close a cycle.
    grad = GSGMRule([f32(0, 0)], [1, 2, 3], lr=0.5)
    disp = GSGMRule([f32(0, 0)], [1, 2, 3], lr=0.5, displacement=True)
    assert grad.apply_at_in_use == "arrival" and disp.apply_at_in_use == "close"
    assert grad.resolved_choices()["apply_at"] == "arrival"
    assert disp.resolved_choices() == {"averaging": "slot", "apply_at": "close"}
    grad.on_update(1, [f32(1, 1)], 0)
    disp.on_update(1, [f32(1, 1)], 0)
    assert not grad.holds(1) and disp.holds(1) and not disp.holds(2)
    assert grad.version == 1 and disp.version == 0  # one steps on arrival, one waits


def test_close_refuses_table_averaging_naming_both_options():
    with pytest.raises(ValueError, match="averaging='table'.*apply_at='close'"):
        GSGMRule([f32(0, 0)], [1, 2], lr=0.5, averaging="table", apply_at="close")
    with pytest.raises(ValueError, match="apply_at"):
        GSGMRule([f32(0, 0)], [1, 2], lr=0.5, apply_at="later")


def test_close_mode_state_round_trips_and_keeps_its_choice():
    opt = GSGMRule([f32(0, 0)], [1, 2, 3], lr=0.5, displacement=True)
    opt.on_update(1, [f32(4, 0)], 0)
    state = opt.state_dict()
    assert state["apply_at_in_use"] == "close"
    other = GSGMRule([f32(0, 0)], [1, 2, 3], lr=0.5, displacement=False)  # "auto"
    other.load_state_dict(state)  # the state's choice, made with its client mode
    assert other.apply_at_in_use == "close" and other.holds(1)
    assert_bits_equal(other.cycle_sum, f32(4, 0), "S")
    # A state written before apply_at existed is refused (not upgraded), naming it.
    old = GSGMRule([f32(0, 0)], [1, 2, 3], lr=0.5).state_dict()
    del old["apply_at_in_use"]
    old["params"] = {
        k: v for k, v in old["params"].items() if k not in ("apply_at", "displacement")
    }
    fresh = GSGMRule([f32(0, 0)], [1, 2, 3], lr=0.5, displacement=True)
    with pytest.raises(ValueError, match="no value of apply_at, displacement cannot be loaded"):
        fresh.load_state_dict(old)


def test_a_member_that_leaves_mid_cycle_and_rejoins_two_cycles_later():
    # Weights mode (apply_at close), every member (quorum 1.0), lr 1, no momentum, one
    # step per cycle: w <- w - (sum of a(s) u) / k, a(s) = 1 / sqrt(1 + s).
    opt = GSGMRule([f32(0, 0)], [1, 2, 3], lr=1.0, beta=0.0, cycle_quorum=1.0, apply_at="close")
    # Cycle 0: node 1 [2,0] held; node 3 leaves (the time model took it offline): the
    # cycle never waits for it; node 2 [0,2] closes it: w = -[2,2] / 2 = [-1,-1].
    assert opt.on_update(1, [f32(2, 0)], 0) is Outcome.DEFERRED
    opt.on_node_lost(3)
    assert opt.on_update(2, [f32(0, 2)], 0) is Outcome.APPLIED
    check(opt, w=(-1, -1), white=opt.white_list, slots={}, momentum=(0, 0), k=0, version=1)
    # Cycle 1, members {1, 2}: w = [-1,-1] - [4,4] / 2 = [-3,-3].
    opt.on_update(1, [f32(2, 2)], 1)
    assert opt.on_update(2, [f32(2, 2)], 1) is Outcome.APPLIED
    check(opt, w=(-3, -3), white=opt.white_list, slots={}, momentum=(0, 0), k=0, version=2)
    # Cycle 2: node 1 [4,0]; node 3 is back (two cycles later) and gets the model of
    # version 2 at once; it joined mid-cycle, so it is a member from the next cycle;
    # node 2 [0,4] closes cycle 2 without it: w = [-5,-5], version 3.
    opt.on_update(1, [f32(4, 0)], 2)
    opt.on_node_joined(3)
    assert opt.members == {1, 2} and opt.active_nodes == {1, 2, 3}
    assert opt.on_update(2, [f32(0, 4)], 2) is Outcome.APPLIED
    check(opt, w=(-5, -5), white=opt.white_list, slots={}, momentum=(0, 0), version=3)
    assert opt.members == {1, 2, 3}
    # Cycle 3, members {1, 2, 3}: node 3's update of version 2 arrives at version 3,
    # staleness 1 (weight 1 / sqrt(2)); nodes 1 and 2 bring zeros: the close steps by
    # a(1) [6,6] / 3.
    assert opt.on_update(3, [f32(6, 6)], 2) is Outcome.DEFERRED
    assert opt.last_staleness == 1
    opt.on_update(1, [f32(0, 0)], 3)
    assert opt.on_update(2, [f32(0, 0)], 3) is Outcome.APPLIED
    a = np.float32(1.0 / np.sqrt(2.0))
    assert_bits_equal(opt.weights[0], f32(-5, -5) - (f32(6, 6) * a) / np.float32(3), "w")
    assert opt.version == 4
