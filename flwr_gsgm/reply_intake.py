"""Reply intake: unpack a train reply and check its envelope before the optimizer sees it.

A reply must carry an ``ArrayRecord`` under ``"arrays"`` whose arrays match the
model's by name (:meth:`flwr_gsgm.model_layout.ModelLayout.match`), and a
``MetricRecord`` under ``"metrics"`` with the partition-id and model version of the
message it answers (see ``clients/client_app.py`` for the protocol). A reply that
fails raises :class:`~flwr_gsgm.core.UpdateRejected` (:class:`ReplyRejected` for the
envelope) whose reason is one of the run's one list, :data:`flwr_gsgm.core.REASONS`.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord

from flwr_gsgm.core import INTAKE_REASONS, UpdateRejected
from flwr_gsgm.in_flight import Dispatch
from flwr_gsgm.model_layout import ModelLayout, ModelUpdate

__all__ = ["REQUIRED_REPLY_METRICS", "ReplyIntake", "ReplyRejected", "metadata_int"]

# Metric keys a train reply must carry (see clients/client_app.py for the protocol).
REQUIRED_REPLY_METRICS = ("partition-id", "model-version", "num-examples")


def metadata_int(key: str, value: Any, low: int = 0) -> int:
    """Return the metadata value ``value`` of ``key`` as an int ``>= low``.

    A metric value may be an int, a float or a list of them (``MetricRecord``); an
    integer is expected here. A float with an integral value (``1.0``) is accepted as
    that integer; ``1.7``, NaN, infinities, lists and bools are not.

    Raises
    ------
    ValueError
        If ``value`` is not such an integer; the message names ``key``, the value and
        what was expected.
    """
    expected = f"expected an integer >= {low} (an integral float such as 1.0 is taken as 1)"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Real, np.number)):
        raise ValueError(f"metadata {key!r} is {value!r} ({type(value).__name__}); {expected}")
    if isinstance(value, (numbers.Integral, np.integer)):
        number = int(value)
    else:
        real = float(value)
        if not math.isfinite(real) or real != math.floor(real):
            raise ValueError(f"metadata {key!r} is {value!r}; {expected}")
        number = int(real)
    if number < low:
        raise ValueError(f"metadata {key!r} is {value!r}; {expected}")
    return number


class ReplyRejected(UpdateRejected):
    """A train reply failed the intake checks; ``reason`` is one of ``INTAKE_REASONS``.

    A subclass of :class:`~flwr_gsgm.core.UpdateRejected`, so the engine records both
    kinds of rejection in one place, keyed by one list of reasons.

    Raises
    ------
    ValueError
        If ``reason`` is not one of :data:`~flwr_gsgm.core.INTAKE_REASONS` (a bug).
    """

    def __init__(self, reason: str, message: str) -> None:
        if reason not in INTAKE_REASONS:
            raise ValueError(
                f"unknown intake rejection reason {reason!r}; add it to INTAKE_REASONS"
            )
        super().__init__(reason, message)


class ReplyIntake:
    """Unpacks train replies for a model of layout ``layout``, matching arrays by name.

    Replays are caught before, by the message a reply answers, not by its content
    (:meth:`flwr_gsgm.in_flight.InFlight.pull`): a deterministic client may send the
    same bytes for other weights (a constant gradient), and they are accepted.
    """

    def __init__(self, layout: ModelLayout) -> None:
        self.layout = layout

    def unpack(self, dispatch: Dispatch, reply: Message) -> ModelUpdate:
        """Return the update in ``reply`` to ``dispatch``, matched to the model by name.

        Raises
        ------
        UpdateRejected
            On a missing record or metric, malformed metadata (``"metadata"``: a
            partition-id, model-version or num-examples that is not an integer >= 0,
            a train-loss that is not a number), a partition-id or model-version other than
            the message's, or arrays that do not match the model by name
            (:meth:`ModelLayout.match`: ``"array-keys"``, ``"array-format"``,
            ``"dtype"``, ``"shape"``, ``"non-finite"``, naming the key).
        """
        arrays, metrics = self._records(reply)
        self._check_metrics(dispatch, metrics)
        return self.layout.match(arrays)

    @staticmethod
    def _records(reply: Message) -> tuple[ArrayRecord, MetricRecord]:
        content = reply.content
        arrays, metrics = content.get("arrays"), content.get("metrics")
        if not isinstance(arrays, ArrayRecord):
            raise ReplyRejected("missing-arrays", "reply has no ArrayRecord under 'arrays'")
        if not isinstance(metrics, MetricRecord):
            raise ReplyRejected("missing-metrics", "reply has no MetricRecord under 'metrics'")
        return arrays, metrics

    @staticmethod
    def _check_metrics(dispatch: Dispatch, metrics: MetricRecord) -> None:
        missing = [k for k in REQUIRED_REPLY_METRICS if k not in metrics]
        if missing:
            raise ReplyRejected("missing-metrics", f"reply metrics lack {missing}")
        try:
            pid, version = (metadata_int(k, metrics[k]) for k in REQUIRED_REPLY_METRICS[:2])
            metadata_int("num-examples", metrics["num-examples"])
        except ValueError as err:
            raise ReplyRejected("metadata", str(err)) from None
        loss = metrics.get("train-loss")
        if loss is not None and (isinstance(loss, bool) or not isinstance(loss, (int, float))):
            raise ReplyRejected(
                "metadata",
                f"metadata 'train-loss' is {loss!r} ({type(loss).__name__}); expected a number "
                "(a non-finite one is left out of the train-loss mean)",
            )
        if pid != dispatch.partition_id:
            raise ReplyRejected(
                "partition-id",
                f"reply says partition-id={metrics['partition-id']}, "
                f"message was sent to partition {dispatch.partition_id}",
            )
        if version != dispatch.base_version:
            raise ReplyRejected(
                "model-version",
                f"reply says model-version={metrics['model-version']}, "
                f"message carried version {dispatch.base_version}",
            )

    def train_loss(self, reply: Message) -> Any:
        """The reply's ``train-loss`` metric, or None (call after :meth:`unpack`)."""
        return reply.content["metrics"].get("train-loss")
