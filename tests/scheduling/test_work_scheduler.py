"""Work scheduling's arithmetic, by hand: speeds, the equal-time assignment, FedNova's
weights, and a ClientApp that cannot take part."""

from __future__ import annotations

import math

import pytest

from flwr_gsgm.scheduling.speeds import NodeSpeeds
from flwr_gsgm.scheduling.work_scheduler import (
    WorkScheduler,
    equal_time_steps,
    normalisation_weight,
)


def test_equal_time_steps_of_three_nodes_at_a_target_of_4_seconds():
    # 4 s / 0.1 = 40, 4 / 0.2 = 20, 4 / 0.4 = 10 steps; own work 20 (bounds 5..80).
    assert [equal_time_steps(s, 4.0, 20) for s in (0.1, 0.2, 0.4)] == [40, 20, 10]


def test_equal_time_steps_stay_within_a_quarter_and_four_times_the_own_work():
    assert equal_time_steps(0.01, 4.0, 20) == 80  # 400 asked, 4 x 20 at most
    assert equal_time_steps(10.0, 4.0, 20) == 5  # 0.4 asked, ceil(20 / 4) at least
    assert equal_time_steps(10.0, 4.0, 1) == 1  # never below one step


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_equal_time_steps_refuse_a_bad_speed_naming_it(bad):
    with pytest.raises(ValueError, match="seconds_per_step must be a finite number > 0"):
        equal_time_steps(bad, 4.0, 20)


def test_normalisation_of_two_nodes_with_2_and_8_steps():
    # FedNova with equal weights: tau_eff = (2 + 8) / 2 = 5; d_i / tau_i * tau_eff,
    # one-sided: the 2-step update is not scaled up (5 / 2 = 2.5 -> 1).
    assert normalisation_weight(2, 5.0) == 1.0
    assert normalisation_weight(8, 5.0) == 0.625
    assert normalisation_weight(5, 5.0) == 1.0


def test_speeds_from_reported_seconds_are_smoothed_by_half():
    speeds = NodeSpeeds()
    speeds.observe(0, 20, train_seconds=2.0, total_seconds=3.0)  # 0.1 s/step, 1 s round trip
    speeds.observe(0, 10, train_seconds=3.0, total_seconds=4.0)  # 0.3 s/step
    assert speeds.seconds_per_step(0) == pytest.approx(0.5 * 0.1 + 0.5 * 0.3)
    assert speeds.round_trip() == 1.0


def test_a_node_that_reports_no_seconds_is_timed_less_the_measured_round_trip():
    speeds = NodeSpeeds()
    speeds.observe(0, 10, train_seconds=1.0, total_seconds=3.0)  # round trip 2 s
    speeds.observe(1, 10, train_seconds=None, total_seconds=7.0)  # (7 - 2) / 10
    assert speeds.seconds_per_step(1) == pytest.approx(0.5)
    speeds.observe(2, 10)  # nothing to measure
    assert speeds.seconds_per_step(2) is None


def _measured(scheduler: WorkScheduler, seconds: dict[int, float], own: int = 20) -> None:
    """Each node's first, unscheduled, reply: ``own`` steps in ``seconds[p]``."""
    for pid, secs in seconds.items():
        assert scheduler.on_reply(pid, None, own, secs, secs) == 1.0


def test_the_scheduler_gives_each_node_the_steps_of_the_median_nodes_time():
    scheduler = WorkScheduler("equal-time")
    assert scheduler.steps_for(0, [0, 1, 2]) is None  # nothing measured: own work
    _measured(scheduler, {0: 2.0, 1: 4.0, 2: 8.0})  # 0.1, 0.2 and 0.4 s per step
    assert scheduler.target_seconds([0, 1, 2]) == 4.0  # median of 2, 4 and 8 s
    assert [scheduler.steps_for(p, [0, 1, 2]) for p in (0, 1, 2)] == [40, 20, 10]
    # Their replies, each against the mean of every node's latest steps: node 0's 40
    # against (40 + 20 + 20) / 3, then node 2's 10 against (40 + 20 + 10) / 3.
    assert scheduler.on_reply(0, 40, 40, 4.0, 4.0) == pytest.approx((40 + 20 + 20) / 3 / 40)
    # 23.3 / 10 = 2.33 would scale the short update up; one-sided, it weighs 1.
    assert scheduler.on_reply(2, 10, 10, 4.0, 4.0) == 1.0


def test_the_target_is_at_least_the_round_trip():
    scheduler = WorkScheduler("equal-time")
    # 20 steps in 0.2 s, replies after 5.2 s: a 5 s round trip dwarfs the compute.
    scheduler.on_reply(0, None, 20, 0.2, 5.2)
    scheduler.on_reply(1, None, 20, 0.2, 5.2)
    assert scheduler.target_seconds([0, 1]) == 5.0
    assert scheduler.steps_for(0, [0, 1]) == 80  # 5 / 0.01 = 500, at most 4 x 20


def test_a_client_that_ignores_local_steps_turns_scheduling_off_once():
    scheduler = WorkScheduler("equal-time")
    _measured(scheduler, {0: 2.0, 1: 8.0})
    assert (
        scheduler.steps_for(1, [0, 1]) == 12
    )  # 5 s (median of 2 and 8) / 0.4 = 12.5, rounded to even
    weight = scheduler.on_reply(1, 12, 20, 8.0, 8.0)  # did its own 20
    assert weight == 1.0
    assert not scheduler.active
    assert scheduler.off_reason.startswith(
        "partition 1 did 20 local steps where 12 were asked: its ClientApp ignores local-steps"
    )
    assert scheduler.steps_for(0, [0, 1]) is None
    assert scheduler.describe().startswith("equal-time, turned off: partition 1 did 20")


def test_a_client_that_reports_no_steps_turns_scheduling_off():
    scheduler = WorkScheduler("equal-time")
    assert scheduler.on_reply(3, None, None, None, 6.0) == 1.0
    assert scheduler.off_reason.startswith("partition 3's reply reports no train-steps")


def test_off_schedules_nothing_and_weighs_one():
    scheduler = WorkScheduler("off")
    _measured(scheduler, {0: 2.0, 1: 8.0})
    assert scheduler.steps_for(0, [0, 1]) is None
    assert scheduler.describe() == "off"


def test_state_round_trips_and_refuses_another_policy():
    scheduler = WorkScheduler("equal-time")
    _measured(scheduler, {0: 2.0, 1: 8.0})
    again = WorkScheduler("equal-time")
    again.load_state_dict(scheduler.state_dict())
    assert again.steps_for(1, [0, 1]) == scheduler.steps_for(1, [0, 1])
    with pytest.raises(ValueError, match="the checkpoint's work-scheduling is 'equal-time'"):
        WorkScheduler("off").load_state_dict(scheduler.state_dict())


def test_an_unknown_policy_is_refused_naming_it():
    with pytest.raises(ValueError, match="work-scheduling 'fast' is unknown"):
        WorkScheduler("fast")
