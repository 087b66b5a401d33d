"""Evaluation rows of an asynchronous run, each checked for divergence.

Each row (one line of ``metrics.csv``, columns
:data:`flwr_gsgm.config.outputs.METRIC_COLUMNS`) holds the centralized evaluation of
the global model and the ledger's figures since the previous row.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from logging import INFO
from typing import Any, Protocol

import numpy as np
from flwr.app import Array, ArrayRecord, MetricRecord
from flwr.common.logger import log

from flwr_gsgm.engine.divergence import evaluation_divergence
from flwr_gsgm.engine.hooks import OnEvaluate, call_hook, evaluation_metrics
from flwr_gsgm.engine.ledger import Ledger

__all__ = ["EvaluateFn", "EvaluatedModel", "Evaluator", "weights_record"]

EvaluateFn = Callable[[int, ArrayRecord], "MetricRecord | None"]


class EvaluatedModel(Protocol):
    """What an evaluation row reads of the global model: the asynchronous engine's
    :class:`~flwr_gsgm.model.optimizer.ModelOptimizer`, or a synchronous round's
    :class:`~flwr_gsgm.strategy.synchronous.RoundModel`."""

    @property
    def version(self) -> int:
        """Steps taken on the model (asynchronous) or rounds applied (synchronous)."""

    @property
    def weights(self) -> list[np.ndarray]:
        """The model's arrays in model order."""

    @property
    def counters(self) -> Mapping[str, int]:
        """Outcome counters: ``deferred``, ``stale``, ``slots_dropped`` (absent: 0)."""


def weights_record(keys: list[str], weights: list[np.ndarray]) -> ArrayRecord:
    """An ``ArrayRecord`` holding copies of ``weights`` under ``keys`` (model order)."""
    return ArrayRecord({k: Array(np.array(w)) for k, w in zip(keys, weights)})


class Evaluator:
    """Builds evaluation rows with ``evaluate_fn`` (or NaN accuracy and loss without it).

    Parameters
    ----------
    keys : list[str]
        Array keys of the model.
    evaluate_fn : callable | None
        ``(updates_received, arrays) -> MetricRecord | None`` with ``accuracy`` and ``loss``.
    max_updates : int
        The run's budget, for the log line only.
    on_evaluate : callable | None
        ``(updates, arrays, metrics) -> None``, called after each row is built
        (:mod:`flwr_gsgm.engine.hooks`; ``metrics``:
        :func:`~flwr_gsgm.engine.hooks.evaluation_metrics`).
    virtual : bool
        Whether the run's clock is virtual (:attr:`~flwr_gsgm.engine.clock.Clock.virtual`):
        the log line shows the virtual time beside the wall time only then (under the
        wall clock the row's ``virtual_time`` is the wall time).

    Attributes
    ----------
    rows : list[dict]
        The run's evaluation rows so far (:meth:`evaluate` appends one; federated
        evaluation adds its columns to the row of its point).
    last_finite : tuple[int, ArrayRecord] | None
        ``(updates received, model)`` of the last evaluation that showed no divergence
        (a copy; None before the first): the model a diverged run keeps. It costs one
        model copy.
    """

    def __init__(
        self,
        keys: list[str],
        evaluate_fn: EvaluateFn | None,
        max_updates: int,
        on_evaluate: OnEvaluate | None = None,
        virtual: bool = True,
    ) -> None:
        self.keys = keys
        self.virtual = virtual
        self.evaluate_fn = evaluate_fn
        self.on_evaluate = on_evaluate
        self.max_updates = max_updates
        self.rows: list[dict[str, float]] = []
        self.last_finite: tuple[int, ArrayRecord] | None = None
        self.initial_loss: float | None = None  # the first row's (a resume restores it)

    def evaluate(
        self,
        received: int,
        optimizer: EvaluatedModel,
        ledger: Ledger,
        clock_now: float,
        wall: float,
    ) -> str | None:
        """Append the :meth:`row` of now to :attr:`rows`; return why the model diverged
        (None if it did not)."""
        row, reason = self.row(received, optimizer, ledger, clock_now, wall)
        self.rows.append(row)
        return reason

    def state_dict(self) -> dict[str, list[dict[str, float]]]:
        """``{"rows": [...]}``: the rows so far (the first one's loss is the reference
        of the divergence check)."""
        return {"rows": [dict(r) for r in self.rows]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.rows = [dict(r) for r in state["rows"]]
        self.initial_loss = self.rows[0]["loss"] if self.rows else None

    def row(
        self,
        received: int,
        optimizer: EvaluatedModel,
        ledger: Ledger,
        clock_now: float,
        wall: float,
    ) -> tuple[dict[str, float], str | None]:
        """Evaluate now; return the row and why the model diverged (None if it did not).

        Raises :class:`flwr_gsgm.engine.hooks.HookFailed` if ``on_evaluate`` raised.

        ``clock_now`` is the engine clock and ``wall`` the wall seconds since the start;
        :func:`flwr_gsgm.engine.divergence.evaluation_divergence` checks the weights and the
        loss (against the first row's, ``initial_loss``).
        """
        row: dict[str, float] = {
            "updates": received,
            "version": optimizer.version,
            "virtual_time": round(clock_now, 6),
            "wall_time": round(wall, 3),
            "accuracy": math.nan,
            "loss": math.nan,
        }
        loss_known = False
        model = weights_record(self.keys, optimizer.weights)
        res = None
        if self.evaluate_fn is not None:
            res = self.evaluate_fn(received, model)
            if res is not None:
                row["accuracy"] = float(res.get("accuracy", math.nan))
                row["loss"] = float(res.get("loss", math.nan))
                loss_known = "loss" in res
        row.update(ledger.window_stats())
        opt_counters = optimizer.counters
        row["deferred"] = int(opt_counters.get("deferred", 0))
        row["rejected"] = ledger.rejected
        row["dropped"] = ledger.dropped(opt_counters)
        loss = row["loss"] if loss_known else None
        reason = evaluation_divergence(received, optimizer.weights, loss, self.initial_loss)
        if self.initial_loss is None:
            self.initial_loss = row["loss"]
        if reason is None:
            self.last_finite = (received, model)
        self._log(row)
        if self.on_evaluate is not None:
            # Every row, a diverged one too: what the hook logs is what metrics.csv holds.
            metrics = evaluation_metrics(row, res)
            call_hook(
                "on_evaluate", self.on_evaluate, updates=received, arrays=model, metrics=metrics
            )
        return row, reason

    def _log(self, row: dict[str, float]) -> None:
        vtime = f"vtime {row['virtual_time']:.1f} s | " if self.virtual else ""
        log(
            INFO,
            "[async] updates %d/%d | version %d | %swall %.1f s | "
            "acc %.4f | loss %.4f | staleness mean %.2f max %d",
            row["updates"],
            self.max_updates,
            row["version"],
            vtime,
            row["wall_time"],
            row["accuracy"],
            row["loss"],
            row["staleness_mean"],
            row["staleness_max"],
        )
