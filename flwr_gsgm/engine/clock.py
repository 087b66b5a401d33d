"""The engine clock: virtual seconds in simulation, wall seconds in deployment.

One object answers every question the engine and its parts ask of time, so that
none of them tests which clock it runs under (:func:`make_clock` is the one place
that picks it):

- :meth:`Clock.now`: the engine time in seconds: the core's ``now``, the end of a
  node's back-off, the ``virtual_time`` column of ``metrics.csv`` and
  ``virtual_seconds`` of ``summary.json``; :meth:`Clock.wall` the wall seconds since
  the start (``wall_time``);
- :attr:`Clock.virtual`: whether time is virtual: replies are then applied in order
  of virtual finish time (:class:`~flwr_gsgm.engine.in_flight.InFlight`), else in
  arrival order;
- an in-flight message's finish time: :meth:`Clock.stamp` when it is sent (virtual:
  drawn from the time model, so it is known before the reply arrives; wall: unknown),
  :meth:`Clock.at_reply` when its reply is handled;
- what a budget in seconds (``max-seconds``) means: :meth:`Clock.out_of_time`
  between replies, :meth:`Clock.too_late` for a reply, :meth:`Clock.time_left` for a
  new dispatch.

Under :class:`VirtualTime` time moves only at a reply (to its virtual finish time,
never back) or when the engine, with nothing in flight, jumps to the end of a
back-off (:meth:`Clock.jump_to`); a run is then reproducible whatever the machine's
load. Under :class:`WallTime` it is ``time.monotonic()`` since :meth:`Clock.start`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from logging import INFO
from typing import TYPE_CHECKING, Any, ClassVar

from flwr.app import ConfigRecord
from flwr.common.logger import log

from flwr_gsgm.simulation.virtual_clock import VirtualClock

if TYPE_CHECKING:
    from flwr_gsgm.engine.settings import EngineSettings
    from flwr_gsgm.intake.dispatch import Dispatch

__all__ = ["Clock", "VirtualTime", "WallTime", "make_clock"]


class Clock(ABC):
    """The engine clock (see the module docstring); ``max_seconds`` is the run's time
    budget in seconds of this clock (None: no time budget)."""

    #: True: virtual seconds of the time model; False: wall seconds.
    virtual: ClassVar[bool]

    def __init__(self, max_seconds: float | None = None) -> None:
        self.max_seconds = max_seconds
        self._t0 = time.monotonic()

    def start(self) -> None:
        """The run starts now: :meth:`wall` (and :class:`WallTime`'s :meth:`now`) count
        from here."""
        self._t0 = time.monotonic()

    def wall(self) -> float:
        """Wall seconds since :meth:`start`."""
        return time.monotonic() - self._t0

    def past_budget(self, t: float) -> bool:
        """True if engine time ``t`` (s) is past the budget (never without one)."""
        return self.max_seconds is not None and t > self.max_seconds

    def time_left(self) -> bool:
        """True if a dispatch sent now may still count: the budget is not reached."""
        return self.max_seconds is None or self.now() < self.max_seconds

    @abstractmethod
    def now(self) -> float:
        """The engine time in seconds."""

    @abstractmethod
    def at_reply(self, dispatch: Dispatch) -> float:
        """The engine time at which ``dispatch``'s reply is handled (the clock moves to it)."""

    @abstractmethod
    def too_late(self, dispatch: Dispatch) -> bool:
        """True if ``dispatch``'s reply, next in line, finishes past the budget: the
        run's time is spent and work still in flight is not applied."""

    @abstractmethod
    def out_of_time(self) -> bool:
        """True if the budget has run out between replies."""

    @abstractmethod
    def jump_to(self, t: float) -> bool:
        """With nothing in flight, move the clock to engine time ``t`` (a back-off's
        end); True if it moved there, False if time cannot jump (the engine waits)."""

    @abstractmethod
    def stamp(
        self, config: ConfigRecord, speed: float, pid: int, index: int, message_bytes: int
    ) -> float:
        """The finish time of a train message being sent (0.0 if unknown before its
        reply); under the virtual clock it also sets ``config["virtual-duration"]``
        and its compute part, ``config["virtual-train-seconds"]`` (what the simulated
        device reports as ``train-seconds``).

        ``speed`` is the node's speed factor, ``index`` the partition's dispatch
        counter, ``message_bytes`` the bytes of the weights sent (the reply is as
        large); ``config`` is the message's train config (its local work).
        """

    @abstractmethod
    def message_seconds(self, dispatch: Dispatch) -> float | None:
        """Seconds from ``dispatch``'s sending to its reply (being handled now)."""

    def start_fleet(
        self, speeds: dict[int, float], config: ConfigRecord, message_bytes: int
    ) -> None:
        """The fleet is known (the time model may size its availability by it): nothing
        under wall time."""
        del speeds, config, message_bytes

    def charge_dispatch(self, dispatch: Dispatch) -> None:
        """A message's work is done: its energy counts (the time model's; nothing here)."""
        del dispatch

    def joules(self) -> float | None:
        """The fleet's joules so far (the time model's power; None here)."""
        return None

    def offline_until(self, pid: int) -> float | None:
        """If partition ``pid`` is offline now, when it is online again (engine seconds,
        ``inf``: never); None if it is online. Only the time model knows (a
        deployment's offline nodes are not among the grid's nodes): None here."""
        del pid
        return None

    def loss(self, pid: int, finish: float) -> tuple[float, float] | None:
        """Whether a train message sent to ``pid`` now, finishing at ``finish``, is lost
        with its node: ``(known_at, back_at)`` (when the server learns the node went
        offline, when it is back), or None. Only the time model knows (a deployment
        learns of a loss from Flower's error reply or the dispatch timeout): None here."""
        del pid, finish
        return None

    @abstractmethod
    def speed_factors(self, num_partitions: int) -> dict[int, float]:
        """Each partition's speed factor (1.0 for a partition not listed)."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The clock's checkpoint entries (``clock_now``: the engine time)."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (from a checkpoint's top-level entries)."""


class VirtualTime(Clock):
    """Virtual seconds of the seeded time model ``model`` (a simulation).

    Each dispatch's duration is drawn when it is sent (:meth:`stamp`: its local work
    read from the train config, ``mode``, ``batch-size``, ``local-batches``,
    ``local-steps``, ``local-epochs``, and the bytes sent,
    :meth:`VirtualClock.duration <flwr_gsgm.simulation.virtual_clock.VirtualClock.duration>`).
    A budget is spent by the first reply that finishes past it.
    """

    virtual = True

    def __init__(self, model: VirtualClock, max_seconds: float | None = None) -> None:
        super().__init__(max_seconds)
        self.model = model
        self._now = 0.0
        # Who is online when; a model that counts in rounds of the fleet gets it from
        # start_fleet (until then every node is online).
        self.online = model.availability_of() if not model.counts_in_rounds else None
        # Energy (with a device-power model): nodes powered, joules above idling.
        self.nodes = 0
        self.message_joules = 0.0

    def charge(self, compute_seconds: float, communication_seconds: float) -> None:
        """A message's work is done (handled, or lost with its node): its joules above
        idling count (:meth:`Power.message_joules
        <flwr_gsgm.simulation.power.Power.message_joules>`); nothing without a power model."""
        power = self.model.power
        if power is not None:
            self.message_joules += power.message_joules(compute_seconds, communication_seconds)

    def charge_dispatch(self, dispatch: Dispatch) -> None:
        """:meth:`charge` the message of ``dispatch`` (its drawn compute and duration)."""
        duration = dispatch.config.get("virtual-duration")
        compute = dispatch.config.get("virtual-train-seconds")
        if duration is not None and compute is not None:
            self.charge(float(compute), float(duration) - float(compute))

    def joules(self) -> float | None:
        """The fleet's joules so far (docs/GSGM.md, "Time model"): every node idling
        since the start plus each message's joules above idling; None without a power
        model."""
        power = self.model.power
        if power is None:
            return None
        return power.idle_watts * self.nodes * self._now + self.message_joules

    def start_fleet(
        self, speeds: dict[int, float], config: ConfigRecord, message_bytes: int
    ) -> None:
        """The fleet is known: ``speeds`` (partition-id -> speed factor), the run's
        train ``config`` (its work) and the model's bytes. An availability model that
        counts in rounds of the fleet takes its round from them: the median node's
        message (:meth:`VirtualClock.round_seconds`), logged. The nodes are the ones
        the energy counts as powered."""
        self.nodes = len(speeds)
        if not self.model.counts_in_rounds:
            return
        seconds = [
            self.model.message_seconds(speed, pid, self.work_steps(pid, config), message_bytes)
            for pid, speed in sorted(speeds.items())
        ]
        round_seconds = self.model.round_seconds(seconds)
        self.online = self.model.availability_of(round_seconds)
        assert self.online.model is not None
        log(
            INFO,
            "[clock] availability %s: a round of the fleet is %.3g s (the median node's "
            "message); mean online %.4g s, mean offline %.4g s",
            self.model.availability,
            round_seconds,
            self.online.model.mean_online_seconds,
            self.online.model.mean_offline_seconds,
        )

    def now(self) -> float:
        return self._now

    def at_reply(self, dispatch: Dispatch) -> float:
        # The reply waits for the server to be free, then costs it the model's seconds
        # per reply (VirtualClock.serve); replies come here in order of finish.
        self._now = self.model.serve(self._now, (dispatch.v_finish,))
        return self._now

    def too_late(self, dispatch: Dispatch) -> bool:
        return self.past_budget(dispatch.v_finish)

    def out_of_time(self) -> bool:
        return False  # virtual time moves only at a reply, which too_late checks

    def jump_to(self, t: float) -> bool:
        self._now = max(self._now, t)
        return True

    def stamp(
        self, config: ConfigRecord, speed: float, pid: int, index: int, message_bytes: int
    ) -> float:
        """See :meth:`Clock.stamp`.

        Raises
        ------
        ValueError
            Epoch work (``local-epochs`` > 0) without the partition's example count
            (:meth:`VirtualClock.work_steps`).
        """
        steps = self.work_steps(pid, config)
        # duration() is compute + communication: the same floats, with the compute
        # part sent too, as the seconds a simulated device would report training.
        compute = self.model.compute_seconds(speed, pid, index, steps)
        duration = compute + self.model.communication_seconds(pid, index, message_bytes)
        config["virtual-duration"] = duration
        config["virtual-train-seconds"] = compute
        return self._now + duration

    def work_steps(self, pid: int, config: ConfigRecord) -> int:
        """Steps of local work ``config`` asks of partition ``pid`` (absent keys:
        gradient mode, one batch or step of 32, no epochs), as the time model counts them."""
        return self.model.work_steps(
            pid,
            str(config.get("mode", "gradient")),
            batch_size=int(config.get("batch-size", 32)),
            local_batches=int(config.get("local-batches", 1)),
            local_steps=int(config.get("local-steps", 1)),
            local_epochs=int(config.get("local-epochs", 0)),
        )

    def offline_until(self, pid: int) -> float | None:
        online = self.online
        if online is None or online.always or online.online(pid, self._now):
            return None
        return online.online_from(pid, self._now)

    def loss(self, pid: int, finish: float) -> tuple[float, float] | None:
        if self.online is None:
            return None
        lost = self.online.loss(pid, self._now, finish)
        if lost is None:
            return None
        # The server learns of the loss once Flower would: offline_detection_seconds
        # after the node went (its heartbeat expired).
        lost_at, back_at = lost
        return lost_at + self.model.offline_detection_seconds, back_at

    def message_seconds(self, dispatch: Dispatch) -> float | None:
        # What a deployment measures (WallTime): from sending to the reply's handling,
        # so the wait for a busy server counts, as the schedulers that read it
        # (FedCompass's deadlines, work scheduling's round trips) would see it deployed.
        # Written as duration + wait so that with no server cost it is the duration,
        # the same float.
        duration = dispatch.config.get("virtual-duration")
        if duration is None:
            return None
        return float(duration) + (self._now - dispatch.v_finish)

    def speed_factors(self, num_partitions: int) -> dict[int, float]:
        return self.model.speed_factors(list(range(num_partitions)))

    def state_dict(self) -> dict[str, Any]:
        energy = {"message_joules": self.message_joules} if self.model.power else {}
        return {"clock_now": self._now, **energy}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._now = state["clock_now"]
        self.message_joules = float(state.get("message_joules", 0.0))


class WallTime(Clock):
    """Wall seconds since the start (a deployment): replies in arrival order.

    A message's finish time is its arrival; the budget is spent once the wall time
    since the start passes it, checked on every turn of the loop. A resumed run counts
    from its own start (as its ``max-seconds`` budget does).
    """

    virtual = False

    def now(self) -> float:
        return self.wall()

    def at_reply(self, dispatch: Dispatch) -> float:
        return self.wall()

    def too_late(self, dispatch: Dispatch) -> bool:
        return False  # its finish time is its arrival: out_of_time checks the budget

    def out_of_time(self) -> bool:
        return self.past_budget(self.wall())

    def jump_to(self, t: float) -> bool:
        return False  # wall time does not jump: the engine waits for it

    def stamp(
        self, config: ConfigRecord, speed: float, pid: int, index: int, message_bytes: int
    ) -> float:
        return 0.0  # known when the reply arrives

    def message_seconds(self, dispatch: Dispatch) -> float | None:
        return time.monotonic() - dispatch.sent_at if dispatch.sent_at else None

    def speed_factors(self, num_partitions: int) -> dict[int, float]:
        return {}  # real devices: no simulated speed

    def state_dict(self) -> dict[str, Any]:
        return {"clock_now": self.now()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state  # wall time goes on from this start


def make_clock(settings: EngineSettings) -> Clock:
    """The engine clock of ``settings``, the one place that picks it: :class:`VirtualTime`
    over ``settings.virtual_clock`` (see :attr:`EngineSettings.virtual`), or, without
    one, :class:`WallTime`; the time budget is ``settings.max_seconds``."""
    if settings.virtual_clock is None:
        return WallTime(settings.max_seconds)
    return VirtualTime(settings.virtual_clock, settings.max_seconds)
