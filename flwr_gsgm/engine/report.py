"""What an engine run produced: :class:`EngineReport`, built from the parts that own
each figure (:meth:`EngineReport.from_parts`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flwr.app import ArrayRecord, MetricRecord

from flwr_gsgm.engine.central_evaluation import weights_record

if TYPE_CHECKING:
    from flwr_gsgm.engine.central_evaluation import Evaluator
    from flwr_gsgm.engine.clock import Clock
    from flwr_gsgm.engine.federated_evaluation import FederatedEvaluator
    from flwr_gsgm.engine.ledger import Ledger
    from flwr_gsgm.engine.membership import Membership
    from flwr_gsgm.engine.run_end import RunEnd
    from flwr_gsgm.model.optimizer import ModelOptimizer
    from flwr_gsgm.nodes.stats import NodeStats
    from flwr_gsgm.scheduling.work_scheduler import WorkScheduler

__all__ = ["EngineReport"]


@dataclass
class EngineReport:
    """What a run produced: final weights, evaluation rows and counters.

    ``counters`` uses the names of ``summary.json`` (:class:`~flwr_gsgm.engine.ledger.Ledger`),
    integers but ``rejected_by_reason`` (the dict ``rejections`` sorted);
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
    default for the client mode). ``work_scheduling`` is the policy the run ended
    with: "off", "equal-time", or "equal-time, turned off: <why>" when a reply showed
    that a ClientApp does not take part (:mod:`flwr_gsgm.scheduling.work_scheduler`);
    ``work_nodes`` gives, per node name, its measured ``seconds_per_step`` and the
    ``local_steps_sent`` in its latest message (None: its own work), empty while
    scheduling is "off" (:meth:`WorkScheduler.nodes_report
    <flwr_gsgm.scheduling.work_scheduler.WorkScheduler.nodes_report>`).
    """

    arrays: ArrayRecord
    rows: list[dict[str, float]]
    counters: dict[str, Any]
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
    work_scheduling: str = "off"
    work_nodes: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def from_parts(
        cls,
        *,
        keys: list[str],
        optimizer: ModelOptimizer,
        received: int,
        ledger: Ledger,
        end: RunEnd,
        stats: NodeStats,
        members: Membership,
        evaluator: Evaluator,
        federated: FederatedEvaluator,
        clock: Clock,
        work: WorkScheduler | None = None,
    ) -> EngineReport:
        """The report of a run from the parts that own its figures: the final weights
        and rule (``optimizer``, arrays named by ``keys``), the ``received`` updates and
        the ledger's counters, how it ended (``end``), the per-node counts and
        warnings (``stats`` over ``members``' nodes), the rows and the last finite
        model (``evaluator``), the federated results and the engine and wall time
        (``clock``), and how work was scheduled (``work``)."""
        mean, worst = ledger.staleness_overall()
        counters = ledger.report_counters(
            optimizer.counters, received, optimizer.version, end.diverged
        )
        return cls(
            arrays=weights_record(keys, optimizer.weights),
            rows=evaluator.rows,
            counters=counters,
            rejections=dict(ledger.rejections),
            staleness_mean=mean,
            staleness_max=worst,
            virtual_seconds=clock.now(),
            wall_seconds=clock.wall(),
            federated=dict(federated.results),
            status=end.status,
            status_reason=end.reason,
            per_node=stats.report(members),
            warnings=list(stats.warnings),
            last_finite=evaluator.last_finite,
            server_learning_rate=float(optimizer.rule.params["lr"]),
            work_scheduling=work.describe() if work is not None else "off",
            work_nodes=work.nodes_report() if work is not None and work.policy != "off" else {},
        )
