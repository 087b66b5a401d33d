"""The asynchronous engine: a push/pull loop over a Flower ``Grid`` with no round barrier.

It owns dispatch, staleness, reply validation, time-outs, node churn, the virtual
clock and the evaluation schedule, and hands every update to a framework-free
server optimizer (``flwr_gsgm.core``) for the math
(``docs/ARCHITECTURE.md``, layer 2).

Loop, per reply: validate the reply envelope -> staleness ``s = t - tau`` ->
``optimizer.on_update`` -> maybe evaluate -> send that node the newest weights at
once. Nodes are keyed on the ``partition-id`` they report (a ``query`` message at
start-up and whenever a new node id appears), not on node ids, which change when a
SuperNode restarts.

Concurrency limit (``max_in_flight``, as in FedBuff/Papaya): at most that many
nodes train at once; whenever a slot frees (a reply, an error reply, a lost node)
a :class:`~flwr_gsgm.dispatch.DispatchPolicy` picks the next idle active node.
Without a limit every active node is kept busy and the node that replied is sent
the newest weights at once.

With a :class:`~flwr_gsgm.virtual_clock.VirtualClock` (simulation), each dispatch
gets a virtual finish time when it is sent and replies are applied in that order,
waiting only for the earliest one to arrive, so the run is reproducible whatever
the machine's load. Without one (deployment), replies are applied in arrival order
and the clock is wall time since the start.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from flwr_gsgm import checkpoint
from flwr_gsgm.core import Outcome, ServerOptimizer, UpdateRejected
from flwr_gsgm.dispatch import DISPATCH_POLICIES, make_dispatch_policy
from flwr_gsgm.run_config import RUN_CONFIG
from flwr_gsgm.virtual_clock import VirtualClock, derive_seed

__all__ = ["EngineSettings", "AsyncEngine", "EngineReport", "EvaluateFn", "OptimizerFactory"]

EvaluateFn = Callable[[int, ArrayRecord], "MetricRecord | None"]
OptimizerFactory = Callable[[list[np.ndarray], list[int]], ServerOptimizer]

# Error code of a reply whose ClientApp raised (flwr.common.constant.ErrorCode).
CLIENT_APP_RAISED_EXCEPTION = 2

# Metric keys a train reply must carry (see clients/client_app.py for the protocol).
REQUIRED_REPLY_METRICS = ("partition-id", "model-version", "num-examples")


def _run_default(key: str) -> Any:
    """The run config's default of ``key``: the engine keeps no default of its own."""
    return RUN_CONFIG[key].default


@dataclass(frozen=True)
class EngineSettings:
    """Engine parameters (run config keys in brackets; defaults are the run config's).

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
        TTL in seconds of every message sent [``message-ttl``].
    reply_timeout : float
        Wall seconds after which a node whose reply has not come is treated as lost
        [``reply-timeout``].
    poll_interval : float
        Wall seconds to sleep when no reply can be applied [``poll-interval``].
    node_refresh_interval : float
        Wall seconds between checks for new node ids (joins, restarts).
    max_consecutive_errors : int
        Error replies in a row after which a node is treated as lost.
    max_consecutive_rejections : int
        Rejected updates in a row after which a node is treated as lost (0 = never)
        [``max-consecutive-rejections``]: a node that only sends garbage must not stall
        GSGM's cycles, which wait for every active node.
    min_nodes : int
        Nodes to wait for (up to ``reply_timeout``) before training starts [``min-nodes``].
    checkpoint_every : int
        Save a checkpoint every this many client updates received (0 = never)
        [``checkpoint-every``]; also on SIGTERM when checkpoints are on.
    checkpoint_path : Path | None
        Where the checkpoint goes (written atomically); required if ``checkpoint_every``.
    resume : bool
        Continue from ``checkpoint_path`` if it exists [``resume``].
    virtual_clock : VirtualClock | None
        Simulation clock, or None to use real arrival order (deployment).
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
        "random" (uniform, seeded from ``seed``) or "scheduled" (fewest updates
        received first; ties: earliest last reply, then partition-id); see
        :mod:`flwr_gsgm.dispatch`. Without a limit the node that replied is the only
        idle one, so the policy is not consulted and idle nodes are filled in
        partition-id order, as before the limit existed.

    Raises
    ------
    ValueError
        On a value out of range; the message names the run config key and the value.
    """

    max_updates: int = _run_default("max-updates")
    max_seconds: float | None = None
    eval_every: int = _run_default("eval-every")
    message_ttl: float = _run_default("message-ttl")
    reply_timeout: float = _run_default("reply-timeout")
    poll_interval: float = _run_default("poll-interval")
    node_refresh_interval: float = 10.0
    max_consecutive_errors: int = 3
    max_consecutive_rejections: int = _run_default("max-consecutive-rejections")
    min_nodes: int = _run_default("min-nodes")
    checkpoint_every: int = _run_default("checkpoint-every")
    checkpoint_path: Path | None = None
    resume: bool = _run_default("resume")
    virtual_clock: VirtualClock | None = None
    seed: int = 0
    max_in_flight: int | None = _run_default("max-in-flight") or None
    dispatch: str = _run_default("dispatch")

    def __post_init__(self) -> None:
        checks = {
            "max-updates": (self.max_updates, self.max_updates >= 1, ">= 1"),
            "eval-every": (self.eval_every, self.eval_every >= 1, ">= 1"),
            "message-ttl": (self.message_ttl, self.message_ttl > 0, "> 0 seconds"),
            "reply-timeout": (self.reply_timeout, self.reply_timeout > 0, "> 0 seconds"),
            "poll-interval": (self.poll_interval, self.poll_interval >= 0, ">= 0 seconds"),
            "min-nodes": (self.min_nodes, self.min_nodes >= 1, ">= 1"),
        }
        for key, (value, ok, expected) in checks.items():
            if not ok:
                raise ValueError(f"{key} must be {expected}, got {value!r}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint-every must be >= 0, got {self.checkpoint_every!r}")
        if (self.checkpoint_every or self.resume) and self.checkpoint_path is None:
            raise ValueError("checkpoint-every / resume need a checkpoint path (a run folder)")
        if self.max_seconds is not None and not self.max_seconds > 0:
            raise ValueError(f"max-seconds must be > 0 or unset, got {self.max_seconds!r}")
        if self.max_in_flight is not None and (
            isinstance(self.max_in_flight, bool) or not isinstance(self.max_in_flight, int)
            or self.max_in_flight < 0
        ):
            raise ValueError(
                f"max-in-flight must be an integer >= 0 (0 = all nodes) or None, got {self.max_in_flight!r}")
        if self.dispatch not in DISPATCH_POLICIES:
            raise ValueError(f"dispatch must be one of {', '.join(DISPATCH_POLICIES)}, got {self.dispatch!r}")

    @property
    def in_flight_limit(self) -> int | None:
        """``max_in_flight`` with 0 read as None (no limit)."""
        return self.max_in_flight or None


@dataclass
class _Node:
    partition_id: int
    node_id: int
    speed: float
    dispatches: int = 0
    errors_in_row: int = 0
    rejections_in_row: int = 0
    # Lost through silence or transport errors (a crash, a reboot): its node id is
    # queried again if it shows up, since a SuperNode restarted with the same
    # authentication key keeps its node id. Nodes lost for bad work stay out.
    may_return: bool = False
    active: bool = True


@dataclass(order=True)
class _Dispatch:
    """One train message in flight; ordered by virtual finish time, then send order."""

    v_finish: float
    seq: int
    partition_id: int = field(compare=False)
    base_version: int = field(compare=False)
    config: dict[str, Any] = field(compare=False)
    # The weights sent, kept only when checkpoints are on: a resumed run re-sends them.
    arrays: list[np.ndarray] | None = field(compare=False, default=None)
    message_id: str = field(compare=False, default="")
    node_id: int = field(compare=False, default=0)
    sent_at: float = field(compare=False, default=0.0)


@dataclass
class EngineReport:
    """What a run produced: final weights, evaluation rows and counters."""

    arrays: ArrayRecord
    rows: list[dict[str, float]]
    counters: dict[str, int]
    rejections: dict[str, int]
    staleness_mean: float
    staleness_max: int
    virtual_seconds: float
    wall_seconds: float


class _Window:
    """Staleness and train-loss statistics since the last evaluation and overall."""

    def __init__(self) -> None:
        self.total_sum = 0
        self.total_count = 0
        self.total_max = 0
        self.reset()

    def reset(self) -> None:
        self.sum = 0
        self.count = 0
        self.max = 0
        self.loss_sum = 0.0
        self.loss_count = 0

    def add(self, staleness: int) -> None:
        self.sum += staleness
        self.count += 1
        self.max = max(self.max, staleness)
        self.total_sum += staleness
        self.total_count += 1
        self.total_max = max(self.total_max, staleness)

    def add_loss(self, loss: float) -> None:
        self.loss_sum += loss
        self.loss_count += 1


class AsyncEngine:
    """One asynchronous training run over a Flower ``Grid``.

    Parameters
    ----------
    grid : flwr.serverapp.Grid
        The grid to push train/query messages to and pull replies from.
    initial_arrays : ArrayRecord
        Initial global model; every array must be float32. Its keys and their order
        define the model layout the optimizer works on.
    optimizer_factory : callable
        ``(weights: list[np.ndarray float32], partition_ids: list[int]) -> ServerOptimizer``,
        called once the nodes are known.
    train_config : ConfigRecord
        Sent in every train message; the engine adds ``model-version``, ``seed`` and,
        under the virtual clock, ``virtual-duration``.
    settings : EngineSettings
    evaluate_fn : callable, optional
        ``(updates_received: int, arrays: ArrayRecord) -> MetricRecord | None`` with
        keys ``accuracy`` and ``loss``; called at 0, every ``eval_every`` updates and
        at the end.

    Raises
    ------
    ValueError
        If an initial array is not float32.
    RuntimeError
        If fewer than ``min_nodes`` nodes answer the start-up query in time.
    """

    def __init__(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        optimizer_factory: OptimizerFactory,
        train_config: ConfigRecord,
        settings: EngineSettings,
        evaluate_fn: EvaluateFn | None = None,
    ) -> None:
        self.grid = grid
        self.keys = list(initial_arrays.keys())
        self.initial = initial_arrays.to_numpy_ndarrays()
        for key, arr in zip(self.keys, self.initial):
            if arr.dtype != np.float32:
                raise ValueError(f"initial array {key!r} has dtype {arr.dtype}, expected float32")
        self.make_optimizer = optimizer_factory
        self.train_config = train_config
        self.s = settings
        self.evaluate_fn = evaluate_fn
        self.optimizer: ServerOptimizer | None = None
        self.nodes: dict[int, _Node] = {}  # partition-id -> node
        self.node_ids_seen: set[int] = set()
        self.queries: dict[str, tuple[int, float]] = {}  # message id -> (node id, sent at)
        self.in_flight: dict[str, _Dispatch] = {}
        self.heap: list[_Dispatch] = []
        self.arrived: dict[str, Message] = {}
        self.arrival_order: list[str] = []
        self.counters: Counter[str] = Counter()
        self.rejections: Counter[str] = Counter()
        self.window = _Window()
        self.rows: list[dict[str, float]] = []
        self.received = 0
        self.diverged = False
        self.stop_requested = False
        # partition-id -> (digest, base version) of its last update, to catch replays
        self.last_digest: dict[int, tuple[bytes, int]] = {}
        self.num_partitions = 0
        self.reported_num: dict[int, int] = {}  # partition-id -> num-partitions it reported
        self.seq = 0
        self.vnow = 0.0
        self.t0 = time.monotonic()
        self.last_refresh = -math.inf
        self.speeds: dict[int, float] = {}
        self.policy = make_dispatch_policy(settings.dispatch, settings.seed)

    # ------------------------------------------------------------------ public
    def run(self) -> EngineReport:
        """Train until a budget is spent or no node is left; return the report."""
        self.t0 = time.monotonic()
        self._discover_nodes()
        saved = self._load_checkpoint()
        if saved is None:
            self._evaluate()
            limit = self.s.in_flight_limit
            if limit is None or limit >= len(self.nodes):
                for pid in sorted(self.nodes):  # every node, as before the limit existed
                    self._dispatch(pid)
            else:
                self._top_up()
        else:
            self._restore(saved)
        with self._sigterm_checkpoints():
            while not self._finished():
                self._pull()
                progressed = self._apply_ready()
                self._expire_timeouts()
                self._refresh_nodes()
                if self.stop_requested:
                    self._save_checkpoint()
                    raise SystemExit(f"SIGTERM: checkpoint saved at {self.received} updates")
                if not progressed:
                    self._idle(self.s.poll_interval)
        if not self.diverged and (not self.rows or self.rows[-1]["updates"] != self.received):
            self._evaluate()
        return self._report()

    # --------------------------------------------------------------- discovery
    def _discover_nodes(self) -> None:
        deadline = time.monotonic() + self.s.reply_timeout
        while True:
            self._query_new_nodes()
            self._pull()
            self._register_query_replies()
            if len(self.nodes) >= self.s.min_nodes and not self.queries:
                break
            if time.monotonic() > deadline:
                if len(self.nodes) >= self.s.min_nodes:
                    break
                raise RuntimeError(
                    f"only {len(self.nodes)} node(s) answered within reply-timeout="
                    f"{self.s.reply_timeout} s, min-nodes={self.s.min_nodes} required"
                )
            self._idle(max(self.s.poll_interval, 0.01))
        self._refuse_other_partitionings()
        pids = sorted(self.nodes)
        if self.s.virtual_clock is not None:
            num_partitions = max(self.num_partitions, max(pids) + 1)
            self.speeds = self.s.virtual_clock.speed_factors(list(range(num_partitions)))
        for pid in pids:
            self.nodes[pid].speed = self.speeds.get(pid, 1.0)
        self.optimizer = self.make_optimizer([a.copy() for a in self.initial], pids)
        slow = [p for p in pids if self.nodes[p].speed > 1.0]
        log(INFO, "[async] %d nodes (partition-ids %s); slow: %s", len(pids), pids, slow)
        if self.s.in_flight_limit is not None:
            log(INFO, "[async] at most %d node(s) in flight, dispatch %s",
                self.s.in_flight_limit, self.s.dispatch)

    def _refuse_other_partitionings(self) -> None:
        """Keep the nodes that agree on the most common num-partitions; refuse the rest."""
        counts = Counter(self.reported_num.values())
        self.num_partitions = max(counts, key=lambda n: (counts[n], n))
        for pid, num in self.reported_num.items():
            if num != self.num_partitions:
                self.counters["nodes-refused"] += 1
                del self.nodes[pid]
                log(WARNING, "[async] partition %d refused: it reports num-partitions %d, the run has %d",
                    pid, num, self.num_partitions)

    def _query_new_nodes(self) -> None:
        present = set(self.grid.get_node_ids())
        asked = {node_id for node_id, _ in self.queries.values()}
        returning = {n.node_id for n in self.nodes.values() if not n.active and n.may_return}
        new_ids = sorted(((present - self.node_ids_seen) | (present & returning)) - asked)
        messages = []
        for node_id in new_ids:
            self.node_ids_seen.add(node_id)
            messages.append(
                Message(RecordDict({"config": ConfigRecord()}), node_id, "query", ttl=self.s.message_ttl)
            )
        sent_at = time.monotonic()
        for node_id, mid in zip(new_ids, self.grid.push_messages(messages)):
            self.queries[mid] = (node_id, sent_at)

    def _register_query_replies(self) -> list[int]:
        """Map answered queries to partition-ids; return partition-ids that (re)joined."""
        joined = []
        for mid in [m for m in self.queries if m in self.arrived]:
            node_id, _ = self.queries.pop(mid)
            reply = self.arrived.pop(mid)
            self.arrival_order.remove(mid)
            pid = self._partition_of_query_reply(node_id, reply)
            if pid is not None and self._attach(pid, node_id):
                joined.append(pid)
        now = time.monotonic()
        for mid, (node_id, sent_at) in list(self.queries.items()):
            if now - sent_at > self.s.reply_timeout:
                del self.queries[mid]
                log(WARNING, "[async] node %d did not answer its query; ignored", node_id)
        return joined

    def _partition_of_query_reply(self, node_id: int, reply: Message) -> int | None:
        if reply.has_error():
            log(WARNING, "[async] node %d answered its query with error: %s", node_id, reply.error.reason)
            return None
        metrics = reply.content.get("metrics")
        if not isinstance(metrics, MetricRecord) or "partition-id" not in metrics:
            log(WARNING, "[async] node %d query reply has no partition-id; ignored", node_id)
            return None
        pid, num = int(metrics["partition-id"]), int(metrics.get("num-partitions", 0))
        started = self.optimizer is not None
        if not 0 <= pid < num or (started and num != self.num_partitions):
            # A node that does not belong to this federation's partitioning.
            self.counters["nodes-refused"] += 1
            log(WARNING, "[async] node %d refused: partition-id %d of %d does not belong (run has %d)",
                node_id, pid, num, self.num_partitions)
            return None
        if not started:
            self.reported_num[pid] = num
        return pid

    def _attach(self, pid: int, node_id: int) -> bool:
        """Bind ``pid`` to ``node_id``; return True if the partition (re)joins the run."""
        node = self.nodes.get(pid)
        if node is None:
            self.nodes[pid] = _Node(pid, node_id, self.speeds.get(pid, 1.0))
            return self.optimizer is not None
        if node.active and node.node_id != node_id and self.optimizer is None:
            self.counters["nodes-refused"] += 1
            log(WARNING, "[async] node %d refused: partition-id %d is already node %d's",
                node_id, pid, node.node_id)
            return False
        if node.active and node.node_id != node_id:
            # A restarted SuperNode: the old node id is gone, its work is lost.
            self._lose(pid, f"replaced by node {node_id}", may_return=True)
        node.node_id = node_id
        if node.active:
            return False
        node.active = True
        node.errors_in_row = node.rejections_in_row = 0
        return True

    def _refresh_nodes(self) -> None:
        now = time.monotonic()
        if self.queries:
            self._register_joins()
        if now - self.last_refresh < self.s.node_refresh_interval:
            return
        self.last_refresh = now
        self._query_new_nodes()

    def _register_joins(self) -> None:
        assert self.optimizer is not None
        for pid in self._register_query_replies():
            self.optimizer.on_node_joined(pid, now=self.vnow)
            self.counters["joined"] += 1
            log(INFO, "[async] partition %d joined (node %d)", pid, self.nodes[pid].node_id)
            self._top_up()

    # ---------------------------------------------------------------- dispatch
    def _may_dispatch(self) -> bool:
        budget_left = self.received + len(self.in_flight) < self.s.max_updates
        time_left = self.s.max_seconds is None or self.vnow < self.s.max_seconds
        return budget_left and time_left

    def _dispatch(self, pid: int) -> None:
        assert self.optimizer is not None
        node = self.nodes[pid]
        index = node.dispatches
        node.dispatches += 1
        version = self.optimizer.version
        config = ConfigRecord(dict(self.train_config))
        config["model-version"] = version
        config["seed"] = derive_seed(self.s.seed, pid, index)
        if self.s.virtual_clock is not None:
            duration = self.s.virtual_clock.duration(node.speed, pid, index)
            config["virtual-duration"] = duration
            v_finish = self.vnow + duration
        else:
            v_finish = 0.0  # unused: deployment applies replies in arrival order
        weights = [np.array(w, copy=True) for w in self.optimizer.weights]
        self.seq += 1
        dispatch = _Dispatch(v_finish, self.seq, pid, version, dict(config),
                             weights if self.s.checkpoint_every else None)
        self.optimizer.on_dispatch(pid)
        self._push(dispatch, weights)

    def _push(self, dispatch: _Dispatch, weights: list[np.ndarray]) -> None:
        """Send ``dispatch`` to the node now bound to its partition and track it."""
        node = self.nodes[dispatch.partition_id]
        arrays = ArrayRecord({k: Array(w) for k, w in zip(self.keys, weights)})
        message = Message(
            RecordDict({"arrays": arrays, "config": ConfigRecord(dispatch.config)}),
            node.node_id,
            "train",
            ttl=self.s.message_ttl,
        )
        (mid,) = list(self.grid.push_messages([message]))
        dispatch.message_id, dispatch.node_id, dispatch.sent_at = mid, node.node_id, time.monotonic()
        self.in_flight[mid] = dispatch
        heapq.heappush(self.heap, dispatch)

    # ----------------------------------------------------------------- replies
    def _awaited(self) -> list[str]:
        """Ids of the pushed messages whose reply has not arrived yet."""
        wanted = [m for m in self.in_flight if m not in self.arrived]
        return wanted + [m for m in self.queries if m not in self.arrived]

    def _idle(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds (the poll interval) for replies.

        A grid with a ``wait_for_replies(message_ids, timeout)`` method (the
        in-process grid) returns as soon as one reply is ready; other grids are
        polled, so the engine sleeps the whole interval. Either way only wall time
        changes: what is applied, and in which order, does not.
        """
        wait = getattr(self.grid, "wait_for_replies", None)
        if wait is None:
            time.sleep(timeout)
        else:
            wait(self._awaited(), timeout)

    def _pull(self) -> None:
        wanted = self._awaited()
        if not wanted:
            return
        for reply in self.grid.pull_messages(wanted):
            mid = reply.metadata.reply_to_message_id
            if mid in self.arrived:
                continue
            self.arrived[mid] = reply
            self.arrival_order.append(mid)

    def _next_ready(self) -> _Dispatch | None:
        """The dispatch whose reply is to be applied next, if its reply is here."""
        if self.s.virtual_clock is None:
            for mid in self.arrival_order:
                if mid in self.in_flight:
                    return self.in_flight[mid]
            return None
        while self.heap and self.heap[0].message_id not in self.in_flight:
            heapq.heappop(self.heap)  # lost or already handled
        if not self.heap or self.heap[0].message_id not in self.arrived:
            return None
        return self.heap[0]

    def _apply_ready(self) -> bool:
        progressed = False
        while not self._finished():
            dispatch = self._next_ready()
            if dispatch is None:
                break
            if self.s.virtual_clock is not None and self._beyond_time_budget(dispatch.v_finish):
                self._stop_in_flight()
                break
            self._handle(dispatch)
            progressed = True
        return progressed

    def _beyond_time_budget(self, t: float) -> bool:
        return self.s.max_seconds is not None and t > self.s.max_seconds

    def _handle(self, dispatch: _Dispatch) -> None:
        assert self.optimizer is not None
        mid = dispatch.message_id
        reply = self.arrived.pop(mid)
        self.arrival_order.remove(mid)
        del self.in_flight[mid]
        if self.s.virtual_clock is not None:
            self.vnow = max(self.vnow, dispatch.v_finish)
        else:
            self.vnow = time.monotonic() - self.t0
        node = self.nodes[dispatch.partition_id]
        self.policy.on_reply(node.partition_id, self.vnow, counted=not reply.has_error())
        if reply.has_error():
            self._on_error_reply(node, reply)
            return
        node.errors_in_row = 0
        self.received += 1
        if self._apply_update(dispatch, reply):
            node.rejections_in_row = 0
        else:
            node.rejections_in_row += 1
            limit = self.s.max_consecutive_rejections
            if limit and node.rejections_in_row >= limit:
                self._lose(node.partition_id, f"{node.rejections_in_row} rejected updates in a row")
        self._top_up()
        if self.received % self.s.eval_every == 0:
            self._evaluate()
        if self.s.checkpoint_every and self.received % self.s.checkpoint_every == 0:
            self._save_checkpoint()

    def _on_error_reply(self, node: _Node, reply: Message) -> None:
        self.counters["error-replies"] += 1
        node.errors_in_row += 1
        reason = (reply.error.reason or "").strip().splitlines()
        log(
            WARNING,
            "[async] error reply from partition %d (code %s): %s",
            node.partition_id,
            reply.error.code,
            reason[-1] if reason else "",
        )
        if node.errors_in_row >= self.s.max_consecutive_errors:
            # Transport errors (message or node unavailable) mean a crash, not bad work.
            transport = reply.error.code != CLIENT_APP_RAISED_EXCEPTION
            self._lose(node.partition_id, f"{node.errors_in_row} error replies in a row",
                       may_return=transport)
        else:
            self._top_up()

    def _apply_update(self, dispatch: _Dispatch, reply: Message) -> bool:
        """Hand a reply's update to the optimizer; return False if it was rejected."""
        assert self.optimizer is not None
        pid = dispatch.partition_id
        try:
            update = self._unpack(dispatch, reply)
            staleness = self.optimizer.version - dispatch.base_version
            outcome = self.optimizer.on_update(pid, update, dispatch.base_version, now=self.vnow)
        except UpdateRejected as err:
            self.rejections[err.reason] += 1
            log(WARNING, "[async] rejected update from partition %d (%s): %s", pid, err.reason, err.message)
            return False
        self.counters[outcome.value] += 1
        self.window.add(staleness)
        loss = reply.content["metrics"].get("train-loss")
        if isinstance(loss, (int, float)) and math.isfinite(loss):
            self.window.add_loss(float(loss))
        if outcome is Outcome.STALE:
            log(INFO, "[async] dropped stale update from partition %d (staleness %d)", pid, staleness)
        return True

    def _unpack(self, dispatch: _Dispatch, reply: Message) -> list[np.ndarray]:
        """Check the reply envelope and return its arrays; raise UpdateRejected if bad."""
        content = reply.content
        arrays = content.get("arrays")
        metrics = content.get("metrics")
        if not isinstance(arrays, ArrayRecord):
            raise UpdateRejected("missing-arrays", "reply has no ArrayRecord under 'arrays'")
        if not isinstance(metrics, MetricRecord):
            raise UpdateRejected("missing-metrics", "reply has no MetricRecord under 'metrics'")
        missing = [k for k in REQUIRED_REPLY_METRICS if k not in metrics]
        if missing:
            raise UpdateRejected("missing-metrics", f"reply metrics lack {missing}")
        if int(metrics["partition-id"]) != dispatch.partition_id:
            raise UpdateRejected(
                "partition-id",
                f"reply says partition-id={metrics['partition-id']}, "
                f"message was sent to partition {dispatch.partition_id}",
            )
        if int(metrics["model-version"]) != dispatch.base_version:
            raise UpdateRejected(
                "model-version",
                f"reply says model-version={metrics['model-version']}, "
                f"message carried version {dispatch.base_version}",
            )
        if list(arrays.keys()) != self.keys:
            raise UpdateRejected(
                "array-keys",
                f"reply array keys {list(arrays.keys())} differ from the model's {self.keys} "
                "(same keys, same order expected)",
            )
        try:
            update = arrays.to_numpy_ndarrays()
        except Exception as err:  # a corrupt payload must not stop the run
            raise UpdateRejected("array-format", f"arrays cannot be decoded: {err}") from err
        self._reject_duplicate(dispatch, update)
        return update

    def _reject_duplicate(self, dispatch: _Dispatch, update: list[np.ndarray]) -> None:
        """Reject a replay: the partition's previous update bytes, sent for another version.

        A deterministic client may send the same bytes twice for the same weights
        (same model version), and an all-zero update may recur; otherwise, for weights
        that changed, equal bytes mean a replay.
        """
        digest = hashlib.blake2b(digest_size=16)
        for arr in update:
            digest.update(np.ascontiguousarray(arr).view(np.uint8).ravel())
        value = digest.digest()
        previous = self.last_digest.get(dispatch.partition_id)
        self.last_digest[dispatch.partition_id] = (value, dispatch.base_version)
        replayed = previous is not None and previous[0] == value and previous[1] != dispatch.base_version
        if replayed and any(np.any(arr) for arr in update):  # an all-zero update may recur
            raise UpdateRejected(
                "duplicate",
                f"partition {dispatch.partition_id} sent the bytes of its update for version "
                f"{previous[1]} again for version {dispatch.base_version}",
            )

    # ------------------------------------------------------------------- churn
    def _expire_timeouts(self) -> None:
        now = time.monotonic()
        overdue = [d for d in self.in_flight.values()
                   if d.message_id not in self.arrived and now - d.sent_at > self.s.reply_timeout]
        if not overdue:
            return
        self._pull()  # the server may have been busy: look once more before giving up
        for dispatch in list(self.in_flight.values()):
            if dispatch.message_id in self.arrived:
                continue
            if now - dispatch.sent_at > self.s.reply_timeout:
                self._lose(dispatch.partition_id, f"no reply within {self.s.reply_timeout} s",
                           may_return=True)

    def _lose(self, pid: int, why: str, may_return: bool = False) -> None:
        assert self.optimizer is not None
        node = self.nodes[pid]
        if not node.active:
            return
        node.active = False
        node.may_return = may_return
        for mid in [m for m, d in self.in_flight.items() if d.partition_id == pid]:
            del self.in_flight[mid]
            if mid in self.arrived:
                del self.arrived[mid]
                self.arrival_order.remove(mid)
            self.counters["lost-in-flight"] += 1
        self.optimizer.on_node_lost(pid, now=self.vnow)
        self.counters["nodes-lost"] += 1
        log(WARNING, "[async] partition %d (node %d) lost: %s", pid, node.node_id, why)
        self._top_up()

    def _top_up(self) -> None:
        """Give idle active nodes the work the budgets and the in-flight limit allow.

        Called whenever a slot may have freed: at start, after a reply, an error
        reply, a loss, a join and a resume. Without a limit every idle active node
        is dispatched, in partition-id order (after a reply that is the node that
        replied: any other idle node is idle because a budget is spent); so is every
        idle node when the limit leaves room for all of them, so a limit at or above
        the number of nodes changes nothing. Otherwise the dispatch policy picks
        among the idle active nodes until ``max_in_flight`` nodes are busy.
        """
        busy = {d.partition_id for d in self.in_flight.values()}
        idle = [pid for pid in sorted(self.nodes) if self.nodes[pid].active and pid not in busy]
        limit = self.s.in_flight_limit
        if limit is None or len(self.in_flight) + len(idle) <= limit:
            for pid in idle:
                if self._may_dispatch():
                    self._dispatch(pid)
            return
        while idle and len(self.in_flight) < limit and self._may_dispatch():
            pid = self.policy.pick(idle)
            idle.remove(pid)
            self._dispatch(pid)

    def _stop_in_flight(self) -> None:
        """Time budget spent: forget every in-flight dispatch (they are not applied)."""
        self.in_flight.clear()
        self.heap.clear()

    def _finished(self) -> bool:
        if self.diverged or self.received >= self.s.max_updates:
            return True
        if not self.in_flight:
            return True  # no node left, or the time budget is spent
        if self.s.virtual_clock is None and self._beyond_time_budget(time.monotonic() - self.t0):
            return True
        return False

    # -------------------------------------------------------------- evaluation
    def _evaluate(self) -> None:
        assert self.optimizer is not None
        row: dict[str, float] = {
            "updates": self.received,
            "version": self.optimizer.version,
            "virtual_time": round(self.vnow, 6),
            "wall_time": round(time.monotonic() - self.t0, 3),
            "accuracy": math.nan,
            "loss": math.nan,
        }
        loss_known = False
        if self.evaluate_fn is not None:
            arrays = ArrayRecord({k: Array(np.array(w)) for k, w in zip(self.keys, self.optimizer.weights)})
            res = self.evaluate_fn(self.received, arrays)
            if res is not None:
                row["accuracy"] = float(res.get("accuracy", math.nan))
                row["loss"] = float(res.get("loss", math.nan))
                loss_known = "loss" in res
        w = self.window
        row["staleness_mean"] = round(w.sum / w.count, 6) if w.count else 0.0
        row["staleness_max"] = w.max
        row["train_loss"] = round(w.loss_sum / w.loss_count, 6) if w.loss_count else math.nan
        row["deferred"] = self.counters[Outcome.DEFERRED.value]
        row["rejected"] = sum(self.rejections.values())
        row["dropped"] = self._dropped()
        w.reset()
        self.rows.append(row)
        self._check_divergence(row, loss_known)
        log(
            INFO,
            "[async] updates %d/%d | version %d | vtime %.1f s | wall %.1f s | "
            "acc %.4f | loss %.4f | staleness mean %.2f max %d",
            row["updates"],
            self.s.max_updates,
            row["version"],
            row["virtual_time"],
            row["wall_time"],
            row["accuracy"],
            row["loss"],
            row["staleness_mean"],
            row["staleness_max"],
        )

    def _check_divergence(self, row: dict[str, float], loss_known: bool) -> None:
        """Stop the run once the model is non-finite: every later update would be rejected."""
        assert self.optimizer is not None
        weights_finite = all(bool(np.isfinite(w).all()) for w in self.optimizer.weights)
        loss_finite = not loss_known or math.isfinite(row["loss"])
        if not (weights_finite and loss_finite):
            self.diverged = True
            log(WARNING, "[async] diverged at %d updates (non-finite %s); stopping",
                self.received, "weights" if not weights_finite else "test loss")

    def _dropped(self) -> int:
        assert self.optimizer is not None
        opt = self.optimizer.counters
        return (
            self.counters[Outcome.STALE.value]
            + int(opt.get("slots_dropped", 0))
            + self.counters["lost-in-flight"]
        )

    # ------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue this run bit-identically (numpy + python values).

        In-flight dispatches are saved with the weights they carried; a resumed run
        re-sends them with the same seed and virtual finish time.
        """
        assert self.optimizer is not None
        return {
            "keys": list(self.keys),
            "optimizer": self.optimizer.state_dict(),
            "nodes": {pid: {"dispatches": n.dispatches, "errors_in_row": n.errors_in_row,
                            "rejections_in_row": n.rejections_in_row,
                            "active": n.active, "speed": n.speed} for pid, n in self.nodes.items()},
            "in_flight": [
                {k: v for k, v in asdict(d).items() if k not in ("message_id", "node_id", "sent_at")}
                for d in sorted(self.in_flight.values())
            ],
            "counters": dict(self.counters),
            "rejections": dict(self.rejections),
            "window": dict(vars(self.window)),
            "rows": [dict(r) for r in self.rows],
            "received": self.received,
            "diverged": self.diverged,
            "seq": self.seq,
            "vnow": self.vnow,
            "speeds": dict(self.speeds),
            "num_partitions": self.num_partitions,
            "last_digest": dict(self.last_digest),
            "dispatch": self.policy.state_dict(),
        }

    def _restore(self, state: dict[str, Any]) -> None:
        assert self.optimizer is not None
        if state["keys"] != self.keys:
            raise ValueError(f"checkpoint model keys {state['keys'][:3]}... differ from the model's")
        self.optimizer.load_state_dict(state["optimizer"])
        self.counters = Counter(state["counters"])
        self.rejections = Counter(state["rejections"])
        vars(self.window).update(state["window"])
        self.rows = [dict(r) for r in state["rows"]]
        self.received, self.diverged = state["received"], state["diverged"]
        self.seq, self.vnow = state["seq"], state["vnow"]
        self.speeds, self.num_partitions = dict(state["speeds"]), state["num_partitions"]
        self.last_digest = dict(state["last_digest"])
        if "dispatch" in state:  # checkpoints written before dispatch policies lack it
            self.policy.load_state_dict(state["dispatch"])
        for pid, saved in state["nodes"].items():
            node = self.nodes.get(pid)
            if node is None:  # its SuperNode did not come back: known but inactive
                node = self.nodes[pid] = _Node(pid, -1, saved["speed"], active=False)
            node.dispatches, node.errors_in_row, node.speed = (
                saved["dispatches"], saved["errors_in_row"], saved["speed"])
            node.rejections_in_row = saved["rejections_in_row"]
            node.active = node.active and saved["active"]
        for saved in state["in_flight"]:
            dispatch = _Dispatch(**saved)
            if self.nodes[dispatch.partition_id].active:
                self._push(dispatch, dispatch.arrays)
        log(INFO, "[async] resumed at %d updates (version %d, virtual time %.1f s)",
            self.received, self.optimizer.version, self.vnow)
        self._top_up()

    def _save_checkpoint(self) -> None:
        if self.s.checkpoint_path is not None and self.s.checkpoint_every:
            checkpoint.save(self.s.checkpoint_path, self.state_dict())
            log(INFO, "[async] checkpoint at %d updates -> %s", self.received, self.s.checkpoint_path)

    def _load_checkpoint(self) -> dict[str, Any] | None:
        path = self.s.checkpoint_path
        if not self.s.resume or path is None or not path.exists():
            if self.s.resume:
                log(WARNING, "[async] resume: no checkpoint at %s, starting afresh", path)
            return None
        return checkpoint.load(path)

    @contextmanager
    def _sigterm_checkpoints(self) -> Iterator[None]:
        """While checkpoints are on, SIGTERM asks the loop to save and stop."""
        if not self.s.checkpoint_every or threading.current_thread() is not threading.main_thread():
            yield
            return

        def on_sigterm(signum: int, frame: Any) -> None:
            self.stop_requested = True

        previous = signal.signal(signal.SIGTERM, on_sigterm)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)

    def _report(self) -> EngineReport:
        assert self.optimizer is not None
        w = self.window
        counters = dict(self.counters)
        counters["received"] = self.received
        counters["diverged"] = int(self.diverged)
        counters["steps"] = self.optimizer.version
        counters["dropped"] = self._dropped()
        counters["slots-dropped"] = int(self.optimizer.counters.get("slots_dropped", 0))
        arrays = ArrayRecord({k: Array(np.array(a)) for k, a in zip(self.keys, self.optimizer.weights)})
        return EngineReport(
            arrays=arrays,
            rows=self.rows,
            counters=counters,
            rejections=dict(self.rejections),
            staleness_mean=(w.total_sum / w.total_count) if w.total_count else 0.0,
            staleness_max=w.total_max,
            virtual_seconds=self.vnow,
            wall_seconds=time.monotonic() - self.t0,
        )
