"""CA2FL: buffered asynchronous aggregation with cached update calibration.

Reference:
    Y. Wang, Y. Cao, J. Wu, R. Chen, J. Chen, "Tackling the Data Heterogeneity in
    Asynchronous Federated Learning with Cached Update Calibration", ICLR 2024
    (Algorithm 1; buffer size M = 10 in its experiments and public code).

Implemented (Algorithm 1, updates written as descent directions): the server caches
the latest update ``h_i`` of every node (zero before its first) and their mean
``h``. Each arrival adds the calibrated ``Delta_i - h_i`` to a buffer, then
``h_i <- Delta_i``. After ``M`` arrivals the server steps along
``v = h^t + (1 / M) * sum of the buffered entries``, where ``h^t`` is the cache
mean computed at the previous step (zero before the first), then recomputes
``h^{t+1}`` as the mean of the caches.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import numpy as np

from .base import Outcome, Parts, PlainKernel, ServerOptimizer, chunks
from .params import Param, server_learning_rate

__all__ = ["CA2FLRule", "PlainCA2FL"]

_F32 = np.dtype(np.float32)


class CA2FLRule(ServerOptimizer):
    r"""CA2FL: cached update calibration on a buffer of ``buffer_size`` arrivals.

    State: caches ``h_i`` (flat float32, one per active node that has sent an
    update; a node without one counts as ``h_i = 0``), the cache mean ``h`` of the
    current buffer (``h^t``), the buffer sum ``B`` of calibrated entries and its
    count ``b``.

    When node ``i``'s update ``Delta_i`` arrives (after validation and the
    staleness bound):

    - ``B <- B + (Delta_i - h_i)`` with ``h_i`` the node's cache *before* this
      arrival (0 if none), then ``h_i <- Delta_i``; ``b += 1``. A node arriving
      twice in one buffer telescopes: its entries sum to ``Delta_last - h_i^t``.
    - if ``b < buffer_size``: :attr:`Outcome.DEFERRED`;
    - else (:attr:`Outcome.APPLIED`): ``v = h + B / buffer_size``;
      ``w <- w - lr * v``; ``version += 1``; ``B, b <- 0``; then
      ``h <- (sum of the caches) / n`` with ``n`` the nodes active at that step
      or holding a cache (nodes that never sent count with a zero cache; this is
      the paper's ``1/N sum_i h_i`` over its ``N`` clients). ``h``
      used by a step is thus the one computed at the previous step (``h^t`` of
      Algorithm 1), zero before the first step (the first step is FedBuff's).

    Node churn: a lost node keeps its cache, as the paper keeps the latest update
    of every client, also of those not sampled for a while: it stays in ``h`` and
    ``n``, and the node's next update after it rejoins is calibrated against it.
    Its entries already in ``B`` stay, as in FedBuff. A node that joins for the
    first time has no cache (zero) and counts in ``n`` from the next recompute.

    Args:
        weights: initial weights, a sequence of numpy arrays (copied to float32).
        partition_ids: partition-ids of the initially active nodes.
        lr: server learning rate eta, > 0.
        buffer_size: ``M`` >= 1, arrivals per step (the declared default is the paper's).
        max_staleness: optional staleness bound (see :class:`ServerOptimizer`);
            a dropped update touches neither the buffer nor the caches.
        max_norm: optional L2-norm bound (see :class:`ServerOptimizer`).

    Raises:
        ValueError: a parameter is out of range; the message names it.

    Memory: ``w``, ``h``, ``B`` and one cache per node that has sent an update,
    active or lost: ``(caches + 3) * size(w)`` float32 with ``w``, plus chunk-sized
    scratch. Cost: 3 element-wise passes per arrival, and at a step 2 passes plus
    ``|caches| + 1`` for the recompute of ``h`` (about ``|A| / M`` passes per
    arrival amortised). The recompute sums the caches in increasing node order.

    The update, written plainly: :class:`PlainCA2FL`.
    """

    name: ClassVar[str] = "ca2fl"
    PARAMS: ClassVar[tuple[Param, ...]] = (
        # A step per buffer of several updates: the tuned rate (10 nodes, seed 0,
        # docs/results/fashion_mnist_scale/tuned.toml) is larger than a per-arrival one.
        # Displacement modes: a step of the declared fraction along the calibrated mean
        # displacement, tuned at 10 nodes, seed 0 (docs/GSGM.md, "Client modes").
        server_learning_rate(0.1, displacement=0.25),
        Param(
            "buffer_size",
            10,
            "CA2FL buffer size M (arrivals per step)",
            kind=int,
            low=1,
            run_config_key="ca2fl-m",
        ),
    )

    def _copies(self, nodes: int) -> int:
        """``w``, the cache mean, the buffer and a cache per node (a lost node keeps
        its cache, so the caches may outnumber the ``nodes`` active)."""
        return 3 + max(nodes, len(getattr(self, "_caches", ())))

    def __init__(
        self, weights: Sequence[np.ndarray], partition_ids: Iterable[int], **params: Any
    ) -> None:
        super().__init__(weights, partition_ids, **params)
        self._caches: dict[int, np.ndarray] = {}
        self._h = np.zeros(self._size, dtype=_F32)
        self._buf = np.zeros(self._size, dtype=_F32)
        self._count = 0

    _LABELS: ClassVar[dict[str, str]] = {
        "_buf": "buffer sum",
        "_h": "cache mean",
        "_caches": "cache of node",
    }

    def _step_bound(self, norm: float) -> tuple[float, float]:
        # Entries Delta - h_i <= 2u, at most M of them in B; v = h + B / M; the
        # recompute of h sums the caches.
        u = max(self._bound_u, norm)
        terms = 2 * self._buffer_size + 3 + len(self._caches) + 1
        w_after = self._bound_w + self._lr * terms * u
        return w_after + (1.0 + self._lr) * terms * u, w_after

    # ---------------------------------------------------------------- introspection
    @property
    def buffer_count(self) -> int:
        """Number of calibrated entries in the buffer (``b``)."""
        return self._count

    @property
    def buffer_sum(self) -> np.ndarray:
        """A flat float32 copy of the buffer sum ``B`` of calibrated entries."""
        return self._buf.copy()

    @property
    def cache_mean(self) -> np.ndarray:
        """A flat float32 copy of ``h``, the cache mean the next step will use."""
        return self._h.copy()

    @property
    def caches(self) -> dict[int, np.ndarray]:
        """node -> flat float32 copy of its cached latest update ``h_i``."""
        return {n: c.copy() for n, c in self._caches.items()}

    # ------------------------------------------------------------------------ rule
    def _on_valid(
        self, partition_id: int, parts: Parts, base_version: int, staleness: int, now: float
    ) -> Outcome:
        buf = self._buf
        cache = self._caches.get(partition_id)
        if cache is None:  # h_i = 0: the entry is Delta_i itself
            for lo, hi, g in chunks(parts):
                bs = buf[lo:hi]
                np.add(bs, g, out=bs)
            self._caches[partition_id] = self._copy_new(parts)
        else:
            a = self._scr_a
            for lo, hi, g in chunks(parts):
                t = a[: hi - lo]
                c = cache[lo:hi]
                np.subtract(g, c, out=t)  # Delta_i - h_i
                bs = buf[lo:hi]
                np.add(bs, t, out=bs)
                np.copyto(c, g)  # h_i <- Delta_i
        self._count += 1
        if self._count < self._buffer_size:
            return Outcome.DEFERRED
        w, h, a = self._w, self._h, self._scr_a
        k, lr = self._count, self._lr
        for lo, hi, s in chunks([(0, buf)]):
            t = a[: hi - lo]
            np.divide(s, k, out=t)
            np.add(t, h[lo:hi], out=t)  # v = h + B / M
            np.multiply(t, lr, out=t)
            ws = w[lo:hi]
            np.subtract(ws, t, out=ws)
        buf.fill(0.0)
        self._count = 0
        self._version += 1
        self._recompute_mean()
        return Outcome.APPLIED

    def _recompute_mean(self) -> None:
        """``h <- (sum of the caches) / n``, ``n`` the nodes active or holding a
        cache (0 without caches)."""
        h = self._h
        h.fill(0.0)
        n = len(self._active.union(self._caches))
        if not self._caches:
            return
        for partition_id in sorted(self._caches):
            np.add(h, self._caches[partition_id], out=h)
        np.divide(h, n, out=h)

    # -------------------------------------------------------------- checkpointing
    def _extra_state(self) -> dict[str, Any]:
        return {
            "buffer_sum": self._buf.copy(),
            "buffer_count": self._count,
            "cache_mean": self._h.copy(),
            "cache_nodes": list(self._caches),
            "cache_values": [c.copy() for c in self._caches.values()],
        }

    def _load_extra(self, state: dict[str, Any]) -> None:
        buf = self._flat_array(state["buffer_sum"], "buffer_sum")
        h = self._flat_array(state["cache_mean"], "cache_mean")
        partition_ids = [int(n) for n in state["cache_nodes"]]
        values = [self._flat_array(v, "cache_values") for v in state["cache_values"]]
        if len(partition_ids) != len(values):
            raise ValueError("state cache_nodes and cache_values differ in length")
        self._buf[...] = buf
        self._h[...] = h
        self._count = int(state["buffer_count"])
        self._caches = dict(zip(partition_ids, values))


# --------------------------------------------------------------------- the plain kernel
class PlainCA2FL(PlainKernel):
    """CA2FL's update written plainly (:class:`~flwr_gsgm.core.base.PlainKernel`).

    Wang et al., ICLR 2024, Algorithm 1, updates as descent directions. The server
    caches the latest update ``h_i`` of every node (0 before its first) and buffers
    each arrival calibrated by it; every ``M``-th arrival steps::

        B <- B + (g_i - h_i); h_i <- g_i                        every arrival
        w <- w - lr * (h + B / M); B <- 0; t += 1               the M-th ("applied")
        h <- (sum_i h_i) / N                                    then

    ``h`` is the cache mean computed at the previous step (0 before the first), ``N``
    the nodes active or holding a cache. A lost node keeps its cache (in ``h`` and
    ``N``), and its entries stay in ``B``. Every array is flat float32 of shape ``(n,)``.
    """

    def __init__(self, w: np.ndarray, nodes: Iterable[int], *, lr: float, buffer_size: int) -> None:
        super().__init__(w, nodes, lr)
        self.M = buffer_size
        self.caches: dict[int, np.ndarray] = {}  # node -> h_i
        self.h = np.zeros_like(self.w)
        self.B = np.zeros_like(self.w)
        self.b = 0

    def arrive(self, node: int, g: np.ndarray, base_version: int, now: float = 0.0) -> str:
        h_i = self.caches.get(node, np.zeros_like(self.w))
        self.B += g - h_i
        self.caches[node] = g.copy()
        self.b += 1
        if self.b < self.M:
            return "deferred"
        self.w -= self.lr * (self.h + self.B / self.M)
        self.version += 1
        self.B = np.zeros_like(self.w)
        self.b = 0
        N = len(self.active | set(self.caches))
        self.h = sum(self.caches.values()) / N
        return "applied"
