"""Each node's measured seconds per local step, and the fleet's round trip.

A node's speed is measured from its replies, as FedCompass's server does (Li et al.,
"FedCompass: Efficient Cross-Silo Federated Learning on Heterogeneous Client Devices
Using a Computing Power-Aware Scheduler", ICLR 2024, arXiv 2309.14675): the seconds
of local training a reply reports divided by the steps it did, smoothed by an
exponential moving average. A reply that reports no training seconds is timed from
its dispatch to its arrival, less the round trip measured on the replies that report
both (their arrival time less their training time). Without any such reply the round
trip is 0 and the node's speed includes its communication: an over-estimate of its
seconds per step that errs toward less work, never more.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any

__all__ = ["NodeSpeeds", "seconds_or_none", "SMOOTHING", "ROUND_TRIP_WINDOW"]

#: Weight of the newest measurement in a node's moving average (FedCompass's is an
#: exponential average too; 0.5 follows a node whose speed changes within two replies).
SMOOTHING = 0.5
#: Replies whose round trip (arrival less training time) makes the fleet's median.
ROUND_TRIP_WINDOW = 64


class NodeSpeeds:
    """Seconds per local step of each node, from its replies.

    Nodes are keyed by partition-id (any int). Every figure is in seconds; a step is
    one mini-batch of local SGD. ``smoothing`` is the weight of the newest measurement
    in the moving average, in (0, 1] (default :data:`SMOOTHING`; FedCompass's server
    uses 0.9).

    Raises
    ------
    ValueError
        If ``smoothing`` is not in (0, 1].
    """

    def __init__(self, smoothing: float = SMOOTHING) -> None:
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing!r}")
        self.smoothing = float(smoothing)
        self._seconds_per_step: dict[int, float] = {}
        self._round_trips: deque[float] = deque(maxlen=ROUND_TRIP_WINDOW)

    def observe(
        self,
        partition_id: int,
        steps: int,
        train_seconds: float | None = None,
        total_seconds: float | None = None,
    ) -> None:
        """Record one reply of ``partition_id``: ``steps`` local steps done.

        Parameters
        ----------
        steps : int
            Local steps the reply did (>= 1; a reply of 0 steps measures nothing).
        train_seconds : float | None
            Seconds of local training the node reported, or None.
        total_seconds : float | None
            Seconds from the dispatch to the reply's arrival, or None.

        A non-finite or negative figure is ignored, as a reply that reports nothing.
        """
        train = seconds_or_none(train_seconds)
        total = seconds_or_none(total_seconds)
        if steps < 1:
            return
        if train is not None:
            if total is not None:
                self._round_trips.append(max(0.0, total - train))
            sample = train / steps
        elif total is not None:
            sample = max(total - self.round_trip(), 0.0) / steps
        else:
            return
        self._smooth(partition_id, sample)

    def _smooth(self, partition_id: int, sample: float) -> None:
        """Fold one measurement ``sample`` (seconds per step) into the node's moving
        average, ``(1 - smoothing) x old + smoothing x sample`` (the first sets it)."""
        old = self._seconds_per_step.get(partition_id)
        self._seconds_per_step[partition_id] = (
            sample if old is None else (1.0 - self.smoothing) * old + self.smoothing * sample
        )

    def seconds_per_step(self, partition_id: int) -> float | None:
        """The node's smoothed seconds per step, or None before its first measurement."""
        return self._seconds_per_step.get(partition_id)

    def round_trip(self) -> float:
        """Median seconds of a message outside training (arrival less training time)
        over the last :data:`ROUND_TRIP_WINDOW` replies that reported both; 0.0 before any."""
        return float(statistics.median(self._round_trips)) if self._round_trips else 0.0

    def forget(self, partition_id: int) -> None:
        """Drop a node's measurement (it left; a rejoin measures it afresh)."""
        self._seconds_per_step.pop(partition_id, None)

    def state_dict(self) -> dict[str, Any]:
        """The measurements, as plain data for a checkpoint."""
        return {
            "seconds_per_step": {str(p): s for p, s in self._seconds_per_step.items()},
            "round_trips": list(self._round_trips),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self._seconds_per_step = {int(p): float(s) for p, s in state["seconds_per_step"].items()}
        self._round_trips = deque(
            (float(s) for s in state["round_trips"]), maxlen=ROUND_TRIP_WINDOW
        )


def seconds_or_none(value: float | None) -> float | None:
    """``value`` as seconds: a finite number >= 0, else None (a figure not reported)."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) and value >= 0 else None
