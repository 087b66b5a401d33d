"""FedCompass's aggregation on a hand-checked sequence: a single update, a group that
arrives together, a deadline with a late member in the general buffer, the fallback
without a scheduler, a checkpoint, and the divisor N under a concurrency limit."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flwr_gsgm.core import Outcome, make_optimizer
from flwr_gsgm.engine.settings import EngineSettings
from flwr_gsgm.model.optimizer import RuleSpec
from flwr_gsgm.scheduling.compass import ArrivalGroups
from flwr_gsgm.strategy.strategies import STRATEGIES


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


def test_min_local_steps_above_max_local_steps_is_refused_naming_both():
    # Q_min and Q_max are APPFL's absolute step counts now (no longer fractions of a
    # node's own work, q_min / q_max): tests/scheduling/test_compass_appfl.py.
    with pytest.raises(
        ValueError, match=r"min_local_steps \(120\) must be at most max_local_steps \(100\)"
    ):
        rule(None, min_local_steps=120)


def test_the_divisor_is_the_number_in_flight_under_a_concurrency_limit():
    # 10 active nodes, at most 2 in flight: N = min(2, 10) = 2, as APPFL's 1 /
    # num_clients over clients that all train. Node 0's first update (no group,
    # staleness 0): c = (1 + 0)^-0.5 / 2 = 0.5; w = 0 - 0.9 x 0.5 x (2, 0) = (-0.9, 0).
    # Divided by the 10 active nodes it would have moved w by 0.9 x 0.1 x 2 = 0.18: a
    # step 5x smaller, as under the edge profile with 100 nodes and 20 in flight.
    ids = list(range(10))
    opt = make_optimizer("fedcompass", [np.zeros(2, np.float32)], ids, lr=0.9, concurrency=2)
    opt.share_schedule(ArrivalGroups())
    assert opt.in_flight() == 2 and opt.weight(0) == 0.5
    assert opt.on_update(0, u(2, 0), 0, now=1.0) is Outcome.APPLIED
    np.testing.assert_allclose(opt.weights[0], [-0.9, 0.0], rtol=1e-6)
    # An update 3 versions stale: c = (1 + 3)^-0.5 / 2 = 0.25.
    assert opt.weight(3) == 0.25
    # A limit above the active nodes changes nothing: N = min(20, 10) = 10.
    loose = make_optimizer("fedcompass", [np.zeros(2, np.float32)], ids, lr=0.9, concurrency=20)
    assert loose.in_flight() == 10 and loose.weight(0) == pytest.approx(0.1)
    # No limit: N = |A| = 10; a node lost leaves 9.
    free = make_optimizer("fedcompass", [np.zeros(2, np.float32)], ids, lr=0.9)
    free.on_node_lost(9, now=0.0)
    assert free.in_flight() == 9


def test_the_engine_limit_reaches_the_rule_as_its_concurrency():
    # What the engine does with a strategy (ModelOptimizer calls its RuleSpec with the
    # engine's max_in_flight): a concurrency left None takes that limit.
    strategy = STRATEGIES["fedcompass"](client_mode="delta", engine=EngineSettings(max_in_flight=2))
    assert strategy.optimizer_params["concurrency"] is None
    ids = list(range(10))
    built = strategy.rule_spec([np.zeros(2, np.float32)], ids, 2)
    assert built.params["concurrency"] == 2 and built.weight(0) == 0.5
    # Given by the user it stays (RuleSpec's rule for every rule that declares it).
    spec = RuleSpec("fedcompass", {"lr": 0.9, "concurrency": 5})
    assert spec([np.zeros(2, np.float32)], ids, 2).in_flight() == 5
