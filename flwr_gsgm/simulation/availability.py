"""When each simulated node is online: the availability part of the time model.

A real fleet is not always there: a phone trains while it charges on Wi-Fi, a board is
switched off, rebooted or loses its network. The time model (``docs/GSGM.md``, "Time
model") gives each node an alternation of online and offline intervals over virtual
time; a message to a node that goes offline before its reply is lost, as a deployment
loses it, and the node rejoins when it is back (the engine's membership; the
synchronous runs sample only the nodes online when a round starts).

Three kinds (run config ``availability``):

- ``"always"``: every node online for ever (the default; runs are those of the clock
  before availability, bit for bit: nothing here is drawn);
- a built-in two-state process (:data:`AVAILABILITY_MODELS`): each node alternates
  online and offline intervals with exponential durations of the declared means,
  starting in its stationary state (online with probability
  ``mean_online / (mean_online + mean_offline)``; an exponential interval seen from a
  random time is again exponential, so the first interval has the same law). FedScale
  models availability the same way, as per-device online/offline intervals
  (``fedscale/cloud/internal/client_metadata.py``, ``is_active``);
- ``"device-profile"``: each node's own, from the device profile file (its
  ``online-intervals``, or its ``mean-online-seconds`` and ``mean-offline-seconds``:
  :mod:`flwr_gsgm.simulation.profile_file`).

Every draw depends only on ``(seed, partition_id)`` and the interval's number, from its
own stream, never on the order of the questions asked, so two runs with the same seed
see the same intervals whatever happens in between.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from flwr_gsgm.simulation.seeds import derive_seed

__all__ = [
    "ALWAYS",
    "DROPOUT_PER_ROUND",
    "AVAILABILITY_MODELS",
    "FROM_PROFILE",
    "Availability",
    "OnOffModel",
]

#: Run config ``availability``: every node always online.
ALWAYS = "always"
#: Run config ``availability``: each node's own, from the device profile file.
FROM_PROFILE = "device-profile"

# Stream tag of derive_seed for the on/off draws (see virtual_clock's tags).
_AVAILABILITY = 0xA7A1


@dataclass(frozen=True)
class OnOffModel:
    """A two-state (online/offline) process with exponential interval durations.

    Parameters
    ----------
    mean_online_seconds : float
        Mean length of an online interval (> 0, finite), in seconds, or in rounds
        with ``in_rounds``.
    mean_offline_seconds : float
        Mean length of an offline interval (> 0, finite), in the same unit.
    source : str
        Where the figures come from (``docs/GSGM.md``, "Time model").
    in_rounds : bool
        The means are in rounds of the fleet (:meth:`Availability` ``round_seconds``:
        the median node's message for the run's work), so that a published dropout
        per round holds whatever the device and the work; False: in seconds.

    Raises
    ------
    ValueError
        If a mean is not a finite number > 0 (the message names it).
    """

    mean_online_seconds: float
    mean_offline_seconds: float
    source: str = ""
    in_rounds: bool = False

    def __post_init__(self) -> None:
        for key, value in (
            ("mean-online-seconds", self.mean_online_seconds),
            ("mean-offline-seconds", self.mean_offline_seconds),
        ):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{key} must be a finite number > 0 seconds, got {value!r}")

    @property
    def online_fraction(self) -> float:
        """The long-run fraction of time a node is online (its stationary probability)."""
        return self.mean_online_seconds / (self.mean_online_seconds + self.mean_offline_seconds)


#: Google's production system loses 6-10% of a round's devices (computation errors,
#: network failures, changes in eligibility): Bonawitz et al., "Towards Federated
#: Learning at Scale: System Design", SysML 2019, arXiv 1902.01046, section 9
#: ("Operational Profile"). The model takes the middle, 8%.
DROPOUT_PER_ROUND = 0.08

#: The built-in availability models (run config ``availability``), besides ``"always"``
#: and ``"device-profile"``; ``docs/GSGM.md``, "Time model", gives the figures' sources.
#:
#: ``"smartphones"``: a node online at a round's start leaves within it with
#: probability 1 - exp(-1 / mean online) = :data:`DROPOUT_PER_ROUND`, so the mean
#: online interval is 1 / -ln(1 - 0.08) = 11.99 rounds, a round being the fleet's
#: (the median node's message for the run's work: ``round_seconds``); a node slower
#: than the median, whose message lasts longer, drops out of more of them. The
#: published traces (FLASH's, FedScale's ``client_behave_trace``) give no mean offline
#: interval that could be read here: it is taken equal to the online one (a device
#: online half the time, an assumption).
AVAILABILITY_MODELS: dict[str, OnOffModel] = {
    "smartphones": OnOffModel(
        mean_online_seconds=1.0 / -math.log1p(-DROPOUT_PER_ROUND),
        mean_offline_seconds=1.0 / -math.log1p(-DROPOUT_PER_ROUND),
        source="8% of a round's devices drop out (Bonawitz et al., arXiv 1902.01046, "
        "section 9); offline as long as online (an assumption)",
        in_rounds=True,
    ),
}


class _Intervals:
    """One node's online intervals ``[start, end)``, sorted, disjoint, in seconds.

    ``model`` set: drawn from it lazily, as far as asked (the stream continues where it
    stopped, so the intervals do not depend on the order of the questions); otherwise
    ``fixed`` is the whole list (the node is offline outside it)."""

    def __init__(
        self,
        fixed: Sequence[tuple[float, float]] | None = None,
        model: OnOffModel | None = None,
        seed: int = 0,
    ) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.model = model
        if model is None:
            for start, end in fixed or ():
                self.starts.append(float(start))
                self.ends.append(float(end))
            self.horizon = math.inf
            return
        self.rng = np.random.default_rng(seed)
        online = self.rng.uniform() < model.online_fraction
        t = 0.0
        if not online:  # the first offline interval, then online ones follow
            t = float(self.rng.exponential(model.mean_offline_seconds))
        self.next_start = t
        self.horizon = t  # intervals are known up to here

    def _extend(self, t: float) -> None:
        """Draw intervals until they cover time ``t`` (a drawn model only)."""
        model = self.model
        assert model is not None
        while self.horizon <= t:
            start = self.next_start
            end = start + float(self.rng.exponential(model.mean_online_seconds))
            self.starts.append(start)
            self.ends.append(end)
            self.next_start = end + float(self.rng.exponential(model.mean_offline_seconds))
            self.horizon = self.next_start

    def _index(self, t: float) -> int:
        """The number of the last interval starting at or before ``t`` (-1: none)."""
        if self.model is not None:
            self._extend(t)
        return bisect.bisect_right(self.starts, t) - 1

    def online(self, t: float) -> bool:
        i = self._index(t)
        return i >= 0 and t < self.ends[i]

    def offline_from(self, t: float) -> float:
        """When the node, online at ``t``, goes offline (``t`` if it is offline)."""
        i = self._index(t)
        if i < 0 or t >= self.ends[i]:
            return t
        return self.ends[i]

    def online_from(self, t: float) -> float:
        """The first time at or after ``t`` the node is online (``inf``: never again)."""
        i = self._index(t)
        if i >= 0 and t < self.ends[i]:
            return t
        if self.model is not None:
            self._extend(self.horizon)  # the next interval, which starts after t
            return self.starts[i + 1]
        return self.starts[i + 1] if i + 1 < len(self.starts) else math.inf


class Availability:
    """Which nodes are online when, in virtual seconds (see the module docstring).

    Parameters
    ----------
    kind : str
        ``"always"``, a name in :data:`AVAILABILITY_MODELS`, or ``"device-profile"``.
    seed : int
        Run seed: the draws of a built-in model depend on it and the partition-id.
    nodes : Mapping[int, OnOffModel | Sequence[tuple[float, float]]] | None
        ``"device-profile"``: each partition-id's own availability, a model of mean
        durations or its online intervals (``[start, end)`` seconds, sorted and
        disjoint: the profile file checks them).
    round_seconds : float | None
        Seconds of a round of the fleet, the unit of a model ``in_rounds`` (the
        engine gives the median node's message for the run's work).

    Raises
    ------
    ValueError
        If ``kind`` is unknown, ``"device-profile"`` comes without ``nodes``, or a
        model in rounds without a ``round_seconds`` > 0 (the message names the value
        and what was expected).
    """

    def __init__(
        self,
        kind: str = ALWAYS,
        seed: int = 0,
        nodes: Mapping[int, OnOffModel | Sequence[tuple[float, float]]] | None = None,
        round_seconds: float | None = None,
    ) -> None:
        if kind not in (ALWAYS, FROM_PROFILE, *AVAILABILITY_MODELS):
            raise ValueError(
                f"availability {kind!r} is unknown; expected one of "
                f"{[ALWAYS, *AVAILABILITY_MODELS, FROM_PROFILE]}"
            )
        if kind == FROM_PROFILE and not nodes:
            raise ValueError(
                "availability 'device-profile' needs a device profile file whose entries "
                "give online-intervals, or mean-online-seconds and mean-offline-seconds"
            )
        model = AVAILABILITY_MODELS.get(kind)
        if model is not None and model.in_rounds:
            if not (
                round_seconds is not None and math.isfinite(round_seconds) and round_seconds > 0
            ):
                raise ValueError(
                    f"availability {kind!r} counts in rounds of the fleet: expected "
                    f"round_seconds > 0, got {round_seconds!r}"
                )
            model = OnOffModel(
                model.mean_online_seconds * round_seconds,
                model.mean_offline_seconds * round_seconds,
                model.source,
            )
        #: The built-in model in seconds (None: ``always`` or ``device-profile``).
        self.model = model
        self.round_seconds = round_seconds
        self.kind = kind
        self.seed = int(seed)
        self._own = dict(nodes or {})
        self._nodes: dict[int, _Intervals] = {}

    @property
    def always(self) -> bool:
        """True if every node is always online (nothing is ever lost)."""
        return self.kind == ALWAYS

    def _of(self, partition_id: int) -> _Intervals:
        pid = int(partition_id)
        intervals = self._nodes.get(pid)
        if intervals is None:
            own = self._own.get(pid) if self.kind == FROM_PROFILE else None
            if self.kind == FROM_PROFILE and own is None:
                raise ValueError(
                    f"partition-id {pid} has no availability in the device profile file; "
                    f"it has partition-ids {sorted(self._own)}"
                )
            model = self.model
            if isinstance(own, OnOffModel):
                model = own
            seed = derive_seed(self.seed, _AVAILABILITY, pid)
            if model is not None:
                intervals = _Intervals(model=model, seed=seed)
            else:
                intervals = _Intervals(fixed=own)  # type: ignore[arg-type]
            self._nodes[pid] = intervals
        return intervals

    def online(self, partition_id: int, t: float) -> bool:
        """Whether node ``partition_id`` is online at virtual second ``t``."""
        return True if self.always else self._of(partition_id).online(t)

    def offline_from(self, partition_id: int, t: float) -> float:
        """When node ``partition_id``, online at ``t``, goes offline (``inf``: never;
        ``t`` if it is offline at ``t``)."""
        return math.inf if self.always else self._of(partition_id).offline_from(t)

    def online_from(self, partition_id: int, t: float) -> float:
        """The first virtual second at or after ``t`` at which ``partition_id`` is
        online (``t`` if it is; ``inf`` if it never is again)."""
        return t if self.always else self._of(partition_id).online_from(t)

    def loss(self, partition_id: int, sent: float, finish: float) -> tuple[float, float] | None:
        """Whether a message sent to ``partition_id`` at ``sent`` whose reply would
        reach the server at ``finish`` is lost: ``(lost_at, back_at)`` if the node is
        offline at ``sent`` (lost at once) or goes offline before ``finish`` (lost
        then), ``back_at`` the first time after that it is online again (``inf``:
        never); None if the reply arrives.

        Example: a node offline from 3 s to 7 s loses a message sent at 2 s that
        lasts 2 s: ``loss(p, 2.0, 4.0) == (3.0, 7.0)``.
        """
        if self.always:
            return None
        lost_at = self.offline_from(partition_id, sent)
        if lost_at >= finish:
            return None
        return lost_at, self.online_from(partition_id, lost_at)
