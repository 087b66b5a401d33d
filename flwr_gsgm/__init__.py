"""flwr-gsgm: asynchronous Flower strategies (GSGM and baselines).

The public names, each imported by name from the module that defines it (the
``TYPE_CHECKING`` block below: what an editor's go-to-definition and a type checker
read). At run time they are imported on first use, because the algorithm core
(:mod:`flwr_gsgm.core`) imports only numpy and must pull in no flwr.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from flwr_gsgm.config.build import build_strategy
    from flwr_gsgm.engine.federated_evaluation import FederatedEvaluation
    from flwr_gsgm.simulation.inprocess_grid import InProcessGrid
    from flwr_gsgm.simulation.virtual_clock import VirtualClock
    from flwr_gsgm.strategy.async_strategy import AsyncResult, AsyncStrategy
    from flwr_gsgm.strategy.fednova import FedNova
    from flwr_gsgm.strategy.strategies import (
        ACE,
        ASGD,
        CA2FL,
        DCASGD,
        GSGM,
        STRATEGIES,
        DelayAdaptiveASGD,
        FedAsync,
        FedBuff,
        FedCompass,
        MomentumASGD,
    )
    from flwr_gsgm.strategy.time_budget_fedavg import TimeBudgetFedAvg

#: Public name -> the module that defines it: the imports above, name for name
#: (tests/packaging/test_public_names.py keeps the two equal).
_DEFINED_IN = {
    "GSGM": "flwr_gsgm.strategy.strategies",
    "ASGD": "flwr_gsgm.strategy.strategies",
    "MomentumASGD": "flwr_gsgm.strategy.strategies",
    "DCASGD": "flwr_gsgm.strategy.strategies",
    "FedAsync": "flwr_gsgm.strategy.strategies",
    "FedBuff": "flwr_gsgm.strategy.strategies",
    "CA2FL": "flwr_gsgm.strategy.strategies",
    "ACE": "flwr_gsgm.strategy.strategies",
    "DelayAdaptiveASGD": "flwr_gsgm.strategy.strategies",
    "FedCompass": "flwr_gsgm.strategy.strategies",
    "STRATEGIES": "flwr_gsgm.strategy.strategies",
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
__all__ = [
    "GSGM",
    "ASGD",
    "MomentumASGD",
    "DCASGD",
    "FedAsync",
    "FedBuff",
    "CA2FL",
    "ACE",
    "DelayAdaptiveASGD",
    "FedCompass",
    "STRATEGIES",
    "AsyncStrategy",
    "AsyncResult",
    "FederatedEvaluation",
    "VirtualClock",
    "InProcessGrid",
    "build_strategy",
    "TimeBudgetFedAvg",
    "FedNova",
    "__version__",
]


def __getattr__(name: str) -> Any:
    # The one lazy import left: importing flwr_gsgm.core runs this file first, and the
    # core must import where flwr is absent and pull in no flwr where it is there
    # (tests/core/test_core_isolation.py, tests/core/test_core_imports.py), while every
    # public name needs flwr. So each is imported from its module on first use.
    module = _DEFINED_IN.get(name)
    if module is None:
        raise AttributeError(f"module 'flwr_gsgm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next use is a plain attribute
    return value
