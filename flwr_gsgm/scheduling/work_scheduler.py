"""Work scheduling: each message's local steps sized by its node's measured speed.

On a small heterogeneous fleet asynchrony alone gains little over FedAvg once local
epochs have averaged the noise (Tyurin and Richtarik, arXiv 2305.12387; ANCHORS.md,
"Small fleets"); what wins there is giving each node as much work as it can do in a
common time, so that a round costs a typical node's time instead of the slowest
node's, and normalising each update by its steps, so that the model does not drift
toward the nodes that did more. This module does both:

- ``equal-time`` (FedCompass's speed-aware assignment, Li et al., ICLR 2024, arXiv
  2309.14675; TimelyFL, arXiv 2304.06947): every node computes for the same target
  seconds T, the median over the nodes of the time its own work takes (its own work:
  the steps of its first, unscheduled, reply: ``local-steps``, or an epoch of its
  partition). Node i is sent ``local-steps = round(T / s_i)``, s_i its measured seconds
  per step (:class:`~flwr_gsgm.scheduling.speeds.NodeSpeeds`), within
  [own / :data:`WORK_FACTOR`, own x :data:`WORK_FACTOR`]. T is at least the
  measured round trip, so no message computes for less time than it travels.
- Normalisation (FedNova, Wang et al., NeurIPS 2020, arXiv 2007.07481; Malenia SGD),
  one-sided: a scheduled update that did tau_i steps is weighted
  ``min(1, tau_eff / tau_i)``, tau_eff the mean over the nodes of the steps of their
  latest reply, so a fast node's extra steps count no more than the fleet's mean.
  FedNova's full weight ``tau_eff / tau_i`` also scales a slow node's few steps up
  (up to WORK_FACTOR^2 / 2 times); on the tuning seed that made GSGM with work
  scheduling, and FedNova itself, swing by up to 25 pp from one evaluation to the
  next (docs/GSGM.md, "Work scheduling"), so a short update is taken as it is.

A ClientApp takes part by doing the ``local-steps`` a message asks for and reporting
``train-steps`` (and, if it can, ``train-seconds``) in its reply's metrics
(docs/PORTING.md). One that reports no ``train-steps``, or did other than the steps
asked, is detected at its reply: the scheduler says so once and turns itself off;
the run goes on with every node's own work, as without scheduling.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any, ClassVar

from flwr_gsgm.scheduling.speeds import NodeSpeeds

__all__ = [
    "WORK_FACTOR",
    "WORK_SCHEDULING",
    "WorkScheduler",
    "equal_time_steps",
    "normalisation_weight",
]

#: Values of run config ``work-scheduling``.
WORK_SCHEDULING = ("off", "equal-time")
#: A scheduled message asks for between own / WORK_FACTOR and own x WORK_FACTOR
#: steps (own: the node's unscheduled work), so that a mismeasured speed cannot ask
#: a node for a trivial or an endless message. 4 covers APPFL's measured fleet, whose
#: fastest and slowest nodes are 3.2x and 0.35x the median's speed (ANCHORS.md).
WORK_FACTOR = 4.0


def equal_time_steps(
    seconds_per_step: float, target_seconds: float, own_steps: int, factor: float = WORK_FACTOR
) -> int:
    """Local steps that take a node ``target_seconds``: ``round(target / seconds_per_step)``
    within ``[max(1, ceil(own_steps / factor)), max(that, floor(own_steps * factor))]``.

    Example: a target of 4 s at 0.1, 0.2 and 0.4 s per step (own work 20 steps)
    gives 40, 20 and 10 steps.

    Raises
    ------
    ValueError
        If ``seconds_per_step`` or ``target_seconds`` is not a finite number > 0, or
        ``own_steps`` < 1.
    """
    for name, value in (("seconds_per_step", seconds_per_step), ("target_seconds", target_seconds)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number > 0 seconds, got {value!r}")
    if own_steps < 1:
        raise ValueError(f"own_steps must be >= 1, got {own_steps!r}")
    low = max(1, math.ceil(own_steps / factor))
    high = max(low, math.floor(own_steps * factor))
    return int(min(high, max(low, round(target_seconds / seconds_per_step))))


def normalisation_weight(steps: int, reference_steps: float) -> float:
    """The weight of an update that did ``steps`` local steps: FedNova's
    ``reference / steps``, at most 1 (2 and 8 steps with a reference of 5, their mean,
    weigh 1.0 and 0.625): a long update is scaled down to the reference's steps, a
    short one is not scaled up (module docstring).

    Raises
    ------
    ValueError
        If ``steps`` < 1 or ``reference_steps`` is not > 0.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps!r}")
    if not reference_steps > 0:
        raise ValueError(f"reference_steps must be > 0, got {reference_steps!r}")
    return min(1.0, float(reference_steps) / float(steps))


class WorkScheduler:
    """The local steps of each train message, and the weight of each reply's update.

    Parameters
    ----------
    policy : str
        One of :data:`WORK_SCHEDULING`: ``"off"`` (every message carries the run's
        client work, every update weighs 1) or ``"equal-time"``.
    name : callable, optional
        ``(key) -> str``: how a node is named in the reason scheduling turned off
        (the engine: Membership's names, "node 8123 (partition 6)"; the synchronous
        strategies of :mod:`flwr_gsgm.strategy.time_budget_fedavg`: "node 8123");
        default "partition <key>".

    Raises
    ------
    ValueError
        On an unknown policy.
    """

    #: The policies this class schedules (a subclass schedules its own).
    POLICIES: ClassVar[tuple[str, ...]] = WORK_SCHEDULING
    #: What the run does once a reply showed that a ClientApp cannot take part.
    OFF_CONSEQUENCE: ClassVar[str] = "every node keeps its own work"

    def __init__(self, policy: str = "off", name: Callable[[int], str] | None = None) -> None:
        if policy not in self.POLICIES:
            raise ValueError(
                f"work-scheduling {policy!r} is unknown; expected one of {self.POLICIES}"
            )
        self.policy = policy
        self.speeds = NodeSpeeds()
        self.own_steps: dict[int, int] = {}  # steps of each node's first unscheduled reply
        self.last_steps: dict[int, int] = {}  # steps of each node's latest reply
        # local-steps of each node's latest message (None: its own work), for the
        # end-of-run line and summary.json: what the user's nodes were asked to do.
        self.sent_steps: dict[int, int | None] = {}
        self.off_reason: str | None = None  # why scheduling turned itself off
        # How a node is named in off_reason: the engine's Membership.name ("node 8123
        # (partition 6)"); alone, by its key.
        self.name: Callable[[int], str] = name or (lambda pid: f"partition {pid}")

    @property
    def active(self) -> bool:
        """True while messages get scheduled work: the policy is on and no node's reply
        showed that its ClientApp cannot take part."""
        return self.policy != "off" and self.off_reason is None

    def describe(self) -> str:
        """The policy, and why it turned itself off if it did (summary.json's
        ``work_scheduling``)."""
        if self.off_reason is not None:
            return f"{self.policy}, turned off: {self.off_reason}"
        return self.policy

    def sent(self, key: int, steps: int | None) -> None:
        """Record that ``key``'s latest train message asked for ``steps`` local steps
        (None: the node's own work, unscheduled)."""
        self.sent_steps[key] = None if steps is None else int(steps)

    def nodes_report(self) -> dict[str, dict[str, Any]]:
        """Per node (named as the log names it, :attr:`name`), in key order: its
        measured ``seconds_per_step`` (None before its first measurement) and
        ``local_steps_sent``, the local-steps of its latest message (None: its own
        work). Every node that was sent work or measured is listed (summary.json's
        ``work_scheduling``).

        Example: nodes measured at 1 and 4 s per step, sent 5 and 2 steps, give
        ``{"node 1 (partition 0)": {"seconds_per_step": 1.0, "local_steps_sent": 5},
        "node 2 (partition 1)": {"seconds_per_step": 4.0, "local_steps_sent": 2}}``.
        """
        keys = sorted(set(self.sent_steps) | set(self.own_steps))
        return {
            self.name(k): {
                "seconds_per_step": self.speeds.seconds_per_step(k),
                "local_steps_sent": self.sent_steps.get(k),
            }
            for k in keys
        }

    def nodes_line(self) -> str:
        """:meth:`nodes_report` in one line, for the log: ``"node 1 (partition 0) 5
        steps at 1 s/step, node 2 (partition 1) 2 steps at 4 s/step"`` ("own work"
        for a message without ``local-steps``, "not measured" for a node without a
        speed); "none" if no node was sent work."""
        parts = []
        for name, node in self.nodes_report().items():
            steps = node["local_steps_sent"]
            speed = node["seconds_per_step"]
            work = "own work" if steps is None else f"{steps} steps"
            rate = "not measured" if speed is None else f"at {speed:.3g} s/step"
            parts.append(f"{name} {work} {rate}")
        return ", ".join(parts) or "none"

    def target_seconds(self, partition_ids: list[int]) -> float | None:
        """T: the median over ``partition_ids`` with a measured speed of their own work's
        seconds, at least the measured round trip; None before any is measured."""
        times = [
            self.own_steps[p] * s
            for p in partition_ids
            if p in self.own_steps and (s := self.speeds.seconds_per_step(p)) is not None
        ]
        if not times:
            return None
        return max(float(statistics.median(times)), self.speeds.round_trip())

    def steps_for(
        self, partition_id: int, partition_ids: list[int], now: float | None = None
    ) -> int | None:
        """Local steps of ``partition_id``'s next message (:func:`equal_time_steps` for
        the target of ``partition_ids``, the active nodes), or None: the run's own
        client work (scheduling off, or this node not measured yet). ``now``, the
        engine clock's seconds at the dispatch, is not needed here (FedCompass's
        scheduler reads it)."""
        if not self.active or partition_id not in self.own_steps:
            return None
        speed = self.speeds.seconds_per_step(partition_id)
        target = self.target_seconds(partition_ids)
        if speed is None or not speed > 0 or target is None or not target > 0:
            return None
        return equal_time_steps(speed, target, self.own_steps[partition_id])

    def ready(self, idle: list[int]) -> list[int]:
        """The idle nodes that may get work now, in the order to send it: all of
        ``idle``, as given (FedCompass's scheduler holds some back and reorders)."""
        return idle

    def on_reply(
        self,
        partition_id: int,
        scheduled_steps: int | None,
        train_steps: int | None,
        train_seconds: float | None = None,
        total_seconds: float | None = None,
    ) -> float:
        """Record a train reply and return the weight of its update.

        Parameters
        ----------
        scheduled_steps : int | None
            The ``local-steps`` this scheduler gave the message, or None (the run's
            own client work).
        train_steps : int | None
            The ``train-steps`` the reply reported, or None.
        train_seconds, total_seconds : float | None
            The reply's reported seconds of training, and the seconds from its
            dispatch to its arrival (:meth:`NodeSpeeds.observe`).

        Returns
        -------
        float
            1.0 for an unscheduled message or while scheduling is off; else
            :func:`normalisation_weight` of its steps against the mean of every
            node's latest steps.
        """
        if not self.active or not self._record(
            partition_id, scheduled_steps, train_steps, train_seconds, total_seconds
        ):
            return 1.0
        if scheduled_steps is None:
            return 1.0
        reference = statistics.fmean(self.last_steps.values())
        return normalisation_weight(int(train_steps), reference)

    def _record(
        self,
        partition_id: int,
        scheduled_steps: int | None,
        train_steps: int | None,
        train_seconds: float | None,
        total_seconds: float | None,
    ) -> bool:
        """Check a reply's report and record its steps and speed; False (and
        scheduling turned off, :meth:`_turn_off`) if it shows that the ClientApp
        cannot take part (no ``train-steps``, or other steps than asked)."""
        if train_steps is None or train_steps < 1:
            self._turn_off(
                f"{self.name(partition_id)}'s reply reports no train-steps (got "
                f"{train_steps!r}): work scheduling needs the steps each ClientApp did "
                f"(docs/PORTING.md, 'Work scheduling'); {self.OFF_CONSEQUENCE}"
            )
            return False
        if scheduled_steps is not None and train_steps != scheduled_steps:
            self._turn_off(
                f"{self.name(partition_id)} did {train_steps} local steps where "
                f"{scheduled_steps} were asked: its ClientApp ignores local-steps "
                f"(docs/PORTING.md, 'Work scheduling'); {self.OFF_CONSEQUENCE}"
            )
            return False
        if scheduled_steps is None:
            self.own_steps.setdefault(partition_id, int(train_steps))
        self.last_steps[partition_id] = int(train_steps)
        self.speeds.observe(partition_id, int(train_steps), train_seconds, total_seconds)
        return True

    def _turn_off(self, reason: str) -> None:
        """Scheduling stops for the rest of the run, for ``reason`` (said once by the engine)."""
        self.off_reason = reason

    def state_dict(self) -> dict[str, Any]:
        """Plain data for a checkpoint."""
        return {
            "policy": self.policy,
            "speeds": self.speeds.state_dict(),
            "own_steps": {str(p): n for p, n in self.own_steps.items()},
            "last_steps": {str(p): n for p, n in self.last_steps.items()},
            "sent_steps": {str(p): n for p, n in self.sent_steps.items()},
            "off_reason": self.off_reason,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`.

        Raises
        ------
        ValueError
            The checkpoint was written with another policy.
        """
        if state["policy"] != self.policy:
            raise ValueError(
                f"the checkpoint's work-scheduling is {state['policy']!r}, this run's "
                f"{self.policy!r}"
            )
        self.speeds.load_state_dict(state["speeds"])
        self.own_steps = {int(p): int(n) for p, n in state["own_steps"].items()}
        self.last_steps = {int(p): int(n) for p, n in state["last_steps"].items()}
        self.sent_steps = {
            int(p): None if n is None else int(n) for p, n in state["sent_steps"].items()
        }
        self.off_reason = state["off_reason"]
