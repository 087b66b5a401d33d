"""The record of one train message in flight: :class:`Dispatch`.

The engine makes one per train message (:mod:`flwr_gsgm.engine.dispatcher`), keeps it
while the message is in flight (:mod:`flwr_gsgm.engine.in_flight`), and the reply is
checked against it (:mod:`flwr_gsgm.intake.reply`: the node and the version come from
the dispatch, not from what the reply says). It lives here, below the engine, because
the intake reads it: a plain value with no behaviour of the engine's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Dispatch"]


@dataclass(order=True)
class Dispatch:
    """One train message in flight; ordered by virtual finish time, then send order.

    ``v_finish`` is in virtual seconds (0.0 without the virtual clock); ``sent_at``
    in seconds of ``time.monotonic()``.
    """

    v_finish: float
    seq: int
    partition_id: int = field(compare=False)
    base_version: int = field(compare=False)
    config: dict[str, Any] = field(compare=False)
    # The weights sent (model order), kept when checkpoints are on (a resumed run
    # re-sends them) and in "weights" client mode (the displacement is formed
    # from them): one model copy per message in flight.
    arrays: list[np.ndarray] | None = field(compare=False, default=None)
    message_id: str = field(compare=False, default="")
    node_id: int = field(compare=False, default=0)
    # The local steps work scheduling gave this message (None: the run's own work).
    scheduled_steps: int | None = field(compare=False, default=None)
    sent_at: float = field(compare=False, default=0.0)
    # Lost with its node (the time model's availability): the node went offline at
    # v_finish and is online again at back_at (virtual seconds; inf: never). None: the
    # message is answered.
    back_at: float | None = field(compare=False, default=None)

    #: Fields that belong to one push, not to the dispatch: not checkpointed.
    TRANSIENT = ("message_id", "node_id", "sent_at")
