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
# Other public names, by the module that defines them (imported on first use).
_PUBLIC = {
    "AsyncStrategy": "flwr_gsgm.strategy.async_strategy",
    "AsyncResult": "flwr_gsgm.strategy.async_strategy",
    "FederatedEvaluation": "flwr_gsgm.engine.federated_evaluation",
    "VirtualClock": "flwr_gsgm.simulation.virtual_clock",
    "InProcessGrid": "flwr_gsgm.simulation.inprocess_grid",
    "build_strategy": "flwr_gsgm.config.build",
    # The synchronous time-budget anchors (subclasses of Flower's FedAvg).
    "TimeBudgetFedAvg": "flwr_gsgm.strategy.time_budget_fedavg",
    "FedNova": "flwr_gsgm.strategy.fednova",
}
__all__ = [*_STRATEGY_NAMES, *_PUBLIC, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _STRATEGY_NAMES:
        from flwr_gsgm.strategy import strategies

        return getattr(strategies, name)
    if name[:1].isupper():  # the strategy of a rule added later (one class per rule)
        from flwr_gsgm.strategy import strategies

        if name in {cls.__name__ for cls in strategies.STRATEGIES.values()}:
            return getattr(strategies, name)
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'flwr_gsgm' has no attribute {name!r}")
