"""A node's states out of the run: backing off (until an engine time) or excluded.

:mod:`flwr_gsgm.nodes.events` decides when a node backs off or is excluded (its
failures in a row, :class:`~flwr_gsgm.nodes.backoff.Backoff`); these functions change the
:class:`~flwr_gsgm.nodes.membership.Node` records of ``Membership.nodes`` (partition-id ->
node) accordingly. A node backing off is inactive with ``retry_at`` set (engine
seconds); an excluded one is inactive for the rest of the run, with the reason.
"""

from __future__ import annotations

from logging import WARNING
from typing import TYPE_CHECKING, Any

from flwr.common.logger import log

if TYPE_CHECKING:
    from flwr_gsgm.engine.ledger import Ledger
    from flwr_gsgm.nodes.membership import Node

__all__ = ["due_back", "exclude", "next_retry", "restore", "set_aside"]


def set_aside(nodes: dict[int, Node], pid: int, retry_at: float) -> Node | None:
    """Back ``pid`` off until the engine clock reads ``retry_at``; return its node, or
    None if it was not active."""
    node = nodes[pid]
    if not node.active:
        return None
    node.active, node.may_return, node.retry_at = False, False, retry_at
    return node


def due_back(nodes: dict[int, Node], now: float) -> list[int]:
    """Partition-ids whose back-off ends at engine time ``now``; they are active again."""
    back = [p for p, n in sorted(nodes.items()) if n.state == "backing-off"]
    back = [p for p in back if nodes[p].retry_at <= now]  # type: ignore[operator]
    for pid in back:
        nodes[pid].active, nodes[pid].retry_at = True, None
    return back


def next_retry(nodes: dict[int, Node]) -> float | None:
    """The earliest end of a back-off (engine seconds), or None if no node backs off."""
    times = [n.retry_at for n in nodes.values() if n.state == "backing-off"]
    return min(times) if times else None  # type: ignore[type-var]


def restore(node: Node, saved: dict[str, Any]) -> None:
    """Restore ``node`` from its checkpoint record ``saved`` (``Node.SAVED``) at a resume.

    ``node.active``: it answered at this start. An excluded node stays out for the
    rest of the run; one backing off at the checkpoint still is (until the engine
    time saved); one lost before the checkpoint that answered now rejoins with clean
    failure and rejection counts.
    """
    node.dispatches, node.speed = saved["dispatches"], saved["speed"]
    node.excluded = saved.get("excluded", "")
    backing_off = not saved["active"] and saved.get("retry_at") is not None
    if saved["active"] or backing_off or node.excluded or not node.active:
        # Checkpoints written before the back-off counted "errors_in_row".
        node.failures = saved.get("failures", saved.get("errors_in_row", 0))
        node.rejections_in_row = saved["rejections_in_row"]
    if node.excluded:  # out for the rest of the run, whether it answered or not
        node.active = node.may_return = False
    elif node.active and backing_off:
        node.active, node.retry_at = False, saved["retry_at"]


def exclude(nodes: dict[int, Node], ledger: Ledger, pid: int, why: str) -> Node | None:
    """Exclude ``pid`` for the rest of the run (counted in ``nodes_excluded``, logged
    with ``why``); return its node, or None if it was excluded already."""
    node = nodes[pid]
    if node.excluded:
        return None
    node.active, node.may_return, node.retry_at, node.excluded = False, False, None, why
    ledger.count("nodes_excluded")
    log(
        WARNING,
        "[async] partition %d (node %d) excluded for the rest of the run: %s",
        pid,
        node.node_id,
        why,
    )
    return node
