"""Engine parameters (:class:`EngineSettings`), each tied to its run config key.

The engine declares its defaults here and the run config shows them
(:data:`flwr_gsgm.config.run_config.RUN_CONFIG` reads them from this class), so the
engine imports nothing from the config layer above it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr_gsgm.engine.dispatch_policy import DISPATCH_POLICIES
from flwr_gsgm.engine.federated_evaluation import FederatedEvaluation
from flwr_gsgm.nodes.backoff import Backoff
from flwr_gsgm.scheduling.work_scheduler import WORK_SCHEDULING
from flwr_gsgm.simulation.virtual_clock import VirtualClock

__all__ = ["EngineSettings", "check_deadlines"]


@dataclass(frozen=True)
class EngineSettings:
    """Engine parameters (run config keys in brackets; the run config's defaults are these).

    Attributes
    ----------
    max_updates : int
        Budget in client updates received (client computations, not applied steps)
        [``max-updates``]. Must be >= 1.
    max_seconds : float | None
        Budget in seconds of the engine clock: virtual seconds under the virtual
        clock, wall seconds otherwise [``max-seconds``, 0 = none].
    eval_every : int
        Evaluate every this many client updates received [``eval-every``].
    message_ttl : float
        TTL in seconds of every train and evaluate message [``message-ttl``]; must be
        above ``dispatch_timeout``.
    startup_timeout : float
        The start-up deadline: wall seconds for ``min_nodes`` nodes to answer the
        start-up query, and for a joining node to answer its query; also the TTL of
        a query [``startup-timeout``]. The first message a node handles loads its
        ClientApp, which may take far longer than a dispatch (tens of seconds under
        Ray).
    dispatch_timeout : float
        The per-dispatch deadline: wall seconds a train message may go unanswered;
        then the node fails (:attr:`backoff`) [``dispatch-timeout``].
    max_node_failures : int
        Failures in a row (dispatch time-outs, error replies of any Flower error
        code) after which a node is excluded from the run [``max-node-failures``];
        each failure before that backs it off.
    backoff : Backoff
        How long a failing node waits before it gets work again
        (:class:`flwr_gsgm.nodes.backoff.Backoff`: base 1 s, factor 2, cap 60 s).
    rejoin_timeout : float
        With no node training or backing off, wall seconds the run waits for a lost
        node (one that left the federation) to come back before it fails
        [``rejoin-timeout``].
    poll_interval : float
        Wall seconds to sleep when no reply can be applied [``poll-interval``].
    node_refresh_interval : float
        Wall seconds between checks for new node ids (joins, restarts).
    max_consecutive_rejections : int
        Rejected updates in a row after which a node is excluded (0 = never)
        [``max-consecutive-rejections``]: a node that only sends garbage must not stall
        GSGM's cycles, which wait for every active node.
    max_norm_ratio : float | None
        Reject an update whose L2 norm exceeds this many times the median norm of
        the recently accepted ones (:mod:`flwr_gsgm.intake.norm_bound`) [``max-norm-ratio``,
        0 = off]; None = off.
    min_nodes : int
        Nodes to wait for (up to ``startup_timeout``) before training starts [``min-nodes``].
    checkpoint_every : int
        Save a checkpoint every this many client updates received (0 = never)
        [``checkpoint-every``]; also on SIGTERM when checkpoints are on.
    checkpoint_path : Path | None
        Where the checkpoint goes (written atomically); required if ``checkpoint_every``.
    resume : bool
        Continue from ``checkpoint_path`` [``resume``]; without a checkpoint there
        the run fails (it never starts afresh in silence).
    run_config : Mapping | None
        The resolved run config, recorded in checkpoints: a resume whose config
        differs in what changes the result is refused (:mod:`flwr_gsgm.checkpoint.resume`).
        None (a strategy started from Python): the rule's parameters and the train
        config are compared instead.
    resume_allow_changes : tuple[str, ...]
        Keys that may differ on resume, each change logged [``resume-allow-changes``].
    virtual_clock : VirtualClock | None
        Simulation clock, or None to use real arrival order (deployment).
    query_partition_ids : bool | None
        Ask each new node for its ``partition-id`` with a ``query`` message (the
        ClientApp needs a query handler, :mod:`flwr_gsgm.nodes.query_reply`), so that nodes
        are keyed on their partition (a SuperNode that restarts under a new node id
        keeps its place; a node of another partitioning is refused). False: no query,
        nodes are keyed by node id in node-id order (a ClientApp written for FedAvg has
        no query handler, and under Flower's simulation engine every query would log
        an ERROR traceback). None (default): query only where keys must mean the
        same partition from run to run: with a ``virtual_clock`` (a node's simulated
        device) or ``checkpoint_path`` (a resume finds its nodes).
    seed : int
        Run seed; each dispatch's client seed is derived from it.
    max_in_flight : int | None
        Concurrency limit: at most this many nodes train at once, each with at most
        one dispatch [``max-in-flight``, 0 = all nodes]. None or 0 = every active
        node is kept busy (no limit). When a slot frees (a reply, an error reply, a
        lost node) the ``dispatch`` policy picks the next idle active node; under
        the virtual clock it starts at the virtual time the slot freed.
    dispatch : str
        Which idle node gets a freed slot when ``max_in_flight`` binds [``dispatch``]:
        "random" (uniform, seeded from ``seed``), "scheduled" (fewest updates
        received first; ties: earliest last reply, then partition-id), or "auto"
        (the default: the strategy picks "scheduled" for a rule that schedules
        its nodes, GSGM with ``scheduling``, and "random" for the others); see
        :mod:`flwr_gsgm.engine.dispatch_policy`. Without a limit the node that replied is the only
        idle one, so the policy is not consulted and idle nodes are filled in
        partition-id order, as before the limit existed.
    federated_evaluation : FederatedEvaluation | None
        Evaluation on the nodes every ``federated_evaluation.every`` updates (a
        multiple of ``eval_every``), without pausing training
        [``federated-eval-every``, ``fraction-evaluate``]; None (default) = none.
        See :mod:`flwr_gsgm.engine.federated_evaluation`.
    work_scheduling : str
        "off" or "equal-time" [``work-scheduling``]: size each train message's
        ``local-steps`` by its node's measured speed so that every node computes for
        the same time, and weigh each update by its steps
        (:mod:`flwr_gsgm.scheduling.work_scheduler`). Delta and weights modes only.
    prefetch : bool
        Deployment only: keep two train dispatches per node in flight instead of one
        [``prefetch``], so that the next message already waits on the SuperLink when
        the node asks for work after its reply (no idle poll between updates), at the
        cost of staleness: with N nodes an update is computed on weights about 2N - 1
        versions old instead of N - 1. Needs real arrival
        order (no virtual clock) and no ``max_in_flight``; ``dispatch_timeout`` then
        covers two round trips.

    Raises
    ------
    ValueError
        On a value out of range, or ``message_ttl <= dispatch_timeout``; the message
        names the run config key and the value.
    """

    max_updates: int = 4000
    max_seconds: float | None = None
    eval_every: int = 100
    message_ttl: float = 600.0
    startup_timeout: float = 300.0
    dispatch_timeout: float = 300.0
    max_node_failures: int = 5
    backoff: Backoff = Backoff()
    rejoin_timeout: float = 120.0
    poll_interval: float = 0.01
    node_refresh_interval: float = 10.0
    max_consecutive_rejections: int = 10
    max_norm_ratio: float | None = 10.0
    min_nodes: int = 1
    checkpoint_every: int = 0
    checkpoint_path: Path | None = None
    resume: bool = False
    virtual_clock: VirtualClock | None = None
    query_partition_ids: bool | None = None
    seed: int = 0
    max_in_flight: int | None = None
    dispatch: str = "auto"
    federated_evaluation: FederatedEvaluation | None = None
    prefetch: bool = False
    work_scheduling: str = "off"
    run_config: Mapping[str, Any] | None = None
    resume_allow_changes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        checks = {
            "max-updates": (self.max_updates, self.max_updates >= 1, ">= 1"),
            "eval-every": (self.eval_every, self.eval_every >= 1, ">= 1"),
            "message-ttl": (self.message_ttl, self.message_ttl > 0, "> 0 seconds"),
            "startup-timeout": (self.startup_timeout, self.startup_timeout > 0, "> 0 seconds"),
            "dispatch-timeout": (self.dispatch_timeout, self.dispatch_timeout > 0, "> 0 seconds"),
            "max-node-failures": (self.max_node_failures, self.max_node_failures >= 1, ">= 1"),
            "rejoin-timeout": (self.rejoin_timeout, self.rejoin_timeout >= 0, ">= 0 seconds"),
            "poll-interval": (self.poll_interval, self.poll_interval >= 0, ">= 0 seconds"),
            "min-nodes": (self.min_nodes, self.min_nodes >= 1, ">= 1"),
        }
        for key, (value, ok, expected) in checks.items():
            if not ok:
                raise ValueError(f"{key} must be {expected}, got {value!r}")
        check_deadlines(self.message_ttl, self.dispatch_timeout)
        if self.max_norm_ratio is not None and not self.max_norm_ratio > 0:
            raise ValueError(
                f"max-norm-ratio must be > 0 or None (off), got {self.max_norm_ratio!r}"
            )
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint-every must be >= 0, got {self.checkpoint_every!r}")
        if (self.checkpoint_every or self.resume) and self.checkpoint_path is None:
            raise ValueError("checkpoint-every / resume need a checkpoint path (a run folder)")
        if self.max_seconds is not None and not self.max_seconds > 0:
            raise ValueError(f"max-seconds must be > 0 or unset, got {self.max_seconds!r}")
        if self.max_in_flight is not None and (
            isinstance(self.max_in_flight, bool)
            or not isinstance(self.max_in_flight, int)
            or self.max_in_flight < 0
        ):
            raise ValueError(
                "max-in-flight must be an integer >= 0 (0 = all nodes) or None, got "
                f"{self.max_in_flight!r}"
            )
        fed = self.federated_evaluation
        if fed is not None and fed.every % self.eval_every:
            raise ValueError(
                f"federated-eval-every={fed.every} must be a multiple of "
                f"eval-every={self.eval_every} (each point goes into an evaluation row)"
            )
        if self.dispatch not in ("auto", *DISPATCH_POLICIES):
            raise ValueError(
                f"dispatch must be one of auto, {', '.join(DISPATCH_POLICIES)}, "
                f"got {self.dispatch!r}"
            )

        if self.work_scheduling not in WORK_SCHEDULING:
            raise ValueError(
                f"work-scheduling must be one of {', '.join(WORK_SCHEDULING)}, "
                f"got {self.work_scheduling!r}"
            )
        if self.prefetch and (self.virtual or self.in_flight_limit):
            raise ValueError(
                "prefetch needs virtual-clock = false and max-in-flight = 0, got "
                f"virtual-clock = {self.virtual}, "
                f"max-in-flight = {self.max_in_flight or 0}"
            )

    @property
    def virtual(self) -> bool:
        """Whether the engine clock is virtual: with a ``virtual_clock``, the one test of
        it (:func:`flwr_gsgm.engine.clock.make_clock` picks the clock by it)."""
        return self.virtual_clock is not None

    @property
    def dispatches_per_node(self) -> int:
        """Train dispatches a node may have in flight: 2 with ``prefetch``, else 1."""
        return 2 if self.prefetch else 1

    @property
    def queries_partition_ids(self) -> bool:
        """Whether new nodes are asked for their partition-id (``query_partition_ids``
        with None resolved: with a virtual clock or checkpoints)."""
        if self.query_partition_ids is not None:
            return bool(self.query_partition_ids)
        return self.virtual or self.checkpoint_path is not None

    @property
    def in_flight_limit(self) -> int | None:
        """``max_in_flight`` with 0 read as None (no limit)."""
        return self.max_in_flight or None


def check_deadlines(message_ttl: float, dispatch_timeout: float) -> None:
    """Refuse time settings that contradict each other.

    A train message expires on the SuperLink after ``message-ttl`` seconds, so a
    per-dispatch deadline at or above it could never fire before the message is gone
    (docs/DEPLOYMENT.md: the deadline stays below the TTL).

    Raises
    ------
    ValueError
        If ``message_ttl <= dispatch_timeout``; the message names both keys and values.
    """
    if not message_ttl > dispatch_timeout:
        raise ValueError(
            f"run config message-ttl={message_ttl!r} must be greater than "
            f"dispatch-timeout={dispatch_timeout!r}: a message expires after message-ttl, so "
            "the per-dispatch deadline must come first; raise message-ttl or lower "
            "dispatch-timeout"
        )
