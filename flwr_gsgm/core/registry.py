"""Registry: a run config string selects a server optimizer.

Rule classes register themselves: a subclass of
:class:`~flwr_gsgm.core.base.ServerOptimizer` that sets ``name`` is added to
:data:`OPTIMIZERS` when its module is imported (``ServerOptimizer.__init_subclass__``
calls :func:`register`), and ``flwr_gsgm.core`` imports each rule module by name.
Adding a rule is one new file in ``flwr_gsgm/core/``, its import line in
``flwr_gsgm/core/__init__.py`` and its strategy class in
``flwr_gsgm/strategy/strategies.py``; its ``PARAMS`` declaration feeds everything else.

This module imports nothing from :mod:`~flwr_gsgm.core.base` (base imports it), so
there is no import cycle; it treats a rule class as any class with ``name``,
``declared_params()`` and the optimizer constructor.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from .params import Param

__all__ = ["OPTIMIZERS", "make_optimizer", "optimizer_params", "declared_params", "register"]

#: name -> class, for the run config key selecting the server optimizer. Filled by
#: :func:`register` in import order (``flwr_gsgm.core`` imports GSGM first).
OPTIMIZERS: dict[str, type[Any]] = {}


def register(cls: type[Any]) -> type[Any]:
    """Add ``cls`` under ``cls.name`` (called by ``ServerOptimizer.__init_subclass__``).

    Raises:
        ValueError: the name is empty or not lower case, or another class already
            holds it.
    """
    name = cls.name
    if name != name.strip().lower() or not name:
        raise ValueError(f"optimizer name {name!r} of {cls.__qualname__} must be lower case")
    held = OPTIMIZERS.get(name)
    if held is not None and held is not cls:
        raise ValueError(
            f"optimizer name {name!r} of {cls.__module__}.{cls.__qualname__} is already "
            f"taken by {held.__module__}.{held.__qualname__}"
        )
    OPTIMIZERS[name] = cls
    return cls


def declared_params(name: str) -> tuple[Param, ...]:
    """The declared parameters of the optimizer ``name`` (base ones first).

    Raises:
        ValueError: unknown ``name`` (the message lists the valid ones).
    """
    return _lookup(name).declared_params()


def optimizer_params(name: str) -> tuple[str, ...]:
    """The keyword parameters the optimizer ``name`` takes (``lr`` included)."""
    return tuple(p.name for p in declared_params(name))


def make_optimizer(
    name: str,
    weights: Sequence[np.ndarray],
    partition_ids: Iterable[int],
    **params: Any,
) -> Any:
    """Build the server optimizer registered as ``name`` (a ``ServerOptimizer``).

    Parameter names may be given in run config style too (``cycle-quorum`` for
    ``cycle_quorum``). ``lr`` must be given: the engine, not a declared default,
    chooses the step size (the declared default serves the strategies and the run
    config, which always pass it).

    Raises:
        ValueError: unknown ``name`` (the message lists the valid ones), a parameter
            the class does not take (the message lists those it takes), a parameter
            given twice, a missing ``lr``, or a value out of range.
    """
    cls = _lookup(name)
    kwargs: dict[str, Any] = {}
    for key, value in params.items():
        k = key.replace("-", "_")
        if k in kwargs:
            raise ValueError(f"parameter {k!r} given twice (as {key!r})")
        kwargs[k] = value
    if "lr" not in kwargs:
        raise ValueError(f"optimizer {cls.name!r} needs the parameter 'lr'")
    return cls(weights, partition_ids, **kwargs)


def _lookup(name: str) -> type[Any]:
    key = name.strip().lower() if isinstance(name, str) else name
    try:
        return OPTIMIZERS[key]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown optimizer {name!r}; valid names: {', '.join(sorted(OPTIMIZERS))}"
        ) from None
