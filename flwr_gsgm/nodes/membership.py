"""Who is in the federation: discovery, queries, joins, losses and refusals.

Nodes are keyed on the ``partition-id`` they report in answer to a ``query``
message (sent at start-up and whenever a new node id appears), not on node ids,
which change when a SuperNode restarts. The query is optional
(:mod:`flwr_gsgm.nodes.query_reply`): a node without a query handler, or whose query
raises, is registered at once without a partition-id and keyed by its node id: at
start-up such nodes get, in node-id order, the keys after the run's partitions
(``num-partitions``, or after the highest partition-id reported), and a node that
joins later the next free key; a node that comes back under the same node id gets
its key again. Such a key is used as the node's partition-id everywhere (the core,
logs, checkpoints) but is not checked against the partition-id its replies report.

A node whose partitioning differs from the run's (another ``num-partitions``, a
partition-id out of range, a partition already held by another node at start-up)
is refused, and so is a node whose query reply
has a partition-id or num-partitions that is not an integer >= 0 (a list, NaN,
infinity, 1.7; an integral float such as 1.0 is taken as that integer).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any

from flwr.common.logger import log
from flwr.serverapp import Grid

from flwr_gsgm.engine.in_flight import InFlight
from flwr_gsgm.engine.ledger import Ledger
from flwr_gsgm.engine.settings import EngineSettings
from flwr_gsgm.nodes import states as node_states
from flwr_gsgm.nodes.error_codes import error_summary
from flwr_gsgm.nodes.query_reply import NO_PARTITION, read_query_reply

__all__ = ["Membership", "Node"]

#: ``lose(partition_id, why, may_return)``: the engine's handler of a lost node.
LoseFn = Callable[[int, str, bool], None]


@dataclass
class Node:
    """One partition of the federation and the node now holding it."""

    partition_id: int
    node_id: int
    speed: float
    dispatches: int = 0
    # Failures in a row (dispatch time-outs, error replies): each backs the node off,
    # max-node-failures of them exclude it (flwr_gsgm.nodes.events). A valid reply
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

    #: Fields saved in a checkpoint.
    SAVED = ("dispatches", "failures", "rejections_in_row", "active", "speed")
    SAVED += ("may_return", "retry_at", "excluded")

    @property
    def state(self) -> str:
        """ "active", "backing-off", "lost" (left the federation) or "excluded"."""
        if self.active:
            return "active"
        if self.excluded:
            return "excluded"
        return "backing-off" if self.retry_at is not None else "lost"


class Membership:
    """The nodes of a run, keyed by partition-id.

    ``started`` becomes True once training starts (the optimizer exists): from then
    on a (re)attached partition is a join, and a node must report the run's
    ``num-partitions``.
    """

    def __init__(
        self, grid: Grid, in_flight: InFlight, settings: EngineSettings, ledger: Ledger
    ) -> None:
        self.grid = grid
        self.in_flight = in_flight
        self.settings = settings
        self.ledger = ledger
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

    def start(self, pids: list[int]) -> None:
        """Training starts with ``pids``: from now on an attach is a join. Logged."""
        self.started = True
        slow = [p for p in pids if self.nodes[p].speed > 1.0]
        log(INFO, "[async] %d nodes (partition-ids %s); slow: %s", len(pids), pids, slow)

    def active_ids(self) -> list[int]:
        """Partition-ids of the active nodes, in order."""
        return [pid for pid in sorted(self.nodes) if self.nodes[pid].active]

    def idle_active(self, depth: int = 1) -> list[int]:
        """Partition-ids of the active nodes with fewer than ``depth`` dispatches in
        flight (1: none), in order."""
        busy = self.in_flight.busy_partitions(depth)
        return [pid for pid in sorted(self.nodes) if self.nodes[pid].active and pid not in busy]

    # ------------------------------------------------------------- discovery
    def discover(self, lose: LoseFn) -> list[int]:
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
            self.register_query_replies(lose)
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
            self._attach(self.key_for(node_id), node_id, lose, identified=False)
        self.unkeyed.clear()
        pids = sorted(self.nodes)
        if self.settings.virtual_clock is not None:
            num_partitions = max(self.num_partitions, max(pids) + 1)
            self.speeds = self.settings.virtual_clock.speed_factors(list(range(num_partitions)))
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
                del self.nodes[pid]
                why = f"it reports num-partitions {num}, the run has {self.num_partitions}"
                log(WARNING, "[async] partition %d refused: %s", pid, why)

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

    def _register_unqueried(self, lose: LoseFn) -> list[int]:
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
                "it to True if your ClientApp answers a query with its partition-id)",
            )
        if not self.started:
            self.unkeyed.extend(new)
            return []
        joined = []
        for node_id in new:
            pid = self.key_for(node_id)
            if self._attach(pid, node_id, lose, identified=False):
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

    def register_query_replies(self, lose: LoseFn) -> list[int]:
        """Map answered queries to partition-ids; return partition-ids that (re)joined.

        Never raises on a reply: one with malformed metadata is logged, counted in
        ``nodes_refused`` and registers no node; a node that cannot answer (no query
        handler, its query raised) or reports no partition-id is registered without
        one (:meth:`key_for`; at start-up once every answer is in). A query answered
        with another error (its TTL expired while the ClientApp started, say) or not
        answered within ``startup_timeout`` seconds failed: it is sent again, up to
        ``max_node_failures`` failed queries in a row (:meth:`_query_failed`).
        """
        joined = self._register_unqueried(lose)
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
            if pid is not None and self._attach(pid, node_id, lose, identified):
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
                    why = f"{node.failures} failures in a row; {why}"
                    node_states.exclude(self.nodes, self.ledger, node.partition_id, why)

    def key_for(self, node_id: int) -> int:
        """The key of a node without a partition-id: its old key, else the next free one.

        Free keys start after the run's partitions, so they never take a partition-id
        a node may report.
        """
        for node in self.nodes.values():
            if not node.identified and node.node_id == node_id:
                return node.partition_id
        return max(self.num_partitions, max(self.nodes, default=-1) + 1)

    def _attach(self, pid: int, node_id: int, lose: LoseFn, identified: bool = True) -> bool:
        """Bind ``pid`` to ``node_id``; return True if the partition (re)joins the run."""
        node = self.nodes.get(pid)
        if node is None:
            self.nodes[pid] = Node(pid, node_id, self.speeds.get(pid, 1.0), identified=identified)
            if not identified:
                log(INFO, "[async] node %d registered without a partition-id, as %d", node_id, pid)
            return self.started
        if node.excluded:
            self.ledger.count("nodes_refused")
            why = f"partition-id {pid} was excluded from the run ({node.excluded})"
            log(WARNING, "[async] node %d refused: %s", node_id, why)
            return False
        if node.active and node.node_id != node_id and not self.started:
            self.ledger.count("nodes_refused")
            why = f"partition-id {pid} is already node {node.node_id}'s"
            log(WARNING, "[async] node %d refused: %s", node_id, why)
            return False
        if node.active and node.node_id != node_id:
            # A restarted SuperNode: the old node id is gone, its work is lost.
            lose(pid, f"replaced by node {node_id}", True)
        node.node_id = node_id
        if node.active:
            return False
        node.active, node.retry_at = True, None
        node.rejections_in_row = 0  # failures stay: only a valid reply resets them
        return True

    def mark_lost(self, pid: int, may_return: bool) -> Node | None:
        """Deactivate ``pid``; return its node, or None if it was not active."""
        node = self.nodes[pid]
        if not node.active:
            return None
        node.active = False
        node.may_return = may_return
        return node

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
        return (queried when it shows up), unless excluded.
        """
        self.speeds, self.num_partitions = dict(state["speeds"]), state["num_partitions"]
        for pid, saved in state["nodes"].items():
            node = self.nodes.get(pid)
            if node is None:  # its SuperNode did not come back: known, may return
                node = self.nodes[pid] = Node(
                    pid, -1, saved["speed"], active=False, may_return=True
                )
            node_states.restore(node, saved)
