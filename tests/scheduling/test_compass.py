"""FedCompass's step assignment by hand: 3 nodes at 0.1, 0.2 and 0.4 s per step form a
group, create groups and join them (APPFL's CompassScheduler rules), and the book of
arrival groups the scheduler shares with the rule. The speed and Q bounds as APPFL's
(whole-message seconds per step, absolute min/max local steps):
tests/scheduling/test_compass_appfl.py."""

from __future__ import annotations

import pytest

from flwr_gsgm.core import fedcompass
from flwr_gsgm.scheduling import compass
from flwr_gsgm.scheduling.compass import ArrivalGroups, CompassScheduler

SPEEDS = {0: 0.1, 1: 0.2, 2: 0.4}  # seconds per step


def measured() -> CompassScheduler:
    """Q_min = 4 and Q_max = 20 steps, given (the defaults are APPFL's 20 and 100: these
    smaller bounds, the former own-work-relative ones of a 20-step node, keep the
    hand-computed sequences short), lambda 1.5; each node's first reply of 20 steps
    takes 20 s_i from sending to reply (no communication), so s_i = 20 s_i / 20."""
    sched = CompassScheduler(min_local_steps=4, max_local_steps=20, latest_factor=1.5)
    for pid, s in SPEEDS.items():
        assert sched.on_reply(pid, None, 20, 20 * s, 20 * s) == 1.0  # no step weighting
    assert (sched.min_local_steps, sched.max_local_steps) == (4, 20)
    return sched


def group_of(sched: CompassScheduler, pid: int) -> tuple[float, float]:
    g = sched.book.groups[sched.book.member_of[pid]]
    return pytest.approx(g.expected), pytest.approx(g.latest)


def test_three_nodes_sent_work_together_form_one_group():
    sched = measured()
    # t = 0: no group, node 0 creates one with Q_max = 20 steps: E = 2 s, L = 0 + 1.5 * 2.
    assert sched.steps_for(0, [0, 1, 2], now=0.0) == 20
    assert group_of(sched, 0) == (2.0, 3.0)
    # Nodes 1 and 2 join it: floor(2 / 0.2) = 10 and floor(2 / 0.4) = 5, in [4, 20].
    assert sched.steps_for(1, [0, 1, 2], now=0.0) == 10
    assert sched.steps_for(2, [0, 1, 2], now=0.0) == 5
    assert sched.book.member_of == {0: 0, 1: 0, 2: 0}
    assert sched.book.groups[0].pending == [0, 1, 2]


def test_a_node_that_cannot_join_creates_a_group_timed_by_the_fastest_member():
    sched = measured()
    assert sched.steps_for(0, [0, 1, 2], now=0.0) == 20  # group 0: E = 2, L = 3
    assert sched.steps_for(1, [0, 1, 2], now=0.0) == 10  # joins group 0
    # t = 1: node 2 would get floor((2 - 1) / 0.4) = 2 < Q_min steps in group 0. It
    # creates group 1, timed for group 0's fastest member (node 0, 0.1 s) sent again at
    # L = 3 with Q_max: back at 3 + 20 * 0.1 = 5, so floor((5 - 1) / 0.4) = 10 steps:
    # E = 1 + 4 = 5, L = 1 + 1.5 * 4 = 7.
    assert sched.steps_for(2, [0, 1, 2], now=1.0) == 10
    assert sched.book.member_of[2] == 1
    assert group_of(sched, 2) == (5.0, 7.0)
    # t = 2: group 0 is back (the rule aggregates and closes it).
    for pid in (0, 1):
        assert sched.book.arrive(pid, 2.0) == (compass.GROUP, 0)
    assert sched.book.due(2.0) == [0] and sched.book.close(0) == [0, 1]
    # Node 0 (released first: the fastest) cannot join group 1: floor(3 / 0.1) = 30 >
    # Q_max. Creating: group 1's fastest member, node 2, back from Q_max at
    # 7 + 20 * 0.4 = 15 would need floor(13 / 0.1) = 130 > Q_max steps: none fits, so
    # Q_max = 20: group 2 with E = 4, L = 5.
    assert sched.ready([1, 0]) == [0, 1]
    assert sched.steps_for(0, [0, 1, 2], now=2.0) == 20
    assert sched.book.member_of[0] == 2 and group_of(sched, 0) == (4.0, 5.0)
    # Node 1 can join both: group 1 with floor(3 / 0.2) = 15 steps, group 2 with
    # floor(2 / 0.2) = 10: it joins the one with the most steps.
    assert sched.steps_for(1, [0, 1, 2], now=2.0) == 15
    assert sched.book.member_of[1] == 1 and sched.book.groups[1].pending == [2, 1]


def test_a_member_holds_until_its_group_is_aggregated_and_late_arrivals_are_late():
    sched = measured()
    sched.steps_for(0, [0, 1, 2], now=0.0)  # group 0: E = 2, L = 3
    sched.steps_for(1, [0, 1, 2], now=0.0)
    assert sched.book.arrive(0, 2.0) == (compass.GROUP, 0)
    assert sched.book.holds(0) and sched.ready([0, 2]) == [2]
    assert sched.book.due(2.5) == []  # node 1 still out, deadline not passed
    assert sched.book.due(3.5) == [0]  # the deadline passed with node 0 back
    assert sched.book.close(0) == [0] and not sched.book.holds(0)
    assert sched.book.arrive(1, 3.5) == (compass.LATE, None)
    assert sched.book.groups == {}  # closed and nobody out: forgotten
    assert sched.book.arrive(2, 3.5) == (compass.SINGLE, None)  # never scheduled


def test_the_first_message_carries_the_own_work_and_a_silent_client_turns_it_off():
    sched = CompassScheduler()
    assert sched.steps_for(0, [0], now=0.0) is None  # speed unknown: the run's own work
    sched.on_reply(0, None, 20, 2.0, 2.0)
    # No group open: the first group gets Q_max, APPFL's default 100 steps (before the
    # Q bounds were absolute, Q_max was the node's own work, 20).
    assert sched.steps_for(0, [0], now=2.0) == 100
    assert sched.on_reply(0, 20, None) == 1.0  # no train-steps
    assert not sched.active and "FedBuff-like" in sched.off_reason
    assert sched.book.enabled is False
    assert sched.book.due(0.0) == []  # group 0: nobody back, closed
    assert sched.steps_for(0, [0], now=4.0) is None
    assert sched.book.arrive(0, 4.0) == (compass.OFF, None)


def test_the_whole_message_time_is_the_speed():
    # Replaces the round trip test: a message is no longer predicted as round trip +
    # steps x training seconds per step, but as steps x (whole seconds / steps), APPFL's.
    sched = CompassScheduler()
    sched.on_reply(0, None, 20, 2.0, 3.0)  # 2 s training, 3 s from sending to reply
    assert sched.speeds.seconds_per_step(0) == pytest.approx(3.0 / 20)
    assert sched.steps_for(0, [0], now=0.0) == 100  # Q_max: E = 100 x 0.15, L = 1.5 E
    assert group_of(sched, 0) == (15.0, 22.5)


def test_checkpoint_restores_the_groups_in_the_shared_book():
    sched = measured()
    sched.steps_for(0, [0, 1, 2], now=0.0)
    sched.steps_for(1, [0, 1, 2], now=0.0)
    sched.book.arrive(0, 2.0)
    state = sched.state_dict()
    other = measured()
    book = other.book
    other.load_state_dict(state)
    assert other.book is book  # the rule keeps the same object
    assert other.book.state_dict() == sched.book.state_dict()
    assert other.book.holds(0) and other.book.member_of == {1: 0}


def test_bad_parameters_are_named():
    with pytest.raises(
        ValueError, match=r"min_local_steps \(2\) must be at most max_local_steps \(1\)"
    ):
        CompassScheduler(min_local_steps=2, max_local_steps=1)
    with pytest.raises(ValueError, match="lambda"):
        CompassScheduler(latest_factor=0.5)


def test_the_rule_and_the_book_name_arrivals_alike():
    assert (fedcompass.GROUP, fedcompass.LATE, fedcompass.SINGLE, fedcompass.OFF) == (
        compass.GROUP,
        compass.LATE,
        compass.SINGLE,
        compass.OFF,
    )
    assert isinstance(ArrivalGroups(), ArrivalGroups)
