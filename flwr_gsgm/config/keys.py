"""Run config keys: what one is (:class:`RunConfigKey`), and those of the server rules.

The server optimizer keys are generated from the rules' declarations
(:class:`flwr_gsgm.core.Param` with a ``run_config_key``), in registry order: an
optional number (``None`` = no bound) appears as ``0`` = none, and a per-rule default
(the server learning rate) as ``0`` = the rule's own. :func:`optimizer_params_from`
turns a parsed run config back into a rule's keyword arguments.

The engine's keys are generated likewise from the engine's declarations
(:data:`flwr_gsgm.engine.settings.ENGINE_SETTINGS`: :func:`engine_keys`).
:mod:`flwr_gsgm.config.run_config` holds the other keys and re-exports these names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from flwr_gsgm.core import OPTIMIZERS, Param, declared_params
from flwr_gsgm.engine.settings import ENGINE_SETTINGS

__all__ = [
    "RunConfigKey",
    "SYNC_STRATEGY_KEYS",
    "OPTIMIZER_KEYS",
    "engine_keys",
    "optimizer_keys",
    "optimizer_params_from",
    "strategy_keys",
    "any_value",
    "positive",
    "non_negative",
    "one_of",
]

#: Server optimizer keys that the synchronous strategies read (FedAvgM: server
#: learning rate and momentum; FedNova: server learning rate); they have no rule
#: declaration.
SYNC_STRATEGY_KEYS: dict[str, tuple[str, ...]] = {
    "fedavg": (),
    "fedavgm": ("server-learning-rate", "beta"),
    "time-budget-fedavg": (),
    "fednova": ("server-learning-rate",),
    "fedmedian": (),
    "fedtrimmedavg": (),
}


@dataclass(frozen=True)
class RunConfigKey:
    """One run config key: default, Python type, check and what the check expects."""

    default: Any
    check: Callable[[Any], bool]
    expected: str
    help: str

    @property
    def kind(self) -> type:
        return type(self.default)


def any_value(v: Any) -> bool:
    """A :class:`RunConfigKey` check that accepts every value of the key's type."""
    return True


def positive(v: Any) -> bool:
    """A :class:`RunConfigKey` check: ``v > 0``."""
    return v > 0


def non_negative(v: Any) -> bool:
    """A :class:`RunConfigKey` check: ``v >= 0``."""
    return v >= 0


def one_of(*values: str) -> Callable[[Any], bool]:
    """A :class:`RunConfigKey` check: ``v`` is one of ``values``."""
    return lambda v: v in values


def engine_keys() -> dict[str, RunConfigKey]:
    """The engine's run config keys, generated from its declarations
    (:data:`~flwr_gsgm.engine.settings.ENGINE_SETTINGS`, in :class:`EngineSettings`'
    field order): each :class:`~flwr_gsgm.engine.settings.Setting`'s default, check,
    expected and help, as they are (``0`` = none is the declaration's own value)."""
    return {s.key: RunConfigKey(s.default, s.check, s.expected, s.doc) for s in ENGINE_SETTINGS}


def _means_none(param: Param, value: Any) -> bool:
    """The run config's ``0`` for an optional number stands for ``None``."""
    return (
        param.optional and param.kind in (int, float) and not isinstance(value, bool) and value == 0
    )


def _means_rule_default(param: Param, value: Any) -> bool:
    """The run config's ``0`` for a per-rule default stands for "the rule's own default"."""
    return param.rule_default and not isinstance(value, bool) and value == 0


def _accepts(param: Param, value: Any) -> bool:
    if _means_none(param, value) or _means_rule_default(param, value):
        return True
    try:
        param.check(value)
    except ValueError:
        return False
    return value is not None


def _expected(param: Param) -> str:
    """``param.expected()``, with the ``0 = none`` of an optional number."""
    if param.rule_default:
        return f"0 (the strategy's default) or {param.expected()}"
    if not param.optional:
        return param.expected()
    prefix = "an integer " if param.kind is int else ""
    # 0 right below the core's range (> 0, integers >= 1 or >= 0) reads as one range.
    if param.high is None and (param.low == 0 or (param.kind is int and param.low == 1)):
        return f"{prefix}>= 0 (0 = none)"
    return f"0 (none) or {param.expected()}"


def _same_declaration(a: Param, b: Param) -> bool:
    """Two rules may share a key only if it means the same value, range and default."""
    fields = ("kind", "low", "low_open", "high", "high_open", "choices", "optional", "rule_default")
    if not a.rule_default:  # a per-rule default may differ from rule to rule
        fields += ("default",)
    return all(getattr(a, f) == getattr(b, f) for f in fields)


def _declaring_rules() -> dict[str, tuple[Param, list[str]]]:
    """run config key -> (its declaration, the rules declaring it), in registry order.

    Raises:
        ValueError: two rules declare one key differently, or an optional
            non-number has a key (the run config has no ``None``).
    """
    keys: dict[str, tuple[Param, list[str]]] = {}
    for rule in OPTIMIZERS:
        for param in declared_params(rule):
            key = param.run_config_key
            if key is None:
                continue
            if param.optional and param.kind not in (int, float):
                raise ValueError(
                    f"{rule}.{param.name}: an optional {param.kind.__name__} "
                    f"cannot be a run config key (0 = none is for numbers)"
                )
            if key not in keys:
                keys[key] = (param, [rule])
                continue
            first, rules = keys[key]
            if not _same_declaration(first, param):
                raise ValueError(
                    f"run config key {key!r}: {rule}.{param.name} is declared differently "
                    f"from {rules[0]}.{first.name} ({param!r} vs {first!r}); a shared key "
                    "needs the same default, kind and range"
                )
            rules.append(rule)
    return keys


def optimizer_keys() -> dict[str, RunConfigKey]:
    """The run config keys of the server rules, generated from their declarations."""
    out: dict[str, RunConfigKey] = {}
    every_rule = set(OPTIMIZERS)
    for key, (param, rules) in _declaring_rules().items():
        readers = rules + [s for s, keys in SYNC_STRATEGY_KEYS.items() if key in keys]
        help = param.doc if set(rules) == every_rule else f"{param.doc} ({', '.join(readers)})"
        default = param.kind(0) if param.default is None or param.rule_default else param.default
        out[key] = RunConfigKey(default, lambda v, p=param: _accepts(p, v), _expected(param), help)
    return out


#: Every run config key a server rule declares (``server-learning-rate`` and ``beta`` included).
OPTIMIZER_KEYS: frozenset[str] = frozenset(_declaring_rules())


def strategy_keys(strategy: str) -> frozenset[str]:
    """The keys of :data:`OPTIMIZER_KEYS` that ``strategy`` reads.

    Raises:
        ValueError: ``strategy`` is neither a registered rule nor a synchronous strategy.
    """
    if strategy in SYNC_STRATEGY_KEYS:
        return frozenset(SYNC_STRATEGY_KEYS[strategy])
    return frozenset(p.run_config_key for p in declared_params(strategy) if p.run_config_key)


def optimizer_params_from(cfg: Mapping[str, Any], rule: str) -> dict[str, Any]:
    """The keyword arguments of rule ``rule`` that a parsed run config sets.

    Every declared parameter with a run config key, by parameter name (``lr``
    included); ``0`` of an optional number becomes ``None``; ``0`` of a per-rule
    default (``server-learning-rate``) is left out, so the rule's declared default applies.

    Raises:
        ValueError: unknown ``rule``. KeyError: ``cfg`` was not parsed (a key is missing).
    """
    out: dict[str, Any] = {}
    for param in declared_params(rule):
        if param.run_config_key is not None:
            value = cfg[param.run_config_key]
            if _means_rule_default(param, value):
                continue
            out[param.name] = None if _means_none(param, value) else value
    return out
