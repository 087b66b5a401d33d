"""Momentum ASGD: asynchronous SGD with naive server momentum.

Reference:
    B. T. Polyak, "Some methods of speeding up the convergence of iteration methods",
    USSR Computational Mathematics and Mathematical Physics 4(5):1-17, 1964 (heavy
    ball), applied by the server to every asynchronous arrival as in
    T.-M. H. Hsu, H. Qi, M. Brown, "Measuring the Effects of Non-Identical Data
    Distribution for Federated Visual Classification", arXiv:1909.06335, 2019
    (server momentum, FedAvgM), here without the round barrier.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import numpy as np

from .base import Outcome, Parts, PlainKernel, ServerOptimizer, chunks
from .params import BETA, Param, server_learning_rate

__all__ = ["MomentumASGDRule", "PlainMomentumASGD"]


class MomentumASGDRule(ServerOptimizer):
    """Momentum ASGD: ``v <- beta * v + g_i; w <- w - lr * v`` for every arrival.

    Args:
        weights: initial weights, a sequence of numpy arrays (copied to float32).
        partition_ids: partition-ids of the initially active nodes.
        lr: server learning rate, > 0.
        beta: momentum coefficient in [0, 1); 0 gives ASGD.
        max_staleness: optional staleness bound (see :class:`ServerOptimizer`).
        max_norm: optional L2-norm bound (see :class:`ServerOptimizer`).

    Raises:
        ValueError: a parameter is out of range; the message names it.

    Memory: ``w``, the velocity ``v`` (``size(w)`` float32, starts at 0) and
    chunk-sized scratch.

    The update, written plainly: :class:`PlainMomentumASGD`.
    """

    name: ClassVar[str] = "masgd"
    PARAMS: ClassVar[tuple[Param, ...]] = (
        # Displacement modes (not tuned): ASGD's fraction before its tuning over the
        # momentum's gain 1 / (1 - beta) at BETA's default (docs/GSGM.md, "Client modes").
        server_learning_rate(0.02, displacement=0.05),
        BETA,
    )

    def _copies(self, nodes: int) -> int:
        """``w`` and the velocity."""
        return 2

    _LABELS: ClassVar[dict[str, str]] = {"_v": "velocity"}

    def __init__(
        self, weights: Sequence[np.ndarray], partition_ids: Iterable[int], **params: Any
    ) -> None:
        super().__init__(weights, partition_ids, **params)
        self._v = np.zeros(self._size, dtype=np.float32)

    @property
    def velocity(self) -> np.ndarray:
        """A flat float32 copy of the velocity ``v``."""
        return self._v.copy()

    def _step_bound(self, norm: float) -> tuple[float, float]:
        # v is a beta-weighted sum of the updates: |v| <= u / (1 - beta).
        v = max(self._bound_u, norm) / (1.0 - self._beta)
        w_after = self._bound_w + self._lr * v
        return w_after + (1.0 + self._lr) * v, w_after

    def _on_valid(
        self, partition_id: int, parts: Parts, base_version: int, staleness: int, now: float
    ) -> Outcome:
        w, v, a = self._w, self._v, self._scr_a
        lr, beta = self._lr, self._beta
        for lo, hi, g in chunks(parts):
            vs = v[lo:hi]
            np.multiply(vs, beta, out=vs)
            np.add(vs, g, out=vs)
            t = a[: hi - lo]
            np.multiply(vs, lr, out=t)
            ws = w[lo:hi]
            np.subtract(ws, t, out=ws)
        self._version += 1
        return Outcome.APPLIED

    def _extra_state(self) -> dict[str, Any]:
        return {"velocity": self._v.copy()}

    def _load_extra(self, state: dict[str, Any]) -> None:
        self._v[...] = self._flat_array(state["velocity"], "velocity")


# --------------------------------------------------------------------- the plain kernel
class PlainMomentumASGD(PlainKernel):
    """Momentum ASGD's update written plainly (:class:`~flwr_gsgm.core.base.PlainKernel`).

    Polyak's heavy ball applied by the server to every arrival (as FedAvgM's server
    momentum, Hsu et al. 2019, without the round barrier): ``v <- beta * v + g;
    w <- w - lr * v``. ``w``, ``g`` and the velocity ``v`` (0 at the start) are flat
    float32 of shape ``(n,)``.
    """

    def __init__(self, w: np.ndarray, nodes: Iterable[int], *, lr: float, beta: float) -> None:
        super().__init__(w, nodes, lr)
        self.beta = beta
        self.v = np.zeros_like(self.w)

    def arrive(self, node: int, g: np.ndarray, base_version: int, now: float = 0.0) -> str:
        self.v = self.beta * self.v + g
        self.w -= self.lr * self.v
        self.version += 1
        return "applied"
