"""DC-ASGD: asynchronous SGD with delay compensation.

Reference:
    S. Zheng, Q. Meng, T. Wang, W. Chen, N. Yu, Z.-M. Ma, T.-Y. Liu, "Asynchronous
    Stochastic Gradient Descent with Delay Compensation", ICML 2017 (PMLR 70).

Implemented: the constant-lambda variant (DC-ASGD-c), whose compensation
approximates the Hessian by ``lambda * g * g`` (element-wise); the adaptive variant
DC-ASGD-a (lambda scaled by a running mean square of the gradient) is not.

Displacement client modes (delta, weights: the update is ``d = w_tau - w_local``):
the curvature estimate needs a gradient, so the rule reads ``d / update_scale``
(``update_scale`` = the client's ``local-lr``, set by the strategy) as one, the
gradient estimate of plain SGD: compensated, ``d~ = d + (lambda / update_scale) *
d * d * (w_t - w_tau)``, and ``w <- w - lr * d~`` with ``lr`` a fraction of the
displacement. So ``dc_lambda`` means the same in every mode.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import numpy as np

from .backups import DispatchBackups
from .base import Outcome, Parts, PlainKernel, chunks
from .params import Param, server_learning_rate

__all__ = ["DCASGDRule", "PlainDCASGD"]


class DCASGDRule(DispatchBackups):
    """DC-ASGD: ``g~ = g + dc_lambda * g * g * (w_t - w_tau); w <- w - lr * g~``.

    ``w_tau`` is the copy of the weights sent to the node, recorded by
    ``on_dispatch``; products are element-wise. With ``update_scale = s`` (the
    displacement client modes) the update ``u`` is read as ``s`` times a gradient:
    ``u~ = u + (dc_lambda / s) * u * u * (w_t - w_tau)``.

    Args:
        weights: initial weights, a sequence of numpy arrays (copied to float32).
        partition_ids: partition-ids of the initially active nodes.
        lr: server learning rate, > 0.
        dc_lambda: variance-control parameter lambda >= 0 (0 gives ASGD).
        update_scale: None (gradient mode: the update is a gradient) or the
            client learning rate that turns a displacement into a gradient
            estimate, > 0 (set by the strategy in delta and weights modes).
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

    The update, written plainly: :class:`PlainDCASGD`.
    """

    name: ClassVar[str] = "dcasgd"
    PARAMS: ClassVar[tuple[Param, ...]] = (
        # Displacement modes (not tuned): ASGD's fraction before its tuning, the
        # compensation being a small correction (docs/GSGM.md, "Client modes").
        server_learning_rate(0.02, displacement=0.1),
        Param("dc_lambda", 0.04, "delay compensation lambda", low=0.0, run_config_key="dc-lambda"),
        # Set by the strategy from the client mode and local-lr, not a run config key.
        Param(
            "update_scale",
            None,
            "update per gradient unit (none = gradient mode; the client's local-lr "
            "in delta and weights modes)",
            low=0.0,
            low_open=True,
            optional=True,
        ),
    )

    def _step_bound(self, norm: float) -> tuple[float, float]:
        # w_t - w_tau <= 2r; * g * g * lambda; g~ = g + that; w - lr * g~.
        r, lr, lam = self._bound_w, self._lr, self._compensation()
        comp = 2.0 * r * max(1.0, norm) ** 2 * max(1.0, lam)
        w_after = r + lr * (norm + comp)
        return w_after + (1.0 + lr) * (norm + comp), w_after

    def _compensation(self) -> float:
        """The coefficient of ``u * u * (w_t - w_tau)``: lambda, or lambda / update_scale."""
        if self._update_scale is None:
            return self._dc_lambda
        return self._dc_lambda / self._update_scale

    def _on_valid(
        self, partition_id: int, parts: Parts, base_version: int, staleness: int, now: float
    ) -> Outcome:
        w, a = self._w, self._scr_a
        backup = self._backups[partition_id][0]
        lr, lam = self._lr, self._compensation()
        for lo, hi, g in chunks(parts):
            t = a[: hi - lo]
            ws = w[lo:hi]
            np.subtract(ws, backup[lo:hi], out=t)  # w_t - w_tau
            np.multiply(t, g, out=t)
            np.multiply(t, g, out=t)
            np.multiply(t, lam, out=t)
            np.add(g, t, out=t)  # g~
            np.multiply(t, lr, out=t)
            np.subtract(ws, t, out=ws)
        self._version += 1
        return Outcome.APPLIED


# --------------------------------------------------------------------- the plain kernel
class PlainDCASGD(PlainKernel):
    """DC-ASGD's update written plainly (:class:`~flwr_gsgm.core.base.PlainKernel`).

    Zheng et al., ICML 2017, the constant-lambda variant DC-ASGD-c: the delay between
    the weights ``w_tau`` the node computed on and the current ``w`` is compensated by
    a diagonal approximation of the Hessian, ``lambda * g * g``::

        g~ = g + lambda * g * g * (w - w_tau)     (element-wise)
        w <- w - lr * g~

    With ``update_scale = s`` (displacement modes) ``lambda / s`` stands for
    ``lambda``. ``w_tau`` is the copy taken by :meth:`dispatch`, dropped when the node
    is lost. Every array is flat float32 of shape ``(n,)``.
    """

    def __init__(
        self,
        w: np.ndarray,
        nodes: Iterable[int],
        *,
        lr: float,
        dc_lambda: float,
        update_scale: float | None,
    ) -> None:
        super().__init__(w, nodes, lr)
        self.lam = dc_lambda if update_scale is None else dc_lambda / update_scale
        self.w_sent: dict[int, np.ndarray] = {}  # node -> w_tau

    def dispatch(self, node: int) -> None:
        self.w_sent[node] = self.w.copy()

    def arrive(self, node: int, g: np.ndarray, base_version: int, now: float = 0.0) -> str:
        w_tau = self.w_sent[node]
        g_compensated = g + self.lam * g * g * (self.w - w_tau)
        self.w -= self.lr * g_compensated
        self.version += 1
        return "applied"

    def lost(self, node: int, now: float = 0.0) -> None:
        super().lost(node, now)
        self.w_sent.pop(node, None)
