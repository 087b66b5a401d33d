"""Declared parameters of the server rules: one :class:`Param` per hyperparameter.

A rule class lists its own parameters in ``PARAMS`` (the common ones, ``lr``,
``max_staleness`` and ``max_norm``, are declared once on
:class:`~flwr_gsgm.core.base.ServerOptimizer`). Everything else is derived from
these declarations: the constructor's defaults and checks, the registry's list of
accepted names, the strategies' keyword arguments, the run config keys and their
checks, the sweep presets' validation and the generated reference of the run config
(docs/REFERENCE.md). A default written anywhere else is a bug.

This module imports numpy only (never flwr, never torch).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "BETA",
    "TRIM_FRACTION",
    "DISPLACEMENT_MODES",
    "Param",
    "resolve",
    "describe",
    "server_learning_rate",
]

#: Client modes whose update is a displacement ``w_sent - w_local`` (not a gradient):
#: there a rule's learning rate is a dimensionless fraction of that displacement,
#: with its own declared default (:attr:`Param.displacement_default`).
DISPLACEMENT_MODES = ("delta", "weights")

_KINDS = (float, int, bool, str)


@dataclass(frozen=True)
class Param:
    """One hyperparameter of a server rule.

    Attributes:
        name: keyword of the constructor (snake_case); stored as ``self._<name>``.
        default: the value used when the caller does not give one (``None`` only
            with ``optional``). The ONLY place the default is written.
        doc: one line for the run config table and the strategies' docstrings.
        kind: ``float``, ``int``, ``bool`` or ``str``.
        low, high: optional bounds of a number; ``low_open`` / ``high_open`` exclude
            the bound itself.
        choices: the allowed values of a ``str`` parameter.
        optional: ``None`` is allowed (no bound, no budget). In the run config,
            ``0`` stands for ``None``.
        run_config_key: the kebab-case run config key, or ``None`` if the run
            config does not expose the parameter. Several rules may share a key
            (``beta``) only with identical declarations apart from ``doc``.
        normalize: optional ``str -> str`` applied to a ``str`` value before the
            check (e.g. accept ``heavy_ball`` for ``heavy-ball``).
        rule_default: each rule may redeclare the parameter with its own default
            (the server learning rate: a step per arrival, per buffer or per cycle
            means different scales); its shared run config key then defaults to
            ``0``, "the strategy's own default".
        displacement_default: with ``rule_default``, the default in the
            displacement client modes (:data:`DISPLACEMENT_MODES`, whose update is
            ``w_sent - w_local``): ``default`` is then the gradient mode's. Checked
            like ``default``; ``None`` for every other parameter.

    Raises:
        ValueError: an inconsistent declaration (unknown kind, choices on a
            number, a default that fails its own check).
    """

    name: str
    default: Any
    doc: str
    kind: type = float
    low: float | None = None
    low_open: bool = False
    high: float | None = None
    high_open: bool = False
    choices: tuple[str, ...] | None = None
    optional: bool = False
    run_config_key: str | None = None
    normalize: Callable[[str], str] | None = None
    rule_default: bool = False
    displacement_default: Any = None

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"Param {self.name}: kind must be one of {_KINDS}, got {self.kind!r}")
        if self.choices is not None and self.kind is not str:
            raise ValueError(f"Param {self.name}: choices need kind=str")
        self.check(self.default)  # a declaration whose default fails is a bug
        if self.displacement_default is not None:
            if not self.rule_default:
                raise ValueError(f"Param {self.name}: displacement_default needs rule_default")
            self.check(self.displacement_default)

    def default_for(self, client_mode: str) -> Any:
        """The default in ``client_mode``: :attr:`displacement_default` in a
        displacement mode (:data:`DISPLACEMENT_MODES`) when declared, else :attr:`default`."""
        if client_mode in DISPLACEMENT_MODES and self.displacement_default is not None:
            return self.displacement_default
        return self.default

    # ------------------------------------------------------------------ checking
    def check(self, value: Any) -> Any:
        """Return ``value`` converted to the declared kind, else raise ValueError.

        The message names the parameter, the value and what was expected, e.g.
        ``beta must be < 1.0, got 1.0``.
        """
        if value is None and self.optional:
            return None
        if self.kind is float:
            return self._check_float(value)
        if self.kind is int:
            return self._check_int(value)
        if self.kind is bool:
            if isinstance(value, (bool, np.bool_)):  # numpy.bool_ is no bool subclass
                return bool(value)
            raise ValueError(f"{self.name} must be a bool, got {value!r}")
        return self._check_str(value)

    def _check_float(self, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"{self.name} must be a real number, got {value!r}")
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"{self.name} must be finite, got {value!r}")
        self._check_bounds(value)
        return value

    def _check_int(self, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{self.name} must be an integer, got {value!r}")
        value = int(value)
        self._check_bounds(value)
        return value

    def _check_bounds(self, value: float) -> None:
        low, high = self.low, self.high
        if low is not None and (value < low or (self.low_open and value == low)):
            raise ValueError(
                f"{self.name} must be {'>' if self.low_open else '>='} {low}, got {value!r}"
            )
        if high is not None and (value > high or (self.high_open and value == high)):
            raise ValueError(
                f"{self.name} must be {'<' if self.high_open else '<='} {high}, got {value!r}"
            )

    def _check_str(self, value: Any) -> str:
        text = self.normalize(str(value)) if self.normalize is not None else value
        if not isinstance(text, str) or (self.choices is not None and text not in self.choices):
            expected = list(self.choices) if self.choices is not None else "a string"
            raise ValueError(f"{self.name} must be one of {expected}, got {value!r}")
        return text

    # --------------------------------------------------------------- description
    def expected(self) -> str:
        """What the check accepts, in words: ``in [0, 1)``, ``an integer >= 1``, ...

        Used by the run config's error messages and the generated run config
        reference (docs/REFERENCE.md).
        """
        if self.kind is bool:
            return "true or false"
        if self.kind is str:
            names = list(self.choices or ())
            return " or ".join([", ".join(names[:-1]), names[-1]]) if len(names) > 1 else "a string"
        prefix = "an integer " if self.kind is int else ""
        low, high = _fmt(self.low), _fmt(self.high)
        if self.low is not None and self.high is not None:
            return (
                f"{prefix}in {'(' if self.low_open else '['}{low}, {high}"
                f"{')' if self.high_open else ']'}"
            )
        if self.low is not None:
            return f"{prefix}{'>' if self.low_open else '>='} {low}"
        if self.high is not None:
            return f"{prefix}{'<' if self.high_open else '<='} {high}"
        return "an integer" if self.kind is int else "a real number"


def _fmt(x: float | None) -> str:
    return "" if x is None else f"{x:g}"


def describe(params: Iterable[Param], rename: Mapping[str, str] | None = None) -> str:
    """A numpy-style docstring section listing ``params`` with their declared defaults.

    Appended to the docstrings of the rule classes and of the strategies, so that
    the documented defaults are the declared ones. ``rename`` maps a parameter name
    to the name the caller takes (the strategies' ``server_learning_rate`` for ``lr``).
    """
    rename = rename or {}
    lines = ["", "    Declared parameters (defaults)", "    ------------------------------"]
    for p in params:
        kind = p.kind.__name__ + (" | None" if p.optional else "")
        default = f"{p.default!r}"
        if p.displacement_default is not None:
            default += f" (gradient mode); {p.displacement_default!r} (delta and weights modes)"
        lines.append(f"    {rename.get(p.name, p.name)} : {kind} = {default}")
        lines.append(
            f"        {p.doc[:1].upper()}{p.doc[1:]}; {p.expected()}"
            f"{' or None' if p.optional else ''}."
        )
    return "\n".join(lines) + "\n"


def resolve(owner: str, declared: Iterable[Param], given: Mapping[str, Any]) -> dict[str, Any]:
    """Every declared parameter's checked value: ``given`` ones, declared defaults else.

    Args:
        owner: the rule's name, for the error messages.
        declared: the rule's parameters (base ones included).
        given: keyword arguments of the caller (snake_case names).

    Returns:
        ``{name: value}`` in declaration order.

    Raises:
        ValueError: a name that is not declared (the message lists the declared
            ones), or a value that fails its parameter's check.
    """
    params = {p.name: p for p in declared}
    unknown = sorted(set(given) - set(params))
    if unknown:
        raise ValueError(
            f"optimizer {owner!r} does not take parameter(s) "
            f"{', '.join(repr(k) for k in unknown)}; it takes: {', '.join(params)}"
        )
    return {name: p.check(given.get(name, p.default)) for name, p in params.items()}


#: The momentum coefficient, one declaration for every rule with a server momentum
#: (GSGM's global momentum, momentum ASGD): they share the run config key ``beta``.
BETA = Param(
    "beta", 0.5, "momentum coefficient", low=0.0, high=1.0, high_open=True, run_config_key="beta"
)


#: The coordinate-wise trimmed mean of the updates a rule keeps (FedBuff's buffer, GSGM's
#: cycle): the fraction cut at each end, per coordinate, before their mean, as Flower's
#: FedTrimmedAvg's ``beta`` (Yin et al., ICML 2018; :mod:`flwr_gsgm.core.robust`).
#: 0, the default: the plain mean, bit for bit the rule without it.
TRIM_FRACTION = Param(
    "trim_fraction",
    0.0,
    "fraction of the kept updates cut at each end, per coordinate, before their mean "
    "(0 = the plain mean; Flower's FedTrimmedAvg beta)",
    low=0.0,
    high=0.5,
    high_open=True,
    run_config_key="trim-fraction",
)


def server_learning_rate(default: float, displacement: float) -> Param:
    """The server learning rate ``lr`` with a rule's own defaults, one per kind of update.

    Strategies take it as ``server_learning_rate`` (as Flower's FedAvgM), the run
    config as ``server-learning-rate``; inside the core it is ``lr`` (as torch.optim).

    ``default`` is the gradient mode's (the update is a gradient: ``lr`` is a step
    size in weight units per gradient unit); ``displacement`` the delta and weights
    modes' (the update is the node's displacement ``w_sent - w_local``: ``lr`` is a
    dimensionless fraction of it, 1.0 applies it whole, whatever the client's own
    learning rate). Each rule declares both in its own file, next to its other
    parameters (a step per arrival, per buffer or per cycle means different
    scales); the shared run config key defaults to 0, "the strategy's default".
    """
    return Param(
        "lr",
        default,
        "server learning rate eta",
        low=0.0,
        low_open=True,
        run_config_key="server-learning-rate",
        rule_default=True,
        displacement_default=displacement,
    )
