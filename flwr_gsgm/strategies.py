"""Named asynchronous strategies for a ServerApp: ``GSGM`` and the baselines.

Each is :class:`~flwr_gsgm.async_strategy.AsyncStrategy` bound to one server
optimizer of :mod:`flwr_gsgm.core`, whose module cites the paper and documents the
rule. Parameters common to all (``server_lr``, client work, bounds, virtual clock,
engine settings, seed) are documented on ``AsyncStrategy``.
"""

from __future__ import annotations

from typing import Any

from flwr_gsgm.async_strategy import AsyncStrategy

__all__ = ["GSGM", "ASGD", "MomentumASGD", "DCASGD", "FedAsync", "FedBuff", "STRATEGIES"]


class GSGM(AsyncStrategy):
    """Gradient Scheduling with Global Momentum (Li et al. 2019; Wang et al. 2022).

    See :class:`flwr_gsgm.core.GSGM` for the rule (white-list scheduling per cycle,
    running-mean pending slots, cycle-level global momentum) and
    ``docs/GSGM.md`` for its definition in this project.

    The defaults (ema momentum, beta 0.5, quorum 0.5, table averaging, and
    ``server_lr=0.02``) are the choice of GSGM.md's tuning protocol: the best final
    accuracy of the 80-point grid on seed 0 (Fashion-MNIST, 10 nodes, 2 classes per
    node); ``docs/RESULTS.md`` has the grid and the figures on seeds 1-3.

    Parameters
    ----------
    beta : float
        Global momentum coefficient in [0, 1).
    momentum_form : str
        "heavy-ball" or "ema".
    cycle_quorum : float
        Fraction in (0, 1] of the active nodes whose contribution closes a cycle.
    cycle_max_updates : int | None
        Close a cycle after this many updates received in it.
    cycle_max_seconds : float | None
        Close a cycle after this many seconds of the engine clock.
    scheduling : bool
        False gives the momentum-only ablation.
    averaging : str
        "slot" (pending-slot running mean) or "table" (latest contribution of every
        node; memory grows with the number of nodes times the model size).
    """

    def __init__(
        self,
        *,
        beta: float = 0.5,
        momentum_form: str = "ema",
        cycle_quorum: float = 0.5,
        cycle_max_updates: int | None = None,
        cycle_max_seconds: float | None = None,
        scheduling: bool = True,
        averaging: str = "table",
        **kwargs: Any,
    ) -> None:
        super().__init__(
            "gsgm",
            beta=beta,
            momentum_form=momentum_form,
            cycle_quorum=cycle_quorum,
            cycle_max_updates=cycle_max_updates,
            cycle_max_seconds=cycle_max_seconds,
            scheduling=scheduling,
            averaging=averaging,
            **kwargs,
        )


class ASGD(AsyncStrategy):
    """Plain asynchronous SGD: ``w <- w - lr * g`` for every arrival."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__("asgd", **kwargs)


class MomentumASGD(AsyncStrategy):
    """Asynchronous SGD with naive server momentum ``beta`` in [0, 1)."""

    def __init__(self, *, beta: float = 0.5, **kwargs: Any) -> None:
        super().__init__("masgd", beta=beta, **kwargs)


class DCASGD(AsyncStrategy):
    """Delay-compensated ASGD (Zheng et al., ICML 2017), ``dc_lambda`` >= 0."""

    def __init__(self, *, dc_lambda: float = 0.04, **kwargs: Any) -> None:
        super().__init__("dcasgd", dc_lambda=dc_lambda, **kwargs)


class FedAsync(AsyncStrategy):
    """FedAsync (Xie et al., 2019): staleness-weighted mixing ``alpha * (s + 1) ** -poly_a``."""

    def __init__(self, *, alpha: float = 0.6, poly_a: float = 0.5, **kwargs: Any) -> None:
        super().__init__("fedasync", alpha=alpha, poly_a=poly_a, **kwargs)


class FedBuff(AsyncStrategy):
    """FedBuff (Nguyen et al., AISTATS 2022): mean of ``buffer_size`` buffered updates."""

    def __init__(self, *, buffer_size: int = 5, **kwargs: Any) -> None:
        super().__init__("fedbuff", buffer_size=buffer_size, **kwargs)


STRATEGIES: dict[str, type[AsyncStrategy]] = {
    "gsgm": GSGM,
    "asgd": ASGD,
    "masgd": MomentumASGD,
    "dcasgd": DCASGD,
    "fedasync": FedAsync,
    "fedbuff": FedBuff,
}
