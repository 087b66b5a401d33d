"""Node events: joins, failures, back-offs, losses, exclusions, carried to every party.

:mod:`flwr_gsgm.nodes.membership` knows who is in the federation. When that changes,
this module tells the server optimizer (``on_node_joined`` / ``on_node_lost`` at the
engine clock), the ledger (``nodes_joined``, ``nodes_lost``, ``nodes_excluded``,
``node_backoffs``, ``lost_in_flight``, ``error_replies``, ``dispatch_timeouts``), the
per-node counts (:mod:`flwr_gsgm.nodes.stats`), the log, and the dispatcher (a freed
slot gets new work). A hung or failing node is backed off, never waited on for ever.

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
  then it is back.

A valid reply resets k; the dispatch that failed is dropped (``lost_in_flight``).
``max-consecutive-rejections`` rejected updates in a row exclude a node too, unless
every node's are rejected at once (the model diverged, :mod:`flwr_gsgm.engine.divergence`).
"""

from __future__ import annotations

import time
from logging import INFO, WARNING
from typing import TYPE_CHECKING

from flwr.app import Message
from flwr.common.constant import ErrorCode
from flwr.common.logger import log

from flwr_gsgm.core import Outcome, UpdateRejected
from flwr_gsgm.evaluation.central import wall_since
from flwr_gsgm.nodes import states as node_states
from flwr_gsgm.nodes.error_codes import describe_error, error_summary, last_line
from flwr_gsgm.nodes.membership import Node

if TYPE_CHECKING:
    from flwr_gsgm.engine.async_engine import AsyncEngine

__all__ = [
    "check_deadlines",
    "end_backoffs",
    "exclude",
    "fail",
    "idle",
    "lose",
    "on_error_reply",
    "on_rejected",
    "on_virtual_time",
    "record_outcome",
    "register_joins",
    "virtual_jump",
]


def now(engine: AsyncEngine) -> float:
    """The engine clock (s): virtual seconds, or wall seconds since the start."""
    virtual = engine.settings.virtual_clock is not None
    return engine.clock_now if virtual else wall_since(engine.t0)


def lose(engine: AsyncEngine, pid: int, why: str, may_return: bool = False) -> None:
    """Partition ``pid`` leaves: its work in flight is dropped, the optimizer told.

    ``may_return``: it left the federation and may come back (it is queried again
    when its node id shows up).
    """
    assert engine.optimizer is not None
    node = engine.members.mark_lost(pid, may_return)
    if node is None:
        return
    engine.ledger.count("lost_in_flight", engine.in_flight.drop_partition(pid))
    engine.optimizer.on_node_lost(pid, now=now(engine))
    engine.norm_bound.forget(pid)  # back later, it meets a model that moved without it
    engine.ledger.count("nodes_lost")
    log(WARNING, "[async] partition %d (node %d) lost: %s", pid, node.node_id, why)
    engine.top_up()


def exclude(engine: AsyncEngine, pid: int, why: str) -> None:
    """Exclude ``pid`` for the rest of the run (:meth:`Membership.exclude`)."""
    assert engine.optimizer is not None
    if node_states.exclude(engine.members.nodes, engine.ledger, pid, why) is None:
        return
    engine.ledger.count("lost_in_flight", engine.in_flight.drop_partition(pid))
    engine.optimizer.on_node_lost(pid, now=now(engine))
    engine.top_up()


def fail(engine: AsyncEngine, pid: int, why: str, left: bool = False) -> None:
    """A failure of ``pid`` (``left``: it is known to have left): back-off, loss or exclusion."""
    node = engine.members.nodes[pid]
    if node.excluded:
        return
    node.failures += 1
    engine.ledger.count("lost_in_flight", engine.in_flight.drop_partition(pid))
    limit = engine.settings.max_node_failures
    if node.failures >= limit:
        last = f"{node.failures} failures in a row (max-node-failures={limit}); last: {why}"
        exclude(engine, pid, last)
    elif left or node.node_id not in set(engine.members.grid.get_node_ids()):
        lose(engine, pid, f"left the federation ({why})", may_return=True)
    else:
        _back_off(engine, node, why)


def _back_off(engine: AsyncEngine, node: Node, why: str) -> None:
    assert engine.optimizer is not None
    clock = now(engine)
    delay = engine.settings.backoff.delay(node.failures)
    if node_states.set_aside(engine.members.nodes, node.partition_id, clock + delay) is None:
        return
    engine.optimizer.on_node_lost(node.partition_id, now=clock)
    engine.ledger.count("node_backoffs")
    engine.stats.count(node.partition_id, "backoffs")
    log(
        WARNING,
        "[async] partition %d (node %d) backs off %.3g s (failure %d in a row of "
        "max-node-failures=%d): %s",
        node.partition_id,
        node.node_id,
        delay,
        node.failures,
        engine.settings.max_node_failures,
        why,
    )
    engine.top_up()


def end_backoffs(engine: AsyncEngine, clock: float) -> None:
    """Take back the nodes whose back-off ends at engine time ``clock``; send them work."""
    back = node_states.due_back(engine.members.nodes, clock)
    if not back:
        return
    assert engine.optimizer is not None
    for pid in back:
        engine.optimizer.on_node_joined(pid, now=clock)
        log(INFO, "[async] partition %d back after its back-off", pid)
    engine.top_up()


def on_virtual_time(engine: AsyncEngine) -> None:
    """Under the virtual clock, back-offs end when a reply moves the clock past them
    (so the run stays reproducible)."""
    if engine.settings.virtual_clock is not None:
        end_backoffs(engine, engine.clock_now)


def idle(engine: AsyncEngine) -> None:
    """Nothing to apply: wait for replies, or jump the virtual clock to a back-off's end."""
    jump = virtual_jump(engine)
    if jump is None:
        engine.in_flight.idle(engine.settings.poll_interval)
    else:
        engine.clock_now = max(engine.clock_now, jump)
        end_backoffs(engine, engine.clock_now)


def virtual_jump(engine: AsyncEngine) -> float | None:
    """Under the virtual clock with nothing in flight, the virtual time the earliest
    back-off ends (the engine jumps to it); None otherwise."""
    if engine.settings.virtual_clock is None or engine.in_flight:
        return None
    return node_states.next_retry(engine.members.nodes)


def check_deadlines(engine: AsyncEngine) -> None:
    """Fail the nodes whose train reply is later than ``dispatch_timeout`` wall seconds;
    in deployment also end the back-offs that are over (wall clock)."""
    timeout = engine.settings.dispatch_timeout
    if engine.in_flight.overdue(time.monotonic(), timeout):
        engine.in_flight.pull()  # the server may have been busy: look once more first
        for dispatch in engine.in_flight.overdue(time.monotonic(), timeout):
            engine.ledger.count("dispatch_timeouts")
            engine.stats.count(dispatch.partition_id, "dispatch_timeouts")
            fail(engine, dispatch.partition_id, f"no reply within dispatch-timeout={timeout} s")
    if engine.settings.virtual_clock is None:
        end_backoffs(engine, now(engine))


def register_joins(engine: AsyncEngine) -> None:
    """Register answered queries as joins; query new node ids now and then."""
    assert engine.optimizer is not None
    if engine.members.joins_pending:
        for pid in engine.members.register_query_replies(engine.lose):
            engine.optimizer.on_node_joined(pid, now=now(engine))
            engine.ledger.count("nodes_joined")
            node_id = engine.members.nodes[pid].node_id
            log(INFO, "[async] partition %d joined (node %d)", pid, node_id)
            engine.top_up()
    if engine.members.refresh_due():
        engine.members.query_new_nodes()


def on_error_reply(engine: AsyncEngine, node: Node, reply: Message) -> None:
    """An error reply to a train message: counted, logged with what its code means
    (TTL expiry named as such), a failure of the node."""
    engine.ledger.count("error_replies")
    engine.stats.count(node.partition_id, "error_replies")
    code, ttl = reply.error.code, engine.settings.message_ttl
    log(
        WARNING,
        "[async] error reply from partition %d (code %s: %s): %s",
        node.partition_id,
        code,
        describe_error(code, ttl),
        last_line(reply),
    )
    why = f"error reply ({error_summary(reply, ttl)})"
    fail(engine, node.partition_id, why, left=code == ErrorCode.NODE_UNAVAILABLE)


def record_outcome(engine: AsyncEngine, pid: int, outcome: Outcome | None) -> None:
    """The per-node counts (:meth:`NodeStats.record_update`) of ``pid``'s update
    (``outcome`` None: rejected)."""
    assert engine.optimizer is not None
    version, active = engine.optimizer.version, engine.members.active_ids()
    engine.stats.record_update(pid, outcome, engine.received, version, active)
    if outcome is not None:  # accepted: the divergence window counts it
        engine.end.on_reply(pid, None, engine.received)


def on_rejected(engine: AsyncEngine, node: Node, err: UpdateRejected) -> None:
    """A rejected update: counted, logged and blamed on the node; too many in a row
    (``max-consecutive-rejections``) exclude it, unless every node's recent updates are
    rejected as out of scale: then the model diverged (:mod:`flwr_gsgm.engine.divergence`,
    check 4) and the run ends without blaming any node."""
    engine.ledger.record_rejection(err.reason)
    pid = node.partition_id
    log(WARNING, "[async] rejected update from partition %d (%s): %s", pid, err.reason, err.message)
    node.rejections_in_row += 1
    if engine.end.on_reply(pid, err.reason, engine.received):
        return  # check 4 of flwr_gsgm.engine.divergence: the model diverged, not the node's fault
    limit = engine.settings.max_consecutive_rejections
    if limit and node.rejections_in_row >= limit:
        exclude(
            engine,
            pid,
            f"{node.rejections_in_row} rejected updates in a row "
            f"(max-consecutive-rejections={limit}); last: {err.reason}: {err.message}",
        )
