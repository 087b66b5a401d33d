"""How a node's speed changes from one message to the next: the time model's slowdowns.

A device's own speed is not one number: other apps take its cores, and a board without
a fan throttles its clock once it is hot. The time model's device profiles give each
node one speed factor, and the jitter spreads a message's time by at most its
``jitter`` either way; run config ``speed-variance`` adds, on top, a per-message
slowdown drawn from a declared process (:data:`SPEED_VARIANCE_MODELS`).

``"none"`` (the default) is the clock before speed variance, bit for bit: nothing is
drawn and no time is multiplied. A built-in :class:`Throttling` makes a message run
``factor`` times slower with probability ``probability``, drawn per node and message
from ``(seed, partition_id, dispatch_index)`` on its own stream (like the jitter), so
the draws do not depend on the order in which messages are sent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from flwr_gsgm.simulation.seeds import derive_seed

__all__ = ["NONE", "PI4_THROTTLE_FACTOR", "SPEED_VARIANCE_MODELS", "Throttling", "slowdown"]

#: Run config ``speed-variance``: no slowdown (each node keeps its profile's speed).
NONE = "none"

# Stream tag of derive_seed for the slowdown draws (see virtual_clock's tags).
_SLOWDOWN = 0x5104


@dataclass(frozen=True)
class Throttling:
    """A message runs ``factor`` times slower with probability ``probability``.

    Parameters
    ----------
    probability : float
        Chance in [0, 1] that a message's local work runs throttled (the long-run
        fraction of a device's work done throttled).
    factor : float
        How many times longer the throttled work takes (>= 1).
    source : str
        Where the figures come from (``docs/GSGM.md``, "Time model").

    Raises
    ------
    ValueError
        If ``probability`` is outside [0, 1] or ``factor`` below 1 (the message names
        the value).
    """

    probability: float
    factor: float
    source: str = ""

    def __post_init__(self) -> None:
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"probability must be in [0, 1], got {self.probability!r}")
        if not (math.isfinite(self.factor) and self.factor >= 1.0):
            raise ValueError(f"factor must be a finite number >= 1, got {self.factor!r}")

    @property
    def mean_factor(self) -> float:
        """The mean slowdown of a message: ``1 + probability x (factor - 1)``."""
        return 1.0 + self.probability * (self.factor - 1.0)


#: A Raspberry Pi 4 runs its Arm cores at 1500 MHz and, once throttled, steps down to
#: 1000 MHz first (then 750 and 600 MHz, "much less likely"): Raspberry Pi's
#: documentation, "Frequency management and thermal control"
#: (raspberrypi/documentation, ``frequency-management.adoc``). A Pi 5 without cooling
#: goes above 85 C under extended load, "leading to sustained thermal throttling"
#: (``raspberry-pi-5/cooling.adoc``).
PI4_THROTTLE_FACTOR = 1500 / 1000

#: The built-in speed-variance models (run config ``speed-variance``), besides
#: ``"none"``; ``docs/GSGM.md``, "Time model", gives the figures' sources.
#:
#: ``"throttling"``: a message runs 1.5x slower (:data:`PI4_THROTTLE_FACTOR`) with
#: probability 0.5. No published figure gives how much of a fanless board's training
#: runs throttled; half is an assumption (training is a sustained load, and a board
#: reaches its throttle point within minutes of one).
SPEED_VARIANCE_MODELS: dict[str, Throttling] = {
    "throttling": Throttling(
        probability=0.5,
        factor=PI4_THROTTLE_FACTOR,
        source="Raspberry Pi 4 at 1000 MHz of its 1500 MHz when throttled (Raspberry Pi "
        "documentation, frequency management); throttled half the time (an assumption)",
    ),
}


def slowdown(kind: str, seed: int, partition_id: int, dispatch_index: int) -> float:
    """The slowdown factor (>= 1) of node ``partition_id``'s ``dispatch_index``-th
    message under speed-variance model ``kind``: 1.0 for ``"none"`` (no draw).

    Raises
    ------
    ValueError
        If ``kind`` is unknown (the message names it and what was expected).
    """
    if kind == NONE:
        return 1.0
    model = SPEED_VARIANCE_MODELS.get(kind)
    if model is None:
        raise ValueError(
            f"speed-variance {kind!r} is unknown; expected one of {[NONE, *SPEED_VARIANCE_MODELS]}"
        )
    rng = np.random.default_rng(
        derive_seed(seed, _SLOWDOWN, int(partition_id), int(dispatch_index))
    )
    return model.factor if rng.uniform() < model.probability else 1.0
