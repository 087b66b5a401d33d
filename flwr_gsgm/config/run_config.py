"""Run config keys of the library: every key it reads, its default and its check.

These are the keys of a Flower App that runs a strategy of this library from its run
config (:func:`flwr_gsgm.config.build.build_strategy`): the strategy and its budget,
the server optimizer, the client work it asks for, the virtual clock, the engine,
checkpoints and outputs. An app's own keys (its data set, model, evaluation) are the
app's: :func:`parse_run_config` returns them as given, or, with the app's
declarations (``app_keys``), checks them the same way and refuses a key neither
declares. This project's app declares its keys in ``serverapp/app_config.py``; the
defaults of both are the ones in ``pyproject.toml`` ``[tool.flwr.app.config]`` (a
test keeps them equal). :func:`parse_run_config` validates a whole run config before
training starts and raises ``ValueError`` naming the key, the value and what was
expected.

The server optimizer keys (``server-learning-rate``, ``beta``, ``fedbuff-k``, ...) and
the engine's (``max-updates``, ``message-ttl``, ``max-in-flight``, ...) are not
written here: :mod:`flwr_gsgm.config.keys` generates them from the rules'
declarations (:class:`flwr_gsgm.core.Param` with a ``run_config_key``), in registry
order, and from the engine's (the fields of
:class:`~flwr_gsgm.engine.settings.EngineSettings` declared with a key); this module
places them among its own keys. :func:`optimizer_params_from` (re-exported here)
turns a parsed run config back into a rule's keyword arguments,
:meth:`EngineSettings.from_run_config` into the engine's settings.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from flwr_gsgm.config.keys import (
    OPTIMIZER_KEYS,
    SYNC_STRATEGY_KEYS,
    RunConfigKey,
    any_value,
    engine_keys,
    non_negative,
    one_of,
    optimizer_keys,
    optimizer_params_from,
    positive,
    strategy_keys,
)
from flwr_gsgm.core import OPTIMIZERS
from flwr_gsgm.core.params import DISPLACEMENT_MODES
from flwr_gsgm.engine.settings import check_deadlines
from flwr_gsgm.simulation.availability import ALWAYS, AVAILABILITY_MODELS, FROM_PROFILE
from flwr_gsgm.simulation.power import POWER_MODELS
from flwr_gsgm.simulation.speed_variance import NONE, SPEED_VARIANCE_MODELS
from flwr_gsgm.simulation.virtual_clock import (
    DEVICE_PROFILE_EXPECTED,
    OFFLINE_DETECTION_SECONDS,
    is_device_profile,
)

#: What run config ``availability`` and ``speed-variance`` accept.
AVAILABILITY_CHOICES = (ALWAYS, *AVAILABILITY_MODELS, FROM_PROFILE)
SPEED_VARIANCE_CHOICES = (NONE, *SPEED_VARIANCE_MODELS)
DEVICE_POWER_CHOICES = ("none", *POWER_MODELS)

__all__ = [
    "RunConfigKey",
    "RUN_CONFIG",
    "check_keys",
    "ASYNC_STRATEGIES",
    "SYNC_STRATEGIES",
    "SYNC_STRATEGY_KEYS",
    "OPTIMIZER_KEYS",
    "optimizer_params_from",
    "parse_run_config",
    "refuse_unknown_keys",
    "strategy_keys",
    "unread_settings",
    "check_deadlines",
    "REMOVED_KEYS",
]

#: The registered server rules, in registry order (GSGM first).
ASYNC_STRATEGIES = tuple(OPTIMIZERS)
#: Synchronous strategies, run round by round on the engine's clock, budgets and rows
#: (:func:`flwr_gsgm.config.build.build_synchronous`): Flower's FedAvg and FedAvgM,
#: the time-budget anchors on Flower's FedAvg
#: (flwr_gsgm/strategy/time_budget_fedavg.py, flwr_gsgm/strategy/fednova.py), and
#: Flower's robust FedMedian and FedTrimmedAvg (Yin et al., ICML 2018; the lying-nodes
#: baselines of docs/FAULTS.md).
SYNC_STRATEGIES = (
    "fedavg",
    "fedavgm",
    "time-budget-fedavg",
    "fednova",
    "fedmedian",
    "fedtrimmedavg",
)


def _key(default: Any, check: Callable[[Any], bool], expected: str, help: str) -> RunConfigKey:
    return RunConfigKey(default, check, expected, help)


#: The engine's keys (declared by the engine), placed below among the others.
_ENGINE = engine_keys()
#: The engine's keys shown first (the budgets) and last (checkpoints); the others go in
#: the "engine" block, in the engine's declaration order.
_BUDGETS = ("max-updates", "max-seconds", "eval-every")
_CHECKPOINTS = ("checkpoint-every", "resume")


RUN_CONFIG: dict[str, RunConfigKey] = {
    # what to run
    "strategy": _key(
        "gsgm",
        one_of(*ASYNC_STRATEGIES, *SYNC_STRATEGIES),
        f"one of {', '.join(ASYNC_STRATEGIES + SYNC_STRATEGIES)}",
        "server strategy",
    ),
    **{key: _ENGINE[key] for key in _BUDGETS},
    "federated-eval-every": _key(
        0,
        non_negative,
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
        0, non_negative, "an integer >= 0", "seed of partitioning, clock and client sampling"
    ),
    # server optimizer: generated from the rules' declarations
    **optimizer_keys(),
    # client work
    "client-mode": _key(
        "gradient",
        one_of("gradient", "delta", "weights"),
        "gradient, delta or weights",
        "what clients return (delta: the displacement w_sent - w_local; weights: w_local, "
        "the server forms the displacement)",
    ),
    "batch-size": _key(32, positive, "an integer > 0", "mini-batch size"),
    "local-batches": _key(1, positive, "an integer > 0", "gradient mode: mini-batches averaged"),
    "local-steps": _key(1, positive, "an integer > 0", "delta/weights mode: local SGD steps"),
    "local-epochs": _key(
        0,
        non_negative,
        "an integer >= 0 (0 = local-steps)",
        "delta/weights mode: passes over the node's partition, ceil(N / batch-size) steps each",
    ),
    "local-lr": _key(0.05, positive, "> 0", "client learning rate (delta/weights mode)"),
    "local-momentum": _key(
        0.0,
        lambda v: 0 <= v < 1,
        "in [0, 1)",
        "delta/weights mode: client SGD momentum (0 = plain SGD)",
    ),
    # virtual clock
    "virtual-clock": _key(
        True, any_value, "true or false", "simulation clock (false = real arrival order)"
    ),
    "base-duration": _key(
        1.0, positive, "> 0 seconds", "uniform: virtual seconds per step of local work, fast node"
    ),
    "slow-fraction": _key(0.25, lambda v: 0 <= v <= 1, "in [0, 1]", "fraction of slow nodes"),
    "slow-factor": _key(4.0, lambda v: v >= 1, ">= 1", "how many times slower a slow node is"),
    "jitter": _key(0.1, lambda v: 0 <= v < 1, "in [0, 1)", "relative jitter of each duration"),
    "device-profile": _key(
        "uniform",
        is_device_profile,
        DEVICE_PROFILE_EXPECTED,
        "time model: compute speeds, latency, bandwidth; a file: partition-id, step-seconds, "
        "bandwidth (bytes/s), latency-seconds per node (docs/GSGM.md, Time model)",
    ),
    "availability": _key(
        ALWAYS,
        lambda v: v in AVAILABILITY_CHOICES,
        f"one of {', '.join(AVAILABILITY_CHOICES)}",
        "time model: when each node is online (device-profile: each node's own, from the "
        "profile file; docs/GSGM.md, Time model)",
    ),
    "offline-detection-seconds": _key(
        OFFLINE_DETECTION_SECONDS,
        non_negative,
        ">= 0 seconds",
        "time model: seconds until the server learns a node went offline (Flower's "
        "heartbeat expiry; 0: it says goodbye)",
    ),
    "device-power": _key(
        "none",
        lambda v: v in DEVICE_POWER_CHOICES,
        f"one of {', '.join(DEVICE_POWER_CHOICES)}",
        "time model: what each device draws computing, communicating and idle (a joules "
        "column in metrics.csv; docs/GSGM.md, Time model)",
    ),
    "speed-variance": _key(
        NONE,
        lambda v: v in SPEED_VARIANCE_CHOICES,
        f"one of {', '.join(SPEED_VARIANCE_CHOICES)}",
        "time model: per-message slowdowns of a node (docs/GSGM.md, Time model)",
    ),
    "step-seconds": _key(
        0.0,
        non_negative,
        ">= 0 seconds",
        "virtual seconds per step of local work (0: the profile's)",
    ),
    "latency-seconds": _key(
        0.0, non_negative, ">= 0 seconds", "virtual latency per message (0: the profile's)"
    ),
    "server-seconds": _key(
        0.0,
        non_negative,
        ">= 0 seconds",
        "virtual seconds the server spends on each reply, one at a time (0: the profile's)",
    ),
    # engine
    **{k: spec for k, spec in _ENGINE.items() if k not in _BUDGETS + _CHECKPOINTS},
    # checkpoints
    **{key: _ENGINE[key] for key in _CHECKPOINTS},
    "resume-allow-changes": _key(
        "",
        any_value,
        "comma-separated run config keys",
        "keys that may differ from the checkpoint's on resume (each change logged)",
    ),
    # outputs
    "run-name": _key(
        "", any_value, "a folder name", "outputs/<run-name>/ (empty = strategy and time)"
    ),
    "output-dir": _key("outputs", any_value, "a folder", "where run folders go"),
}


#: Keys a run config may no longer use, and what replaced each.
REMOVED_KEYS = {
    "reply-timeout": "startup-timeout (the start-up deadline) and dispatch-timeout (the "
    "per-dispatch deadline, below message-ttl)",
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
            if not math.isfinite(value):  # inf passes "> 0" checks: refuse it by name
                raise ValueError(
                    f"run config {key}={value!r}: expected {spec.expected}, a finite number"
                )
            return float(value)
    elif isinstance(value, str):
        return value
    raise ValueError(f"run config {key}={value!r}: expected {spec.expected} ({kind.__name__})")


def check_keys(run_config: Mapping[str, Any], keys: Mapping[str, RunConfigKey]) -> dict[str, Any]:
    """Each key of ``keys``: its value in ``run_config`` (or its default), coerced to the
    key's type and checked; in the order of ``keys``. Other keys of ``run_config`` are
    not looked at.

    Raises
    ------
    ValueError
        ``run config <key>=<value>: expected <what>`` for a value of the wrong type or
        out of range (a non-finite number for a float key).
    """
    cfg: dict[str, Any] = {}
    for key, spec in keys.items():
        value = _coerce(key, run_config.get(key, spec.default), spec)
        if not spec.check(value):
            raise ValueError(f"run config {key}={value!r}: expected {spec.expected}")
        cfg[key] = value
    return cfg


def refuse_unknown_keys(run_config: Mapping[str, Any], known: Iterable[str]) -> None:
    """Refuse the keys of ``run_config`` not in ``known``, naming the closest known key
    of each (:func:`difflib.get_close_matches`), then every known key.

    Raises
    ------
    ValueError
        ``run config key(s) ['max-update'] unknown; did you mean max-updates? known
        keys: [...]`` (several: ``did you mean max-updates for max-update, eval-every
        for eval-evry?``; a key with no close match is not in that clause, which is
        left out if none has one).
    """
    known = sorted(known)
    unknown = sorted(set(run_config) - set(known))
    if not unknown:
        return
    close = {k: difflib.get_close_matches(k, known, n=1) for k in unknown}
    matches = {k: m[0] for k, m in close.items() if m}
    if len(unknown) == 1 and matches:
        hint = f"did you mean {matches[unknown[0]]}? "
    elif matches:
        hint = "did you mean " + ", ".join(f"{m} for {k}" for k, m in matches.items()) + "? "
    else:
        hint = ""
    raise ValueError(f"run config key(s) {unknown} unknown; {hint}known keys: {known}")


def parse_run_config(
    run_config: Mapping[str, Any], app_keys: Mapping[str, RunConfigKey] | None = None
) -> dict[str, Any]:
    """Validate a run config and fill in defaults: the library's keys, and the app's.

    Parameters
    ----------
    run_config : Mapping[str, Any]
        ``context.run_config`` (kebab-case keys).
    app_keys : Mapping[str, RunConfigKey], optional
        The app's own keys (:class:`RunConfigKey`: default, check, what it expects).
        Given, they are checked and defaulted as the library's are, and a key that
        neither declares is refused (a typo fails before training). Absent (None),
        every key the library does not know is left to the app: returned as given,
        unchecked.

    Returns
    -------
    dict[str, Any]
        Every key of :data:`RUN_CONFIG` with a value of the key's type, then every key
        of ``app_keys`` likewise, or (without ``app_keys``) the run config's other keys
        as given.

    Raises
    ------
    ValueError
        For a removed key (``reply-timeout``), a key unknown to both (with
        ``app_keys``; the closest known key named, :func:`refuse_unknown_keys`), an
        app key that redeclares a library key, a value of the wrong type or out of
        range, a ``federated-eval-every`` that is not a multiple of ``eval-every``, a
        ``resume-allow-changes`` naming a key the run config does not have, or
        ``message-ttl`` not above ``dispatch-timeout`` (:func:`check_deadlines`); the
        message names the key, the value and what was expected.
    """
    removed = sorted(set(run_config) & set(REMOVED_KEYS))
    if removed:
        raise ValueError(
            "; ".join(f"run config key {k!r} was removed: use {REMOVED_KEYS[k]}" for k in removed)
        )
    if app_keys is None:
        cfg = check_keys(run_config, RUN_CONFIG)
        cfg.update((k, v) for k, v in run_config.items() if k not in RUN_CONFIG)
    else:
        clash = sorted(set(app_keys) & set(RUN_CONFIG))
        if clash:
            raise ValueError(f"app run config key(s) {clash} are the library's keys already")
        known = {**RUN_CONFIG, **app_keys}
        refuse_unknown_keys(run_config, known)
        cfg = check_keys(run_config, known)
    if cfg["federated-eval-every"] % cfg["eval-every"]:
        raise ValueError(
            f"run config federated-eval-every={cfg['federated-eval-every']}: expected a "
            f"multiple of eval-every={cfg['eval-every']} (each point goes into an evaluation row)"
        )
    from flwr_gsgm.checkpoint.resume import parse_allowed  # imports flwr: only when parsing

    parse_allowed(cfg["resume-allow-changes"], cfg)
    if cfg["resume"] and not cfg["run-name"]:
        raise ValueError(
            "run config resume=true: expected a run-name naming the run folder to resume"
        )
    check_deadlines(cfg["message-ttl"], cfg["dispatch-timeout"])
    if not cfg["virtual-clock"]:
        # Availability and slowdowns are the time model's: real devices bring their own.
        for key, off in (
            ("availability", ALWAYS),
            ("speed-variance", NONE),
            ("device-power", "none"),
        ):
            if cfg[key] != off:
                raise ValueError(
                    f"run config {key}={cfg[key]!r} needs virtual-clock=true (it is part of "
                    f"the time model); expected {off!r} with virtual-clock=false"
                )
    return cfg


def unread_settings(cfg: Mapping[str, Any]) -> list[str]:
    """Warnings for server optimizer keys set to a non-default value that the strategy ignores.

    Which keys ``cfg["strategy"]`` reads is :func:`strategy_keys` (the rules' declarations;
    Flower's FedAvg and FedAvgM from :data:`SYNC_STRATEGY_KEYS`), the same knowledge the
    presets use to refuse such keys. A key at its default gives nothing: the default is
    what every run config holds after :func:`parse_run_config`.

    Parameters
    ----------
    cfg : Mapping[str, Any]
        A run config parsed by :func:`parse_run_config`.

    Returns
    -------
    list[str]
        One sentence per ignored key, in key order, naming the key, its value and the strategy.
    """
    strategy = cfg["strategy"]
    takes = strategy_keys(strategy)
    found = []
    for key in sorted(OPTIMIZER_KEYS - takes):
        value = cfg[key]
        if value != RUN_CONFIG[key].default:
            found.append(
                f"run config {key}={value!r} does nothing: strategy {strategy!r} does not read "
                f"{key!r} (it reads {', '.join(sorted(takes)) or 'none of the optimizer keys'})"
            )
    if strategy == "gsgm" and _gsgm_steps_at_close(cfg):
        for key in _GSGM_ARRIVAL_KEYS:
            value = cfg[key]
            if value != RUN_CONFIG[key].default:
                found.append(
                    f"run config {key}={value!r} does nothing: GSGM steps at each cycle's close "
                    f"(apply-at={cfg['apply-at']!r}, client-mode={cfg['client-mode']!r}), "
                    f'where {key!r} does not enter; set apply-at = "arrival" to use it'
                )
    return found


#: GSGM's keys that only its step on every arrival reads (apply-at = "arrival").
_GSGM_ARRIVAL_KEYS = ("beta", "lr-scaling", "momentum-form")


def _gsgm_steps_at_close(cfg: Mapping[str, Any]) -> bool:
    """GSGM's ``apply-at`` resolved: "close", or "auto" in a displacement client mode."""
    apply_at = cfg["apply-at"]
    return apply_at == "close" or (apply_at == "auto" and cfg["client-mode"] in DISPLACEMENT_MODES)
