"""flwr-gsgm: asynchronous Flower strategies (GSGM and baselines).

The algorithm core (:mod:`flwr_gsgm.core`) imports only numpy; the strategies are
imported lazily so that ``import flwr_gsgm.core`` works where flwr is absent.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_STRATEGY_NAMES = (
    "GSGM",
    "ASGD",
    "MomentumASGD",
    "DCASGD",
    "FedAsync",
    "FedBuff",
    "CA2FL",
    "ACE",
    "DelayAdaptiveASGD",
    "STRATEGIES",
)
__all__ = [
    *_STRATEGY_NAMES,
    "AsyncStrategy",
    "AsyncResult",
    "FederatedEvaluation",
    "VirtualClock",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name in _STRATEGY_NAMES:
        from flwr_gsgm import strategies

        return getattr(strategies, name)
    if name[:1].isupper():  # the strategy of a rule added later (one class per rule)
        from flwr_gsgm import strategies

        if name in {cls.__name__ for cls in strategies.STRATEGIES.values()}:
            return getattr(strategies, name)
    if name in ("AsyncStrategy", "AsyncResult"):
        from flwr_gsgm import async_strategy

        return getattr(async_strategy, name)
    if name == "VirtualClock":
        from flwr_gsgm.virtual_clock import VirtualClock

        return VirtualClock
    if name == "FederatedEvaluation":
        from flwr_gsgm.federated_evaluation import FederatedEvaluation

        return FederatedEvaluation
    raise AttributeError(f"module 'flwr_gsgm' has no attribute {name!r}")
