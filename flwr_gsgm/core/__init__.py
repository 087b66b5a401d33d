"""Framework-free algorithm core: GSGM and the asynchronous baselines.

Server optimizers on flat float32 numpy buffers, shared by every engine. This
package imports numpy only (never flwr, never torch).

Every module of the package is imported here, so a rule class in a new file
registers itself in :data:`OPTIMIZERS` without any other edit (see
:mod:`flwr_gsgm.core.registry`). The explicit imports below come first: they fix
the order of the shipped rules in ``OPTIMIZERS`` (GSGM, then the baselines), which
the run config and its generated reference (docs/REFERENCE.md) list in that order.
"""

import importlib as _importlib
import pkgutil as _pkgutil

# The import order is the registration order (GSGM first, then the baselines in the
# order the run config and docs/REFERENCE.md list them): keep it, whatever isort would do.
from .gsgm import GSGMRule  # isort: skip
from .asgd import ASGDRule  # isort: skip
from .momentum_asgd import MomentumASGDRule  # isort: skip
from .dcasgd import DCASGDRule  # isort: skip
from .fedasync import FedAsyncRule  # isort: skip
from .fedbuff import FedBuffRule  # isort: skip
from .ca2fl import CA2FLRule  # isort: skip
from .ace import ACERule  # isort: skip
from .delay_adaptive_asgd import DelayAdaptiveASGDRule  # isort: skip
from .base import (
    CORE_REASONS,
    INTAKE_REASONS,
    REASONS,
    STATE_LIMIT,
    Outcome,
    ServerOptimizer,
    UpdateRejected,
)
from .params import Param
from .registry import OPTIMIZERS, declared_params, make_optimizer, optimizer_params

# Rules added in new files: registered on import, after the shipped ones.
for _module in sorted(m.name for m in _pkgutil.iter_modules(__path__)):
    _importlib.import_module(f"{__name__}.{_module}")

__all__ = [
    "ACERule",
    "ASGDRule",
    "CA2FLRule",
    "DCASGDRule",
    "GSGMRule",
    "OPTIMIZERS",
    "DelayAdaptiveASGDRule",
    "FedAsyncRule",
    "FedBuffRule",
    "MomentumASGDRule",
    "Outcome",
    "Param",
    "ServerOptimizer",
    "UpdateRejected",
    "REASONS",
    "CORE_REASONS",
    "STATE_LIMIT",
    "INTAKE_REASONS",
    "declared_params",
    "make_optimizer",
    "optimizer_params",
]
