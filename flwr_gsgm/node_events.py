"""Node events: joins, losses, time-outs and error replies, carried to every party.

:mod:`flwr_gsgm.membership` knows who is in the federation. When that changes,
this module tells the server optimizer (``on_node_joined`` / ``on_node_lost`` at the
engine clock), the ledger (``nodes_joined``, ``nodes_lost``, ``lost_in_flight``,
``error_replies``), the log, and the dispatcher (a freed slot gets new work). A
hung or failing node is lost, never waited on forever: no reply within
``reply_timeout`` seconds, ``max_consecutive_errors`` error replies in a row, or
``max_consecutive_rejections`` rejected updates in a row.
"""

from __future__ import annotations

import time
from logging import INFO, WARNING
from typing import TYPE_CHECKING

from flwr.app import Message
from flwr.common.constant import ErrorCode
from flwr.common.logger import log

from flwr_gsgm.core import UpdateRejected
from flwr_gsgm.membership import Node

if TYPE_CHECKING:
    from flwr_gsgm.async_engine import AsyncEngine

__all__ = ["lose", "expire_timeouts", "register_joins", "on_error_reply", "on_rejected"]


def lose(engine: AsyncEngine, pid: int, why: str, may_return: bool = False) -> None:
    """Partition ``pid`` leaves: its work in flight is dropped, the optimizer told.

    ``may_return``: the node may come back under the same partition-id (a time-out
    or a transport error), rather than being refused for good.
    """
    assert engine.optimizer is not None
    node = engine.members.mark_lost(pid, may_return)
    if node is None:
        return
    engine.ledger.count("lost_in_flight", engine.in_flight.drop_partition(pid))
    engine.optimizer.on_node_lost(pid, now=engine.clock_now)
    engine.ledger.count("nodes_lost")
    log(WARNING, "[async] partition %d (node %d) lost: %s", pid, node.node_id, why)
    engine.top_up()


def expire_timeouts(engine: AsyncEngine) -> None:
    """Lose the nodes whose reply is later than ``reply_timeout`` wall seconds."""
    timeout = engine.settings.reply_timeout
    now = time.monotonic()
    if not engine.in_flight.overdue(now, timeout):
        return
    engine.in_flight.pull()  # the server may have been busy: look once more before giving up
    for dispatch in engine.in_flight.overdue(now, timeout):
        lose(engine, dispatch.partition_id, f"no reply within {timeout} s", may_return=True)


def register_joins(engine: AsyncEngine) -> None:
    """Register answered queries as joins; query new node ids now and then."""
    assert engine.optimizer is not None
    if engine.in_flight.queries:
        for pid in engine.members.register_query_replies(engine.lose):
            engine.optimizer.on_node_joined(pid, now=engine.clock_now)
            engine.ledger.count("nodes_joined")
            node_id = engine.members.nodes[pid].node_id
            log(INFO, "[async] partition %d joined (node %d)", pid, node_id)
            engine.top_up()
    if engine.members.refresh_due():
        engine.members.query_new_nodes()


def on_error_reply(engine: AsyncEngine, node: Node, reply: Message) -> None:
    """Count an error reply; lose the node after too many in a row, else refill its slot."""
    engine.ledger.count("error_replies")
    node.errors_in_row += 1
    reason = (reply.error.reason or "").strip().splitlines()
    log(
        WARNING,
        "[async] error reply from partition %d (code %s): %s",
        node.partition_id,
        reply.error.code,
        reason[-1] if reason else "",
    )
    if node.errors_in_row >= engine.settings.max_consecutive_errors:
        # Transport errors (message or node unavailable) mean a crash, not bad work.
        transport = reply.error.code != ErrorCode.CLIENT_APP_RAISED_EXCEPTION
        lose(
            engine,
            node.partition_id,
            f"{node.errors_in_row} error replies in a row",
            may_return=transport,
        )
    else:
        engine.top_up()


def on_rejected(engine: AsyncEngine, node: Node, err: UpdateRejected) -> None:
    """Record a rejected update (its reason); lose the node after too many in a row."""
    engine.ledger.record_rejection(err.reason)
    pid = node.partition_id
    log(WARNING, "[async] rejected update from partition %d (%s): %s", pid, err.reason, err.message)
    node.rejections_in_row += 1
    limit = engine.settings.max_consecutive_rejections
    if limit and node.rejections_in_row >= limit:
        lose(engine, pid, f"{node.rejections_in_row} rejected updates in a row")
