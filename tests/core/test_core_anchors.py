"""CA2FL, ACE/ACED and delay-adaptive ASGD with hand-computed numbers.

Two-element vectors, lr = 0.5, w0 = [0, 0]; every number is a small dyadic
fraction, exact in float32, so the expectations are compared exactly.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from core_testutil import assert_bits_equal, assert_state_equal, f32

from flwr_gsgm.core import ACERule, CA2FLRule, DelayAdaptiveASGDRule, Outcome, make_optimizer


def w_is(opt, *values):
    assert_bits_equal(opt.weights[0], f32(*values), "w")


# ---------------------------------------------------------------------- CA2FL
def test_ca2fl_hand_computed():
    opt = CA2FLRule([f32(0, 0)], [1, 2, 3, 4], lr=0.5, buffer_size=2)
    # a1 node 1 [2,4]: no cache (0): entry [2,4]; B = [2,4]; h_1 = [2,4]; b = 1.
    assert opt.on_update(1, [f32(2, 4)], 0) is Outcome.DEFERRED
    assert_bits_equal(opt.buffer_sum, f32(2, 4))
    w_is(opt, 0, 0)
    # a2 node 2 [4,0]: entry [4,0]; B = [6,4], b = 2 -> v = h + B/2 = 0 + [3,2];
    # w = -0.5 [3,2] = [-1.5,-1]; version 1. h <- (h_1 + h_2) / |A| = [6,4] / 4
    # = [1.5,1].
    assert opt.on_update(2, [f32(4, 0)], 0) is Outcome.APPLIED
    w_is(opt, -1.5, -1)
    assert opt.version == 1 and opt.buffer_count == 0
    assert_bits_equal(opt.buffer_sum, f32(0, 0))
    assert_bits_equal(opt.cache_mean, f32(1.5, 1))
    # a3 node 1 [6,4]: entry [6,4] - h_1 [2,4] = [4,0]; h_1 = [6,4].
    assert opt.on_update(1, [f32(6, 4)], 1) is Outcome.DEFERRED
    assert_bits_equal(opt.buffer_sum, f32(4, 0))
    # a4 node 1 again [2,2]: entry [2,2] - h_1 [6,4] = [-4,-2] (the cache read
    # before it is replaced); B = [0,-2] = [2,2] - [2,4] (telescoped); h_1 = [2,2].
    # v = h [1.5,1] + B/2 [0,-1] = [1.5,0]; w = [-1.5,-1] - [0.75,0] = [-2.25,-1].
    # h <- ([2,2] + [4,0]) / 4 = [1.5,0.5].
    assert opt.on_update(1, [f32(2, 2)], 1) is Outcome.APPLIED
    w_is(opt, -2.25, -1)
    assert_bits_equal(opt.cache_mean, f32(1.5, 0.5))
    assert {n: c.tolist() for n, c in opt.caches.items()} == {1: [2, 2], 2: [4, 0]}
    # Node 2 lost: it keeps its cache, as the paper keeps every client's latest
    # update; h is kept until the next step. Node 5 joins (no cache):
    # n = |{1,3,4,5} (active) + {1,2} (cached)| = 5.
    opt.on_node_lost(2)
    opt.on_node_joined(5)
    assert set(opt.caches) == {1, 2}
    assert_bits_equal(opt.cache_mean, f32(1.5, 0.5))
    # a5 node 3 [4,4]: entry [4,4]; B = [4,4].
    assert opt.on_update(3, [f32(4, 4)], 2) is Outcome.DEFERRED
    # a6 node 1 [2,6]: entry [2,6] - [2,2] = [0,4]; B = [4,8] -> v = [1.5,0.5] +
    # [2,4] = [3.5,4.5]; w = [-2.25,-1] - [1.75,2.25] = [-4,-3.25]; version 3.
    # h <- (h_1 [2,6] + h_2 [4,0] + h_3 [4,4]) / 5 = [10,10] / 5 = [2,2].
    assert opt.on_update(1, [f32(2, 6)], 2) is Outcome.APPLIED
    w_is(opt, -4, -3.25)
    assert opt.version == 3
    assert_bits_equal(opt.cache_mean, f32(2, 2))
    # Node 2 rejoins: its update is calibrated against the cache it kept.
    # a7 node 2 [4,2]: entry [4,2] - [4,0] = [0,2]; B = [0,2]; h_2 = [4,2].
    opt.on_node_joined(2)
    assert opt.on_update(2, [f32(4, 2)], 3) is Outcome.DEFERRED
    assert_bits_equal(opt.buffer_sum, f32(0, 2))
    # a8 node 4 [2,2]: entry [2,2]; B = [2,4] -> v = [2,2] + [1,2] = [3,4];
    # w = [-4,-3.25] - [1.5,2] = [-5.5,-5.25]. h <- ([2,6] + [4,2] + [4,4] + [2,2])
    # / 5 = [12,14] / 5 (float32 of 2.4 and 2.8).
    assert opt.on_update(4, [f32(2, 2)], 3) is Outcome.APPLIED
    w_is(opt, -5.5, -5.25)
    assert_bits_equal(opt.cache_mean, f32(2.4, 2.8))
    c = opt.counters
    assert (c["arrivals"], c["applied"], c["deferred"]) == (8, 4, 4)


def test_ca2fl_default_buffer_and_stale_updates():
    opt = CA2FLRule([f32(0, 0)], [1], lr=1.0, max_staleness=0)
    assert opt.params["buffer_size"] == 10
    for _ in range(9):
        assert opt.on_update(1, [f32(1, 1)], 0) is Outcome.DEFERRED
    # Entries: [1,1] - 0, then [1,1] - [1,1] = 0 eight times: B = [1,1];
    # v = 0 + [1,1] / 10; w = -[0.1,0.1] (float32 of 1/10).
    assert opt.on_update(1, [f32(1, 1)], 0) is Outcome.APPLIED
    w_is(opt, -0.1, -0.1)
    # h = [1,1] / |A| = [1,1]; a stale update touches neither the buffer nor h_1.
    assert opt.on_update(1, [f32(8, 8)], 0) is Outcome.STALE
    assert opt.buffer_count == 0
    assert {n: c.tolist() for n, c in opt.caches.items()} == {1: [1, 1]}


# ------------------------------------------------------------------------- ACE
def test_ace_hand_computed():
    opt = ACERule([f32(0, 0)], [1, 2, 3], lr=0.5)
    # node 1 [2,4] (base 0): rows {1}; mean [2,4]; w = [-1,-2].
    assert opt.on_update(1, [f32(2, 4)], 0) is Outcome.APPLIED
    w_is(opt, -1, -2)
    # node 2 [4,0] (base 0): sum [6,4], mean over 2 rows [3,2]; w = [-2.5,-3].
    assert opt.on_update(2, [f32(4, 0)], 0) is Outcome.APPLIED
    w_is(opt, -2.5, -3)
    # node 1 [0,2] (base 1) replaces its row: sum [4,2], mean [2,1];
    # w = [-2.5,-3] - [1,0.5] = [-3.5,-3.5].
    assert opt.on_update(1, [f32(0, 2)], 1) is Outcome.APPLIED
    w_is(opt, -3.5, -3.5)
    assert_bits_equal(opt.table_sum, f32(4, 2))
    # node 3 [2,4] (base 0, staleness 3; ACE has no age bound): sum [6,6], mean
    # over 3 rows [2,2]; w = [-4.5,-4.5].
    assert opt.on_update(3, [f32(2, 4)], 0) is Outcome.APPLIED
    w_is(opt, -4.5, -4.5)
    assert opt.version == 4
    assert opt.row_versions == {1: 1, 2: 0, 3: 0}
    # node 3 lost: its row leaves; sum [4,2] over 2 rows.
    opt.on_node_lost(3)
    assert set(opt.table) == {1, 2}
    assert_bits_equal(opt.table_sum, f32(4, 2))
    # node 2 [2,2] (base 4): rows [0,2], [2,2]: sum [2,4], mean [1,2];
    # w = [-4.5,-4.5] - [0.5,1] = [-5,-5.5].
    opt.on_update(2, [f32(2, 2)], 4)
    w_is(opt, -5, -5.5)


def test_aced_rows_older_than_max_row_age_leave_the_mean():
    opt = ACERule([f32(0, 0)], [1, 2, 3], lr=0.5, max_row_age=1)
    # a1 node 1 [2,4] base 0 (age 0): mean [2,4]; w = [-1,-2]; version 1.
    assert opt.on_update(1, [f32(2, 4)], 0) is Outcome.APPLIED
    # a2 node 2 [4,0] base 0 (age 1 <= 1): rows 1 (b0), 2 (b0); ages 1, 1;
    # mean [3,2]; w = [-2.5,-3]; version 2.
    assert opt.on_update(2, [f32(4, 0)], 0) is Outcome.APPLIED
    w_is(opt, -2.5, -3)
    # a3 node 3 [8,8] base 0: staleness 2 > 1: dropped, no step.
    assert opt.on_update(3, [f32(8, 8)], 0) is Outcome.STALE
    w_is(opt, -2.5, -3)
    assert opt.version == 2 and set(opt.table) == {1, 2}
    # a4 node 2 [0,2] base 2: row 2 (b2); row 1 has age 2 - 0 = 2 > 1: expired.
    # mean = row 2 = [0,2]; w = [-2.5,-4]; version 3.
    assert opt.on_update(2, [f32(0, 2)], 2) is Outcome.APPLIED
    w_is(opt, -2.5, -4)
    assert opt.row_versions == {2: 2}
    # a5 node 1 [2,2] base 1: staleness 2 > 1: dropped.
    assert opt.on_update(1, [f32(2, 2)], 1) is Outcome.STALE
    # a6 node 1 [4,2] base 3: rows 2 (b2, age 1), 1 (b3, age 0): sum [4,4],
    # mean [2,2]; w = [-3.5,-5]; version 4.
    assert opt.on_update(1, [f32(4, 2)], 3) is Outcome.APPLIED
    w_is(opt, -3.5, -5)
    # a7 node 2 [8,8] base 2: staleness 2 > 1: dropped, and its own row (b2, older
    # still) leaves too.
    assert opt.on_update(2, [f32(8, 8)], 2) is Outcome.STALE
    assert opt.row_versions == {1: 3}
    # a8 node 3 [6,6] base 4: rows 1 (b3, age 1), 3 (b4): sum [10,8], mean [5,4];
    # w = [-3.5,-5] - [2.5,2] = [-6,-7]; version 5.
    assert opt.on_update(3, [f32(6, 6)], 4) is Outcome.APPLIED
    w_is(opt, -6, -7)
    assert_bits_equal(opt.table_sum, f32(10, 8))
    c = opt.counters
    assert (c["arrivals"], c["applied"], c["stale"], c["rows_expired"]) == (8, 5, 3, 2)
    assert opt.version == 5


def test_ace_running_sum_is_resynced():
    # Every |U| row changes, Sigma is recomputed from the rows (counted).
    opt = ACERule([f32(0, 0)], [1, 2], lr=0.5)
    opt.on_update(1, [f32(2, 4)], 0)  # 1 change >= 1 row: resync
    assert opt.counters["resyncs"] == 1
    opt.on_update(2, [f32(2, 4)], 1)  # 1 change < 2 rows
    opt.on_update(1, [f32(2, 4)], 2)  # 2 changes >= 2 rows: resync
    assert opt.counters["resyncs"] == 2
    assert_bits_equal(opt.table_sum, f32(4, 8))


# --------------------------------------------------------- delay-adaptive ASGD
def test_delay_adaptive_asgd_hand_computed():
    opt = DelayAdaptiveASGDRule([f32(0, 0)], [1, 2], lr=0.5)  # m = |A| = 2
    # node 1 [2,4] s = 0: step 0.5 * 2 / max(2, 0) = 0.5: w = [-1,-2]; v1.
    assert opt.on_update(1, [f32(2, 4)], 0) is Outcome.APPLIED
    w_is(opt, -1, -2)
    # node 1 [2,0] s = 0: w = [-2,-2]; v2.
    opt.on_update(1, [f32(2, 0)], 1)
    # node 2 [2,2] s = 2 = m: full step 0.5: w = [-3,-3]; v3.
    opt.on_update(2, [f32(2, 2)], 0)
    w_is(opt, -3, -3)
    assert opt.counters["steps_shrunk"] == 0
    # node 1 [4,4] s = 1: w = [-5,-5]; node 1 [0,4] s = 0: w = [-5,-7]; v5.
    opt.on_update(1, [f32(4, 4)], 2)
    opt.on_update(1, [f32(0, 4)], 4)
    w_is(opt, -5, -7)
    # node 2 [4,8] base 1: s = 4 > m = 2: step 0.5 * 2 / 4 = 0.25: [1,2];
    # w = [-6,-9]; v6.
    opt.on_update(2, [f32(4, 8)], 1)
    w_is(opt, -6, -9)
    assert opt.version == 6 and opt.counters["steps_shrunk"] == 1
    # m follows |A|: with node 3 joined, m = 3; s = 6: 0.5 * 3 / 6 = 0.25.
    opt.on_node_joined(3)
    assert opt.step_size(6) == 0.25 and opt.step_size(3) == 0.5


def test_delay_adaptive_asgd_fixed_threshold():
    opt = DelayAdaptiveASGDRule([f32(0, 0)], [1, 2, 3, 4], lr=0.5, delay_threshold=1)
    # s = 1 <= 1: 0.5; s = 2: 0.5 * 1 / 2 = 0.25; s = 4: 0.125 (|A| = 4 unused).
    assert [opt.step_size(s) for s in (0, 1, 2, 4)] == [0.5, 0.5, 0.25, 0.125]
    opt.on_update(1, [f32(4, 8)], 0)  # s = 0: w = [-2,-4]; v1
    opt.on_update(2, [f32(4, 8)], 0)  # s = 1: w = [-4,-8]; v2
    opt.on_update(3, [f32(4, 8)], 0)  # s = 2: 0.25 [4,8] = [1,2]: w = [-5,-10]
    w_is(opt, -5, -10)


# ------------------------------------------------------------------- parameters
@pytest.mark.parametrize(
    "cls,kw",
    [
        (CA2FLRule, dict(buffer_size=0)),
        (CA2FLRule, dict(buffer_size=2.5)),
        (ACERule, dict(max_row_age=-1)),
        (ACERule, dict(max_row_age=1.5)),
        (DelayAdaptiveASGDRule, dict(delay_threshold=0)),
        (DelayAdaptiveASGDRule, dict(delay_threshold=True)),
    ],
)
def test_constructor_rejects_bad_parameters_naming_them(cls, kw):
    with pytest.raises(ValueError) as info:
        cls([f32(0, 0)], [1], lr=0.5, **kw)
    name = next(iter(kw))
    assert name in str(info.value) and repr(kw[name]) in str(info.value)


@pytest.mark.parametrize("cls", [CA2FLRule, ACERule, DelayAdaptiveASGDRule])
def test_docstrings_cite_and_document(cls):
    module_doc = sys.modules[cls.__module__].__doc__
    assert "Reference" in module_doc
    for part in ("Args:", "Raises:", "Memory"):
        assert part in cls.__doc__


def test_registry_builds_aced_and_run_config_keys():
    opt = make_optimizer("ace", [f32(0, 0)], [1], **{"lr": 0.1, "max-row-age": 50})
    assert type(opt) is ACERule and opt.params["max_row_age"] == 50
    assert make_optimizer("ca2fl", [f32(0, 0)], [1], lr=0.1).params["buffer_size"] == 10
    assert make_optimizer("daasgd", [f32(0, 0)], [1], lr=0.1).params["delay_threshold"] is None


# ------------------------------------------------------------------ chunking
@pytest.mark.parametrize(
    "name,kw",
    [
        ("ca2fl", dict(buffer_size=3)),
        ("ace", dict()),
        ("ace", dict(max_row_age=2)),
        ("daasgd", dict()),
        ("gsgm", dict(momentum_form="ema")),
        ("gsgm", dict(averaging="table", cycle_quorum=0.5)),
        ("gsgm", dict(averaging="table", momentum_form="heavy-ball")),
        ("gsgm", dict(lr_scaling="cycle", beta=0.9)),
    ],
)
def test_chunked_and_unchunked_runs_agree(monkeypatch, name, kw):
    # Chunks of 1000 elements: arrays cross chunk boundaries at odd offsets.
    import flwr_gsgm.core.base as base

    rng = np.random.default_rng(7)
    shapes = ((7_001,), (3, 1_111), (5,))
    weights = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    seq = []
    for _ in range(40):
        node = int(rng.choice([1, 2, 3, 3, 3]))
        lag = int(rng.integers(0, 4))
        seq.append((node, lag, [rng.standard_normal(s).astype(np.float32) for s in shapes]))
    runs = []
    for chunk in (1000, 1 << 18):
        monkeypatch.setattr(base, "CHUNK", chunk)
        opt = make_optimizer(name, weights, [1, 2, 3], lr=0.1, **kw)
        for node, lag, g in seq:
            opt.on_update(node, g, max(0, opt.version - lag))
        runs.append(opt.state_dict())
    assert runs[0]["counters"]["applied"] > 0
    assert_state_equal(runs[0], runs[1])
