"""Time-budget FedAvg: Flower's FedAvg where every node trains for the same seconds.

The synchronous time-budget setting of FedNova's experiments (Wang, Liu, Liang,
Joshi and Poor, "Tackling the Objective Inconsistency Problem in Heterogeneous
Federated Optimization", NeurIPS 2020, arXiv 2007.07481: clients run for a fixed
wall-clock budget, so faster ones do more local steps) and of TimelyFL (Zhang et
al., "TimelyFL: Heterogeneity-aware Asynchronous Federated Learning with Adaptive
Partial Training", CVPR Workshops 2023, arXiv 2304.06947: each client's work sized
to what it can do in a common time). ANCHORS.md, "Small fleets", says why it is an
anchor: a round then costs the median node's time, not the slowest node's.

Each round, node i's train message asks for ``local-steps`` =
:func:`~flwr_gsgm.scheduling.work_scheduler.equal_time_steps` of its measured
seconds per step s_i and the target T, the median over the nodes of the seconds of
their own work (:class:`~flwr_gsgm.scheduling.work_scheduler.WorkScheduler`,
``"equal-time"``), with ``local-epochs`` = 0. A node's first message carries the
run's own work (the train config's ``local-steps`` or ``local-epochs``): its reply
measures its speed (``train-seconds`` / ``train-steps``) and its own steps. The
aggregation is FedAvg's, unchanged: the mean of the returned weights weighted by
``num-examples``, with no normalisation by steps (so the model drifts toward the
nodes that did more, the objective inconsistency FedNova corrects:
:class:`~flwr_gsgm.strategy.fednova.FedNova`).

A ClientApp takes part by doing the ``local-steps`` its message asks for and
reporting ``train-steps`` and ``train-seconds`` in its reply's MetricRecord
(docs/PORTING.md, "Work scheduling"). One whose reply reports no ``train-steps``,
or other steps than asked, turns scheduling off for the rest of the run, logged
once (WARNING); every message then carries the run's own work: plain FedAvg.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from logging import WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from flwr_gsgm.scheduling.work_scheduler import WorkScheduler

__all__ = ["TimeBudgetFedAvg", "reported_work"]


def reported_work(reply: Message) -> tuple[int | None, float | None]:
    """The ``train-steps`` and ``train-seconds`` of a train reply's MetricRecord.

    Returns
    -------
    tuple[int | None, float | None]
        Steps (an integer >= 0; None if absent, or not an integer: a bool, a
        fraction) and seconds (a finite number >= 0; None if absent or not such a
        number). A reply with an error, or without a MetricRecord, reports neither.
    """
    if reply.has_error():
        return None, None
    records = list(reply.content.metric_records.values())
    if not records:
        return None, None
    metrics: MetricRecord = records[0]
    steps, seconds = metrics.get("train-steps"), metrics.get("train-seconds")
    if isinstance(steps, bool) or not isinstance(steps, (int, float)) or steps != int(steps):
        steps = None
    elif steps < 0:
        steps = None
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, (int, float))
        or not math.isfinite(seconds)
        or seconds < 0
    ):
        seconds = None
    return (None if steps is None else int(steps)), (None if seconds is None else float(seconds))


class TimeBudgetFedAvg(FedAvg):
    """Flower's FedAvg with each node's ``local-steps`` sized to a common time.

    Parameters
    ----------
    *args, **kwargs
        Flower's :class:`flwr.serverapp.strategy.FedAvg` arguments (sampling,
        ``weighted_by_key``, record keys), unchanged.
    work_scheduling : str
        ``"equal-time"`` (default): the time-budget assignment above; ``"off"``:
        every message carries the run's own work (FedAvg itself, with the speeds
        still measured). Any other value raises ValueError.

    Attributes
    ----------
    work : WorkScheduler
        Each node's measured seconds per step, keyed by node id (``work.speeds``),
        its own steps, the ``local-steps`` of its latest message (``work.sent_steps``,
        None: the run's own work) and whether scheduling turned itself off
        (``work.describe()``).

    The train config given to :meth:`start` is sent as is, plus ``local-steps`` and
    ``local-epochs`` = 0 in each scheduled message; each node's message has its own
    ConfigRecord (FedAvg sends one record to all).
    """

    def __init__(self, *args: Any, work_scheduling: str = "equal-time", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.work = WorkScheduler(work_scheduling, name=lambda node_id: f"node {node_id}")

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """FedAvg's sampled messages, each with its own config: the node's
        ``local-steps`` (and ``local-epochs`` = 0) once its speed is measured."""
        messages = list(super().configure_train(server_round, arrays, config, grid))
        node_ids = list(grid.get_node_ids())  # the target is the median over all nodes
        out = []
        for message in messages:
            node = message.metadata.dst_node_id
            steps = self.work.steps_for(node, node_ids)
            self.work.sent(node, steps)
            own = ConfigRecord(dict(config))  # a copy: FedAvg's record is shared
            if steps is not None:
                own["local-steps"] = steps
                own["local-epochs"] = 0
            record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: own})
            out.append(Message(content=record, message_type=MessageType.TRAIN, dst_node_id=node))
        return out

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Measure each reply's speed (:meth:`measure`), then FedAvg's aggregation."""
        replies = list(replies)
        self.measure(replies)
        return super().aggregate_train(server_round, replies)

    def measure(self, replies: list[Message]) -> None:
        """Record each successful reply's ``train-steps`` and ``train-seconds`` in
        :attr:`work`, keyed by its node id; log once if scheduling turns off."""
        for reply in replies:
            if reply.has_error():
                continue
            node = reply.metadata.src_node_id
            steps, seconds = reported_work(reply)
            was_active = self.work.active
            # A round's replies answer its messages: the steps the scheduler last sent.
            self.work.on_reply(node, self.work.sent_steps.get(node), steps, seconds)
            if was_active and not self.work.active:
                log(
                    WARNING,
                    "[%s] work scheduling off: %s",
                    type(self).__name__,
                    self.work.off_reason,
                )
