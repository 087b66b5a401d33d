"""What a resumed run must share with its checkpoint: the settings that change the result.

A checkpoint records the run's *fingerprint*: the resolved run config without the
keys listed in :data:`RESUME_FREE_KEYS` (budgets, paths, timeouts: they change when
or where the run goes on, not the numbers it computes), or, for a strategy started
without a run config, the rule's parameters and the train config. A resume whose
fingerprint differs is refused, naming each key with both values, unless every
differing key is listed in run config ``resume-allow-changes`` (then each change is
logged and the new value applies). The number of partitions the nodes report is
compared too (``num-partitions``: another data split), once the nodes answered.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from logging import WARNING
from typing import Any

from flwr.common.logger import log

__all__ = ["RESUME_FREE_KEYS", "ResumeRefused", "check_resume", "fingerprint", "parse_allowed"]

#: Run config keys that may differ between a checkpoint and its resume.
RESUME_FREE_KEYS: frozenset[str] = frozenset(
    {
        "max-updates",
        "max-seconds",
        "checkpoint-every",
        "resume",
        "resume-allow-changes",
        "run-name",
        "output-dir",
        "data-root",
        "poll-interval",
        "reply-timeout",
        # time-outs and back-off bound of the engine's fault handling
        "startup-timeout",
        "dispatch-timeout",
        "rejoin-timeout",
        "max-node-failures",
        "message-ttl",
        "min-nodes",
        "eval-threads",
    }
)


class ResumeRefused(ValueError):
    """A resume whose settings differ from its checkpoint's (the message names each key)."""


def fingerprint(
    run_config: Mapping[str, Any] | None,
    optimizer_params: Mapping[str, Any],
    train_config: Mapping[str, Any],
) -> dict[str, Any]:
    """The settings of a run that change its result, by the name a user sets them by.

    With a run config: its keys but :data:`RESUME_FREE_KEYS`. Without one (a strategy
    started from Python): ``optimizer.<param>`` and ``train.<key>``.
    """
    if run_config is not None:
        return {k: v for k, v in sorted(run_config.items()) if k not in RESUME_FREE_KEYS}
    out = {f"optimizer.{k}": v for k, v in sorted(optimizer_params.items())}
    out.update({f"train.{k}": v for k, v in sorted(train_config.items())})
    return out


def parse_allowed(value: str | Iterable[str], known: Iterable[str]) -> tuple[str, ...]:
    """The keys of ``resume-allow-changes`` (comma-separated), each a known key.

    Raises
    ------
    ValueError
        Naming a listed key that is neither in ``known`` nor ``num-partitions``.
    """
    keys = [k.strip() for k in value.split(",")] if isinstance(value, str) else list(value)
    keys = [k for k in keys if k]
    allowed = set(known) | {"num-partitions"}
    unknown = [k for k in keys if k not in allowed]
    if unknown:
        raise ValueError(
            f"run config resume-allow-changes={','.join(keys)!r}: {unknown} are not run "
            "config keys (nor num-partitions)"
        )
    return tuple(keys)


def check_resume(
    path: object, saved: Mapping[str, Any], now: Mapping[str, Any], allowed: Iterable[str]
) -> list[str]:
    """Compare a checkpoint's fingerprint ``saved`` with this run's ``now``.

    Returns the keys that differ and are allowed (each logged with both values).

    Raises
    ------
    ResumeRefused
        If a key differs that ``allowed`` does not list; the message names the
        checkpoint, every differing key with both values, and the two ways out.
    """
    allowed = set(allowed)
    missing = object()
    diff = {
        k: (saved.get(k, missing), now.get(k, missing))
        for k in sorted(set(saved) | set(now))
        if saved.get(k, missing) != now.get(k, missing)
    }

    def show(v: Any) -> str:
        return "(unset)" if v is missing else repr(v)

    refused = {k: v for k, v in diff.items() if k not in allowed}
    if refused:
        listed = "; ".join(
            f"{k}: {show(a)} in the checkpoint, {show(b)} now" for k, (a, b) in refused.items()
        )
        raise ResumeRefused(
            f"resume refused: the run differs from checkpoint {path} in what changes its "
            f"result: {listed}. Resume with the checkpoint's values, or allow the change "
            f'with resume-allow-changes="{",".join(refused)}"'
        )
    for k, (a, b) in diff.items():
        log(WARNING, "[async] resume: %s changed from %s to %s (allowed)", k, show(a), show(b))
    return list(diff)
