"""FedCompass's COMPASS scheduler: local steps that make groups of nodes arrive together.

Reference:
    Z. Li, P. Chaturvedi, S. He, H. Chen, G. Singh, V. Kindratenko, E. A. Huerta,
    K. Kim, R. Madduri, "FedCompass: Efficient Cross-Silo Federated Learning on
    Heterogeneous Client Devices Using a Computing Power-Aware Scheduler", ICLR 2024,
    arXiv 2309.14675 (Algorithm 1); APPFL's ``CompassScheduler``
    (github.com/APPFL/APPFL, ``src/appfl/scheduler/compass_scheduler.py``), whose
    formulas this module follows line for line; the defaults are its example
    configurations' (``examples/resources/configs/mnist/server_fedcompass.yaml`` and
    ``.../cifar10/server_fedcompass.yaml``: ``max_local_steps: 100``,
    ``min_local_steps: 20``, ``speed_momentum: 0.9``, ``latest_time_factor: 1.5``).

Speed. The server estimates each node's seconds per local step s_i as APPFL's
``_record_info`` does: the whole time of its latest message, from its sending to its
reply (communication, queueing and training together), divided by the steps it did,
smoothed with the speed momentum m (0.9 on the newest):
``s_i <- (1 - m) s_i + m * T_i / Q_i`` (the first reply: ``T_i / Q_i``). A message of
Q steps is then expected to take ``Q * s_i``: no separate round trip. Where
communication dwarfs computation (this repository's ``loopback`` profile: a 7 s round
trip against 0.34 s for 19 steps) this is what lets a node join another's group: its
duration is predicted to grow with its steps as a whole message, so the steps left
until a group's expected arrival are many (``floor(remaining / s_i)``), where a
``round trip + Q * compute`` prediction left none and every node made its own group.
(A clock that cannot time a message, wall time without a send time, falls back to
the reported training seconds.)

Groups. Times are the engine clock's seconds (virtual in simulation). At each
dispatch the node is put in an *arrival group*: a set of nodes expected back at the
group's expected arrival time E, with a deadline, the latest arrival time L. Q_min
and Q_max are absolute step counts (APPFL's ``min_local_steps``,
``max_local_steps``: 20 and 100).

- Join (APPFL ``_join_group``): over the open groups, in creation order, the steps
  ``Q = floor((E - now) / s_i)``; the node joins the group with the most steps among
  those with ``Q_min <= Q <= Q_max`` (ties: the later group).
- Create (``_create_group``), when no group can be joined: for each open group whose
  deadline has not passed, with s_f the least seconds per step of its members, the
  steps that bring node i back when that fastest member, sent again at L, would come
  back from Q_max steps: ``Q = floor((L + Q_max s_f - now) / s_i)``; Q is the largest
  of those <= Q_max, raised to Q_min if below it, and Q_max if there is none (also
  when no group is open: APPFL ``_assign_group``'s first group). The new group
  expects the node at ``E = now + Q s_i``, at the latest ``L = now + lambda Q s_i``
  (lambda = ``latest_time_factor``, 1.5).

What the scheduler and FedCompass's rule (:mod:`flwr_gsgm.core.fedcompass`) know of
the groups is one :class:`ArrivalGroups` object, which the engine hands to both: the
scheduler writes memberships at dispatch, the rule reads them at arrival (on time:
buffered in the group; after L: the general buffer; no group: a single update) and
closes a group when it aggregates it (every member arrived, or its deadline passed).
A member that arrived on time waits, as in APPFL, for its group's aggregation before
it gets new work (:meth:`CompassScheduler.ready`); the members released by an
aggregation are sent work fastest first, as APPFL assigns them.

A node's first message carries the run's own work (its speed is unknown; APPFL's
first message is its client configuration's ``num_local_steps``, 100 = Q_max in its
examples, and its first speed divides by Q_max: here by the steps the reply reports).
A ClientApp that reports no ``train-steps``, or does other steps than asked (gradient
mode, whose message is ``local-batches`` gradients whatever ``local-steps`` says),
turns the scheduler off, said once
(:class:`~flwr_gsgm.scheduling.work_scheduler.WorkScheduler`): every open group is
then due, every node keeps the run's own work, and the rule falls back to FedBuff-like
buffered aggregation.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, ClassVar

from flwr_gsgm.scheduling.speeds import NodeSpeeds, seconds_or_none
from flwr_gsgm.scheduling.work_scheduler import WorkScheduler

__all__ = [
    "ArrivalGroup",
    "ArrivalGroups",
    "CompassScheduler",
    "MessageSpeeds",
    "GROUP",
    "LATE",
    "OFF",
    "SINGLE",
]

#: What an arrival is (:meth:`ArrivalGroups.arrive`): on time in its group, after its
#: group's deadline, without a group (an unscheduled message), or scheduling is off.
GROUP, LATE, SINGLE, OFF = "group", "late", "single", "off"

# Times and steps are floats of seconds: a quotient meant to be an integer (4.0 s at
# 0.1 s per step) may come out a hair below it (39.99999...); floor() would lose a step.
_EPS = 1e-9


@dataclass
class ArrivalGroup:
    """One arrival group: ``expected`` and ``latest`` arrival times (engine seconds),
    the members still out (``pending``) and those back on time (``arrived``).
    ``closed``: aggregated (or expired without arrivals): nobody joins it, and a
    member still out arrives late."""

    expected: float
    latest: float
    pending: list[int] = field(default_factory=list)
    arrived: list[int] = field(default_factory=list)
    closed: bool = False


class ArrivalGroups:
    """The arrival groups FedCompass's scheduler and rule share (partition-ids, seconds).

    ``member_of`` maps a node to the group of its message in flight; ``held`` a node
    that arrived on time to the group whose aggregation it waits for. ``enabled`` is
    False once scheduling turned itself off.
    """

    def __init__(self) -> None:
        self.groups: dict[int, ArrivalGroup] = {}
        self.member_of: dict[int, int] = {}
        self.held: dict[int, int] = {}
        self.next_id = 0
        self.enabled = True

    # ------------------------------------------------------------ the scheduler's
    def open_groups(self) -> list[tuple[int, ArrivalGroup]]:
        """``(group id, group)`` of the groups not closed, in creation order."""
        return [(gid, g) for gid, g in self.groups.items() if not g.closed]

    def create(self, expected: float, latest: float, partition_id: int) -> int:
        """A new group with ``partition_id`` out in it; returns its id."""
        gid = self.next_id
        self.next_id += 1
        self.groups[gid] = ArrivalGroup(float(expected), float(latest))
        self.join(gid, partition_id)
        return gid

    def join(self, gid: int, partition_id: int) -> None:
        """``partition_id`` is sent work that group ``gid`` expects back."""
        self.groups[gid].pending.append(partition_id)
        self.member_of[partition_id] = gid

    def leave(self, partition_id: int) -> None:
        """``partition_id``'s work of its group will not come (it is sent other work,
        was lost or its update was dropped): its group stops waiting for it."""
        gid = self.member_of.pop(partition_id, None)
        if gid is not None:
            self.groups[gid].pending.remove(partition_id)
            self._forget_if_done(gid)

    def holds(self, partition_id: int) -> bool:
        """True while ``partition_id`` waits for its group's aggregation."""
        return partition_id in self.held

    def disable(self) -> None:
        """Scheduling is off: no new group; every open group is due at the next event."""
        self.enabled = False
        for _, g in self.open_groups():
            g.latest = -math.inf

    # ----------------------------------------------------------------- the rule's
    def arrive(self, partition_id: int, now: float) -> tuple[str, int | None]:
        """``partition_id``'s update arrives at ``now``: ``(GROUP, group id)`` if on time
        in an open group (it then waits in :attr:`held`), ``(LATE, None)`` after its
        group's deadline (strictly after, as APPFL) or closing, ``(SINGLE, None)``
        without a group, ``(OFF, None)`` once scheduling is off."""
        gid = self.member_of.pop(partition_id, None)
        if gid is None:
            return (SINGLE if self.enabled else OFF), None
        g = self.groups[gid]
        g.pending.remove(partition_id)
        if not self.enabled:
            self._forget_if_done(gid)
            return OFF, None
        if g.closed or now > g.latest:
            self._forget_if_done(gid)
            return LATE, None
        g.arrived.append(partition_id)
        self.held[partition_id] = gid
        return GROUP, gid

    def due(self, now: float) -> list[int]:
        """The open groups to aggregate at ``now``, by deadline: every member back, or
        the deadline passed with some back. A group whose deadline passed with none
        back is closed here (nothing to aggregate; its members will arrive late)."""
        ready = []
        for gid, g in self.open_groups():
            expired = now > g.latest
            if g.arrived and (expired or not g.pending):
                ready.append(gid)
            elif expired:
                g.closed = True
                self._forget_if_done(gid)
        return sorted(ready, key=lambda gid: (self.groups[gid].latest, gid))

    def next_deadline(self) -> float | None:
        """The earliest deadline (``latest``) of an open group with members back and
        members still out: its aggregation without them is due just after it (None:
        no such group)."""
        times = [g.latest for _, g in self.open_groups() if g.arrived and g.pending]
        return min(times) if times else None

    def close(self, gid: int) -> list[int]:
        """Group ``gid`` was aggregated: its arrived members are released (returned)."""
        g = self.groups[gid]
        g.closed = True
        released = list(g.arrived)
        for pid in released:
            self.held.pop(pid, None)
        self._forget_if_done(gid)
        return released

    def release(self, partition_id: int) -> None:
        """``partition_id`` left while it waited: it waits no more (its update stays)."""
        self.held.pop(partition_id, None)

    def _forget_if_done(self, gid: int) -> None:
        g = self.groups[gid]
        if g.closed and not g.pending:
            del self.groups[gid]

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Plain data for a checkpoint (an infinite deadline is kept as a string)."""
        return {
            "groups": [
                [gid, repr(g.expected), repr(g.latest), g.pending, g.arrived, g.closed]
                for gid, g in self.groups.items()
            ],
            "member_of": {str(p): gid for p, gid in self.member_of.items()},
            "held": {str(p): gid for p, gid in self.held.items()},
            "next_id": self.next_id,
            "enabled": self.enabled,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (in place: the rule keeps the same object)."""
        self.groups = {
            int(gid): ArrivalGroup(
                float(expected),
                float(latest),
                [int(p) for p in pend],
                [int(p) for p in arr],
                bool(c),
            )
            for gid, expected, latest, pend, arr, c in state["groups"]
        }
        self.member_of = {int(p): int(g) for p, g in state["member_of"].items()}
        self.held = {int(p): int(g) for p, g in state["held"].items()}
        self.next_id = int(state["next_id"])
        self.enabled = bool(state["enabled"])


class MessageSpeeds(NodeSpeeds):
    """Each node's seconds per local step as APPFL's ``CompassScheduler._record_info``
    measures them: the whole message, from its sending to its reply, over its steps.

    ``s_i <- (1 - m) s_i + m * total_seconds / steps`` with m = ``smoothing``
    (APPFL's ``speed_momentum``, 0.9 on the newest); the first reply sets
    ``s_i = total_seconds / steps``. Without ``total_seconds`` (a clock that cannot time
    the message) the reported ``train_seconds`` stand in; without either, nothing is
    measured. :class:`~flwr_gsgm.scheduling.speeds.NodeSpeeds` instead times the
    training alone and keeps the round trip apart (work scheduling's ``equal-time``):
    FedCompass's formulas have no round trip term, so its speed must carry it.
    """

    def observe(
        self,
        partition_id: int,
        steps: int,
        train_seconds: float | None = None,
        total_seconds: float | None = None,
    ) -> None:
        """Record one reply of ``partition_id``: ``steps`` local steps in ``total_seconds``
        from sending to reply (``train_seconds`` if the total is unknown). A non-finite
        or negative figure counts as missing; a reply of 0 steps measures nothing."""
        seconds = seconds_or_none(total_seconds)
        if seconds is None:
            seconds = seconds_or_none(train_seconds)
        if steps < 1 or seconds is None:
            return
        # APPFL: speed = (1 - speed_momentum) * speed + speed_momentum * client_speed.
        self._smooth(partition_id, seconds / steps)


def _steps_bound(name: str, value: Any) -> int:
    """``value`` as a step count >= 1, else ValueError naming ``name`` and the value."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an integer number of local steps >= 1, got {value!r}")
    return int(value)


class CompassScheduler(WorkScheduler):
    """FedCompass's step assignment (module docstring) as the dispatcher's work scheduler.

    Parameters
    ----------
    min_local_steps, max_local_steps : int
        Q_min and Q_max: the fewest and most local steps of a scheduled message, as
        absolute step counts (APPFL's ``min_local_steps`` and ``max_local_steps``;
        its example configurations' 20 and 100), ``1 <= Q_min <= Q_max``.
    latest_factor : float
        lambda >= 1: a new group's deadline is lambda times its creator's expected
        duration after now (APPFL's ``latest_time_factor``, 1.5).
    smoothing : float
        Weight of the newest measurement of a node's seconds per step, in (0, 1]
        (APPFL's ``speed_momentum``, 0.9).

    Raises
    ------
    ValueError
        If ``min_local_steps`` or ``max_local_steps`` is not an integer >= 1,
        ``min_local_steps > max_local_steps``, ``latest_factor`` < 1 or ``smoothing``
        not in (0, 1]; the message names the value.
    """

    POLICIES: ClassVar[tuple[str, ...]] = ("compass",)
    OFF_CONSEQUENCE: ClassVar[str] = (
        "every node keeps the run's own work and FedCompass aggregates every fedbuff-k "
        "arrivals (FedBuff-like) instead of groups"
    )

    def __init__(
        self,
        min_local_steps: int = 20,
        max_local_steps: int = 100,
        latest_factor: float = 1.5,
        smoothing: float = 0.9,
    ) -> None:
        super().__init__("compass")
        high = _steps_bound("max_local_steps", max_local_steps)
        low = _steps_bound("min_local_steps", min_local_steps)
        if low > high:
            raise ValueError(
                f"min_local_steps ({low}) must be at most max_local_steps ({high}): Q_min <= Q_max"
            )
        if not (latest_factor >= 1 and math.isfinite(latest_factor)):
            raise ValueError(f"latest_factor (lambda) must be >= 1, got {latest_factor!r}")
        self.min_local_steps, self.max_local_steps = low, high
        self.latest_factor = float(latest_factor)
        self.speeds = MessageSpeeds(smoothing)
        self.book = ArrivalGroups()

    # ------------------------------------------------------------------ measures
    def _measured(self, partition_id: int) -> float | None:
        """The node's seconds per step (whole message) if measured, else None."""
        s = self.speeds.seconds_per_step(partition_id)
        return s if s is not None and s > 0 else None

    # --------------------------------------------------------------- assignment
    def steps_for(
        self, partition_id: int, partition_ids: list[int], now: float | None = None
    ) -> int | None:
        """Local steps of ``partition_id``'s message sent at ``now`` (engine seconds),
        after putting it in an arrival group (join, else create); None (the run's own
        work, no group) while scheduling is off, the node is not measured yet or
        ``now`` is None. Any earlier group the node was out in stops waiting for it."""
        self.book.leave(partition_id)
        speed = self._measured(partition_id)
        if not self.active or now is None or speed is None:
            return None
        joined = self._join(partition_id, speed, float(now))
        return joined if joined is not None else self._create(partition_id, speed, float(now))

    def _join(self, pid: int, speed: float, now: float) -> int | None:
        # APPFL _join_group: local_steps = floor((expected_arrival_time - curr_time) /
        # speed); skip if < min_local_steps, < the best so far or > max_local_steps.
        best_gid, best = None, -1
        for gid, g in self.book.open_groups():
            steps = math.floor((g.expected - now) / speed + _EPS)
            if steps < self.min_local_steps or steps < best or steps > self.max_local_steps:
                continue
            best_gid, best = gid, steps
        if best_gid is None:
            return None
        self.book.join(best_gid, pid)
        return best

    def _create(self, pid: int, speed: float, now: float) -> int:
        # APPFL _create_group (and _assign_group's first group, Q_max, when none is open).
        low, high = self.min_local_steps, self.max_local_steps
        steps = -1
        for _, g in self.book.open_groups():
            if not now < g.latest:
                continue
            # fastest_speed: the least seconds per step of the group's members, out or back.
            speeds = [s for p in g.pending + g.arrived if (s := self._measured(p))]
            if not speeds:
                continue
            # est_arrival_time = latest_arrival_time + fastest_speed * max_local_steps
            back = g.latest + min(speeds) * high
            q = math.floor((back - now) / speed + _EPS)
            if q <= high:
                steps = max(steps, q)
        if 0 <= steps < low:
            steps = low
        if steps < 0:
            steps = high
        # expected = now + steps * speed; latest = now + steps * speed * latest_time_factor
        duration = steps * speed
        self.book.create(now + duration, now + duration * self.latest_factor, pid)
        return steps

    def ready(self, idle: list[int]) -> list[int]:
        """The idle nodes not waiting for their group's aggregation, fastest first (as
        APPFL assigns a group's members; nodes not measured yet last, in given order)."""
        free = [p for p in idle if not self.book.holds(p)]
        return sorted(free, key=lambda p: s if (s := self._measured(p)) else math.inf)

    # ---------------------------------------------------------------------- replies
    def on_reply(
        self,
        partition_id: int,
        scheduled_steps: int | None,
        train_steps: int | None,
        train_seconds: float | None = None,
        total_seconds: float | None = None,
    ) -> float:
        """Record a train reply (its speed, :class:`MessageSpeeds`; detection as
        :meth:`WorkScheduler.on_reply`) and return 1.0: FedCompass weighs updates by
        staleness in its rule, not by their steps."""
        if self.active:
            self._record(partition_id, scheduled_steps, train_steps, train_seconds, total_seconds)
        return 1.0

    def _turn_off(self, reason: str) -> None:
        super()._turn_off(reason)
        self.book.disable()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """:meth:`WorkScheduler.state_dict` and the arrival groups."""
        return {**super().state_dict(), "groups": self.book.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the book in place: the rule shares it)."""
        super().load_state_dict(state)
        self.book.load_state_dict(state["groups"])
