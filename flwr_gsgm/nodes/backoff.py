"""Exponential back-off of a failing node: how long it waits before it gets work again.

A node fails when a train message to it goes unanswered past ``dispatch-timeout`` or
is answered with an error (any Flower error code). After its k-th failure in a row it
gets no work for :meth:`Backoff.delay` ``(k) = min(cap, base * factor ** (k - 1))``
seconds of the engine clock (virtual seconds under the virtual clock, so a simulation
stays reproducible; wall seconds in deployment); after ``max-node-failures`` failures
in a row it is excluded from the run (:meth:`flwr_gsgm.engine.membership.Membership.fail`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Backoff"]


@dataclass(frozen=True)
class Backoff:
    """The back-off schedule, declared once: ``min(cap, base * factor ** (k - 1))`` seconds.

    Attributes
    ----------
    base : float
        Seconds after the first failure (> 0). Default 1.
    factor : float
        Growth per further failure in a row (>= 1). Default 2.
    cap : float
        Longest wait in seconds (>= base). Default 60.

    Raises
    ------
    ValueError
        If a value is out of range; the message names it.
    """

    base: float = 1.0
    factor: float = 2.0
    cap: float = 60.0

    def __post_init__(self) -> None:
        if not self.base > 0:
            raise ValueError(f"back-off base must be > 0 seconds, got {self.base!r}")
        if not self.factor >= 1:
            raise ValueError(f"back-off factor must be >= 1, got {self.factor!r}")
        if not self.cap >= self.base:
            raise ValueError(f"back-off cap must be >= base ({self.base}), got {self.cap!r}")

    def delay(self, failures: int) -> float:
        """Seconds to wait after the ``failures``-th failure in a row (``failures >= 1``).

        Raises
        ------
        ValueError
            If ``failures < 1``.
        """
        if failures < 1:
            raise ValueError(f"failures must be >= 1, got {failures!r}")
        delay = self.base
        for _ in range(failures - 1):  # stops at the cap: factor ** k may overflow a float
            if delay >= self.cap:
                break
            delay *= self.factor
        return min(self.cap, delay)
