"""Who is in the federation, and each node's state: discovery, queries, joins,
back-offs, losses, exclusions, rejoins and refusals.

Nodes are keyed on the ``partition-id`` they report in answer to a ``query``
message (sent at start-up and whenever a new node id appears), not on node ids,
which change when a SuperNode restarts. The query is optional
(:mod:`flwr_gsgm.nodes.query_reply`): a node without a query handler, or whose query
raises, is registered at once without a partition-id and keyed by its node id: at
start-up such nodes get, in node-id order, the keys after the run's partitions
(``num-partitions``, or after the highest partition-id reported), and a node that
joins later the next free key; a node that comes back under the same node id gets
its key again. Such a key stands in for a partition-id inside the run (the core,
checkpoints) but is never shown and is not checked against the partition-id its
replies report.

**Names.** Logs, ``summary.json`` (``per_node``, exclusion and failure reasons) and
warnings name a node as Flower does, by :attr:`Node.name` (:meth:`Membership.name`):
its node id, plus the partition-id of its node config where it has one ("node 8123
(partition 6)"); a node registered without a partition-id is "node 8123", never by
its stand-in key.

A node whose partitioning differs from the run's (another ``num-partitions``, a
partition-id out of range, a partition already held by another node at start-up)
is refused, and so is a node whose query reply
has a partition-id or num-partitions that is not an integer >= 0 (a list, NaN,
infinity, 1.7; an integral float such as 1.0 is taken as that integer).

**A node's states.** :class:`Membership` owns every :class:`Node` record and each
transition of it: "active" -> "backing-off" (until an engine time) -> "active",
"active" -> "lost" (it left the federation) -> "active" (it rejoins when it comes
back), and any state -> "excluded" (for the rest of the run, with the reason). What
the other parties must hear of a transition goes to them explicitly: the ledger's
counters (``nodes_joined``, ``nodes_lost``, ``nodes_excluded``, ``node_backoffs``,
``lost_in_flight``, ``error_replies``, ``dispatch_timeouts``, ``nodes_refused``), the
per-node counts (:class:`~flwr_gsgm.nodes.stats.NodeStats`), the log, and through
:class:`NodeListener` the server optimizer (``on_node_joined`` / ``on_node_lost`` at
the engine clock), the norm bound and the dispatcher (a freed slot gets new work).
A hung or failing node is backed off, never waited on for ever.

A **failure** is a train message unanswered past ``dispatch-timeout`` (wall seconds
from its push) or answered with an error reply, whatever its Flower error code
(:mod:`flwr_gsgm.nodes.error_codes`). After the k-th failure in a row of a node:

- k >= ``max-node-failures``: the node is **excluded** for the rest of the run
  (logged with the reason; a query from it later is refused);
- the node left the federation (its node id is no longer among the grid's nodes, or
  the reply says it is unavailable): it is **lost** and rejoins when it comes back
  (it is queried again);
- otherwise it **backs off**: it is out of the run (the server rule treats it as
  lost, so GSGM's cycles do not wait for it) and gets no work for
  :meth:`Backoff.delay(k) <flwr_gsgm.nodes.backoff.Backoff.delay>` seconds of the engine
  clock (virtual seconds under the virtual clock: a simulation stays reproducible),
  then it is back (:meth:`Membership.end_backoffs`, whenever the clock is read past it).

A valid reply resets k; the dispatch that failed is dropped (``lost_in_flight``).

**Offline** (a simulation whose time model has availability,
:mod:`flwr_gsgm.simulation.availability`): a node the time model takes offline is out
of the run until it is online again, "active" -> "offline" -> "active", without a
failure (going offline is not the node's fault, so it never excludes it). Its message
in flight is lost (``lost_in_flight``), its going counted in ``nodes_lost`` and its
return in ``nodes_joined``, as a deployment counts a SuperNode that leaves and
rejoins; the engine brings it back at the virtual second it is online again
(:meth:`Membership.next_online`).
``max-consecutive-rejections`` rejected updates in a row exclude a node too, unless
every node's are rejected at once (the model diverged, :mod:`flwr_gsgm.engine.divergence`).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any

from flwr.app import Message
from flwr.common.constant import ErrorCode
from flwr.common.logger import log
from flwr.serverapp import Grid

from flwr_gsgm.engine.clock import Clock
from flwr_gsgm.engine.in_flight import InFlight
from flwr_gsgm.engine.ledger import Ledger
from flwr_gsgm.engine.settings import EngineSettings
from flwr_gsgm.nodes.error_codes import describe_error, error_summary, last_line
from flwr_gsgm.nodes.query_reply import NO_PARTITION, read_query_reply
from flwr_gsgm.nodes.stats import NodeStats

__all__ = ["Membership", "Node", "NodeListener"]

# The states a node leaves at an engine time of its own (Node.retry_at).
_WAITING = ("backing-off", "offline")


def _nothing(*args: Any) -> None:
    """A listener that hears nothing."""


@dataclass(frozen=True)
class NodeListener:
    """Who hears of a node's transitions besides the ledger, the per-node counts and
    the log (the engine wires each to the part that must know).

    Attributes
    ----------
    joined : callable
        ``(partition_id, now) -> None``: the node is in the run again (it joined,
        rejoined, or its back-off ended) at engine time ``now`` (s): the server
        optimizer's ``on_node_joined``.
    left : callable
        ``(partition_id, now) -> None``: the node is out of the run (lost, backing
        off or excluded): the server optimizer's ``on_node_lost``.
    forget : callable
        ``(partition_id) -> None``: the node left the federation: what is kept of its
        past updates is forgotten (the norm bound's window of it).
    freed : callable
        ``() -> None``: slots may have freed (a node left, or is back): the dispatcher
        tops up.
    """

    joined: Callable[[int, float], None] = _nothing
    left: Callable[[int, float], None] = _nothing
    forget: Callable[[int], None] = _nothing
    freed: Callable[[], None] = _nothing


@dataclass
class Node:
    """One partition of the federation and the node now holding it."""

    partition_id: int
    node_id: int
    speed: float
    dispatches: int = 0
    # Failures in a row (dispatch time-outs, error replies): each backs the node off,
    # max-node-failures of them exclude it (Membership.fail). A valid reply
    # resets the count.
    failures: int = 0
    rejections_in_row: int = 0
    # Lost because it left the federation (a crash, a reboot): its node id is queried
    # again if it shows up, since a SuperNode restarted with the same authentication
    # key keeps its node id.
    may_return: bool = False
    active: bool = True
    # False: registered without a partition-id (no query handler), keyed by node id.
    identified: bool = True
    # Backing off: out of the run until the engine clock reaches this (seconds).
    retry_at: float | None = None
    # Why the node was excluded for the rest of the run ("" = it is not).
    excluded: str = ""
    # Offline in the time model until retry_at (its availability), not backing off.
    offline: bool = False

    #: Fields saved in a checkpoint (``node_id`` and ``identified`` name a node that
    #: did not answer at a resume).
    SAVED = ("dispatches", "failures", "rejections_in_row", "active", "speed")
    SAVED += ("may_return", "retry_at", "excluded", "node_id", "identified", "offline")

    @property
    def name(self) -> str:
        """The node as Flower names it, in every log line, ``summary.json`` entry and
        warning: ``"node 8123 (partition 6)"``, or ``"node 8123"`` for a node
        registered without a partition-id (its key is a stand-in, not Flower's
        partition)."""
        node = f"node {self.node_id}"
        return f"{node} (partition {self.partition_id})" if self.identified else node

    @property
    def state(self) -> str:
        """ "active", "backing-off", "offline" (the time model's availability), "lost"
        (left the federation) or "excluded"."""
        if self.active:
            return "active"
        if self.excluded:
            return "excluded"
        if self.retry_at is None:
            return "lost"
        return "offline" if self.offline else "backing-off"


class Membership:
    """The nodes of a run, keyed by partition-id, and every transition of their state.

    ``started`` becomes True once training starts (the optimizer exists): from then
    on a (re)attached partition is a join, and a node must report the run's
    ``num-partitions``.

    Parameters
    ----------
    grid : Grid
        Where node ids are listed (a node no longer there has left the federation).
    in_flight : InFlight
        Queries are pushed through it; a node out of the run has its dispatches dropped.
    settings : EngineSettings
        ``min_nodes``, ``startup_timeout``, ``max_node_failures``, ``backoff``,
        ``max_consecutive_rejections``, ``dispatch_timeout``, ...
    ledger : Ledger
        Counts the run's node events (see the module docstring).
    stats : NodeStats
        Counts each node's ``backoffs``, ``dispatch_timeouts`` and ``error_replies``.
    clock : Clock
        The engine clock: when a node leaves or is back, when a back-off ends; the
        nodes' speed factors.

    Who else hears of a transition (the optimizer, the norm bound, the dispatcher) is
    the :class:`NodeListener` given to :meth:`start`: before it, while the nodes are
    discovered, nobody needs to.
    """

    def __init__(
        self,
        grid: Grid,
        in_flight: InFlight,
        settings: EngineSettings,
        ledger: Ledger,
        stats: NodeStats,
        clock: Clock,
    ) -> None:
        self.grid = grid
        self.in_flight = in_flight
        self.settings = settings
        self.ledger = ledger
        self.stats = stats
        self.clock = clock
        self.listener = NodeListener()
        self.nodes: dict[int, Node] = {}  # partition-id -> node
        self.node_ids_seen: set[int] = set()
        self.query_failures: Counter[int] = Counter()  # node id -> failed queries in a row
        self.num_partitions = 0
        self.reported_num: dict[int, int] = {}  # partition-id -> num-partitions it reported
        self.speeds: dict[int, float] = {}
        self.last_refresh = -math.inf
        self.started = False
        self.unkeyed: list[int] = []  # node ids without a partition-id, before the start
        self.unqueried: list[int] = []  # new node ids not queried (query_partition_ids off)
        self.said_unqueried = False
        stats.name = self.name  # the per-node warnings name nodes as the log does

    def name(self, pid: int) -> str:
        """The name of the node keyed ``pid`` (:attr:`Node.name`); a key no node holds
        (a refused one): ``"partition <pid>"``."""
        node = self.nodes.get(pid)
        return node.name if node is not None else f"partition {pid}"

    def names(self, pids: list[int]) -> str:
        """The names of ``pids``' nodes, comma-separated (``"node 1 (partition 0), node 4"``)."""
        return ", ".join(self.name(pid) for pid in pids) or "none"

    def start(self, pids: list[int], listener: NodeListener) -> None:
        """Training starts with ``pids``: from now on an attach is a join, and
        ``listener`` hears of every transition. Logged."""
        self.started = True
        self.listener = listener
        slow = [p for p in pids if self.nodes[p].speed > 1.0]
        log(INFO, "[async] %d nodes: %s; slow: %s", len(pids), self.names(pids), self.names(slow))

    def active_ids(self) -> list[int]:
        """Partition-ids of the active nodes, in order."""
        return [pid for pid in sorted(self.nodes) if self.nodes[pid].active]

    def idle_active(self, depth: int = 1) -> list[int]:
        """Partition-ids of the active nodes with fewer than ``depth`` dispatches in
        flight (1: none), in order."""
        busy = self.in_flight.busy_partitions(depth)
        return [pid for pid in sorted(self.nodes) if self.nodes[pid].active and pid not in busy]

    # ------------------------------------------------------------- discovery
    def discover(self) -> list[int]:
        """Query nodes until ``min_nodes`` answered; return the partition-ids, sorted.

        Raises
        ------
        RuntimeError
            If fewer than ``min_nodes`` nodes answer within ``startup_timeout`` seconds.
        """
        deadline = time.monotonic() + self.settings.startup_timeout
        self.query_new_nodes()
        while True:
            self.in_flight.pull()
            self.register_query_replies()
            self.query_new_nodes()  # new node ids, and those whose query failed
            registered = len(self.nodes) + len(self.unkeyed)
            if registered >= self.settings.min_nodes and not self.in_flight.queries:
                break
            if time.monotonic() > deadline:
                if registered >= self.settings.min_nodes:
                    break
                raise RuntimeError(
                    f"only {registered} node(s) answered within startup-timeout="
                    f"{self.settings.startup_timeout} s, min-nodes={self.settings.min_nodes} "
                    "required"
                )
            self.in_flight.idle(max(self.settings.poll_interval, 0.01))
        self._refuse_other_partitionings()
        for node_id in sorted(self.unkeyed):
            self._attach(self.key_for(node_id), node_id, identified=False)
        self.unkeyed.clear()
        pids = sorted(self.nodes)
        self.speeds = self.clock.speed_factors(max(self.num_partitions, max(pids) + 1))
        for pid in pids:
            self.nodes[pid].speed = self.speeds.get(pid, 1.0)
        return pids

    def _refuse_other_partitionings(self) -> None:
        """Keep the nodes that agree on the most common num-partitions; refuse the rest."""
        counts = Counter(self.reported_num.values())
        if not counts:
            return  # no node reported a partition-id
        self.num_partitions = max(counts, key=lambda n: (counts[n], n))
        for pid, num in self.reported_num.items():
            if num != self.num_partitions:
                self.ledger.count("nodes_refused")
                name = self.nodes.pop(pid).name
                why = f"it reports num-partitions {num}, the run has {self.num_partitions}"
                log(WARNING, "[async] %s refused: %s", name, why)

    def query_new_nodes(self) -> None:
        """Query node ids not seen before, and returning ones that may come back."""
        present = set(self.grid.get_node_ids())
        asked = {node_id for node_id, _ in self.in_flight.queries.values()}
        returning = {n.node_id for n in self.nodes.values() if not n.active and n.may_return}
        new_ids = sorted(((present - self.node_ids_seen) | (present & returning)) - asked)
        self.node_ids_seen.update(new_ids)
        if self.settings.queries_partition_ids:
            self.in_flight.push_queries(new_ids)
        else:
            self.unqueried.extend(new_ids)

    def _register_unqueried(self) -> list[int]:
        """Register the node ids not asked for a partition-id (``query_partition_ids``
        off) as a node without a query handler is: keyed by node id (:meth:`key_for`),
        at start-up once every node is in. Return the partition-ids that (re)joined."""
        new, self.unqueried = self.unqueried, []
        if new and not self.said_unqueried:
            self.said_unqueried = True
            log(
                INFO,
                "[async] nodes keyed by node id, in node-id order, without a query "
                "(query_partition_ids is off without a virtual clock or checkpoints; set "
                "EngineSettings(query_partition_ids=True) if your ClientApp answers a "
                "query with its partition-id)",
            )
        if not self.started:
            self.unkeyed.extend(new)
            return []
        joined = []
        for node_id in new:
            pid = self.key_for(node_id)
            if self._attach(pid, node_id, identified=False):
                joined.append(pid)
        return joined

    @property
    def joins_pending(self) -> bool:
        """Queries in flight or new node ids not yet registered."""
        return bool(self.in_flight.queries or self.unqueried)

    def refresh_due(self) -> bool:
        """True (and the refresh clock restarts) every ``node_refresh_interval`` wall seconds."""
        now = time.monotonic()
        if now - self.last_refresh < self.settings.node_refresh_interval:
            return False
        self.last_refresh = now
        return True

    def register_query_replies(self) -> list[int]:
        """Map answered queries to partition-ids; return partition-ids that (re)joined.

        Never raises on a reply: one with malformed metadata is logged, counted in
        ``nodes_refused`` and registers no node; a node that cannot answer (no query
        handler, its query raised) or reports no partition-id is registered without
        one (:meth:`key_for`; at start-up once every answer is in). A query answered
        with another error (its TTL expired while the ClientApp started, say) or not
        answered within ``startup_timeout`` seconds failed: it is sent again, up to
        ``max_node_failures`` failed queries in a row (:meth:`_query_failed`).
        """
        joined = self._register_unqueried()
        queries = self.in_flight.queries
        for mid in [m for m in queries if m in self.in_flight.arrived]:
            node_id, _ = queries.pop(mid)
            reply = self.in_flight.take_reply(mid)
            answer = read_query_reply(
                node_id, reply, self.started, self.num_partitions, self.settings.startup_timeout
            )
            self.ledger.count("nodes_refused", int(answer.refused))
            if answer.partition_id is None and not answer.refused:
                why = error_summary(reply, self.settings.startup_timeout)
                self._query_failed(node_id, f"its query failed ({why})")
                continue
            self.query_failures.pop(node_id, None)
            pid, identified = answer.partition_id, answer.partition_id != NO_PARTITION
            if pid == NO_PARTITION and not self.started:
                self.unkeyed.append(node_id)  # keyed once every start-up answer is in
                continue
            if pid == NO_PARTITION:
                pid = self.key_for(node_id)
            elif pid is not None and not self.started:
                self.reported_num[pid] = answer.num_partitions
            if pid is not None and self._attach(pid, node_id, identified):
                joined.append(pid)
        now = time.monotonic()
        for mid, (node_id, sent_at) in list(queries.items()):
            if now - sent_at > self.settings.startup_timeout:
                del queries[mid]
                why = f"no answer within startup-timeout={self.settings.startup_timeout} s"
                log(WARNING, "[async] node %d did not answer its query (%s)", node_id, why)
                self._query_failed(node_id, why)
        return joined

    def _query_failed(self, node_id: int, why: str) -> None:
        """A query failed: the node is asked again (at once during start-up, then at
        the next node refresh) until ``max_node_failures`` queries in a row failed;
        then it is refused. A failed query of a returning node is a failure of its
        partition too (as many exclude it), so it is not queried for ever."""
        limit = self.settings.max_node_failures
        self.query_failures[node_id] += 1
        if self.query_failures[node_id] < limit:
            self.node_ids_seen.discard(node_id)
        elif self.query_failures[node_id] == limit:
            self.ledger.count("nodes_refused")
            last = f"{limit} failed queries in a row; last: {why}"
            log(WARNING, "[async] node %d refused: %s", node_id, last)
        for node in self.nodes.values():
            if node.node_id == node_id and node.state == "lost":
                node.failures += 1
                if node.failures >= limit:
                    self.exclude(node.partition_id, f"{node.failures} failures in a row; {why}")

    def key_for(self, node_id: int) -> int:
        """The key of a node without a partition-id: its old key, else the next free one.

        Free keys start after the run's partitions, so they never take a partition-id
        a node may report.
        """
        for node in self.nodes.values():
            if not node.identified and node.node_id == node_id:
                return node.partition_id
        return max(self.num_partitions, max(self.nodes, default=-1) + 1)

    def _attach(self, pid: int, node_id: int, identified: bool = True) -> bool:
        """Bind ``pid`` to ``node_id``; return True if the partition (re)joins the run."""
        node = self.nodes.get(pid)
        if node is None:
            self.nodes[pid] = Node(pid, node_id, self.speeds.get(pid, 1.0), identified=identified)
            if not identified:
                log(INFO, "[async] node %d registered without a partition-id", node_id)
            return self.started
        if node.excluded:
            self.ledger.count("nodes_refused")
            why = f"{node.name} was excluded from the run ({node.excluded})"
            log(WARNING, "[async] node %d refused: %s", node_id, why)
            return False
        if node.active and node.node_id != node_id and not self.started:
            self.ledger.count("nodes_refused")
            why = f"partition-id {pid} is already {node.name}'s"
            log(WARNING, "[async] node %d refused: %s", node_id, why)
            return False
        if node.active and node.node_id != node_id:
            # A restarted SuperNode: the old node id is gone, its work is lost.
            self.lose(pid, f"replaced by node {node_id}", may_return=True)
        node.node_id = node_id
        if node.active:
            return False
        node.active, node.retry_at = True, None
        node.rejections_in_row = 0  # failures stay: only a valid reply resets them
        return True

    # ------------------------------------------------------------- transitions
    def _now(self) -> float:
        return self.clock.now()

    def _drop_in_flight(self, pid: int) -> None:
        """The node's work in flight is dropped (counted in ``lost_in_flight``)."""
        self.ledger.count("lost_in_flight", self.in_flight.drop_partition(pid))

    def lose(self, pid: int, why: str, may_return: bool = False) -> None:
        """Partition ``pid`` leaves (active -> lost): its work in flight is dropped, the
        listener told, the loss counted and logged with ``why``.

        ``may_return``: it left the federation and may come back (it is queried again
        when its node id shows up). Nothing happens if it was not active.
        """
        node = self.nodes[pid]
        if not node.active:
            return
        node.active, node.may_return = False, may_return
        self._drop_in_flight(pid)
        self.listener.left(pid, self._now())
        self.listener.forget(pid)  # back later, it meets a model that moved without it
        self.ledger.count("nodes_lost")
        log(WARNING, "[async] %s lost: %s", node.name, why)
        self.listener.freed()

    def exclude(self, pid: int, why: str) -> None:
        """Exclude ``pid`` for the rest of the run (counted in ``nodes_excluded``, logged
        with ``why``); an active node's work in flight is dropped and the listener
        told. Nothing happens if it was excluded already."""
        node = self.nodes[pid]
        if node.excluded:
            return
        was_active = node.active
        node.active, node.may_return, node.retry_at, node.excluded = False, False, None, why
        self.ledger.count("nodes_excluded")
        log(
            WARNING,
            "[async] %s excluded for the rest of the run: %s",
            node.name,
            why,
        )
        if was_active:  # a lost node's work was dropped and the optimizer told at its loss
            self._drop_in_flight(pid)
            self.listener.left(pid, self._now())
            self.listener.freed()

    def fail(self, pid: int, why: str, left: bool = False) -> None:
        """A failure of ``pid`` (``left``: it is known to have left the federation):
        its work in flight is dropped, then it backs off, is lost or is excluded (see
        the module docstring). Nothing happens to an excluded node."""
        node = self.nodes[pid]
        if node.excluded:
            return
        node.failures += 1
        self._drop_in_flight(pid)
        limit = self.settings.max_node_failures
        if node.failures >= limit:
            last = f"{node.failures} failures in a row (max-node-failures={limit}); last: {why}"
            self.exclude(pid, last)
        elif left or node.node_id not in set(self.grid.get_node_ids()):
            self.lose(pid, f"left the federation ({why})", may_return=True)
        else:
            self._back_off(node, why)

    def _back_off(self, node: Node, why: str) -> None:
        """Active -> backing-off until the engine clock has run the back-off delay."""
        if not node.active:
            return
        now = self._now()
        delay = self.settings.backoff.delay(node.failures)
        node.active, node.may_return, node.retry_at = False, False, now + delay
        self.listener.left(node.partition_id, now)
        self.ledger.count("node_backoffs")
        self.stats.count(node.partition_id, "backoffs")
        log(
            WARNING,
            "[async] %s backs off %.3g s (failure %d in a row of max-node-failures=%d): %s",
            node.name,
            delay,
            node.failures,
            self.settings.max_node_failures,
            why,
        )
        self.listener.freed()

    def next_retry(self) -> float | None:
        """The earliest end of a back-off or of an offline interval (engine seconds), or
        None if no node backs off or is offline."""
        times = [n.retry_at for n in self.nodes.values() if n.state in _WAITING]
        return min(times) if times else None  # type: ignore[type-var]

    def next_online(self) -> float | None:
        """The earliest time an offline node is online again (engine seconds), or None."""
        times = [n.retry_at for n in self.nodes.values() if n.state == "offline"]
        return min(times) if times else None  # type: ignore[type-var]

    def go_offline(self, pid: int, back_at: float, lost: bool, freed: bool = True) -> None:
        """Partition ``pid`` goes offline (the time model's availability) until engine
        time ``back_at`` (``inf``: it never comes back, and is lost for good).

        ``lost``: a message of it was lost (counted in ``lost_in_flight``), as opposed
        to a node found offline when it was to get work. Its other work in flight is
        dropped, the listener told, the loss counted in ``nodes_lost`` and logged;
        with ``freed`` the dispatcher tops up (not from inside its own top-up).
        Nothing happens to a node that is not active.
        """
        node = self.nodes[pid]
        if not node.active:
            return
        self.ledger.count("lost_in_flight", int(lost))
        if math.isinf(back_at):
            self.lose(pid, "offline for the rest of the run (its availability)")
            return
        node.active, node.may_return = False, False
        node.offline, node.retry_at = True, back_at
        self._drop_in_flight(pid)
        now = self._now()
        self.listener.left(pid, now)
        self.listener.forget(pid)  # back later, it meets a model that moved without it
        self.ledger.count("nodes_lost")
        what = "its message lost" if lost else "no message sent"
        log(INFO, "[async] %s offline at %.1f s until %.1f s (%s)", node.name, now, back_at, what)
        if freed:
            self.listener.freed()

    def end_backoffs(self) -> None:
        """Backing-off or offline -> active for every node whose back-off or offline
        interval has ended by the engine clock's reading now (in partition-id order);
        then the freed slots get work.

        The engine calls it whenever the clock may have passed a back-off's end: after
        each reply and on each turn of its loop (virtual time moves only at a reply or
        a jump, so a simulation stays reproducible).
        """
        now = self._now()
        back = [p for p, n in sorted(self.nodes.items()) if n.state in _WAITING]
        back = [p for p in back if self.nodes[p].retry_at <= now]  # type: ignore[operator]
        if not back:
            return
        was_offline = {pid for pid in back if self.nodes[pid].offline}
        for pid in back:
            node = self.nodes[pid]
            node.active, node.retry_at, node.offline = True, None, False
        for pid in back:
            self.listener.joined(pid, now)
            if pid in was_offline:
                self.ledger.count("nodes_joined")
                log(INFO, "[async] %s online again at %.1f s", self.name(pid), now)
            else:
                log(INFO, "[async] %s back after its back-off", self.name(pid))
        self.listener.freed()

    def register_joins(self) -> None:
        """Register answered queries as joins (lost -> active, or a new node), each
        counted, logged and given work; query new node ids now and then."""
        if self.joins_pending:
            for pid in self.register_query_replies():
                self.listener.joined(pid, self._now())
                self.ledger.count("nodes_joined")
                log(INFO, "[async] %s joined", self.name(pid))
                self.listener.freed()
        if self.refresh_due():
            self.query_new_nodes()

    def check_deadlines(self) -> None:
        """Fail the nodes whose train reply is later than ``dispatch_timeout`` wall
        seconds (counted in ``dispatch_timeouts``); end the back-offs that are over."""
        timeout = self.settings.dispatch_timeout
        if self.in_flight.overdue(time.monotonic(), timeout):
            self.in_flight.pull()  # the server may have been busy: look once more first
            for dispatch in self.in_flight.overdue(time.monotonic(), timeout):
                self.ledger.count("dispatch_timeouts")
                self.stats.count(dispatch.partition_id, "dispatch_timeouts")
                self.fail(dispatch.partition_id, f"no reply within dispatch-timeout={timeout} s")
        self.end_backoffs()

    def on_error_reply(self, pid: int, reply: Message) -> None:
        """An error reply to a train message of ``pid``: counted, logged with what its
        code means (TTL expiry named as such), a failure of the node."""
        self.ledger.count("error_replies")
        self.stats.count(pid, "error_replies")
        code, ttl = reply.error.code, self.settings.message_ttl
        log(
            WARNING,
            "[async] error reply from %s (code %s: %s): %s",
            self.name(pid),
            code,
            describe_error(code, ttl),
            last_line(reply),
        )
        why = f"error reply ({error_summary(reply, ttl)})"
        self.fail(pid, why, left=code == ErrorCode.NODE_UNAVAILABLE)

    def replied(self, pid: int) -> None:
        """A valid reply of ``pid``: its failures in a row start again from 0."""
        self.nodes[pid].failures = 0

    def accepted(self, pid: int) -> None:
        """An update of ``pid`` was accepted: its rejections in a row start again from 0."""
        self.nodes[pid].rejections_in_row = 0

    def rejected(self, pid: int, why: str, blame: bool = True) -> None:
        """An update of ``pid`` was rejected (``why``: reason and message). With
        ``blame``, ``max-consecutive-rejections`` of them in a row exclude it; without
        (every node's updates are rejected: the model diverged) only the count goes on."""
        node = self.nodes[pid]
        node.rejections_in_row += 1
        limit = self.settings.max_consecutive_rejections
        if blame and limit and node.rejections_in_row >= limit:
            self.exclude(
                pid,
                f"{node.rejections_in_row} rejected updates in a row "
                f"(max-consecutive-rejections={limit}); last: {why}",
            )

    def reconcile(self, active_before: set[int] | frozenset[int]) -> None:
        """At a resume, the nodes that answered now are the run's: those lost before
        the checkpoint (not in ``active_before``, the optimizer's active nodes) rejoin;
        those active then that did not answer are lost (they rejoin if they come)."""
        now = self._now()
        for pid, node in sorted(self.nodes.items()):
            if node.active and pid not in active_before:
                self.listener.joined(pid, now)
                self.ledger.count("nodes_joined")
                log(INFO, "[async] %s rejoined at the resume", node.name)
            elif not node.active and pid in active_before:
                node.may_return = True
                self.listener.left(pid, now)
                self.ledger.count("nodes_lost")
                log(
                    WARNING,
                    "[async] %s lost: it did not answer at the resume (it rejoins when it "
                    "comes back)",
                    node.name,
                )

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Per-partition state and the clock's speed factors, as python values."""
        return {
            "nodes": {pid: {k: getattr(n, k) for k in Node.SAVED} for pid, n in self.nodes.items()},
            "speeds": dict(self.speeds),
            "num_partitions": self.num_partitions,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` over the nodes that answered at this start.

        A node that answered is active again (one lost before the checkpoint rejoins,
        with clean failure and rejection counts), unless it was excluded (it stays
        out for the rest of the run) or backing off (it still is, until the engine
        time saved). A saved partition that did not answer is inactive and may
        return (queried when it shows up), unless excluded. ``num_partitions`` stays
        this start's (checked against the checkpoint's before: it may differ only
        where ``resume-allow-changes`` allows it); then :meth:`reconcile`.
        """
        self.speeds = dict(state["speeds"])
        for pid, saved in state["nodes"].items():
            node = self.nodes.get(pid)
            if node is None:  # its SuperNode did not come back: known, may return
                node = self.nodes[pid] = Node(
                    pid,
                    saved["node_id"],
                    saved["speed"],
                    active=False,
                    may_return=True,
                    identified=saved["identified"],
                )
            _restore_node(node, saved)


def _restore_node(node: Node, saved: dict[str, Any]) -> None:
    """Restore ``node`` from its checkpoint record ``saved`` (``Node.SAVED``) at a resume.

    ``node.active``: it answered at this start. An excluded node stays out for the
    rest of the run; one backing off at the checkpoint still is (until the engine
    time saved); one lost before the checkpoint that answered now rejoins with clean
    failure and rejection counts.
    """
    node.dispatches, node.speed = saved["dispatches"], saved["speed"]
    node.excluded = saved["excluded"]
    # Offline in the time model: out until its time, as a back-off is (a checkpoint
    # from before availability has no "offline").
    node.offline = bool(saved.get("offline", False))
    backing_off = not saved["active"] and saved["retry_at"] is not None
    if saved["active"] or backing_off or node.excluded or not node.active:
        node.failures = saved["failures"]
        node.rejections_in_row = saved["rejections_in_row"]
    if node.excluded:  # out for the rest of the run, whether it answered or not
        node.active = node.may_return = False
    elif node.active and backing_off:
        node.active, node.retry_at = False, saved["retry_at"]
