"""Reply intake: unpack a train reply and check its envelope before the optimizer sees it.

A reply must carry an ``ArrayRecord`` under ``"arrays"`` whose arrays match the
model's by name (:meth:`flwr_gsgm.model.layout.ModelLayout.match`), and a
``MetricRecord`` under ``"metrics"`` with ``num-examples``; its partition-id and
model version, when it reports them, must be those of the message it answers (see
``clients/client_app.py`` for the protocol). A reply that
fails raises :class:`~flwr_gsgm.core.UpdateRejected` (:class:`ReplyRejected` for the
envelope) whose reason is one of the run's one list, :data:`flwr_gsgm.core.REASONS`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord

from flwr_gsgm.core import INTAKE_REASONS, UpdateRejected
from flwr_gsgm.intake.dispatch import Dispatch
from flwr_gsgm.model.layout import ModelLayout, ModelUpdate

__all__ = [
    "REQUIRED_REPLY_METRICS",
    "ReplyIntake",
    "ReplyRejected",
    "displacement",
    "metadata_int",
]

#: Metric a train reply must carry: Flower's standard reply is arrays + num-examples.
REQUIRED_REPLY_METRICS = ("num-examples",)
#: Integer metadata checked when present (the protocol of clients/client_app.py).
CHECKED_REPLY_METRICS = ("partition-id", "model-version", "num-examples", "train-steps")
#: What a reply reports of its local work, read by work scheduling when present
#: (docs/PORTING.md, "Work scheduling"): the steps done, and the seconds they took.
WORK_METRICS = ("train-steps", "train-seconds")
#: The train loss, under the protocol's key or Flower's quickstarts' key.
TRAIN_LOSS_METRICS = ("train-loss", "train_loss")


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

    The bookkeeping of a reply (which node, which model version, what weights were
    sent, in which client mode) comes from the engine's own dispatch record, so a
    standard Flower reply, ``"arrays"`` plus ``"metrics"`` with ``num-examples``, is
    enough. The ``partition-id`` and ``model-version`` metrics of the protocol are
    checked when present: integers >= 0 equal to the dispatch's (the partition-id
    only for a node that reported one to the query: ``identified``). ``train-loss``
    (or Flower's ``train_loss``) is used when present and must be a number.

    In ``"weights"`` client mode (the dispatch's config ``mode``) the node returns
    its trained weights; the update handed to the rule is the displacement
    ``w_sent - w_returned`` over the trainable arrays, from the weights this
    dispatch sent (:func:`displacement`), the update a delta-mode client would have
    sent; the client's learning rate does not enter it. Buffers are values in every
    mode.

    Replays are caught before, by the message a reply answers, not by its content
    (:meth:`flwr_gsgm.engine.in_flight.InFlight.pull`): a deterministic client may send the
    same bytes for other weights (a constant gradient), and they are accepted.

    Parameters
    ----------
    layout : ModelLayout
    identified : callable, optional
        ``(partition_id) -> bool``: False for a node registered without a
        partition-id; default: every node reported one.
    """

    def __init__(
        self, layout: ModelLayout, identified: Callable[[int], bool] = lambda pid: True
    ) -> None:
        self.layout = layout
        self.identified = identified

    def unpack(self, dispatch: Dispatch, reply: Message) -> ModelUpdate:
        """Return the update in ``reply`` to ``dispatch``, matched to the model by name.

        Raises
        ------
        UpdateRejected
            On a missing record or ``num-examples``, a second ArrayRecord, malformed metadata
            (``"metadata"``: a partition-id, model-version or num-examples that is not
            an integer >= 0, a train-loss that is not a number), a partition-id or
            model-version other than the message's, or arrays that do not match the
            model by name
            (:meth:`ModelLayout.match`: ``"array-keys"``, ``"array-format"``,
            ``"dtype"``, ``"shape"``, ``"non-finite"``, naming the key).
        """
        arrays, metrics = self._records(reply)
        self._check_metrics(dispatch, metrics, self.identified(dispatch.partition_id))
        update = self.layout.match(arrays)
        if dispatch.config.get("mode") == "weights":
            assert dispatch.arrays is not None  # the dispatcher keeps them in this mode
            sent = self.layout.trainable_of(dispatch.arrays)
            update.trainable = displacement(sent, update.trainable)
        return update

    @staticmethod
    def _records(reply: Message) -> tuple[ArrayRecord, MetricRecord]:
        content = reply.content
        arrays, metrics = content.get("arrays"), content.get("metrics")
        if not isinstance(arrays, ArrayRecord):
            raise ReplyRejected("missing-arrays", "reply has no ArrayRecord under 'arrays'")
        # As Flower's own strategies: exactly one ArrayRecord, or which is the update?
        # (Not RecordDict.array_records: in Flower 1.42 it leaves a reference cycle that
        # keeps the whole reply, a model copy, alive until the garbage collector runs.)
        names = [k for k, v in content.items() if isinstance(v, ArrayRecord)]
        if len(names) > 1:
            raise ReplyRejected(
                "extra-arrays",
                f"reply has {len(names)} ArrayRecords {names}; exactly one is expected, "
                "under 'arrays'",
            )
        if not isinstance(metrics, MetricRecord):
            raise ReplyRejected("missing-metrics", "reply has no MetricRecord under 'metrics'")
        return arrays, metrics

    @staticmethod
    def _check_metrics(dispatch: Dispatch, metrics: MetricRecord, identified: bool) -> None:
        missing = [k for k in REQUIRED_REPLY_METRICS if k not in metrics]
        if missing:
            raise ReplyRejected("missing-metrics", f"reply metrics lack {missing}")
        try:
            said = {k: metadata_int(k, metrics[k]) for k in CHECKED_REPLY_METRICS if k in metrics}
        except ValueError as err:
            raise ReplyRejected("metadata", str(err)) from None
        key, loss = _train_loss(metrics)
        if loss is not None and (isinstance(loss, bool) or not isinstance(loss, (int, float))):
            raise ReplyRejected(
                "metadata",
                f"metadata {key!r} is {loss!r} ({type(loss).__name__}); expected a number "
                "(a non-finite one is left out of the train-loss mean)",
            )
        seconds = metrics.get("train-seconds")
        if seconds is not None and (
            isinstance(seconds, bool)
            or not isinstance(seconds, (int, float))
            or not math.isfinite(seconds)
            or seconds < 0
        ):
            raise ReplyRejected(
                "metadata",
                f"metadata 'train-seconds' is {seconds!r}; expected a finite number of "
                "seconds >= 0",
            )
        if identified and said.get("partition-id", dispatch.partition_id) != dispatch.partition_id:
            raise ReplyRejected(
                "partition-id",
                f"reply says partition-id={metrics['partition-id']}, "
                f"message was sent to partition {dispatch.partition_id}",
            )
        if said.get("model-version", dispatch.base_version) != dispatch.base_version:
            raise ReplyRejected(
                "model-version",
                f"reply says model-version={metrics['model-version']}, "
                f"message carried version {dispatch.base_version}",
            )

    def work_report(self, reply: Message) -> tuple[int | None, float | None]:
        """The reply's ``train-steps`` and ``train-seconds`` (each None if not
        reported), checked by :meth:`unpack` before."""
        metrics = reply.content["metrics"]
        steps, seconds = metrics.get("train-steps"), metrics.get("train-seconds")
        return (
            None if steps is None else metadata_int("train-steps", steps),
            None if seconds is None else float(seconds),
        )

    def train_loss(self, reply: Message) -> Any:
        """The reply's ``train-loss`` (or ``train_loss``) metric, or None (after :meth:`unpack`)."""
        return _train_loss(reply.content["metrics"])[1]


def _train_loss(metrics: MetricRecord) -> tuple[str, Any]:
    """``(key, value)`` of the train loss: ``train-loss``, else Flower's ``train_loss``."""
    for key in TRAIN_LOSS_METRICS:
        if key in metrics:
            return key, metrics[key]
    return TRAIN_LOSS_METRICS[0], None


def displacement(sent: list[np.ndarray], returned: list[np.ndarray]) -> list[np.ndarray]:
    """The node's displacement ``w_sent - w_returned`` per array, float32 (new arrays).

    Independent of the client's learning rate: the server learning rate of the
    displacement modes is a fraction of it (1.0 applies it whole), as in delta
    mode, where the client sends it itself. Non-finite returned weights give a
    non-finite update, which the rule rejects.
    """
    out = []
    for w0, w1 in zip(sent, returned):
        with np.errstate(over="ignore", invalid="ignore"):
            out.append(np.subtract(w0, w1, dtype=np.float32))
    return out
