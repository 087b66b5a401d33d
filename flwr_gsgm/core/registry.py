"""Registry: a run config string selects a server optimizer."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from .ace import ACE
from .asgd import ASGD
from .base import ServerOptimizer
from .ca2fl import CA2FL
from .dcasgd import DCASGD
from .delay_adaptive_asgd import DelayAdaptiveASGD
from .fedasync import FedAsync
from .fedbuff import FedBuff
from .gsgm import GSGM
from .momentum_asgd import MomentumASGD

__all__ = ["OPTIMIZERS", "make_optimizer", "optimizer_params"]

#: name -> class, for the run config key selecting the server optimizer.
OPTIMIZERS: dict[str, type[ServerOptimizer]] = {
    cls.name: cls
    for cls in (
        GSGM, ASGD, MomentumASGD, DCASGD, FedAsync, FedBuff, CA2FL, ACE,
        DelayAdaptiveASGD,
    )
}


def optimizer_params(name: str) -> tuple[str, ...]:
    """The keyword parameters the optimizer ``name`` takes (``lr`` included)."""
    cls = _lookup(name)
    sig = inspect.signature(cls.__init__)
    return tuple(
        p.name for p in sig.parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY
    )


def make_optimizer(
    name: str,
    weights: Sequence[np.ndarray],
    node_ids: Iterable[int],
    **params: Any,
) -> ServerOptimizer:
    """Build the server optimizer registered as ``name``.

    Parameter names may be given in run config style too (``cycle-quorum`` for
    ``cycle_quorum``).

    Raises:
        ValueError: unknown ``name`` (the message lists the valid ones), a parameter
            the class does not take (the message lists those it takes), a parameter
            given twice, or a value out of range.
    """
    cls = _lookup(name)
    accepted = optimizer_params(name)
    kwargs: dict[str, Any] = {}
    for key, value in params.items():
        k = key.replace("-", "_")
        if k in kwargs:
            raise ValueError(f"parameter {k!r} given twice (as {key!r})")
        kwargs[k] = value
    unknown = sorted(k for k in kwargs if k not in accepted)
    if unknown:
        raise ValueError(
            f"optimizer {cls.name!r} does not take parameter(s) "
            f"{', '.join(repr(k) for k in unknown)}; it takes: {', '.join(accepted)}"
        )
    if "lr" not in kwargs:
        raise ValueError(f"optimizer {cls.name!r} needs the parameter 'lr'")
    return cls(weights, node_ids, **kwargs)


def _lookup(name: str) -> type[ServerOptimizer]:
    key = name.strip().lower() if isinstance(name, str) else name
    try:
        return OPTIMIZERS[key]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown optimizer {name!r}; valid names: {', '.join(sorted(OPTIMIZERS))}"
        ) from None
