"""Delay-adaptive asynchronous SGD: the step shrinks when the delay exceeds the workers.

References:
    K. Mishchenko, F. Bach, M. Even, B. Woodworth, "Asynchronous SGD Beats Minibatch
    SGD Under Arbitrary Delays", NeurIPS 2022 (their code steps
    ``lr * M / max(M, tau)`` with M workers and delay tau);
    A. Koloskova, S. U. Stich, M. Jaggi, "Sharper Convergence Guarantees for
    Asynchronous SGD for Distributed and Federated Learning", NeurIPS 2022
    (step ``lr`` if ``tau <= tau_C``, else ``min(lr, c / tau)``; with
    ``c = lr * tau_C`` this is the same rule).

Implemented: ``w <- w - lr * m / max(m, tau) * g`` for every arrival, with ``tau``
the update's staleness in versions and ``m`` the delay threshold (by default the
number of active nodes at the arrival).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import numpy as np

from .base import Outcome, Parts, PlainKernel, ServerOptimizer
from .params import Param, server_learning_rate

__all__ = ["DelayAdaptiveASGDRule", "PlainDelayAdaptiveASGD"]


class DelayAdaptiveASGDRule(ServerOptimizer):
    """Delay-adaptive ASGD: ``w <- w - lr * m / max(m, tau) * g_i`` for every arrival.

    ``tau = version - base_version`` is the update's staleness (versions, an int
    >= 0); ``m`` is ``delay_threshold`` or, when it is ``None``, the number of
    active nodes ``|A|`` at the arrival (``|A| >= 1``, since the sender is active).
    An update no older than ``m`` takes the full step ``lr``; an older one takes
    ``lr * m / tau`` (so ``tau * step <= lr * m``). With every node always in
    flight the mean staleness is about ``|A|``: the default damps only the updates
    slower than the average round trip. Every arrival is :attr:`Outcome.APPLIED`
    and takes one step (``version`` += 1).

    Args:
        weights: initial weights, a sequence of numpy arrays (copied to float32).
        partition_ids: partition-ids of the initially active nodes.
        lr: server learning rate, > 0 (the step of an update with ``tau <= m``).
        delay_threshold: ``m``, an int >= 1, or ``None`` (default) for the number
            of active nodes at each arrival (Mishchenko et al.'s choice).
        max_staleness: optional staleness bound (see :class:`ServerOptimizer`).
        max_norm: optional L2-norm bound (see :class:`ServerOptimizer`).

    Raises:
        ValueError: a parameter is out of range; the message names it.

    Extra counter: ``steps_shrunk`` (steps with ``tau > m``).

    Memory: ``w`` and chunk-sized scratch.

    The update, written plainly: :class:`PlainDelayAdaptiveASGD`.
    """

    name: ClassVar[str] = "daasgd"
    PARAMS: ClassVar[tuple[Param, ...]] = (
        # Displacement modes (not tuned): ASGD's fraction before its tuning, for the
        # step of an update no older than m (docs/GSGM.md, "Client modes").
        server_learning_rate(0.02, displacement=0.1),
        Param(
            "delay_threshold",
            None,
            "delay-adaptive ASGD: staleness above which the step "
            "shrinks (none = the number of active nodes)",
            kind=int,
            low=1,
            optional=True,
            run_config_key="delay-threshold",
        ),
    )
    _counter_names: ClassVar[tuple[str, ...]] = ServerOptimizer._counter_names + ("steps_shrunk",)

    def _step_bound(self, norm: float) -> tuple[float, float]:
        # The step is at most lr: as ASGD.
        w_after = self._bound_w + self._lr * norm
        return w_after + (1.0 + self._lr) * norm, w_after

    def step_size(self, staleness: int) -> float:
        """``lr * m / max(m, staleness)`` with the current ``m`` (a python float)."""
        m = self._threshold()
        return self._lr * m / max(m, int(staleness))

    def _threshold(self) -> int:
        if self._delay_threshold is not None:
            return self._delay_threshold
        return max(1, len(self._active))

    def _on_valid(
        self, partition_id: int, parts: Parts, base_version: int, staleness: int, now: float
    ) -> Outcome:
        if staleness > self._threshold():
            self._counters["steps_shrunk"] += 1
        self._sgd_step(parts, self.step_size(staleness))
        self._version += 1
        return Outcome.APPLIED


# --------------------------------------------------------------------- the plain kernel
class PlainDelayAdaptiveASGD(PlainKernel):
    """Delay-adaptive ASGD's update written plainly
    (:class:`~flwr_gsgm.core.base.PlainKernel`).

    Mishchenko et al., NeurIPS 2022 (Koloskova et al., NeurIPS 2022, the same rule):
    an update of delay ``tau`` (its staleness in versions) steps
    ``w <- w - lr * m / max(m, tau) * g``, with ``m`` the delay threshold or, when it
    is None, the number of active nodes at the arrival. ``w`` and ``g`` are flat
    float32 of shape ``(n,)``.
    """

    def __init__(
        self, w: np.ndarray, nodes: Iterable[int], *, lr: float, delay_threshold: int | None
    ) -> None:
        super().__init__(w, nodes, lr)
        self.delay_threshold = delay_threshold

    def arrive(self, node: int, g: np.ndarray, base_version: int, now: float = 0.0) -> str:
        tau = self.version - base_version
        m = len(self.active) if self.delay_threshold is None else self.delay_threshold
        self.w -= self.lr * m / max(m, tau) * g
        self.version += 1
        return "applied"
