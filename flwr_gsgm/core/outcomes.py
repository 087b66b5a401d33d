"""What a server optimizer tells its caller about an update: an outcome or a rejection.

:class:`Outcome` is what happened to a valid update; :class:`UpdateRejected` is raised
for an invalid one, with a reason code of :data:`REASONS`. This module imports
nothing but the standard library.
"""

from __future__ import annotations

import enum
from typing import ClassVar

__all__ = ["CORE_REASONS", "INTAKE_REASONS", "REASONS", "Outcome", "UpdateRejected"]


class Outcome(str, enum.Enum):
    """What happened to a valid update.

    - ``APPLIED``: the update (alone, or within the GSGM slot it was folded into)
      took a step on ``w`` during this call.
    - ``DEFERRED``: kept for later (a GSGM pending slot, the FedBuff buffer).
    - ``STALE``: dropped because its staleness exceeded ``max_staleness``.
    """

    APPLIED = "applied"
    DEFERRED = "deferred"
    STALE = "stale"


#: Rejection reasons of the server optimizers' validation (:meth:`ServerOptimizer.on_update`).
CORE_REASONS: tuple[str, ...] = (
    "num-arrays",
    "shape",
    "dtype",
    "non-finite",
    "norm",
    "unknown-node",
    "base-version",
    "step-range",
)
#: Rejection reasons of the engine's reply intake (:mod:`flwr_gsgm.intake.reply`),
#: checked before the optimizer sees an update: no ArrayRecord / MetricRecord, more
#: than one ArrayRecord (which one is the update?), a
#: metadata that is not what the protocol says (a partition-id, model-version or
#: num-examples that is not an integer, a train-loss that is not a number), a
#: partition-id or model-version other than the message's, other array keys, arrays
#: that cannot be decoded; ``"duplicate"``: a replayed reply (a second reply to a
#: message, a reply to a message not in flight or from another node), ignored; and
#: ``"norm-ratio"``: an update far larger than the recent accepted ones (the engine's
#: relative norm bound, ``flwr_gsgm.intake.norm_bound``).
INTAKE_REASONS: tuple[str, ...] = (
    "missing-arrays",
    "extra-arrays",
    "missing-metrics",
    "metadata",
    "partition-id",
    "model-version",
    "array-keys",
    "array-format",
    "duplicate",
    "norm-ratio",
)
#: Every rejection reason of a run, the one list ``rejected_by_reason`` is keyed by.
REASONS: tuple[str, ...] = INTAKE_REASONS + CORE_REASONS


class UpdateRejected(ValueError):
    """An update failed validation; the optimizer state is unchanged.

    Attributes:
        reason: short kebab-case code, one of :data:`REASONS` (the optimizers raise
            those of :data:`CORE_REASONS`, the engine's reply intake those of
            :data:`INTAKE_REASONS`).
        message: what was wrong: the offending value and what was expected.
    """

    REASONS: ClassVar[tuple[str, ...]] = REASONS

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(reason, message)
        self.reason = reason
        self.message = message

    def __str__(self) -> str:
        return f"update rejected ({self.reason}): {self.message}"
