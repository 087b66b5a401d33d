"""Framework-free algorithm core: GSGM and the asynchronous baselines.

Server optimizers on flat float32 numpy buffers, shared by every engine. This
package imports numpy only (never flwr, never torch).

Every rule module is imported here by name (a rule class registers itself in
:data:`OPTIMIZERS` when its module is imported, see :mod:`flwr_gsgm.core.registry`),
so a new rule file adds its import line below; the import order is the order of the
rules in ``OPTIMIZERS`` (GSGM, then the baselines), which the run config and its
generated reference (docs/REFERENCE.md) list in that order.
"""

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
from .fedcompass import FedCompassRule  # isort: skip
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
    "FedCompassRule",
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
