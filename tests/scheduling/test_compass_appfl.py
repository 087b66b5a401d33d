"""FedCompass's scheduler as APPFL's, by hand: a node's seconds per step is its whole
message's time over its steps (``CompassScheduler._record_info``), so a node whose
round trip dwarfs its compute joins a group; the join / create formulas
(``_join_group``, ``_create_group``) on those speeds; the speed momentum; and Q_min /
Q_max as absolute step counts with APPFL's defaults (its example configurations,
``examples/resources/configs/mnist/server_fedcompass.yaml``: ``min_local_steps: 20``,
``max_local_steps: 100``), a bad value refused by name."""

from __future__ import annotations

import numpy as np
import pytest

from flwr_gsgm.config.build import build_strategy
from flwr_gsgm.config.run_config import RUN_CONFIG, parse_run_config
from flwr_gsgm.core import declared_params, make_optimizer
from flwr_gsgm.scheduling.compass import CompassScheduler


def group_of(sched: CompassScheduler, pid: int) -> tuple[float, float]:
    g = sched.book.groups[sched.book.member_of[pid]]
    return pytest.approx(g.expected), pytest.approx(g.latest)


def loopback_like() -> CompassScheduler:
    """APPFL's defaults (Q_min 20, Q_max 100, lambda 1.5, momentum 0.9). Three nodes
    whose first message (20 steps, sent at t = 0) is mostly communication, as under
    this repository's ``loopback`` profile (a 7 s round trip, 0.34 s for 19 steps):

    ======  ==============  ==========================  =====================
    node    training (s)    sending to reply (s), at t   s_i = whole / 20
    ======  ==============  ==========================  =====================
    0       0.4             8.0                          0.4
    2       1.6             9.0                          0.45
    1       0.8             10.0                         0.5
    ======  ==============  ==========================  =====================
    """
    sched = CompassScheduler()
    for pid, train, total in ((0, 0.4, 8.0), (2, 1.6, 9.0), (1, 0.8, 10.0)):
        assert sched.on_reply(pid, None, 20, train, total) == 1.0
    assert [sched.speeds.seconds_per_step(p) for p in (0, 1, 2)] == pytest.approx([0.4, 0.5, 0.45])
    return sched


def test_a_node_whose_round_trip_dwarfs_its_compute_joins_a_group_as_appfl_would():
    sched = loopback_like()
    # t = 8, node 0 back, no group: APPFL _assign_group's first group, max_local_steps
    # = 100 steps; expected = 8 + 100 x 0.4 = 48, latest = 8 + 100 x 0.4 x 1.5 = 68.
    assert sched.steps_for(0, [0, 1, 2], now=8.0) == 100
    assert group_of(sched, 0) == (48.0, 68.0)
    # t = 9, node 2 (0.45 s per step): APPFL _join_group, floor((48 - 9) / 0.45) =
    # floor(86.67) = 86 in [20, 100]: it joins group 0 with 86 steps.
    # (The former prediction, round trip + steps x training seconds per step, put
    # group 0 at 8 + 7.6 + 100 x 0.02 = 17.6 and gave node 2
    # floor((17.6 - 9 - 7.4) / 0.08) = 15 < Q_min steps: a group of its own, and so
    # for every node: FedAsync in effect.)
    assert sched.steps_for(2, [0, 1, 2], now=9.0) == 86
    # t = 10, node 1 (0.5 s per step): floor((48 - 10) / 0.5) = 76: joins too.
    assert sched.steps_for(1, [0, 1, 2], now=10.0) == 76
    assert sched.book.member_of == {0: 0, 2: 0, 1: 0}
    assert sched.book.groups[0].pending == [0, 2, 1]


def test_a_node_that_cannot_join_creates_a_group_timed_by_the_fastest_member():
    sched = loopback_like()
    for pid, now in ((0, 8.0), (2, 9.0), (1, 10.0)):
        sched.steps_for(pid, [0, 1, 2, 3, 4, 5], now=now)  # group 0: E = 48, L = 68
    # Node 3: 20 steps in 40 s from sending to reply: 2.0 s per step.
    sched.on_reply(3, None, 20, 4.0, 40.0)
    # t = 20: joining group 0 gives floor((48 - 20) / 2) = 14 < 20 steps. APPFL
    # _create_group: group 0 (20 < L = 68), its fastest member node 0 (0.4 s) sent
    # again at L with max_local_steps is back at est = 68 + 0.4 x 100 = 108; node 3
    # gets floor((108 - 20) / 2) = 44 <= 100 steps; expected = 20 + 44 x 2 = 108,
    # latest = 20 + 88 x 1.5 = 152.
    assert sched.steps_for(3, [0, 1, 2, 3], now=20.0) == 44
    assert sched.book.member_of[3] == 1 and group_of(sched, 3) == (108.0, 152.0)
    # Node 4 at 1.0 s per step, t = 30: group 0 gives floor(18 / 1) = 18 < 20, group 1
    # floor((108 - 30) / 1) = 78 in [20, 100]: it joins group 1.
    sched.on_reply(4, None, 20, 2.0, 20.0)
    assert sched.steps_for(4, [0, 1, 2, 3, 4], now=30.0) == 78
    assert sched.book.groups[1].pending == [3, 4]
    # Node 5 at 10 s per step, t = 60: no join (floor(-12 / 10) < 0 and
    # floor(48 / 10) = 4 < 20). Creating: group 0 (60 < 68) gives floor((108 - 60) /
    # 10) = 4; group 1 (60 < 152), fastest node 4 at 1.0 s: est = 152 + 100 = 252,
    # floor(192 / 10) = 19; the largest, 19 < min_local_steps, is raised to 20:
    # expected = 60 + 200 = 260, latest = 60 + 300 = 360.
    sched.on_reply(5, None, 20, 20.0, 200.0)
    assert sched.steps_for(5, [0, 1, 2, 3, 4, 5], now=60.0) == 20
    assert group_of(sched, 5) == (260.0, 360.0)


def test_the_speed_is_smoothed_with_appfl_speed_momentum():
    sched = loopback_like()
    # Node 2's 86 steps come back 43 s after sending: 0.5 s per step. APPFL: speed =
    # (1 - 0.9) x 0.45 + 0.9 x 0.5 = 0.045 + 0.45 = 0.495.
    sched.on_reply(2, 86, 86, 1.72, 43.0)
    assert sched.speeds.seconds_per_step(2) == pytest.approx(0.495)
    # A clock that cannot time a message: the reported training seconds stand in.
    other = CompassScheduler(smoothing=0.5)
    other.on_reply(7, None, 10, 3.0, None)
    other.on_reply(7, 100, 100, 20.0, None)
    assert other.speeds.seconds_per_step(7) == pytest.approx(0.5 * 0.3 + 0.5 * 0.2)


def test_q_bounds_are_appfl_step_counts_in_every_layer():
    # APPFL's example configurations: min_local_steps 20, max_local_steps 100.
    assert (CompassScheduler().min_local_steps, CompassScheduler().max_local_steps) == (20, 100)
    declared = {p.name: p for p in declared_params("fedcompass")}
    assert (declared["min_local_steps"].default, declared["max_local_steps"].default) == (20, 100)
    assert declared["min_local_steps"].run_config_key == "fedcompass-min-local-steps"
    assert declared["max_local_steps"].run_config_key == "fedcompass-max-local-steps"
    assert RUN_CONFIG["fedcompass-min-local-steps"].default == 20
    assert RUN_CONFIG["fedcompass-max-local-steps"].default == 100
    # The run config's values reach the scheduler the engine builds from the rule.
    cfg = parse_run_config(
        {
            "strategy": "fedcompass",
            "client-mode": "delta",
            "fedcompass-min-local-steps": 5,
            "fedcompass-max-local-steps": 50,
        }
    )
    params = build_strategy(cfg).optimizer_params
    rule = make_optimizer("fedcompass", [np.zeros(2, np.float32)], [0], **params)
    sched = CompassScheduler(**rule.schedule_params())
    assert (sched.min_local_steps, sched.max_local_steps) == (5, 50)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_local_steps": 0}, r"min_local_steps must be an integer .*>= 1, got 0$"),
        ({"max_local_steps": -5}, r"max_local_steps must be an integer .*>= 1, got -5$"),
        ({"max_local_steps": 2.5}, r"max_local_steps must be an integer .*, got 2\.5$"),
        ({"min_local_steps": True}, r"min_local_steps must be an integer .*, got True$"),
        (
            {"min_local_steps": 120},
            r"min_local_steps \(120\) must be at most max_local_steps \(100\)",
        ),
    ],
)
def test_bad_q_bounds_are_refused_naming_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CompassScheduler(**kwargs)


def test_bad_q_bounds_are_refused_by_the_rule_and_the_run_config():
    weights = [np.zeros(2, np.float32)]
    with pytest.raises(ValueError, match=r"min_local_steps must be >= 1, got 0"):
        make_optimizer("fedcompass", weights, [0], lr=0.9, min_local_steps=0)
    with pytest.raises(ValueError, match=r"max_local_steps must be an integer, got 2\.5"):
        make_optimizer("fedcompass", weights, [0], lr=0.9, max_local_steps=2.5)
    with pytest.raises(ValueError, match=r"min_local_steps \(30\) must be at most"):
        make_optimizer("fedcompass", weights, [0], lr=0.9, min_local_steps=30, max_local_steps=25)
    with pytest.raises(ValueError, match=r"fedcompass-max-local-steps=0: expected an integer"):
        parse_run_config({"strategy": "fedcompass", "fedcompass-max-local-steps": 0})
