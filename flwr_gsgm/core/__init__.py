"""Framework-free algorithm core: GSGM and the asynchronous baselines.

Server optimizers on flat float32 numpy buffers, shared by every engine. This
package imports numpy only (never flwr, never torch).
"""

from .asgd import ASGD
from .base import Outcome, ServerOptimizer, UpdateRejected
from .dcasgd import DCASGD
from .fedasync import FedAsync
from .fedbuff import FedBuff
from .gsgm import GSGM
from .momentum_asgd import MomentumASGD
from .registry import OPTIMIZERS, make_optimizer, optimizer_params

__all__ = [
    "ASGD",
    "DCASGD",
    "GSGM",
    "OPTIMIZERS",
    "FedAsync",
    "FedBuff",
    "MomentumASGD",
    "Outcome",
    "ServerOptimizer",
    "UpdateRejected",
    "make_optimizer",
    "optimizer_params",
]
