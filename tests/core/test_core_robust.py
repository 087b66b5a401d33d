"""The coordinate-wise trimmed mean (flwr_gsgm/core/robust.py) and the rules that keep
their updates for it, FedBuff's buffer and GSGM's cycle, with hand-computed numbers
(small dyadic fractions, exact in float32, compared bit for bit)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from core_testutil import assert_bits_equal, f32

from flwr_gsgm.core import FedBuffRule, GSGMRule, Outcome
from flwr_gsgm.core.robust import least_cutting_fraction, trimmed_count, trimmed_mean_chunk


def test_trimmed_count_is_flowers():
    # Flower's FedTrimmedAvg: int(beta * n) cut at each end
    assert [trimmed_count(n, 0.2) for n in (1, 4, 5, 9, 10)] == [0, 0, 1, 1, 2]
    assert trimmed_count(7, 0.0) == 0 and trimmed_count(7, 0.49) == 3


def test_the_least_cutting_fraction_cuts_one_and_a_thousandth_less_cuts_none():
    assert [least_cutting_fraction(n) for n in (3, 5, 7, 10)] == [0.334, 0.2, 0.143, 0.1]
    for n in range(2, 400):
        f = least_cutting_fraction(n)
        assert trimmed_count(n, f) == 1 and trimmed_count(n, round(f - 0.001, 3)) == 0, n


def test_trimmed_mean_cuts_each_coordinate_on_its_own():
    rows = [f32(1, -8, 0), f32(2, 4, 0), f32(100, 2, 0), f32(3, 6, 0), f32(-50, 0, 0)]
    stack = np.empty((5, 3), np.float32)
    out = np.empty(3, np.float32)
    # cut 1 at each end: x {-50, 1, 2, 3, 100} -> mean(1, 2, 3) = 2;
    # y {-8, 0, 2, 4, 6} -> mean(0, 2, 4) = 2; z all 0 -> 0
    trimmed_mean_chunk(rows, 0, 3, 1, out, stack)
    assert_bits_equal(out, f32(2, 2, 0))
    # cut 2: the median of 5
    trimmed_mean_chunk(rows, 0, 3, 2, out, stack)
    assert_bits_equal(out, f32(2, 2, 0))
    # cut 0: the plain mean of coordinates [1, 3): y (-8+4+2+6+0)/5 = 0.8, z 0
    part = np.empty(2, np.float32)
    trimmed_mean_chunk(rows, 1, 3, 0, part, stack)
    assert_bits_equal(part, np.array([0.8, 0.0], np.float32))
    with pytest.raises(ValueError, match=r"a trimmed mean of 4 update\(s\) cutting 2 at each"):
        trimmed_mean_chunk(rows[:4], 0, 3, 2, out, stack)


def test_fedbuff_steps_along_the_trimmed_mean_of_its_buffer():
    opt = FedBuffRule([f32(0, 0)], [1, 2, 3, 4, 5], lr=0.5, buffer_size=5, trim_fraction=0.2)
    updates = {1: f32(2, 4), 2: f32(4, 0), 3: f32(-96, 2), 4: f32(6, 6), 5: f32(8, 2)}
    for node, u in list(updates.items())[:4]:
        assert opt.on_update(node, [u], 0) is Outcome.DEFERRED
    # buffered, nothing applied; the introspected sum is the kept updates' sum
    assert_bits_equal(opt.buffer_sum, f32(-84, 12))
    assert opt.state_dict()["buffer_rows"][2].tolist() == [-96.0, 2.0]
    assert opt.on_update(5, [updates[5]], 0) is Outcome.APPLIED
    # cut int(0.2 x 5) = 1 at each end: x {-96, 2, 4, 6, 8} -> mean(2, 4, 6) = 4;
    # y {0, 2, 2, 4, 6} -> mean(2, 2, 4) = 8/3; w = -0.5 x that
    assert_bits_equal(opt.weights[0], np.array([-2.0, -0.5 * np.float32(8 / 3)], dtype=np.float32))
    assert opt.version == 1 and opt.buffer_count == 0 and opt.state_dict()["buffer_rows"] == []
    # the plain FedBuff would have moved x by +38 (the liar's -96 in the mean)
    plain = FedBuffRule([f32(0, 0)], [1, 2, 3, 4, 5], lr=0.5, buffer_size=5)
    for node, u in updates.items():
        plain.on_update(node, [u], 0)
    assert_bits_equal(plain.weights[0], f32(7.6, -1.4))
    # w and the sum, and with trimming the 5 kept updates too
    assert plain.model_copies(5) == 2 and opt.model_copies(5) == 7


def test_fedbuff_refuses_a_trim_fraction_that_cuts_none_of_its_buffer():
    # int(0.1 x 5) = 0: the plain mean at 5 more model copies, refused at the start
    with pytest.raises(
        ValueError,
        match=r"trim_fraction=0.1 cuts int\(0.1 x 5\) = 0 of a buffer of buffer_size=5 .*"
        r"at least 0.2, buffer_size to at least 10, or trim_fraction to 0",
    ):
        FedBuffRule([f32(0, 0)], [1, 2], lr=0.5, buffer_size=5, trim_fraction=0.1)
    # a buffer of 3 needs int(f x 3) >= 1: 0.334 (0.333 x 3 = 0.999 would cut none)
    with pytest.raises(ValueError, match=r"at least 0.334, buffer_size to at least 4,"):
        FedBuffRule([f32(0, 0)], [1, 2], lr=0.5, buffer_size=3, trim_fraction=0.3)
    FedBuffRule([f32(0, 0)], [1, 2], lr=0.5, buffer_size=3, trim_fraction=0.334)


def test_fedbuff_trimming_state_round_trips_and_is_checked():
    opt = FedBuffRule([f32(0, 0)], [1, 2], lr=0.5, buffer_size=4, trim_fraction=0.25)
    opt.on_update(1, [f32(2, 4)], 0)
    opt.on_update(2, [f32(4, 0)], 0)
    state = opt.state_dict()
    other = FedBuffRule([f32(0, 0)], [1, 2], lr=0.5, buffer_size=4, trim_fraction=0.25)
    other.load_state_dict(state)
    assert other.buffer_count == 2
    assert_bits_equal(other.buffer_sum, f32(6, 4))
    bad = {**state, "buffer_rows": state["buffer_rows"][:1]}
    with pytest.raises(ValueError, match=r"buffer_rows'\] holds 1 update\(s\); expected buffer_"):
        other.load_state_dict(bad)


def gsgm(trim: float, nodes=(1, 2, 3, 4, 5)) -> GSGMRule:
    # close mode (displacements), every node a member, quorum 1: a cycle is 5 updates
    return GSGMRule(
        [f32(0, 0)],
        list(nodes),
        lr=0.5,
        displacement=True,
        cycle_quorum=1.0,
        trim_fraction=trim,
    )


def test_gsgm_closes_its_cycle_along_the_trimmed_mean():
    opt = gsgm(0.2)
    updates = [f32(2, 4), f32(4, 0), f32(-96, 2), f32(6, 6), f32(8, 2)]
    for node, u in enumerate(updates[:4], start=1):
        assert opt.on_update(node, [u], 0) is Outcome.DEFERRED
    assert_bits_equal(opt.cycle_sum, f32(-84, 12))
    assert opt.on_update(5, [updates[4]], 0) is Outcome.APPLIED
    # staleness 0: weights 1; the same numbers as FedBuff's: x 4, y 8/3, times lr 0.5
    assert_bits_equal(opt.weights[0], np.array([-2.0, -0.5 * np.float32(8 / 3)], dtype=np.float32))
    assert opt.version == 1 and opt.cycle_count == 0 and opt.state_dict()["cycle_rows"] == []


def test_gsgm_logs_what_its_first_trimmed_closes_cut(caplog):
    caplog.set_level(logging.INFO, logger="flwr")
    opt = gsgm(0.2)
    for cycle in range(2):  # two closes of 5: int(0.2 x 5) = 1, logged once
        for node in (1, 2, 3, 4, 5):
            opt.on_update(node, [f32(2, 2)], cycle)
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "trimmed close" in r.message]
    assert said == [
        (
            logging.INFO,
            "gsgm: trimmed close: cut 1 of 5 contributions at each end (trim_fraction=0.2)",
        )
    ]
    caplog.clear()
    opt = gsgm(0.1)  # int(0.1 x 5) = 0: the close is the plain mean, and says so
    for node in (1, 2, 3, 4, 5):
        opt.on_update(node, [f32(2, 2)], 0)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (
            logging.WARNING,
            "gsgm: trimmed close of 5 contributions cut none (int(0.1 x 5) = 0): it was "
            "the plain mean; trim_fraction >= 0.2 cuts one at each end",
        )
    ]
    assert_bits_equal(opt.weights[0], f32(-1, -1))  # lr 0.5 x the mean (2, 2)


def test_gsgm_weights_a_stale_contribution_before_trimming():
    opt = gsgm(0.2)
    for node in (1, 2, 3, 4, 5):  # cycle 1: every node sends (4, 4): w = -0.5 (4, 4)
        opt.on_update(node, [f32(4, 4)], 0)
    assert_bits_equal(opt.weights[0], f32(-2, -2))
    # cycle 2: node 1's update was trained on version 0, now 1: staleness 1, so it is
    # kept as (8, 8) / sqrt(2), FedBuff's weight, before any trimming
    opt.on_update(1, [f32(8, 8)], 0)
    kept = opt.state_dict()["cycle_rows"][0]
    assert_bits_equal(kept, f32(8, 8) * np.float32(1 / np.sqrt(2.0)))


def test_gsgm_trimming_is_refused_where_it_steps_on_every_arrival():
    with pytest.raises(ValueError, match=r"trim_fraction=0.2 needs apply_at='close'.*'arrival'"):
        GSGMRule([f32(0, 0)], [1, 2], lr=0.5, trim_fraction=0.2)


def test_gsgm_trimming_state_round_trips_and_is_checked():
    opt = gsgm(0.2)
    opt.on_update(1, [f32(2, 4)], 0)
    opt.on_update(2, [f32(4, 0)], 0)
    state = opt.state_dict()
    other = gsgm(0.2)
    other.load_state_dict(state)
    assert other.cycle_count == 2
    assert_bits_equal(other.cycle_sum, f32(6, 4))
    with pytest.raises(ValueError, match=r"cycle_rows'\] holds 1 contribution\(s\); expected"):
        other.load_state_dict({**state, "cycle_rows": state["cycle_rows"][:1]})
    assert gsgm(0.0).model_copies(5) == 7 and opt.model_copies(5) == 17


@pytest.mark.parametrize("n", [2, 3, 5, 6, 10, 24, 40, 41])
def test_the_sorting_network_sorts_as_numpy_does_to_the_bit(n):
    """Random rows with ties and signed zeros: every column sorted, and the trimmed mean
    the same bytes as with numpy's sort (41 rows: numpy's sort itself)."""
    from flwr_gsgm.core.robust import NETWORK_ROWS, sort_columns

    assert NETWORK_ROWS == 40
    rng = np.random.default_rng(n)
    rows = rng.standard_normal((n, 1000)).astype(np.float32)
    rows[:, :10] = 0.0
    rows[0, :5] = -0.0
    rows[-1, 20:40] = rows[0, 20:40]  # ties
    ours = rows.copy()
    sort_columns(ours, np.empty(1000, np.float32))
    numpy_sorted = np.sort(rows, axis=0)
    assert np.array_equal(ours, numpy_sorted)
    cut = max(1, int(0.2 * n)) if n > 2 else 0
    assert np.mean(ours[cut : n - cut], axis=0).tobytes() == (
        np.mean(numpy_sorted[cut : n - cut], axis=0).tobytes()
    )
    out, stack = np.empty(1000, np.float32), np.empty((n, 1000), np.float32)
    trimmed_mean_chunk(list(rows), 0, 1000, cut, out, stack)
    assert out.tobytes() == np.mean(numpy_sorted[cut : n - cut], axis=0).tobytes()
