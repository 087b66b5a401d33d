"""When a run's model has diverged: one notion for every strategy and every way of running.

A run has diverged, ends at once with ``status`` "diverged" (:data:`DIVERGED`) and a
``status_reason`` "<kind>: <details>" (the kinds: :data:`KINDS`), when:

1. ``non-finite weights``: at an evaluation, a weight or buffer of the global model
   is NaN or infinite (every later update would be rejected);
2. ``non-finite test loss``: the centralized evaluation's loss is NaN or infinite;
3. ``exploding test loss``: the test loss exceeds :data:`LOSS_GROWTH` (10) times the
   run's first evaluation's loss (that of the initial model, at 0 updates; kept in
   the checkpoint's rows, so a resumed run keeps it). Why 10 x the initial loss: an
   untrained classifier's mean cross-entropy is about ln(classes) (2.30 on 10
   classes), so 10 x is 23, the loss of a model that gives the true class a mean
   log-probability of -23 (a probability of 1e-10): no model that is training gets
   there, while observed diverged runs reached 7e4. The initial loss, not
   ln(classes) x 10, because the server knows neither the classes nor the loss
   (any ``evaluate_fn``); the check is off when the initial loss is not finite and > 0;
4. ``replies rejected``: at least :data:`REJECTED_SHARE` (half) of the last
   :data:`REJECTION_WINDOW` (20) updates received were rejected as ``non-finite``
   or ``norm-ratio`` (:data:`DIVERGENCE_REASONS`), and so was the latest reply of
   every active node that replied within those 20, from at least :data:`MIN_NODES`
   (2) nodes (1 when only one is active). When every node's update is far above
   the norm bound, the nodes are not at fault: the model moved (too large a
   learning rate), so no node is excluded for it; the check runs before the node's
   ``max-consecutive-rejections`` exclusion, and "at least half" lets a lone node
   reach it at its 10th rejection in a row, where the default limit of 10 would
   exclude it. One bad node among honest ones is not a divergence: the honest
   nodes' latest replies pass, and the bad node is excluded as before.

Checks 1-3 run at every evaluation of the asynchronous engine
(:mod:`flwr_gsgm.engine.central_evaluation`), 2-3 on the evaluation rows of Flower's FedAvg and
FedAvgM in ``serverapp/experiment.py``; check 4 at every rejected update
(:class:`DivergenceWatch`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from typing import Any

import numpy as np

__all__ = [
    "DIVERGENCE_REASONS",
    "KINDS",
    "LOSS_GROWTH",
    "MIN_NODES",
    "REJECTED_SHARE",
    "REJECTION_WINDOW",
    "DivergenceWatch",
    "evaluation_divergence",
]

#: The test loss may grow to this many times the initial evaluation's loss (check 3).
LOSS_GROWTH = 10.0
#: Updates received (accepted or rejected) that check 4 looks back over.
REJECTION_WINDOW = 20
#: Check 4: at least this share of the window rejected for DIVERGENCE_REASONS.
REJECTED_SHARE = 0.5
#: Check 4: at least this many nodes (or every active node, if fewer) rejected last.
MIN_NODES = 2
#: Rejection reasons that say an update is out of scale (check 4).
DIVERGENCE_REASONS = ("non-finite", "norm-ratio")
#: The first words of a diverged run's ``status_reason``, one per check.
KINDS = ("non-finite weights", "non-finite test loss", "exploding test loss", "replies rejected")


def evaluation_divergence(
    received: int,
    weights: Iterable[np.ndarray] | None,
    loss: float | None,
    initial_loss: float | None,
) -> str | None:
    """The reason an evaluation shows divergence (checks 1-3), or None.

    Parameters
    ----------
    received : int
        Client updates received at the evaluation (for the message).
    weights : iterable of numpy arrays | None
        The evaluated model (every array); None skips check 1.
    loss : float | None
        Its test loss; None when the evaluation gave none (checks 2-3 skipped).
    initial_loss : float | None
        The run's first evaluation's loss; None, or not finite and > 0: check 3 off.
    """
    if weights is not None and not all(bool(np.isfinite(w).all()) for w in weights):
        return f"non-finite weights: the global model holds NaN or inf at {received} updates"
    if loss is None:
        return None
    if not math.isfinite(loss):
        return f"non-finite test loss: {loss} at {received} updates"
    if (
        initial_loss is not None
        and math.isfinite(initial_loss)
        and initial_loss > 0.0
        and loss > LOSS_GROWTH * initial_loss
    ):
        return (
            f"exploding test loss: {loss:.6g} at {received} updates exceeds "
            f"{LOSS_GROWTH:g} x the initial evaluation's loss {initial_loss:.6g}"
        )
    return None


class DivergenceWatch:
    """Check 4 of the module: the last :data:`REJECTION_WINDOW` updates received.

    The engine tells it every update received (:meth:`reply`): accepted (reason None)
    or rejected with its reason.
    """

    def __init__(self) -> None:
        self.window: deque[tuple[int, bool]] = deque(maxlen=REJECTION_WINDOW)

    def reply(self, partition_id: int, reason: str | None, active: Iterable[int]) -> str | None:
        """Record ``partition_id``'s update (``reason``: why it was rejected, None if
        accepted); return the divergence reason if check 4 now holds, else None.

        ``active`` holds the partition-ids of the nodes still in the run.
        """
        bad = reason in DIVERGENCE_REASONS
        self.window.append((partition_id, bad))
        if not bad:
            return None
        rejected = sum(b for _, b in self.window)
        if rejected < REJECTED_SHARE * REJECTION_WINDOW:
            return None
        latest = {pid: b for pid, b in self.window}  # each node's latest in the window
        active = set(active) | {partition_id}
        seen = sorted(pid for pid in latest if pid in active)
        if not all(latest[pid] for pid in seen) or len(seen) < min(MIN_NODES, len(active)):
            return None
        return (
            f"replies rejected: {rejected} of the last {len(self.window)} updates received "
            f"were rejected ({' or '.join(DIVERGENCE_REASONS)}), the latest of every node "
            f"that replied among them too (partitions {seen}): the model moved away from "
            "every node's updates (too large a learning rate?); no node is blamed"
        )

    def state_dict(self) -> dict[str, Any]:
        """The window as python values."""
        return {"window": [[pid, bad] for pid, bad in self.window]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.window = deque(
            ((int(pid), bool(bad)) for pid, bad in state["window"]), maxlen=REJECTION_WINDOW
        )
