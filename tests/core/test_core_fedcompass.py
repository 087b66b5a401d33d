"""FedCompass's aggregation on a hand-checked sequence: a single update, a group that
arrives together, a deadline with a late member in the general buffer, the fallback
without a scheduler, and a checkpoint."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flwr_gsgm.core import Outcome, make_optimizer
from flwr_gsgm.scheduling.compass import ArrivalGroups


def u(x: float, y: float) -> list[np.ndarray]:
    return [np.array([x, y], np.float32)]


def rule(book: ArrivalGroups | None, **params):
    opt = make_optimizer("fedcompass", [np.zeros(2, np.float32)], [0, 1, 2], lr=0.9, **params)
    if book is not None:
        opt.share_schedule(book)
    return opt


def test_single_update_then_a_group_then_a_deadline_and_a_late_member():
    book = ArrivalGroups()
    opt = rule(book)
    # Node 0's first (unscheduled) update: alone, c = (1 + 0)^-0.5 / 3 = 1/3:
    # w = 0 - 0.9 * (1/3) * (3, 0) = (-0.9, 0).
    assert opt.on_update(0, u(3, 0), 0, now=2.0) is Outcome.APPLIED
    np.testing.assert_allclose(opt.weights[0], [-0.9, 0.0], rtol=1e-6)
    assert opt.version == 1
    # Nodes 1 (sent at version 0) and 2 (sent at version 1) in group 0: E = 10, L = 15.
    g0 = book.create(10.0, 15.0, 1)
    book.join(g0, 2)
    assert opt.on_update(1, u(0, 3), 0, now=9.0) is Outcome.DEFERRED  # c1 = 2^-0.5 / 3
    assert book.holds(1)
    assert opt.on_update(2, u(3, 3), 1, now=10.0) is Outcome.APPLIED  # c2 = 1/3; complete
    # w -= 0.9 * (c1 (0, 3) + c2 (3, 3)) = 0.9 * (1, 1 + 2^-0.5) = (0.9, 1.5363961)
    np.testing.assert_allclose(opt.weights[0], [-1.8, -0.9 * (1 + 2**-0.5)], rtol=1e-6)
    assert opt.version == 2 and not book.holds(1) and book.groups == {}
    # Group 1: nodes 1 and 0, E = 20, L = 22. Node 1 is back on time, node 0 is not.
    g1 = book.create(20.0, 22.0, 1)
    book.join(g1, 0)
    assert opt.on_update(1, u(0, 6), 2, now=21.0) is Outcome.DEFERRED  # c = 1/3
    w_before = opt.weights[0].copy()
    # At 23 the deadline has passed: group 1 is aggregated first with node 1 alone
    # (w -= 0.9 * (0, 2)), then node 0 (sent at version 1, staleness 3 - 1 = 2 after
    # that step) goes to the general buffer with c = 3^-0.5 / 3.
    assert opt.on_update(0, u(3, 0), 1, now=23.0) is Outcome.DEFERRED
    assert opt.last_staleness == 2
    np.testing.assert_allclose(opt.weights[0], w_before - [0.0, 1.8], rtol=1e-6)
    assert opt.buffered == {"general": 1} and opt.version == 3
    # Group 2 (node 2 alone, sent at version 3: staleness 0) aggregates its own update
    # with the general buffer:
    # w -= 0.9 * ((1/3) (0, 3) + 3^-0.5 / 3 * (3, 0)) = (0.9 / sqrt(3), 0.9).
    g2 = book.create(30.0, 35.0, 2)
    w_before = opt.weights[0].copy()
    assert opt.on_update(2, u(0, 3), 3, now=30.0) is Outcome.APPLIED
    assert g2 not in book.groups and opt.buffered == {"general": 0}
    np.testing.assert_allclose(opt.weights[0], w_before - [0.9 / math.sqrt(3), 0.9], rtol=1e-6)
    assert opt.version == 4
    counters = opt.counters
    assert (counters["arrivals"], counters["applied"], counters["deferred"]) == (6, 3, 3)


def test_a_lost_member_is_not_waited_for():
    book = ArrivalGroups()
    opt = rule(book)
    g = book.create(10.0, 15.0, 0)
    book.join(g, 1)
    assert opt.on_update(0, u(3, 0), 0, now=9.0) is Outcome.DEFERRED
    opt.on_node_lost(1, now=9.5)  # the group is complete without it: aggregated
    np.testing.assert_allclose(opt.weights[0], [-0.9, 0.0], rtol=1e-6)  # 0.9 * (1/3) * 3
    assert book.groups == {} and not book.holds(0)


def test_without_a_scheduler_every_k_arrivals_are_aggregated():
    opt = rule(None, buffer_size=2)
    assert opt.model_copies() == 2
    assert opt.on_update(0, u(3, 0), 0, now=1.0) is Outcome.DEFERRED
    assert opt.on_update(1, u(0, 3), 0, now=2.0) is Outcome.APPLIED
    np.testing.assert_allclose(opt.weights[0], [-0.9, -0.9], rtol=1e-6)  # 0.9 * (1, 1)
    assert opt.version == 1


def test_checkpoint_keeps_the_buffers():
    book = ArrivalGroups()
    opt = rule(book)
    g = book.create(10.0, 15.0, 0)
    book.join(g, 1)
    opt.on_update(0, u(3, 0), 0, now=9.0)
    state = opt.state_dict()
    other = rule(book)
    other.load_state_dict(state)
    assert other.buffered == {"general": 0, g: 1}
    other.on_update(1, u(0, 3), 0, now=10.0)
    np.testing.assert_allclose(other.weights[0], [-0.9, -0.9], rtol=1e-6)


def test_q_min_above_q_max_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"q_min \(2\.0\) must be at most q_max \(1\.0\)"):
        rule(None, q_min=2.0, q_max=1.0)
