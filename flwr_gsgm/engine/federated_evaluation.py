"""Federated evaluation of an asynchronous run, in flight alongside training.

Every ``every`` client updates received, the engine asks a sample of the active
nodes to evaluate the global model of that moment (an ``evaluate`` message, served by
the ClientApp's ``@app.evaluate()``, as Flower's FedAvg does each round) and goes on
training at once: the evaluate messages are in flight together with the train
messages, their replies are pulled on every turn of the engine's loop and recorded
when they arrive. A point's aggregate is formed once every node asked has answered,
failed or passed ``dispatch-timeout``; it goes into the evaluation row of the same
``updates`` (``metrics.csv`` columns ``federated_<key>``), into the ``Result``'s
``evaluate_metrics_clientapp`` and, at once, to the strategy's
``on_federated_evaluate(updates, metrics)`` hook (a live logger's).

Aggregation is Flower's: ``evaluate_metrics_aggr_fn(contents, weighted_by_key)``,
by default :func:`flwr.serverapp.strategy.strategy_utils.aggregate_metricrecords`,
the mean of every metric weighted by ``num-examples`` (FedAvg's default; the
weighting key itself is left out). A reply is left out of the aggregate, logged and
counted (``federated_eval_failed``) if it is an error reply, has not exactly one
MetricRecord, lacks the weighting key, carries a non-finite or negative weight or a
non-finite value, or has other metric keys than the point's first valid reply.

Which nodes: ``max(int(n * fraction_evaluate), min_evaluate_nodes)`` of the ``n``
active nodes (at most ``n``), drawn with a seed derived from the run seed and the
point, so a simulation under the virtual clock asks the same nodes every time.
Evaluation takes no virtual time. Evaluations still pending when a checkpoint is
written are not resumed (their columns stay empty).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from flwr_gsgm.core import ServerOptimizer
from flwr_gsgm.engine.central_evaluation import weights_record
from flwr_gsgm.engine.hooks import OnFederatedEvaluate, call_hook
from flwr_gsgm.engine.ledger import Ledger
from flwr_gsgm.simulation.virtual_clock import derive_seed

__all__ = [
    "COLUMN_PREFIX",
    "FederatedEvaluation",
    "FederatedEvaluator",
    "MetricsAggrFn",
    "column_name",
]

#: ``(reply contents, weighted_by_key) -> MetricRecord``, as Flower's FedAvg takes it.
MetricsAggrFn = Callable[[list[RecordDict], str], MetricRecord]
#: metrics.csv column of an aggregated metric ``key``: ``federated_`` + key, ``-`` -> ``_``.
COLUMN_PREFIX = "federated_"
_SAMPLE_STREAM = 0xE7A1_0DE5  # separates the sampling seed from the other derived seeds


@dataclass(frozen=True)
class FederatedEvaluation:
    """When and how the nodes evaluate the global model (Flower's FedAvg names).

    Attributes
    ----------
    every : int
        Evaluate every this many client updates received [run config
        ``federated-eval-every``]; a multiple of the engine's ``eval_every``, so each
        point has its evaluation row.
    fraction_evaluate : float
        Fraction of the active nodes asked, in (0, 1] [``fraction-evaluate``].
    min_evaluate_nodes : int
        Nodes asked at least (if that many are active), >= 1.
    weighted_by_key : str
        The metric that weights each node's metrics (``num-examples``).
    evaluate_metrics_aggr_fn : callable | None
        ``(contents: list[RecordDict], weighted_by_key) -> MetricRecord``; None:
        Flower's weighted mean (``aggregate_metricrecords``).
    evaluate_config : dict
        Sent in every evaluate message's ``"config"`` ConfigRecord (the engine adds
        ``model-version``, the version evaluated).

    Raises
    ------
    ValueError
        On a value out of range, naming it.
    """

    every: int
    fraction_evaluate: float = 1.0
    min_evaluate_nodes: int = 1
    weighted_by_key: str = "num-examples"
    evaluate_metrics_aggr_fn: MetricsAggrFn | None = None
    evaluate_config: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"federated-eval-every must be an integer >= 1, got {self.every!r}")
        if not 0 < self.fraction_evaluate <= 1:
            raise ValueError(f"fraction-evaluate must be in (0, 1], got {self.fraction_evaluate!r}")
        if self.min_evaluate_nodes < 1:
            raise ValueError(f"min_evaluate_nodes must be >= 1, got {self.min_evaluate_nodes!r}")

    def with_config(self, evaluate_config: Mapping[str, Any] | None) -> FederatedEvaluation:
        """These settings with ``evaluate_config``'s keys added to ``evaluate_config``."""
        if not evaluate_config:
            return self
        return replace(self, evaluate_config={**self.evaluate_config, **dict(evaluate_config)})

    def sample_size(self, active: int) -> int:
        """Nodes asked out of ``active``: Flower's ``max(int(n * f), min)``, at most ``n``."""
        return min(active, max(int(active * self.fraction_evaluate), self.min_evaluate_nodes))


@dataclass
class _Point:
    """One evaluation point: the messages it sent and the valid replies so far."""

    updates: int
    pending: dict[str, tuple[str, float]]  # message id -> (node name, wall send time)
    contents: list[RecordDict] = field(default_factory=list)
    asked: int = 0


class FederatedEvaluator:
    """Sends the evaluate messages of each point, pulls and aggregates their replies.

    Parameters
    ----------
    grid : Grid
        The run's grid (the evaluate messages travel beside the train messages).
    keys : list[str]
        Array keys of the model, in order.
    engine : EngineSettings
        Its ``federated_evaluation`` (None: no federated evaluation, every method is
        then a no-op), ``message_ttl`` (TTL of each evaluate message),
        ``dispatch_timeout`` (wall seconds after which a reply not yet here is given up
        and counted as failed) and ``seed`` (which nodes each point asks).
    ledger : Ledger
        Counts ``federated_eval_sent``, ``federated_eval_replies`` (aggregated) and
        ``federated_eval_failed``.
    on_metrics : callable | None
        ``(updates, metrics) -> None``, called with each point's aggregate (a copy)
        once it is formed: the strategy's ``on_federated_evaluate``. If it raises,
        :class:`~flwr_gsgm.engine.hooks.HookFailed` stops the run.
    """

    def __init__(
        self,
        grid: Grid,
        keys: list[str],
        engine: Any,
        ledger: Ledger,
        on_metrics: OnFederatedEvaluate | None = None,
    ) -> None:
        self.grid = grid
        self.keys = keys
        self.settings: FederatedEvaluation | None = engine.federated_evaluation
        self.ledger = ledger
        self.ttl = engine.message_ttl
        self.timeout = engine.dispatch_timeout
        self.seed = engine.seed
        self.on_metrics = on_metrics
        self.points: list[_Point] = []
        #: updates received at the point -> aggregated MetricRecord
        self.results: dict[int, MetricRecord] = {}

    def maybe_send(
        self, received: int, optimizer: ServerOptimizer, nodes: Mapping[int, Any]
    ) -> None:
        """At a point (``received`` a multiple of ``every``), send the evaluate messages.

        They carry the optimizer's current weights; ``nodes`` maps partition-id ->
        node (``.active``, ``.node_id``, ``.name``: how the log names it).
        """
        s = self.settings
        if s is None or received == 0 or received % s.every:
            return
        active = sorted(pid for pid, node in nodes.items() if node.active)
        if not active:
            return
        rng = np.random.default_rng(derive_seed(self.seed, received, _SAMPLE_STREAM))
        chosen = sorted(rng.choice(active, s.sample_size(len(active)), replace=False).tolist())
        if not chosen:
            return
        content = RecordDict(
            {
                "arrays": weights_record(self.keys, optimizer.weights),
                "config": ConfigRecord({**s.evaluate_config, "model-version": optimizer.version}),
            }
        )
        messages = [
            Message(content, nodes[pid].node_id, "evaluate", ttl=self.ttl) for pid in chosen
        ]
        sent_at = time.monotonic()
        mids = list(self.grid.push_messages(messages))
        pending = {mid: (nodes[pid].name, sent_at) for mid, pid in zip(mids, chosen)}
        self.points.append(_Point(received, pending, asked=len(chosen)))
        self.ledger.count("federated_eval_sent", len(chosen))

    def poll(self, rows: list[dict[str, Any]]) -> None:
        """Record the evaluate replies that are here; close the points that are complete.

        A complete point's aggregate goes into the row of ``rows`` with the same
        ``updates`` (columns ``federated_<key>`` and ``federated_nodes``) and into
        :attr:`results`. Never waits.
        """
        if not self.points:
            return
        by_mid = {mid: p for p in self.points for mid in p.pending}
        for reply in self.grid.pull_messages(list(by_mid)):
            mid = reply.metadata.reply_to_message_id
            point = by_mid.get(mid)
            if point is not None and mid in point.pending:  # a second reply is ignored
                name, _ = point.pending.pop(mid)
                self._record(point, name, reply)
        now = time.monotonic()
        for point in self.points:
            for mid, (name, sent_at) in list(point.pending.items()):
                if now - sent_at > self.timeout:
                    del point.pending[mid]
                    self._fail(point, name, f"no reply within dispatch-timeout={self.timeout} s")
        for point in [p for p in self.points if not p.pending]:
            self.points.remove(point)
            self._close(point, rows)

    def finish(self, rows: list[dict[str, Any]], poll_interval: float) -> None:
        """At the end of the run: wait for the pending points (each up to dispatch-timeout)."""
        while self.points:
            self.poll(rows)
            if self.points:
                time.sleep(poll_interval)

    # ------------------------------------------------------------------ replies
    def _record(self, point: _Point, name: str, reply: Message) -> None:
        why = self._invalid(reply)
        if why is not None:
            self._fail(point, name, why)
            return
        content = reply.content
        if point.contents and _metric_keys(content) != _metric_keys(point.contents[0]):
            self._fail(
                point,
                name,
                f"metric keys {sorted(_metric_keys(content))} differ from the other "
                f"nodes' {sorted(_metric_keys(point.contents[0]))}",
            )
            return
        point.contents.append(content)

    def _invalid(self, reply: Message) -> str | None:
        """Why ``reply`` cannot be aggregated, or None."""
        if reply.has_error():
            reason = (reply.error.reason or "").strip().splitlines()
            return f"error reply (code {reply.error.code}): {reason[-1] if reason else ''}"
        records = reply.content.metric_records
        if len(records) != 1:
            return f"expected exactly one MetricRecord, got {len(records)}"
        (metrics,) = records.values()
        key = self.settings.weighted_by_key if self.settings else "num-examples"
        weight = metrics.get(key)
        if not _finite_number(weight) or weight < 0:
            return f"{key}={weight!r}: expected a finite number >= 0"
        for name, value in metrics.items():
            values = value if isinstance(value, list) else [value]
            if not all(_finite_number(v) for v in values):
                return f"metric {name}={value!r} is not finite"
        return None

    def _fail(self, point: _Point, name: str, why: str) -> None:
        self.ledger.count("federated_eval_failed")
        log(
            WARNING,
            "[async] federated evaluation at %d updates: %s left out: %s",
            point.updates,
            name,
            why,
        )

    def _close(self, point: _Point, rows: list[dict[str, Any]]) -> None:
        assert self.settings is not None
        key = self.settings.weighted_by_key
        total = sum(float(next(iter(c.metric_records.values()))[key]) for c in point.contents)
        if not point.contents or total <= 0:
            log(
                WARNING,
                "[async] federated evaluation at %d updates: no usable reply of %d",
                point.updates,
                point.asked,
            )
            return
        aggr = self.settings.evaluate_metrics_aggr_fn or aggregate_metricrecords
        metrics = aggr(point.contents, key)
        self.results[point.updates] = metrics
        self.ledger.count("federated_eval_replies", len(point.contents))
        columns = {"federated_nodes": len(point.contents)}
        columns.update({column_name(k): v for k, v in metrics.items() if not isinstance(v, list)})
        for row in rows:
            if row["updates"] == point.updates:
                row.update(columns)
        log(
            INFO,
            "[async] federated evaluation at %d updates (%d of %d nodes): %s",
            point.updates,
            len(point.contents),
            point.asked,
            dict(metrics),
        )
        if self.on_metrics is not None:  # a copy: the hook may not change the results
            call_hook(
                "on_federated_evaluate",
                self.on_metrics,
                updates=point.updates,
                metrics=MetricRecord(dict(metrics)),
            )


def column_name(key: str) -> str:
    """The ``metrics.csv`` column of aggregated metric ``key`` (``eval-loss`` ->
    ``federated_eval_loss``)."""
    return COLUMN_PREFIX + key.replace("-", "_")


def _metric_keys(content: RecordDict) -> set[str]:
    return set(next(iter(content.metric_records.values())).keys())


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
