"""What an engine run produced: :class:`EngineReport`, built from the engine's books."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flwr.app import ArrayRecord, MetricRecord

from flwr_gsgm.evaluation.central import wall_since, weights_record

if TYPE_CHECKING:
    from flwr_gsgm.engine.async_engine import AsyncEngine

__all__ = ["EngineReport", "build_report"]


@dataclass
class EngineReport:
    """What a run produced: final weights, evaluation rows and counters.

    ``counters`` uses the names of ``summary.json`` (:class:`~flwr_gsgm.engine.ledger.Ledger`);
    ``rejections`` is keyed by :data:`flwr_gsgm.core.REASONS`; staleness in
    versions, times in seconds. ``federated`` maps the updates received at each
    federated evaluation point to the nodes' aggregated metrics. ``status`` is
    "completed", "diverged" or "failed" (:mod:`flwr_gsgm.engine.run_end`), ``status_reason``
    says why a run diverged or failed ("" otherwise); ``per_node`` (counts and state by
    partition-id) and ``warnings`` come from :class:`~flwr_gsgm.nodes.stats.NodeStats`.
    ``last_finite`` holds ``(updates received, model)`` of the last evaluation that
    showed no divergence (None before the first, or if the first diverged): a diverged
    run's ``arrays`` are the diverged model, this is the one to keep.
    ``server_learning_rate`` is the rule's ``lr`` the run used (given, or the rule's
    default for the client mode).
    """

    arrays: ArrayRecord
    rows: list[dict[str, float]]
    counters: dict[str, int]
    rejections: dict[str, int]
    staleness_mean: float
    staleness_max: int
    virtual_seconds: float
    wall_seconds: float
    federated: dict[int, MetricRecord] = field(default_factory=dict)
    status: str = "completed"
    status_reason: str = ""
    per_node: dict[str, dict[str, Any]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    last_finite: tuple[int, ArrayRecord] | None = None
    server_learning_rate: float | None = None


def build_report(engine: AsyncEngine) -> EngineReport:
    """The report of ``engine``'s run: final weights, its rows, the ledger's figures."""
    assert engine.optimizer is not None
    optimizer, ledger = engine.optimizer, engine.ledger
    mean, worst = ledger.staleness_overall()
    counters = ledger.report_counters(
        optimizer.counters, engine.received, optimizer.version, engine.end.diverged
    )
    engine.stats.finish(optimizer.rule.params.get("max_staleness"), engine.members)
    return EngineReport(
        arrays=weights_record(engine.keys, optimizer.weights),
        rows=engine.rows,
        counters=counters,
        rejections=dict(ledger.rejections),
        staleness_mean=mean,
        staleness_max=worst,
        virtual_seconds=engine.clock_now,
        wall_seconds=wall_since(engine.t0),
        federated=dict(engine.federated.results),
        status=engine.end.status,
        status_reason=engine.end.reason,
        per_node=engine.stats.report(engine.members),
        warnings=list(engine.stats.warnings),
        last_finite=engine.evaluator.last_finite,
        server_learning_rate=float(optimizer.rule.params["lr"]),
    )
