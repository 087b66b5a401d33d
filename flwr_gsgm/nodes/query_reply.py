"""What a node's answer to the membership ``query`` says about it.

The engine asks every new node id for its ``partition-id`` and ``num-partitions``
(the protocol of ``clients/client_app.py``). The query is optional: a ClientApp
written for Flower's FedAvg has no query handler, and Flower answers for it with an
error reply (code ``CLIENT_APP_RAISED_EXCEPTION``, "No query function registered"),
as it does for a query handler that raises. Such a node, or one whose reply carries
no ``partition-id``, is registered at once **without a partition-id**
(:data:`NO_PARTITION`): the engine keys it by its node id
(:meth:`flwr_gsgm.engine.membership.Membership.key_for`). A reply with a malformed or
foreign partition-id refuses the node; any other error (the ClientApp cannot be
loaded, the node is unreachable) registers nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from logging import INFO, WARNING

from flwr.app import Message, MetricRecord
from flwr.common.constant import ErrorCode
from flwr.common.logger import log

from flwr_gsgm.intake.reply import metadata_int
from flwr_gsgm.nodes.error_codes import error_summary

__all__ = ["NO_PARTITION", "QueryAnswer", "read_query_reply"]

#: Partition of a node registered without a partition-id (keyed by its node id).
NO_PARTITION = -1


@dataclass(frozen=True)
class QueryAnswer:
    """``partition_id``: the reported one, :data:`NO_PARTITION`, or None (not registered).

    ``num_partitions`` is what the node reported (0 without a partition-id);
    ``refused`` is True when the node was refused (counted in ``nodes_refused``).
    """

    partition_id: int | None
    num_partitions: int = 0
    refused: bool = False


def read_query_reply(
    node_id: int, reply: Message, started: bool, num_partitions: int, ttl: float = 0.0
) -> QueryAnswer:
    """Read ``node_id``'s ``reply`` to its query; log what it means.

    ``started`` and ``num_partitions`` describe the run: once training started, a
    node must report the run's ``num-partitions``. ``ttl``: the query's TTL in
    seconds, named in the log of a TTL expiry. Never raises on a reply.
    """
    if reply.has_error():
        reason = (reply.error.reason or "").strip().splitlines()
        last = reason[-1] if reason else ""
        if reply.error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION:
            log(
                INFO,
                "[async] node %d cannot answer the query (%s): no partition-id",
                node_id,
                last,
            )
            return QueryAnswer(NO_PARTITION)
        why = error_summary(reply, ttl)
        log(WARNING, "[async] node %d answered its query with error %s", node_id, why)
        return QueryAnswer(None)
    metrics = reply.content.get("metrics")
    if not isinstance(metrics, MetricRecord) or "partition-id" not in metrics:
        log(INFO, "[async] node %d query reply has no partition-id", node_id)
        return QueryAnswer(NO_PARTITION)
    try:
        pid = metadata_int("partition-id", metrics["partition-id"])
        num = metadata_int("num-partitions", metrics.get("num-partitions", 0))
    except ValueError as err:
        # Malformed metadata: the node registers nothing (and the run goes on).
        log(WARNING, "[async] node %d refused: its query reply has %s", node_id, err)
        return QueryAnswer(None, refused=True)
    if not 0 <= pid < num or (started and num != num_partitions):
        # A node that does not belong to this federation's partitioning.
        log(
            WARNING,
            "[async] node %d refused: partition-id %d of %d does not belong (run has %d)",
            node_id,
            pid,
            num,
            num_partitions,
        )
        return QueryAnswer(None, refused=True)
    return QueryAnswer(pid, num)
