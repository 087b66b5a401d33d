"""Engine parameters (:class:`EngineSettings`): each declared once, with its run config key.

Every engine setting that a run config sets is one field of :class:`EngineSettings`
declared with :func:`setting`: its run config key, default, check (what it expects)
and one line of help (a :class:`Setting`, in the style of the core rules'
:class:`flwr_gsgm.core.Param`). The run config's engine keys are derived from these
declarations (:data:`ENGINE_SETTINGS`, read by :func:`flwr_gsgm.config.keys.engine_keys`),
so the engine imports nothing from the config layer above it, and a default or a
check written anywhere else is a bug.

"0 means none" (``max-in-flight = 0``: every node; ``max-norm-ratio = 0``: off;
``max-seconds = 0``: no limit) is translated in one place, :meth:`Setting.value`,
which :class:`EngineSettings` applies to every declared field: such a field holds
None for "none", whether it was given 0 (a run config) or None (Python).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from flwr_gsgm.engine.dispatch_policy import DISPATCH_POLICIES
from flwr_gsgm.engine.federated_evaluation import FederatedEvaluation
from flwr_gsgm.intake.norm_bound import INITIAL_ROOM, NEW_NODE_ROOM, NODE_MIN, WARMUP, WINDOW
from flwr_gsgm.nodes.backoff import Backoff
from flwr_gsgm.scheduling.work_scheduler import WORK_SCHEDULING
from flwr_gsgm.simulation.virtual_clock import VirtualClock

__all__ = ["ENGINE_SETTINGS", "EngineSettings", "Setting", "check_deadlines", "setting"]

# The metadata key of a declared field (dataclasses.field(metadata=...)).
_SETTING = "flwr_gsgm.setting"


@dataclass(frozen=True)
class Setting:
    """One engine setting: its field, run config key, default, check and help.

    Attributes:
        key: the kebab-case run config key.
        default: the run config default, of the key's type (``int``, ``float``,
            ``bool`` or ``str``); the field's default is :meth:`value` of it.
        check: ``value -> bool``, on a value of the key's type (0 included where it
            means none).
        expected: what ``check`` accepts, in words, for the error messages
            (``an integer >= 0 (0 = all nodes)``).
        doc: one line of help for the run config table (docs/REFERENCE.md).
        zero_is_none: the run config's ``0`` (TOML has no null) stands for the
            field's None ("no limit", "off"); the field then also takes None.
        name: the :class:`EngineSettings` field, filled in from the declaration.
    """

    key: str
    default: Any
    check: Callable[[Any], bool]
    expected: str
    doc: str
    zero_is_none: bool = False
    name: str = ""

    @property
    def kind(self) -> type:
        """The run config value's type: the default's."""
        return type(self.default)

    def value(self, raw: Any) -> Any:
        """The field's value for the run config's ``raw`` (already checked): ``0`` read
        as None where it means none; the one place this translation is made."""
        if self.zero_is_none and not isinstance(raw, bool) and raw == 0:
            return None
        return raw

    def shown(self, value: Any) -> Any:
        """The run config value of the field's ``value``: None as ``0`` where 0 means none
        (for messages that name the key)."""
        return self.kind(0) if value is None and self.zero_is_none else value

    def checked(self, value: Any) -> Any:
        """``value`` (a field's, or a run config's) as the field holds it: checked, then
        :meth:`value`.

        Raises:
            ValueError: ``<key> must be <expected>[ or None], got <value>`` for a value
                of the wrong type or one ``check`` refuses.
        """
        if value is None and self.zero_is_none:
            return None
        if not (_of_kind(value, self.kind) and self.check(value)):
            none = " or None" if self.zero_is_none else ""
            raise ValueError(f"{self.key} must be {self.expected}{none}, got {value!r}")
        return self.value(value)


def _of_kind(value: Any, kind: type) -> bool:
    """``value`` is of ``kind`` as the run config reads it: an int is a float, no bool is
    a number."""
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind is int:
        return isinstance(value, numbers.Integral)
    if kind is float:
        return isinstance(value, numbers.Real)
    return isinstance(value, kind)


def setting(
    key: str,
    default: Any,
    check: Callable[[Any], bool],
    expected: str,
    doc: str,
    *,
    zero_is_none: bool = False,
) -> Any:
    """An :class:`EngineSettings` field declared as a run config setting
    (:class:`Setting`'s attributes); its default is the run config default read by
    :meth:`Setting.value` (``0`` -> None with ``zero_is_none``)."""
    declared = Setting(key, default, check, expected, doc, zero_is_none)
    return field(default=declared.value(default), metadata={_SETTING: declared})


def _positive(v: Any) -> bool:
    return v > 0


def _non_negative(v: Any) -> bool:
    return v >= 0


def _any(v: Any) -> bool:
    return True


def _one_of(*values: str) -> Callable[[Any], bool]:
    return lambda v: v in values


def _either(*values: str) -> str:
    """``a, b or c``."""
    return f"{', '.join(values[:-1])} or {values[-1]}"


@dataclass(frozen=True)
class EngineSettings:
    """Engine parameters (run config keys in brackets; each keyed field is declared with
    :func:`setting`, and the run config's key, default and check are that declaration).

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
        On a declared field of the wrong type or out of range (``<key> must be
        <expected>, got <value>``: :meth:`Setting.checked`), ``message_ttl <=
        dispatch_timeout``, ``checkpoint_every`` or ``resume`` without a
        ``checkpoint_path``, a ``federated_evaluation`` not every multiple of
        ``eval_every``, or ``prefetch`` with a virtual clock or a ``max_in_flight``;
        the message names the run config key and the value.
    """

    # Declared settings (a run config key each), in the run config's order.
    max_updates: int = setting(
        "max-updates",
        4000,
        _positive,
        "an integer > 0",
        "budget: client updates received (client computations)",
    )
    max_seconds: float | None = setting(
        "max-seconds",
        0.0,
        _non_negative,
        ">= 0 (0 = no limit)",
        "budget: virtual seconds (virtual-clock = true) or wall seconds",
        zero_is_none=True,
    )
    eval_every: int = setting(
        "eval-every", 100, _positive, "an integer > 0", "evaluate every N client updates received"
    )
    message_ttl: float = setting(
        "message-ttl",
        600.0,
        _positive,
        "> 0 seconds",
        "TTL of every train and evaluate message (above dispatch-timeout)",
    )
    startup_timeout: float = setting(
        "startup-timeout",
        300.0,
        _positive,
        "> 0 seconds",
        "start-up deadline: wall seconds for min-nodes to answer the query (also a joining "
        "node's query, and a query's TTL)",
    )
    dispatch_timeout: float = setting(
        "dispatch-timeout",
        300.0,
        _positive,
        "> 0 seconds, below message-ttl",
        "per-dispatch deadline: wall seconds a train message may go unanswered before the "
        "node fails",
    )
    max_node_failures: int = setting(
        "max-node-failures",
        5,
        _positive,
        "an integer > 0",
        "failures in a row (time-outs, error replies; each backs the node off) that exclude a node",
    )
    rejoin_timeout: float = setting(
        "rejoin-timeout",
        120.0,
        _non_negative,
        ">= 0 seconds",
        "with no node left training, wall seconds to wait for a lost node before the run fails",
    )
    poll_interval: float = setting(
        "poll-interval", 0.01, _non_negative, ">= 0 seconds", "sleep between pulls when idle"
    )
    max_consecutive_rejections: int = setting(
        "max-consecutive-rejections",
        10,
        _non_negative,
        "an integer >= 0 (0 = never)",
        "a node whose updates are rejected this often in a row is excluded",
    )
    max_norm_ratio: float | None = setting(
        "max-norm-ratio",
        10.0,
        _non_negative,
        ">= 0 (0 = off)",
        f"reject an update whose L2 norm exceeds this times the median of the last {WINDOW} "
        f"accepted ({NEW_NODE_ROOM:g}x that for a node with fewer than {NODE_MIN} accepted, "
        f"and for all in the first {WARMUP}, which must also stay within "
        f"{INITIAL_ROOM:g}x the initial model's scale)",
        zero_is_none=True,
    )
    min_nodes: int = setting(
        "min-nodes", 1, _positive, "an integer > 0", "nodes to wait for before training"
    )
    max_in_flight: int | None = setting(
        "max-in-flight",
        0,
        _non_negative,
        "an integer >= 0 (0 = all nodes)",
        "nodes training at once (FedAvg/FedAvgM: nodes sampled per round)",
        zero_is_none=True,
    )
    prefetch: bool = setting(
        "prefetch",
        False,
        _any,
        "true or false",
        "deployment: a second train message queued per node, waiting when it polls",
    )
    dispatch: str = setting(
        "dispatch",
        "auto",
        _one_of("auto", *DISPATCH_POLICIES),
        _either("auto", *DISPATCH_POLICIES),
        "which idle node gets a freed slot (max-in-flight < nodes); auto = scheduled "
        "for GSGM with scheduling, random for the others",
    )
    work_scheduling: str = setting(
        "work-scheduling",
        "off",
        _one_of(*WORK_SCHEDULING),
        ", ".join(WORK_SCHEDULING),
        "delta/weights mode: equal-time sizes each message's local-steps by its node's "
        "measured speed and scales a longer-than-mean update down by its steps (needs "
        "train-steps replies); "
        "time-budget-fedavg and fednova always schedule equal-time",
    )
    checkpoint_every: int = setting(
        "checkpoint-every",
        0,
        _non_negative,
        "an integer >= 0 (0 = never)",
        "save the server state every N client updates (and on SIGTERM)",
    )
    resume: bool = setting(
        "resume",
        False,
        _any,
        "true or false",
        "continue from outputs/<run-name>/checkpoint.pt (fails without one)",
    )
    # Set from Python (or by the run config layer from other keys): no key of their own.
    backoff: Backoff = Backoff()
    node_refresh_interval: float = 10.0
    checkpoint_path: Path | None = None
    virtual_clock: VirtualClock | None = None
    query_partition_ids: bool | None = None
    seed: int = 0
    federated_evaluation: FederatedEvaluation | None = None
    run_config: Mapping[str, Any] | None = None
    resume_allow_changes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # Each declared setting's own check, and its "0 means none" (Setting.value).
        for declared in ENGINE_SETTINGS:
            object.__setattr__(self, declared.name, declared.checked(getattr(self, declared.name)))
        check_deadlines(self.message_ttl, self.dispatch_timeout)
        # The checks that tie settings together.
        if (self.checkpoint_every or self.resume) and self.checkpoint_path is None:
            raise ValueError("checkpoint-every / resume need a checkpoint path (a run folder)")
        fed = self.federated_evaluation
        if fed is not None and fed.every % self.eval_every:
            raise ValueError(
                f"federated-eval-every={fed.every} must be a multiple of "
                f"eval-every={self.eval_every} (each point goes into an evaluation row)"
            )
        if self.prefetch and (self.virtual or self.max_in_flight is not None):
            raise ValueError(
                "prefetch needs virtual-clock = false and max-in-flight = 0, got "
                f"virtual-clock = {self.virtual}, "
                f"max-in-flight = {_declared('max_in_flight').shown(self.max_in_flight)}"
            )

    @classmethod
    def from_run_config(cls, cfg: Mapping[str, Any], **others: Any) -> EngineSettings:
        """The settings a checked run config sets: each declared field from its key
        (:data:`ENGINE_SETTINGS`), the fields without a key from ``others``.

        Raises
        ------
        KeyError
            ``cfg`` lacks a declared key (it was not parsed).
        ValueError
            As :class:`EngineSettings`.
        """
        return cls(**{s.name: cfg[s.key] for s in ENGINE_SETTINGS}, **others)

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


#: The declared settings of :class:`EngineSettings`, in field order (the run config's).
ENGINE_SETTINGS: tuple[Setting, ...] = tuple(
    replace(f.metadata[_SETTING], name=f.name)
    for f in fields(EngineSettings)
    if _SETTING in f.metadata
)


def _declared(name: str) -> Setting:
    """The declaration of field ``name``."""
    return next(s for s in ENGINE_SETTINGS if s.name == name)
