"""ASGD: asynchronous SGD on a parameter server.

Reference:
    F. Niu, B. Recht, C. Re, S. J. Wright, "Hogwild!: A Lock-Free Approach to
    Parallelizing Stochastic Gradient Descent", NeurIPS 2011; J. Dean et al., "Large
    Scale Distributed Deep Networks" (Downpour SGD), NeurIPS 2012. As a federated
    baseline: the server applies every arrival at once, no round barrier.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import numpy as np

from .base import Outcome, Parts, PlainKernel, ServerOptimizer
from .params import Param, server_learning_rate

__all__ = ["ASGDRule", "PlainASGD"]


class ASGDRule(ServerOptimizer):
    """Asynchronous SGD: ``w <- w - lr * g_i`` for every arrival.

    Args:
        weights: initial weights, a sequence of numpy arrays (copied to float32).
        partition_ids: partition-ids of the initially active nodes.
        lr: server learning rate, > 0.
        max_staleness: optional staleness bound (see :class:`ServerOptimizer`).
        max_norm: optional L2-norm bound (see :class:`ServerOptimizer`).

    Raises:
        ValueError: a parameter is out of range; the message names it.

    Memory: ``w`` and chunk-sized scratch.

    The update, written plainly: :class:`PlainASGD`.
    """

    name: ClassVar[str] = "asgd"
    PARAMS: ClassVar[tuple[Param, ...]] = (
        # Displacement modes: every arrival applies the declared fraction of its node's
        # displacement, tuned at 10 nodes, seed 0 (docs/GSGM.md, "Client modes").
        server_learning_rate(0.02, displacement=0.05),
    )

    def _step_bound(self, norm: float) -> tuple[float, float]:
        # lr * g, then w - lr * g.
        w_after = self._bound_w + self._lr * norm
        return w_after + (1.0 + self._lr) * norm, w_after

    def _on_valid(
        self, partition_id: int, parts: Parts, base_version: int, staleness: int, now: float
    ) -> Outcome:
        self._sgd_step(parts, self._lr)
        self._version += 1
        return Outcome.APPLIED


# --------------------------------------------------------------------- the plain kernel
class PlainASGD(PlainKernel):
    """ASGD's update written plainly (:class:`~flwr_gsgm.core.base.PlainKernel`).

    Every arrival steps at once (Niu et al., NeurIPS 2011; Dean et al., NeurIPS 2012):
    ``w <- w - lr * g``, with ``w`` and ``g`` flat float32 of shape ``(n,)``.
    """

    def __init__(self, w: np.ndarray, nodes: Iterable[int], *, lr: float) -> None:
        super().__init__(w, nodes, lr)

    def arrive(self, node: int, g: np.ndarray, base_version: int, now: float = 0.0) -> str:
        self.w -= self.lr * g
        self.version += 1
        return "applied"
