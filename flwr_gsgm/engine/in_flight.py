"""What the engine has in flight: train dispatches, membership queries, their replies.

:class:`InFlight` is the engine's transport over Flower's ``Grid``: it pushes train
and query messages, pulls replies, remembers which reply arrived when, and says
which dispatch is to be handled next: under the virtual clock the one with the
earliest virtual finish time (once its reply is here), otherwise the earliest
arrival. Deadlines (``dispatch-timeout``, ``startup-timeout``) are read from the
wall-clock send time of each message. Which idle node gets a freed slot is the
dispatch policy's choice (:mod:`flwr_gsgm.engine.dispatch_policy`).
"""

from __future__ import annotations

import heapq
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict
from logging import WARNING
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from flwr_gsgm.deploy.flower_waits import shorten_reply_pull_backoff
from flwr_gsgm.intake.dispatch import Dispatch

__all__ = ["InFlight"]


class InFlight:
    """Train dispatches and queries pushed whose reply has not been handled yet.

    Parameters
    ----------
    grid : Grid
        Where messages are pushed and replies pulled.
    keys : list[str]
        Array keys of the model, in order (the layout of every train message).
    message_ttl : float
        TTL in seconds of every message pushed.
    virtual_order : bool
        True (virtual clock): replies are handled in virtual finish order;
        False: in arrival order.
    on_replay : callable, optional
        ``(message_id, why) -> None``, called for each replayed reply pulled (a second
        reply to a message, a reply to a message not in flight, a reply from another
        node than the message's), which is then ignored. Default: ignore silently.
    query_ttl : float, optional
        TTL in seconds of a query (a node's start-up message): the start-up
        deadline, so that a ClientApp slower to start than ``message_ttl`` still
        answers. Default: ``message_ttl``.
    """

    def __init__(
        self,
        grid: Grid,
        keys: list[str],
        message_ttl: float,
        virtual_order: bool,
        on_replay: Callable[[str, str], None] | None = None,
        query_ttl: float | None = None,
    ) -> None:
        self.on_replay = on_replay or (lambda mid, why: None)
        self.grid = grid
        self.keys = keys
        self.ttl = message_ttl
        self.query_ttl = message_ttl if query_ttl is None else query_ttl
        self.virtual_order = virtual_order
        self.dispatches: dict[str, Dispatch] = {}  # message id -> train dispatch
        self.queries: dict[str, tuple[int, float]] = {}  # message id -> (node id, sent at)
        self.heap: list[Dispatch] = []
        # Replies that are here; None for a message lost with its node (push_lost).
        self.arrived: dict[str, Message | None] = {}
        self.arrival_order: list[str] = []
        self.unsent = 0  # pushes the SuperLink refused (their local ids: unsent-<n>)
        self.lost = 0  # messages lost with their node (their local ids: lost-<n>)
        if type(grid).__module__ == "flwr.superlink.grid.http_grid":
            # A deployment: a reply pulled while its node still uploads it would wait
            # Flower's 1 s object back-off (the in-process grid has no such wait).
            try:
                shorten_reply_pull_backoff()
            except RuntimeError as err:  # another Flower: its own back-off stays
                log(WARNING, "[async] %s", err)

    def __len__(self) -> int:
        """Number of train dispatches in flight."""
        return len(self.dispatches)

    def busy_partitions(self, depth: int = 1) -> set[int]:
        """Partition-ids with at least ``depth`` train dispatches in flight."""
        counts = Counter(d.partition_id for d in self.dispatches.values())
        return {pid for pid, n in counts.items() if n >= depth}

    def count(self, partition_id: int) -> int:
        """Train dispatches in flight to ``partition_id``."""
        return sum(d.partition_id == partition_id for d in self.dispatches.values())

    # ------------------------------------------------------------------ push
    def push_train(self, dispatch: Dispatch, node_id: int, weights: list[np.ndarray]) -> None:
        """Send ``dispatch`` with ``weights`` (float32, model order) to ``node_id``; track it."""
        arrays = ArrayRecord({k: Array(w) for k, w in zip(self.keys, weights)})
        message = Message(
            RecordDict({"arrays": arrays, "config": ConfigRecord(dispatch.config)}),
            node_id,
            "train",
            ttl=self.ttl,
        )
        (mid,) = list(self.grid.push_messages([message]))
        mid = self._tracked_id(mid, node_id, "train")
        dispatch.message_id, dispatch.node_id, dispatch.sent_at = mid, node_id, time.monotonic()
        self.dispatches[mid] = dispatch
        heapq.heappush(self.heap, dispatch)

    def push_lost(self, dispatch: Dispatch, node_id: int) -> None:
        """Track ``dispatch`` as a message lost with its node (the time model's
        availability: ``dispatch.back_at`` is set): nothing is sent, since its reply
        would never come; it is due at its ``v_finish``, when the node went offline,
        like any dispatch, and its "reply" (None) is here at once."""
        self.lost += 1
        mid = f"lost-{self.lost}"
        dispatch.message_id, dispatch.node_id, dispatch.sent_at = mid, node_id, time.monotonic()
        self.dispatches[mid] = dispatch
        self.arrived[mid] = None
        self.arrival_order.append(mid)
        heapq.heappush(self.heap, dispatch)

    def push_queries(self, node_ids: list[int]) -> None:
        """Ask each of ``node_ids`` for its partition-id (a ``query`` message)."""
        messages = [
            Message(RecordDict({"config": ConfigRecord()}), node_id, "query", ttl=self.query_ttl)
            for node_id in node_ids
        ]
        sent_at = time.monotonic()
        for node_id, mid in zip(node_ids, self.grid.push_messages(messages)):
            self.queries[self._tracked_id(mid, node_id, "query")] = (node_id, sent_at)

    def _tracked_id(self, mid: str | None, node_id: int, kind: str) -> str:
        """The id to track a pushed message under: its message id, or for a push the
        SuperLink refused (Flower 1.42 returns None, 1.43 ``""``) a local id no reply
        can carry, so that the message is failed by its deadline (dispatch-timeout for
        a train message, startup-timeout for a query) like one never answered, and
        two refused pushes do not overwrite each other."""
        if mid:
            return mid
        self.unsent += 1
        log(
            WARNING,
            "[async] the %s message to node %d was not accepted by the SuperLink (push "
            "returned %r); it fails at its deadline",
            kind,
            node_id,
            mid,
        )
        return f"unsent-{self.unsent}"

    # ------------------------------------------------------------------ pull
    def awaited(self) -> list[str]:
        """Ids of the pushed messages whose reply has not arrived yet (dispatches first)."""
        wanted = [m for m in self.dispatches if m not in self.arrived]
        wanted += [m for m in self.queries if m not in self.arrived]
        return [m for m in wanted if not m.startswith("unsent-")]

    def pull(self) -> None:
        """Pull the replies that are ready and note their arrival order.

        A replayed reply (see :meth:`_replayed`) is passed to ``on_replay`` and ignored.
        """
        wanted = self.awaited()
        if not wanted:
            return
        for reply in self.grid.pull_messages(wanted):
            mid = reply.metadata.reply_to_message_id
            why = self._replayed(mid, reply)
            if why is not None:
                self.on_replay(mid, why)
                continue
            self.arrived[mid] = reply
            self.arrival_order.append(mid)

    def _replayed(self, mid: str, reply: Message) -> str | None:
        """Why ``reply`` (answering message ``mid``) is a replay, or None if it is not.

        A reply is identified by the message it answers and the node it comes from,
        not by its content: it is a replay if that message was answered already or
        is not in flight (handled, lost, never sent), or if it carries content from
        another node than the one the message was sent to (an error reply may come
        from the SuperLink).
        """
        if mid in self.arrived:
            return f"a second reply to message {mid!r}, whose reply has arrived already"
        if mid in self.dispatches:
            node_id = self.dispatches[mid].node_id
        elif mid in self.queries:
            node_id = self.queries[mid][0]
        else:
            return f"a reply to message {mid!r}, which is not in flight (answered or dropped)"
        src = reply.metadata.src_node_id
        # The SuperLink answers for a node it cannot reach (gone, TTL expired) with an
        # error reply whose source is the SuperLink itself (node id 1 in Flower 1.42),
        # and keeps returning it until it is taken: an error reply is the message's
        # answer whatever its source.
        if src != node_id and not reply.has_error():
            return f"a reply to message {mid!r} from node {src}, the message went to node {node_id}"
        return None

    def idle(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds (the poll interval) for replies.

        A grid with a ``wait_for_replies(message_ids, timeout)`` method (the
        in-process grid) returns as soon as one reply is ready; other grids are
        polled, so this sleeps the whole interval. Either way only wall time
        changes: what is applied, and in which order, does not.
        """
        wait = getattr(self.grid, "wait_for_replies", None)
        if wait is None:
            time.sleep(timeout)
        else:
            wait(self.awaited(), timeout)

    def take_reply(self, mid: str) -> Message | None:
        """Remove and return the reply to message ``mid`` (KeyError if it has not
        arrived; None for a message lost with its node)."""
        reply = self.arrived.pop(mid)
        self.arrival_order.remove(mid)
        return reply

    # ------------------------------------------------------------ dispatches
    def next_ready(self) -> Dispatch | None:
        """The dispatch whose reply is to be handled next, if its reply is here."""
        if not self.virtual_order:
            for mid in self.arrival_order:
                if mid in self.dispatches:
                    return self.dispatches[mid]
            return None
        while self.heap and self.heap[0].message_id not in self.dispatches:
            heapq.heappop(self.heap)  # lost or already handled
        if not self.heap or self.heap[0].message_id not in self.arrived:
            return None
        return self.heap[0]

    def finish(self, dispatch: Dispatch) -> Message | None:
        """Stop tracking ``dispatch`` and return its reply (which must have arrived;
        None for a message lost with its node)."""
        reply = self.take_reply(dispatch.message_id)
        del self.dispatches[dispatch.message_id]
        return reply

    def drop_partition(self, partition_id: int) -> int:
        """Forget every dispatch to ``partition_id`` (and replies to it); return how many."""
        mids = [m for m, d in self.dispatches.items() if d.partition_id == partition_id]
        for mid in mids:
            del self.dispatches[mid]
            if mid in self.arrived:
                self.take_reply(mid)
        return len(mids)

    def first_due(self) -> Dispatch | None:
        """The dispatch due first in virtual finish order, whether its reply is here
        or not (None: nothing in flight)."""
        while self.heap and self.heap[0].message_id not in self.dispatches:
            heapq.heappop(self.heap)  # lost or already handled
        return self.heap[0] if self.heap else None

    def overdue(self, now: float, timeout: float) -> list[Dispatch]:
        """Dispatches without a reply, sent more than ``timeout`` seconds before ``now``."""
        return [
            d
            for d in self.dispatches.values()
            if d.message_id not in self.arrived and now - d.sent_at > timeout
        ]

    def clear(self) -> None:
        """Forget every dispatch (the time budget is spent: they are not applied)."""
        self.dispatches.clear()
        self.heap.clear()

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """``{"in_flight": [...]}``: every train dispatch in flight, in handling order,
        with the weights it carried (kept when checkpoints are on) and without what
        belongs to one push (:attr:`Dispatch.TRANSIENT`)."""
        return {
            "in_flight": [
                {k: v for k, v in asdict(d).items() if k not in Dispatch.TRANSIENT}
                for d in sorted(self.dispatches.values())
            ]
        }

    def load_state_dict(self, state: dict[str, Any], node_ids: Mapping[int, int]) -> None:
        """Re-send the dispatches of :meth:`state_dict` whose partition is in
        ``node_ids`` (partition-id -> node id of the active nodes), with the same seed,
        weights and virtual finish time; the others are not resumed."""
        for saved in state["in_flight"]:
            dispatch = Dispatch(**saved)
            if dispatch.partition_id in node_ids:
                node_id = node_ids[dispatch.partition_id]
                if dispatch.back_at is not None:  # lost with its node: still lost
                    self.push_lost(dispatch, node_id)
                else:
                    self.push_train(dispatch, node_id, dispatch.arrays)  # type: ignore[arg-type]
