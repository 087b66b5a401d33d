"""The engine's books: what happened to every reply and node, counted once.

The server optimizer decides (outcome, staleness) and counts outcomes itself
(``ServerOptimizer.counters``: ``applied``, ``deferred``, ``stale``,
``slots_dropped``); the :class:`Ledger` records the staleness the optimizer
computed (``ServerOptimizer.last_staleness``), train losses, rejections by reason
(one list: :data:`flwr_gsgm.core.REASONS`) and the engine's own events, and reads
the optimizer's counters instead of counting outcomes again.

Counter names are snake_case and are the names ``summary.json`` uses
(:func:`flwr_gsgm.config.outputs.summarize`): :data:`ENGINE_COUNTERS` for the
engine's events and :meth:`Ledger.report_counters` for a run's report.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from flwr_gsgm.core import REASONS

__all__ = ["ENGINE_COUNTERS", "Ledger", "Window"]

#: Events the engine counts itself (the optimizer counts the outcomes of updates).
ENGINE_COUNTERS = (
    "error_replies",
    "dispatch_timeouts",
    "node_backoffs",
    "nodes_lost",
    "nodes_excluded",
    "lost_in_flight",
    "nodes_refused",
    "nodes_joined",
    # federated evaluation (flwr_gsgm.engine.federated_evaluation): evaluate messages sent,
    # replies aggregated, replies left out (error, invalid, too late)
    "federated_eval_sent",
    "federated_eval_replies",
    "federated_eval_failed",
)


class Window:
    """Staleness (versions) and train-loss statistics since the last evaluation and overall."""

    def __init__(self) -> None:
        self.total_sum = 0
        self.total_count = 0
        self.total_max = 0
        self.reset()

    def reset(self) -> None:
        """Start a new evaluation window (the totals stay)."""
        self.sum = 0
        self.count = 0
        self.max = 0
        self.loss_sum = 0.0
        self.loss_count = 0

    def add(self, staleness: int) -> None:
        """Record the staleness of one valid update."""
        self.sum += staleness
        self.count += 1
        self.max = max(self.max, staleness)
        self.total_sum += staleness
        self.total_count += 1
        self.total_max = max(self.total_max, staleness)

    def add_loss(self, loss: float) -> None:
        """Record one client's mean train loss."""
        self.loss_sum += loss
        self.loss_count += 1


class Ledger:
    """Counters of one run: engine events, rejections by reason, staleness windows."""

    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()
        self.rejections: Counter[str] = Counter()
        self.window = Window()

    def count(self, event: str, n: int = 1) -> None:
        """Count ``n`` engine events ``event`` (one of :data:`ENGINE_COUNTERS`).

        Raises
        ------
        ValueError
            If ``event`` is not in :data:`ENGINE_COUNTERS` (a misspelt counter).
        """
        if event not in ENGINE_COUNTERS:
            raise ValueError(f"unknown engine counter {event!r}; expected one of {ENGINE_COUNTERS}")
        if n:
            self.counters[event] += n

    def record_update(self, staleness: int, train_loss: Any) -> None:
        """A valid update: its staleness (the optimizer's) and its train loss if finite."""
        self.window.add(staleness)
        if isinstance(train_loss, (int, float)) and math.isfinite(train_loss):
            self.window.add_loss(float(train_loss))

    def record_rejection(self, reason: str) -> None:
        """A rejected update; ``reason`` must be one of :data:`flwr_gsgm.core.REASONS`.

        Raises
        ------
        ValueError
            If ``reason`` is not in the list (a rejection outside the one list).
        """
        if reason not in REASONS:
            raise ValueError(f"rejection reason {reason!r} is not in flwr_gsgm.core.REASONS")
        self.rejections[reason] += 1

    @property
    def rejected(self) -> int:
        """Updates rejected so far (every reason)."""
        return sum(self.rejections.values())

    def dropped(self, optimizer_counters: dict[str, int]) -> int:
        """Valid work thrown away: stale updates, dropped GSGM slots, dispatches lost in flight."""
        return (
            int(optimizer_counters.get("stale", 0))
            + int(optimizer_counters.get("slots_dropped", 0))
            + self.counters["lost_in_flight"]
        )

    def window_stats(self) -> dict[str, float]:
        """The evaluation row's window columns; starts a new window."""
        w = self.window
        stats = {
            "staleness_mean": round(w.sum / w.count, 6) if w.count else 0.0,
            "staleness_max": w.max,
            "train_loss": round(w.loss_sum / w.loss_count, 6) if w.loss_count else math.nan,
        }
        w.reset()
        return stats

    def staleness_overall(self) -> tuple[float, int]:
        """(mean, max) staleness in versions over the whole run."""
        w = self.window
        return (w.total_sum / w.total_count) if w.total_count else 0.0, w.total_max

    def report_counters(
        self, optimizer_counters: dict[str, int], received: int, steps: int, diverged: bool
    ) -> dict[str, Any]:
        """Every counter of a run under its ``summary.json`` name (snake_case), the
        updates first: ``updates_received``, ``updates_applied``, ``rejected`` and
        ``rejected_by_reason`` (``{reason: count}`` of the reasons that occurred,
        sorted: the one dict the end-of-run log line and ``summary.json`` show), then
        the others (integers)."""
        opt = optimizer_counters
        counters: dict[str, Any] = {
            "updates_received": received,
            "updates_applied": int(opt.get("applied", 0)),
            "rejected": self.rejected,
            "rejected_by_reason": dict(sorted(self.rejections.items())),
        }
        counters.update({name: self.counters[name] for name in ENGINE_COUNTERS})
        counters.update(
            {
                "steps_applied": steps,
                "updates_deferred": int(opt.get("deferred", 0)),
                "updates_stale": int(opt.get("stale", 0)),
                "slots_dropped": int(opt.get("slots_dropped", 0)),
                "dropped": self.dropped(opt),
                "diverged": int(diverged),
            }
        )
        return counters

    # --------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Counters, rejections and windows as python values."""
        return {
            "counters": dict(self.counters),
            "rejections": dict(self.rejections),
            "window": dict(vars(self.window)),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.counters = Counter(state["counters"])
        self.rejections = Counter(state["rejections"])
        vars(self.window).update(state["window"])
