"""Run config of the flwr-gsgm Flower App: every key, its default and its check, in one place.

The defaults here are the ones in ``pyproject.toml`` ``[tool.flwr.app.config]`` (a
test keeps the two equal). :func:`parse_run_config` validates a whole run config
before training starts and raises ``ValueError`` naming the key, the value and what
was expected.

The server optimizer keys (``server-learning-rate``, ``beta``, ``fedbuff-k``, ...) are not
written here: they are generated from the rules' declarations
(:class:`flwr_gsgm.core.Param` with a ``run_config_key``), in registry order. An
optional parameter (``None`` = no bound) appears as ``0`` = none.
:func:`optimizer_params_from` turns a parsed run config back into a rule's
keyword arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from flwr_gsgm.core import OPTIMIZERS, Param, declared_params

__all__ = [
    "RunConfigKey",
    "RUN_CONFIG",
    "ASYNC_STRATEGIES",
    "SYNC_STRATEGIES",
    "SYNC_STRATEGY_KEYS",
    "OPTIMIZER_KEYS",
    "optimizer_params_from",
    "parse_run_config",
    "strategy_keys",
]

#: The registered server rules, in registry order (GSGM first).
ASYNC_STRATEGIES = tuple(OPTIMIZERS)
SYNC_STRATEGIES = ("fedavg", "fedavgm")
#: Server optimizer keys that Flower's synchronous strategies read (FedAvgM: server
#: learning rate and momentum); they have no rule declaration.
SYNC_STRATEGY_KEYS: dict[str, tuple[str, ...]] = {
    "fedavg": (),
    "fedavgm": ("server-learning-rate", "beta"),
}
DATASET_CLASSES = {"fashion-mnist": 10, "cifar10": 10, "cifar100": 100}


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


def _positive(v: Any) -> bool:
    return v > 0


def _non_negative(v: Any) -> bool:
    return v >= 0


def _one_of(*values: str) -> Callable[[Any], bool]:
    return lambda v: v in values


def _key(default: Any, check: Callable[[Any], bool], expected: str, help: str) -> RunConfigKey:
    return RunConfigKey(default, check, expected, help)


def _ANY(v: Any) -> bool:
    return True


# ------------------------------------------------- keys generated from the rules
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


def _optimizer_keys() -> dict[str, RunConfigKey]:
    """The run config keys of the server rules, generated from their declarations."""
    out: dict[str, RunConfigKey] = {}
    every_rule = set(OPTIMIZERS)
    for key, (param, rules) in _declaring_rules().items():
        readers = rules + [s for s, keys in SYNC_STRATEGY_KEYS.items() if key in keys]
        help = param.doc if set(rules) == every_rule else f"{param.doc} ({', '.join(readers)})"
        default = param.kind(0) if param.default is None or param.rule_default else param.default
        out[key] = _key(default, lambda v, p=param: _accepts(p, v), _expected(param), help)
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


RUN_CONFIG: dict[str, RunConfigKey] = {
    # what to run
    "strategy": _key(
        "gsgm",
        _one_of(*ASYNC_STRATEGIES, *SYNC_STRATEGIES),
        f"one of {', '.join(ASYNC_STRATEGIES + SYNC_STRATEGIES)}",
        "server strategy",
    ),
    "max-updates": _key(
        4000, _positive, "an integer > 0", "budget: client updates received (client computations)"
    ),
    "max-seconds": _key(
        0.0,
        _non_negative,
        ">= 0 (0 = no limit)",
        "budget: virtual seconds (virtual-clock = true) or wall seconds",
    ),
    "eval-every": _key(
        100, _positive, "an integer > 0", "evaluate every N client updates received"
    ),
    "eval-examples": _key(
        0,
        _non_negative,
        "an integer >= 0 (0 = the whole test set)",
        "server evaluation on a fixed random subset (seed 0) of this many test images",
    ),
    "eval-threads": _key(
        2,
        _positive,
        "an integer > 0",
        "threads of the server evaluation (same accuracy; loss up to float rounding)",
    ),
    "federated-eval-every": _key(
        0,
        _non_negative,
        "an integer >= 0 (0 = none), a multiple of eval-every",
        "federated evaluation (the ClientApp's evaluate) every N client updates received",
    ),
    "fraction-evaluate": _key(
        1.0,
        lambda v: 0 < v <= 1,
        "in (0, 1]",
        "federated evaluation: fraction of the active nodes asked",
    ),
    "seed": _key(
        0, _non_negative, "an integer >= 0", "seed of partitioning, clock and client sampling"
    ),
    # server optimizer: generated from the rules' declarations
    **_optimizer_keys(),
    # client work
    "client-mode": _key(
        "gradient", _one_of("gradient", "delta"), "gradient or delta", "what clients return"
    ),
    "batch-size": _key(32, _positive, "an integer > 0", "mini-batch size"),
    "local-batches": _key(1, _positive, "an integer > 0", "gradient mode: mini-batches averaged"),
    "local-steps": _key(1, _positive, "an integer > 0", "delta/weights mode: local SGD steps"),
    "local-lr": _key(0.05, _positive, "> 0", "client learning rate (delta/weights mode)"),
    "eval-max-examples": _key(
        1000,
        _positive,
        "an integer > 0",
        "ClientApp evaluate handler (federated evaluation): test images per node",
    ),
    "client-threads": _key(1, _positive, "an integer > 0", "torch threads per ClientApp"),
    # data
    "dataset": _key(
        "fashion-mnist",
        _one_of(*DATASET_CLASSES),
        f"one of {', '.join(DATASET_CLASSES)}",
        "data set",
    ),
    "data-root": _key(
        "/usr/share/datasets/fashion-mnist", _ANY, "a folder", "where the data set lies"
    ),
    "partitioner": _key(
        "pathological",
        _one_of("pathological", "dirichlet", "iid"),
        "pathological, dirichlet or iid",
        "non-IID partitioning",
    ),
    "classes-per-node": _key(
        2, _positive, "an integer in [1, number of classes]", "pathological: classes per node"
    ),
    "dirichlet-alpha": _key(0.5, _positive, "> 0", "dirichlet: concentration alpha"),
    # virtual clock
    "virtual-clock": _key(
        True, _ANY, "true or false", "simulation clock (false = real arrival order)"
    ),
    "base-duration": _key(
        1.0, _positive, "> 0 seconds", "virtual seconds per computation, fast node"
    ),
    "slow-fraction": _key(0.25, lambda v: 0 <= v <= 1, "in [0, 1]", "fraction of slow nodes"),
    "slow-factor": _key(4.0, lambda v: v >= 1, ">= 1", "how many times slower a slow node is"),
    "jitter": _key(0.1, lambda v: 0 <= v < 1, "in [0, 1)", "relative jitter of each duration"),
    # engine
    "message-ttl": _key(600.0, _positive, "> 0 seconds", "TTL of every message"),
    "reply-timeout": _key(300.0, _positive, "> 0 seconds", "a node silent this long is lost"),
    "poll-interval": _key(0.01, _non_negative, ">= 0 seconds", "sleep between pulls when idle"),
    "max-consecutive-rejections": _key(
        10,
        _non_negative,
        "an integer >= 0 (0 = never)",
        "a node whose updates are rejected this often in a row is lost",
    ),
    "min-nodes": _key(1, _positive, "an integer > 0", "nodes to wait for before training"),
    "max-in-flight": _key(
        0,
        _non_negative,
        "an integer >= 0 (0 = all nodes)",
        "nodes training at once (FedAvg/FedAvgM: nodes sampled per round)",
    ),
    "prefetch": _key(
        False,
        _ANY,
        "true or false",
        "deployment: a second train message queued per node, waiting when it polls",
    ),
    "dispatch": _key(
        "auto",
        _one_of("auto", "random", "scheduled"),
        "auto, random or scheduled",
        "which idle node gets a freed slot (max-in-flight < nodes); auto = scheduled "
        "for GSGM with scheduling, random for the others",
    ),
    # checkpoints
    "checkpoint-every": _key(
        0,
        _non_negative,
        "an integer >= 0 (0 = never)",
        "save the server state every N client updates (and on SIGTERM)",
    ),
    "resume": _key(False, _ANY, "true or false", "continue from outputs/<run-name>/checkpoint.pt"),
    # outputs
    "run-name": _key("", _ANY, "a folder name", "outputs/<run-name>/ (empty = strategy and time)"),
    "output-dir": _key("outputs", _ANY, "a folder", "where run folders go"),
}


def _coerce(key: str, value: Any, spec: RunConfigKey) -> Any:
    kind = spec.kind
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif isinstance(value, str):
        return value
    raise ValueError(f"run config {key}={value!r}: expected {spec.expected} ({kind.__name__})")


def parse_run_config(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """Validate a run config and fill in defaults.

    Parameters
    ----------
    run_config : Mapping[str, Any]
        ``context.run_config`` (kebab-case keys). Unknown keys are rejected.

    Returns
    -------
    dict[str, Any]
        Every key of :data:`RUN_CONFIG` with a value of the key's type.

    Raises
    ------
    ValueError
        For an unknown key, a value of the wrong type or out of range,
        ``classes-per-node`` above the data set's number of classes, or a
        ``federated-eval-every`` that is not a multiple of ``eval-every``; the
        message names the key, the value and what was expected.
    """
    unknown = sorted(set(run_config) - set(RUN_CONFIG))
    if unknown:
        raise ValueError(f"run config key(s) {unknown} unknown; known keys: {sorted(RUN_CONFIG)}")
    cfg: dict[str, Any] = {}
    for key, spec in RUN_CONFIG.items():
        value = _coerce(key, run_config.get(key, spec.default), spec)
        if not spec.check(value):
            raise ValueError(f"run config {key}={value!r}: expected {spec.expected}")
        cfg[key] = value
    if cfg["federated-eval-every"] % cfg["eval-every"]:
        raise ValueError(
            f"run config federated-eval-every={cfg['federated-eval-every']}: expected a "
            f"multiple of eval-every={cfg['eval-every']} (each point goes into an evaluation row)"
        )
    if cfg["resume"] and not cfg["run-name"]:
        raise ValueError(
            "run config resume=true: expected a run-name naming the run folder to resume"
        )
    num_classes = DATASET_CLASSES[cfg["dataset"]]
    if cfg["partitioner"] == "pathological" and cfg["classes-per-node"] > num_classes:
        raise ValueError(
            f"run config classes-per-node={cfg['classes-per-node']}: expected an integer in "
            f"[1, {num_classes}] ({cfg['dataset']} has {num_classes} classes)"
        )
    return cfg
