"""The engine clock: what now, a budget and a message's finish time mean per clock."""

from __future__ import annotations

from flwr.app import ConfigRecord

from flwr_gsgm.engine import clock as clock_module
from flwr_gsgm.engine.clock import VirtualTime, WallTime, make_clock
from flwr_gsgm.engine.settings import EngineSettings
from flwr_gsgm.intake.dispatch import Dispatch
from flwr_gsgm.simulation.virtual_clock import VirtualClock

# No jitter, no slow set, no bytes charged: a message lasts steps x speed factor.
PLAIN = VirtualClock(seed=1, jitter=0.0, slow_fraction=0.0)


def dispatch(v_finish: float) -> Dispatch:
    return Dispatch(v_finish, 0, partition_id=0, base_version=0, config={})


def test_make_clock_picks_the_clock_from_the_settings():
    virtual = make_clock(EngineSettings(virtual_clock=PLAIN, max_seconds=9.0))
    wall = make_clock(EngineSettings())
    assert isinstance(virtual, VirtualTime) and virtual.virtual and virtual.max_seconds == 9.0
    assert isinstance(wall, WallTime) and not wall.virtual and wall.max_seconds is None


def test_virtual_time_moves_only_at_a_reply_or_a_jump_and_never_back():
    clock = VirtualTime(PLAIN, max_seconds=4.0)
    assert clock.now() == 0.0
    assert clock.at_reply(dispatch(3.5)) == 3.5
    assert clock.at_reply(dispatch(2.0)) == 3.5  # an earlier finish does not move it back
    assert clock.jump_to(3.0) and clock.now() == 3.5
    assert not clock.out_of_time()  # between replies a virtual budget never runs out
    assert clock.time_left()  # 3.5 < 4
    assert not clock.too_late(dispatch(4.0)) and clock.too_late(dispatch(4.25))
    assert clock.jump_to(4.0) and clock.now() == 4.0 and not clock.time_left()
    assert clock.state_dict() == {"clock_now": 4.0}
    other = VirtualTime(PLAIN)
    other.load_state_dict({"clock_now": 12.5})
    assert other.now() == 12.5


def test_virtual_time_charges_the_server_each_reply_one_at_a_time():
    clock = VirtualTime(VirtualClock(seed=1, jitter=0.0, slow_fraction=0.0, server_seconds=0.5))
    # a reply reaching an idle server is handled 0.5 s later
    assert clock.at_reply(dispatch(3.0)) == 3.5
    # two replies that finished together at 4.0: the second waits for the first
    assert clock.at_reply(dispatch(4.0)) == 4.5
    assert clock.at_reply(dispatch(4.0)) == 5.0
    # one that finished while the server was busy waits too
    assert clock.at_reply(dispatch(4.75)) == 5.5
    assert clock.too_late(dispatch(4.0)) is False  # the budget reads the finish time


def test_virtual_message_seconds_count_the_wait_for_the_server_as_wall_time_does():
    clock = VirtualTime(VirtualClock(seed=1, jitter=0.0, slow_fraction=0.0, server_seconds=0.5))
    sent = [Dispatch(4.0, i, partition_id=i, base_version=0, config={}) for i in range(3)]
    for d in sent:
        d.config["virtual-duration"] = 1.5  # sent at 2.5, finished at 4.0
    # handled at 4.5, 5.0, 5.5: 1.5 s of message, then 0.5, 1.0 and 1.5 s at the server
    assert [(clock.at_reply(d), clock.message_seconds(d)) for d in sent] == [
        (4.5, 2.0),
        (5.0, 2.5),
        (5.5, 3.0),
    ]
    # no server cost: the drawn duration, the same float
    plain = VirtualTime(PLAIN)
    d = Dispatch(0.1 + 0.2, 0, partition_id=0, base_version=0, config={"virtual-duration": 0.3})
    plain.at_reply(d)
    assert plain.message_seconds(d) == 0.3
    assert plain.message_seconds(dispatch(1.0)) is None  # not stamped: unknown


def test_virtual_stamp_draws_the_duration_of_the_messages_work():
    clock = VirtualTime(PLAIN)
    clock.jump_to(10.0)
    config = ConfigRecord({"mode": "gradient", "local-batches": 3})
    # 3 batches of work at 1 s each, on a node 2x slower: 6 s, finishing at 16 s.
    assert clock.stamp(config, speed=2.0, pid=0, index=0, message_bytes=0) == 16.0
    assert config["virtual-duration"] == 6.0
    assert clock.speed_factors(3) == {0: 1.0, 1: 1.0, 2: 1.0}


def test_wall_time_is_seconds_since_the_start_and_its_budget_runs_out_between_replies(
    monkeypatch,
):
    now = {"t": 100.0}
    monkeypatch.setattr(clock_module.time, "monotonic", lambda: now["t"])
    clock = WallTime(max_seconds=2.5)
    clock.start()
    now["t"] = 102.0
    assert clock.now() == clock.wall() == 2.0
    assert clock.at_reply(dispatch(0.0)) == 2.0  # a reply's time is its arrival
    assert not clock.too_late(dispatch(99.0)) and not clock.out_of_time()
    now["t"] = 103.0
    assert clock.out_of_time() and not clock.time_left()
    assert not clock.jump_to(50.0) and clock.now() == 3.0  # wall time cannot jump
    config = ConfigRecord({"mode": "gradient"})
    assert clock.stamp(config, speed=1.0, pid=0, index=0, message_bytes=8) == 0.0
    assert "virtual-duration" not in config
    assert clock.speed_factors(4) == {}
    clock.load_state_dict({"clock_now": 500.0})  # a resumed run counts from its own start
    assert clock.now() == 3.0


def test_without_a_budget_no_clock_runs_out(monkeypatch):
    monkeypatch.setattr(clock_module.time, "monotonic", lambda: 1e9)
    for clock in (VirtualTime(PLAIN), WallTime()):
        assert clock.time_left() and not clock.out_of_time()
        assert not clock.too_late(dispatch(1e12))
