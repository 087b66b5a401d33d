"""FedAsync: asynchronous federated optimization with staleness-weighted mixing.

Reference:
    C. Xie, S. Koyejo, I. Gupta, "Asynchronous Federated Optimization",
    arXiv:1903.03934, 2019 (OPT-2020 workshop).

Reading used here: the paper's server mixes the node's *model* into the global one,
``w <- (1 - a_s) w + a_s w_i``, with the polynomial staleness function
``a_s = alpha * (s + 1) ** (-poly_a)``. Our nodes send an update ``g`` (a gradient, or
``(w_tau - w_local) / lr_local`` in delta mode), so the node model is rebuilt from the
weights it was sent: ``w_i = w_tau - lr * g``. In delta mode with ``lr`` equal to the
clients' local learning rate this is exactly the node's local model.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import numpy as np

from .backups import DispatchBackups
from .base import Outcome, Parts, PlainKernel, chunks
from .params import Param, server_learning_rate

__all__ = ["FedAsyncRule", "PlainFedAsync"]


class FedAsyncRule(DispatchBackups):
    """FedAsync: ``w_i = w_tau - lr * g; w <- (1 - a_s) * w + a_s * w_i``.

    ``a_s = alpha * (s + 1) ** (-poly_a)`` with staleness ``s = version -
    base_version``; ``w_tau`` is the copy recorded by ``on_dispatch``.

    Args:
        weights: initial weights, a sequence of numpy arrays (copied to float32).
        partition_ids: partition-ids of the initially active nodes.
        lr: learning rate rebuilding the node model from its update, > 0 (set it to
            the clients' local learning rate in delta mode).
        alpha: mixing weight in (0, 1] of a fresh model.
        poly_a: exponent >= 0 of the polynomial staleness function.
        max_staleness: optional staleness bound (see :class:`ServerOptimizer`).
        max_norm: optional L2-norm bound (see :class:`ServerOptimizer`).

    Raises:
        ValueError: a parameter is out of range (the message names it), or
            ``on_dispatch`` for an inactive node.
        UpdateRejected: as in :class:`ServerOptimizer`, and with reason
            ``"base-version"`` when the update's base version is not that of the
            node's last dispatch.

    Memory: ``w``, one ``size(w)`` float32 backup per dispatched active node,
    chunk-sized scratch.

    The update, written plainly: :class:`PlainFedAsync`.
    """

    name: ClassVar[str] = "fedasync"
    PARAMS: ClassVar[tuple[Param, ...]] = (
        # Displacement modes: a fraction of 1 would rebuild the node's model
        # w_i = w_tau - d = w_local (the paper's rule), mixed in with weight alpha; the
        # declared fraction was tuned at 10 nodes, seed 0 (docs/GSGM.md, "Client modes").
        server_learning_rate(0.02, displacement=0.3),
        Param(
            "alpha",
            0.6,
            "mixing weight of a fresh model",
            low=0.0,
            low_open=True,
            high=1.0,
            run_config_key="fedasync-alpha",
        ),
        Param("poly_a", 0.5, "staleness exponent", low=0.0, run_config_key="fedasync-a"),
    )

    def _step_bound(self, norm: float) -> tuple[float, float]:
        # w_tau - lr * g, mixed with w: a convex combination.
        w_after = self._bound_w + self._lr * norm
        return 2.0 * w_after + (1.0 + self._lr) * norm, w_after

    def mixing_weight(self, staleness: int) -> float:
        """``a_s = alpha * (staleness + 1) ** (-poly_a)``."""
        return self._alpha * float(staleness + 1) ** (-self._poly_a)

    def _on_valid(
        self, partition_id: int, parts: Parts, base_version: int, staleness: int, now: float
    ) -> Outcome:
        w, a = self._w, self._scr_a
        backup = self._backups[partition_id][0]
        lr = self._lr
        mix = self.mixing_weight(staleness)
        keep = 1.0 - mix
        for lo, hi, g in chunks(parts):
            t = a[: hi - lo]
            np.multiply(g, lr, out=t)
            np.subtract(backup[lo:hi], t, out=t)  # w_i = w_tau - lr * g
            np.multiply(t, mix, out=t)
            ws = w[lo:hi]
            np.multiply(ws, keep, out=ws)  # in place: one chunk buffer less in cache
            np.add(ws, t, out=ws)  # (1 - a_s) w + a_s w_i
        self._version += 1
        return Outcome.APPLIED


# --------------------------------------------------------------------- the plain kernel
class PlainFedAsync(PlainKernel):
    """FedAsync's update written plainly (:class:`~flwr_gsgm.core.base.PlainKernel`).

    Xie et al., arXiv:1903.03934: the node's model, rebuilt from the weights ``w_tau``
    it was sent (:meth:`dispatch`) and its update, is mixed into ``w`` with a weight
    that decays polynomially with the staleness ``s``::

        a_s = alpha * (s + 1) ** (-poly_a)
        w_i = w_tau - lr * g
        w <- (1 - a_s) * w + a_s * w_i

    Every array is flat float32 of shape ``(n,)``.
    """

    def __init__(
        self, w: np.ndarray, nodes: Iterable[int], *, lr: float, alpha: float, poly_a: float
    ) -> None:
        super().__init__(w, nodes, lr)
        self.alpha, self.poly_a = alpha, poly_a
        self.w_sent: dict[int, np.ndarray] = {}  # node -> w_tau

    def dispatch(self, node: int) -> None:
        self.w_sent[node] = self.w.copy()

    def arrive(self, node: int, g: np.ndarray, base_version: int, now: float = 0.0) -> str:
        s = self.version - base_version
        a_s = self.alpha * (s + 1) ** (-self.poly_a)
        w_i = self.w_sent[node] - self.lr * g
        self.w = (1 - a_s) * self.w + a_s * w_i
        self.version += 1
        return "applied"

    def lost(self, node: int, now: float = 0.0) -> None:
        super().lost(node, now)
        self.w_sent.pop(node, None)
