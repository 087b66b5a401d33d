"""Property-based tests over random arrival sequences (hypothesis).

Events: updates from random nodes after random clock steps, bad updates of every
rejection kind, node losses and joins. Checked:
- GSGM: within one cycle no node contributes twice, plus the bookkeeping invariants;
- every optimizer: a rejected update changes no state at all (bit for bit);
- every optimizer: save/restore (state_dict -> pickle -> fresh instance) at a random
  point ends in the same state, bit for bit, as the uninterrupted run.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from core_testutil import Engine, assert_state_equal, assert_unchanged_but_rejected
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from flwr_gsgm.core import OPTIMIZERS, GSGMRule, UpdateRejected, make_optimizer

NODES = [1, 2, 3, 4]
SHAPES = [(3,), (2, 2)]
BAD_KINDS = ["num-arrays", "shape", "dtype", "non-finite", "norm", "unknown-node", "base-version"]
SETTINGS = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

gsgm_params = st.fixed_dictionaries(
    {
        "beta": st.sampled_from([0.0, 0.5, 0.9]),
        "momentum_form": st.sampled_from(["heavy-ball", "ema"]),
        "cycle_quorum": st.sampled_from([1.0, 1.0, 0.5, 0.75]),
        "scheduling": st.sampled_from([True, True, True, False]),
        "averaging": st.sampled_from(["slot", "slot", "table"]),
        "max_staleness": st.one_of(st.none(), st.integers(0, 3)),
        "lr_scaling": st.sampled_from(["step", "step", "cycle"]),
    }
)
other_params = {
    "asgd": st.fixed_dictionaries({"max_staleness": st.one_of(st.none(), st.integers(0, 3))}),
    "masgd": st.fixed_dictionaries({"beta": st.sampled_from([0.0, 0.9])}),
    "dcasgd": st.fixed_dictionaries({"dc_lambda": st.sampled_from([0.0, 0.04, 1.0])}),
    "fedasync": st.fixed_dictionaries(
        {"alpha": st.sampled_from([0.6, 1.0]), "poly_a": st.sampled_from([0.0, 0.5])}
    ),
    "fedbuff": st.fixed_dictionaries(
        {"buffer_size": st.integers(1, 4), "max_staleness": st.one_of(st.none(), st.integers(0, 3))}
    ),
    "ca2fl": st.fixed_dictionaries(
        {"buffer_size": st.integers(1, 4), "max_staleness": st.one_of(st.none(), st.integers(0, 3))}
    ),
    "ace": st.fixed_dictionaries(
        {
            "max_row_age": st.one_of(st.none(), st.integers(0, 4)),
            "max_staleness": st.one_of(st.none(), st.integers(0, 3)),
        }
    ),
    "daasgd": st.fixed_dictionaries({"delay_threshold": st.one_of(st.none(), st.integers(1, 3))}),
    # Without a scheduler (a rule alone): its FedBuff-like fallback.
    "fedcompass": st.fixed_dictionaries(
        {"buffer_size": st.integers(1, 4), "max_staleness": st.one_of(st.none(), st.integers(0, 3))}
    ),
}
all_params = dict(other_params, gsgm=gsgm_params)
# GSGM has the most state: it gets most of the examples.
configs = st.sampled_from(["gsgm"] * 5 + sorted(other_params)).flatmap(
    lambda n: st.tuples(st.just(n), all_params[n])
)
events = st.lists(
    st.tuples(
        st.sampled_from(["update"] * 12 + ["bad", "bad", "lost", "join", "join"]),
        st.sampled_from([1, 1, 1, 2, 2, 2, 3, 4, 5]),  # node 3 is slow
        st.integers(0, 2**32 - 1),  # seed of the update's values
        st.sampled_from([0.0, 0.5, 1.0, 3.0]),  # clock step before the event
        st.sampled_from(BAD_KINDS),
    ),
    min_size=10,
    max_size=80,
)


def update_arrays(seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def bad_update(kind, good):
    if kind == "num-arrays":
        return good[:1]
    if kind == "shape":
        return [good[0], good[1].reshape(4)]
    if kind == "dtype":
        return [good[0].astype(np.float64), good[1]]
    if kind == "non-finite":
        bad = [a.copy() for a in good]
        bad[1][1, 0] = np.inf
        return bad
    if kind == "norm":
        return [a + np.float32(1e3) for a in good]
    return good


def build(name, params, cls=None):
    params = dict(params, lr=0.1, max_norm=50.0)
    if cls is not None:
        return cls(update_arrays(0), NODES[:3], **params)
    return make_optimizer(name, update_arrays(0), NODES[:3], **params)


def run(opt, eng, evs, check=None):
    """Drive ``opt`` through ``evs`` like the engine would."""
    for kind, node, seed, dt, bad_kind in evs:
        if kind == "update":
            if node in eng.sent:
                eng.update(node, update_arrays(seed), dt=dt)
        elif kind == "bad":
            base = eng.sent.get(node, 0)
            if bad_kind == "unknown-node":
                node = 99
            elif bad_kind == "base-version":
                base = opt.version + 1
            before = opt.state_dict()
            with pytest.raises(UpdateRejected):
                opt.on_update(
                    node, bad_update(bad_kind, update_arrays(seed)), base, now=eng.now + dt
                )
            assert_unchanged_but_rejected(before, opt.state_dict())
        elif kind == "lost":
            eng.lost(node, dt=dt)
        elif kind == "join":
            if node not in eng.sent:
                eng.joined(node, dt=dt)
        if check is not None:
            check(opt)


class RecordingGSGM(GSGMRule):
    """GSGM that asserts, at every contribution, that the node is new to the cycle."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: set[tuple[int, int]] = set()

    def _contribute(self, node, parts, *args):
        key = (self.cycle_index, node)
        assert key not in self.seen, f"node {node} contributed twice in cycle {key[0]}"
        self.seen.add(key)
        super()._contribute(node, parts, *args)


def gsgm_invariants(opt):
    active = opt.active_nodes
    assert opt.white_list <= active
    assert not (opt.white_list & opt.contributed)
    assert set(opt.slots) <= active
    assert not (set(opt.slots) & opt.white_list)
    assert all(c >= 1 for _, c in opt.slots.values())
    assert opt.cycle_count == len(opt.contributed)
    assert set(opt.table) <= active
    if opt.table:  # the running sum follows the rows (losses, closes)
        rows = sum(r.astype(np.float64) for r in opt.table.values())
        np.testing.assert_allclose(opt._table_sum, rows, rtol=1e-4, atol=1e-4)
    c = opt.counters
    assert c["arrivals"] == c["applied"] + c["deferred"] + c["stale"]


@SETTINGS
@given(params=gsgm_params, evs=events)
def test_gsgm_no_node_contributes_twice_per_cycle(params, evs):
    params = dict(params, scheduling=True)
    opt = build("gsgm", params, cls=RecordingGSGM)
    eng = Engine(opt, NODES[:3])
    run(opt, eng, evs, check=gsgm_invariants)


def pending(opt):
    """How much in-flight state the optimizer holds (slots, buffered updates)."""
    if isinstance(opt, GSGMRule):
        return len(opt.slots) + opt.cycle_count
    return getattr(opt, "buffer_count", 0)


@SETTINGS
@given(config=configs, evs=events, data=st.data())
def test_save_restore_at_a_random_point_is_bit_identical(config, evs, data):
    name, params = config
    richness = [0]  # pending state after each prefix of evs

    def record(opt):
        c = opt.counters
        assert c["arrivals"] == c["applied"] + c["deferred"] + c["stale"]
        richness.append(pending(opt))

    straight = build(name, params)
    eng = Engine(straight, NODES[:3])
    run(straight, eng, evs, check=record)

    # Cut anywhere, or (half of the time) where the most state is in flight.
    top = max(richness)
    rich = [i for i, r in enumerate(richness) if r == top]
    if data.draw(st.booleans(), label="cut where most is pending"):
        cut = data.draw(st.sampled_from(rich), label="cut")
    else:
        cut = data.draw(st.integers(0, len(evs)), label="cut")
    if name == "gsgm":
        event(f"pending at cut: {min(richness[cut], 4)}")

    first = build(name, params)
    eng1 = Engine(first, NODES[:3])
    run(first, eng1, evs[:cut])
    blob = pickle.dumps(first.state_dict())
    snap = eng1.snapshot()
    del first
    # The same mode (STATE_LAYOUT); every other parameter comes from the state.
    layout = {k: v for k, v in params.items() if k in OPTIMIZERS[name].STATE_LAYOUT}
    fresh = make_optimizer(name, [np.zeros(s, np.float32) for s in SHAPES], [], lr=0.5, **layout)
    fresh.load_state_dict(pickle.loads(blob))
    eng2 = Engine(fresh, [])
    eng2.restore(fresh, snap)
    run(fresh, eng2, evs[cut:])

    assert_state_equal(straight.state_dict(), fresh.state_dict())
    for a, b in zip(straight.weights, fresh.weights):
        assert a.tobytes() == b.tobytes()


def test_all_names_are_covered_by_the_configs():
    assert set(other_params) | {"gsgm"} == set(OPTIMIZERS)
