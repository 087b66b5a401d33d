"""FedBuff: buffered asynchronous aggregation.

Reference:
    J. Nguyen, K. Malik, H. Zhan, A. Yousefpour, M. Rabbat, M. Malek, D. Huba,
    "Federated Learning with Buffered Asynchronous Aggregation", AISTATS 2022
    (PMLR 151).

Implemented (Algorithm 1): the server adds each arriving update, weighted by the
paper's staleness scaling ``s(tau) = 1 / sqrt(1 + tau)`` (tau the update's staleness
in server steps), to a buffer and, once ``buffer_size`` (K) of them are in, steps
along the buffer sum divided by K with its learning rate. With
``trim_fraction`` > 0 the buffer keeps the K updates and steps along their
coordinate-wise trimmed mean instead (Yin et al., ICML 2018; :mod:`.robust`), an
option of this project's, not of the paper's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import numpy as np

from .base import Outcome, Parts, PlainKernel, ServerOptimizer, chunks
from .params import TRIM_FRACTION, Param, server_learning_rate
from .robust import least_cutting_fraction, plain_trimmed_mean, trimmed_count, trimmed_step

__all__ = ["FedBuffRule", "PlainFedBuff", "staleness_scale"]


def staleness_scale(staleness: int) -> np.float32:
    """FedBuff's staleness scaling ``s(tau) = 1 / sqrt(1 + tau)`` (Nguyen et al.,
    AISTATS 2022), as float32.

    Args:
        staleness: tau >= 0, server steps between the update's base version and now.

    Returns:
        The weight in (0, 1]; exactly 1 for tau = 0.
    """
    if staleness == 0:
        return np.float32(1.0)
    return np.float32(1.0 / math.sqrt(1.0 + staleness))


class FedBuffRule(ServerOptimizer):
    """FedBuff: buffer K updates, then ``w <- w - lr * (sum of the K) / K``.

    Each update enters the buffer as ``Delta / sqrt(1 + tau)``, ``tau`` its staleness
    (server steps since its base version): a fresh one (tau = 0) at full weight.

    The first K - 1 arrivals of a buffer are :attr:`Outcome.DEFERRED`, the K-th is
    :attr:`Outcome.APPLIED` and takes one step (``version`` += 1). Updates of a node
    that is lost stay in the buffer. With ``trim_fraction`` = f > 0 the step is
    ``w <- w - lr * trimmed mean of the K weighted updates`` (per coordinate,
    ``int(f * K)`` cut at each end: :func:`~flwr_gsgm.core.robust.trimmed_count`), the
    buffer holding the K updates.

    Args:
        weights: initial weights, a sequence of numpy arrays (copied to float32).
        partition_ids: partition-ids of the initially active nodes.
        lr: server learning rate, > 0.
        buffer_size: K >= 1 (1: ASGD with its steps damped by the staleness weight).
        trim_fraction: f in [0, 0.5): the trimmed mean above; 0 = the plain mean.
        max_staleness: optional staleness bound (see :class:`ServerOptimizer`).
        max_norm: optional L2-norm bound (see :class:`ServerOptimizer`).

    Raises:
        ValueError: a parameter is out of range, or ``trim_fraction`` cuts none of a
            buffer (``int(f * K)`` = 0); the message names it.

    Memory: ``w``, the buffer sum (``size(w)`` float32), chunk-sized scratch; with
    ``trim_fraction`` > 0 also the K updates, and K chunks of scratch at a step.

    The update, written plainly: :class:`PlainFedBuff`.
    """

    name: ClassVar[str] = "fedbuff"
    PARAMS: ClassVar[tuple[Param, ...]] = (
        # A step per buffer of several updates: the tuned rate (10 nodes, seed 0,
        # docs/results/fashion_mnist_scale/tuned.toml) is larger than a per-arrival one.
        # Displacement modes: a step of the declared fraction along the mean displacement
        # of the buffer's K nodes (buffer_size), tuned at 10 nodes, seed 0 (docs/GSGM.md,
        # "Client modes").
        server_learning_rate(0.1, displacement=0.25),
        Param("buffer_size", 5, "buffer size K", kind=int, low=1, run_config_key="fedbuff-k"),
        TRIM_FRACTION,
    )

    def _copies(self, nodes: int) -> int:
        """``w`` and the buffer sum; trimming: also the K updates (the sum stays
        allocated, at 0, for the state's layout)."""
        return 2 + self._buffer_size if self._trim_fraction > 0 else 2

    def __init__(
        self, weights: Sequence[np.ndarray], partition_ids: Iterable[int], **params: Any
    ) -> None:
        super().__init__(weights, partition_ids, **params)
        f, k = self._trim_fraction, self._buffer_size
        if f > 0 and trimmed_count(k, f) == 0:
            # A trim that cuts nothing is the plain mean at K more model copies.
            raise ValueError(
                f"fedbuff: trim_fraction={f} cuts int({f} x {k}) = 0 of a buffer of "
                f"buffer_size={k} at each end (the plain mean, at {k} more model copies): "
                f"set trim_fraction to at least {least_cutting_fraction(k):g}, "
                f"buffer_size to at least {math.ceil(1.0 / f - 1e-9)}, or trim_fraction to 0"
            )
        self._buf = np.zeros(self._size, dtype=np.float32)
        self._count = 0
        # trim_fraction > 0: the buffered updates themselves (the sum stays 0).
        self._rows: list[np.ndarray] = []

    _LABELS: ClassVar[dict[str, str]] = {"_buf": "buffer sum", "_rows": "buffered update"}

    def _step_bound(self, norm: float) -> tuple[float, float]:
        # The buffer sums at most K updates (its mean is at most one).
        k = self._buffer_size + 1
        u = max(self._bound_u, norm)
        w_after = self._bound_w + self._lr * k * u
        return w_after + (1.0 + self._lr) * k * u, w_after

    @property
    def buffer_count(self) -> int:
        """Number of updates in the buffer."""
        return self._count

    @property
    def buffer_sum(self) -> np.ndarray:
        """A flat float32 copy of the buffer sum (trimming: the buffered updates' sum)."""
        if self._rows:
            return np.sum(self._rows, axis=0, dtype=np.float32)
        return self._buf.copy()

    def _on_valid(
        self, partition_id: int, parts: Parts, base_version: int, staleness: int, now: float
    ) -> Outcome:
        scale = staleness_scale(staleness)
        if self._trim_fraction > 0:
            return self._keep_and_trim(parts, scale)
        buf = self._buf
        self._count += 1
        flush = self._count >= self._buffer_size
        w, a, k, lr = self._w, self._scr_a, self._count, self._lr
        for lo, hi, g in chunks(parts):
            bs = buf[lo:hi]
            if scale == 1.0:
                np.add(bs, g, out=bs)
            else:
                t = a[: hi - lo]
                np.multiply(g, scale, out=t)
                np.add(bs, t, out=bs)
            if flush:
                # The step of a full buffer, chunk by chunk while the chunk is in cache.
                t = a[: hi - lo]
                np.divide(bs, k, out=t)
                np.multiply(t, lr, out=t)
                ws = w[lo:hi]
                np.subtract(ws, t, out=ws)
                bs.fill(0.0)
        if not flush:
            return Outcome.DEFERRED
        self._count = 0
        self._version += 1
        return Outcome.APPLIED

    def _keep_and_trim(self, parts: Parts, scale: np.float32) -> Outcome:
        """``trim_fraction`` > 0: keep the weighted update; the K-th steps along the
        trimmed mean of the K (:func:`~flwr_gsgm.core.robust.trimmed_step`) and empties
        the buffer."""
        row = self._copy_new(parts)
        if scale != 1.0:
            np.multiply(row, scale, out=row)
        self._rows.append(row)
        self._count += 1
        if self._count < self._buffer_size:
            return Outcome.DEFERRED
        rows = self._rows
        trimmed_step(self._w, rows, self._trim_fraction, self._lr, self._scr_a)
        for row in rows:
            self._release(row)
        self._rows = []
        self._count = 0
        self._version += 1
        return Outcome.APPLIED

    def _extra_state(self) -> dict[str, Any]:
        return {
            "buffer_sum": self._buf.copy(),
            "buffer_count": self._count,
            "buffer_rows": [row.copy() for row in self._rows],
        }

    def _check_state_extra(self, state: dict[str, Any], version: int, active: set[int]) -> None:
        """With ``trim_fraction`` > 0 the buffer holds ``buffer_count`` updates, else none."""
        trimming = dict(state["params"])["trim_fraction"] > 0
        rows, count = len(state["buffer_rows"]), state["buffer_count"]
        if rows != (count if trimming else 0):
            raise ValueError(
                f"state['buffer_rows'] holds {rows} update(s); expected "
                + (f"buffer_count = {count}" if trimming else "none (trim_fraction = 0)")
            )

    def _load_extra(self, state: dict[str, Any]) -> None:
        self._buf[...] = self._flat_array(state["buffer_sum"], "buffer_sum")
        self._count = int(state["buffer_count"])
        self._rows = [self._flat_array(v, "buffer_rows") for v in state["buffer_rows"]]


# --------------------------------------------------------------------- the plain kernel
class PlainFedBuff(PlainKernel):
    """FedBuff's update written plainly (:class:`~flwr_gsgm.core.base.PlainKernel`).

    Nguyen et al., AISTATS 2022, Algorithm 1: each update enters the buffer weighted by
    the staleness scaling ``s(tau) = 1 / sqrt(1 + tau)``; the K-th steps along the
    buffer's mean and empties it::

        buffer <- buffer + [g / sqrt(1 + tau)]               every arrival ("deferred")
        w <- w - lr * mean(buffer); buffer <- []; t += 1     the K-th ("applied")

    With ``trim_fraction`` = f > 0 the step is along the buffer's coordinate-wise
    trimmed mean, ``int(f * K)`` cut at each end
    (:func:`~flwr_gsgm.core.robust.plain_trimmed_mean`).
    The buffer is a list of flat float32 arrays of shape ``(n,)``, as ``w`` and ``g``
    (the rule keeps their sum when f = 0). Updates of a lost node stay in it.
    """

    def __init__(
        self,
        w: np.ndarray,
        nodes: Iterable[int],
        *,
        lr: float,
        buffer_size: int,
        trim_fraction: float,
    ) -> None:
        super().__init__(w, nodes, lr)
        self.K, self.trim_fraction = buffer_size, trim_fraction
        self.buffer: list[np.ndarray] = []

    def arrive(self, node: int, g: np.ndarray, base_version: int, now: float = 0.0) -> str:
        tau = self.version - base_version
        self.buffer.append(g / math.sqrt(1 + tau))
        if len(self.buffer) < self.K:
            return "deferred"
        self.w -= self.lr * plain_trimmed_mean(self.buffer, self.trim_fraction)
        self.buffer = []
        self.version += 1
        return "applied"
