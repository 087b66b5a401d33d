"""Framework-free algorithm core: GSGM and the asynchronous baselines.

Server optimizers on flat float32 numpy buffers, shared by every engine. This
package imports numpy only (never flwr, never torch).
"""

from .ace import ACE
from .asgd import ASGD
from .base import Outcome, ServerOptimizer, UpdateRejected
from .ca2fl import CA2FL
from .dcasgd import DCASGD
from .delay_adaptive_asgd import DelayAdaptiveASGD
from .fedasync import FedAsync
from .fedbuff import FedBuff
from .gsgm import GSGM
from .momentum_asgd import MomentumASGD
from .registry import OPTIMIZERS, make_optimizer, optimizer_params

__all__ = [
    "ACE",
    "ASGD",
    "CA2FL",
    "DCASGD",
    "GSGM",
    "OPTIMIZERS",
    "DelayAdaptiveASGD",
    "FedAsync",
    "FedBuff",
    "MomentumASGD",
    "Outcome",
    "ServerOptimizer",
    "UpdateRejected",
    "make_optimizer",
    "optimizer_params",
]
