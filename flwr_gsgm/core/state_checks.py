"""Checks of a checkpoint state before a server optimizer loads it.

``ServerOptimizer.load_state_dict`` runs them before anything changes, so that a
corrupted or foreign state is refused with a message naming the field and the
optimizer is left as it was. The rules use :func:`state_int` and
:func:`state_nodes` in their ``_check_state_extra`` hooks.

This module imports numpy only.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .range_guard import STATE_LIMIT, first_out_of_range, max_abs

__all__ = [
    "check_header",
    "check_params",
    "check_layout",
    "check_common",
    "check_state_values",
    "flat_array",
    "state_int",
    "state_nodes",
]

_F32 = np.dtype(np.float32)


def state_int(value: Any, *path: str | int, low: int = 0, high: int | None = None) -> int:
    """A state field (``state[path[0]][path[1]]...``) that must be an integer in
    ``[low, high]``; returns it as an int, else raises ValueError naming it."""
    where = "state" + "".join(f"[{p!r}]" for p in path)
    span = f">= {low}" if high is None else f"in [{low}, {high}]"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{where} is {value!r}, expected an integer {span}")
    if int(value) < low or (high is not None and int(value) > high):
        raise ValueError(f"{where} is {value!r}, expected an integer {span}")
    return int(value)


def state_nodes(value: Any, what: str, within: set[int] | None = None) -> set[int]:
    """A state list of partition-ids: integers, no repeats, members of ``within`` if
    given; returns them as a set, else raises ValueError naming ``state[what]``."""
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"state[{what!r}] is {value!r}, expected a list of partition-ids")
    partition_ids = []
    for n in value:
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, numbers.Integral):
            raise ValueError(f"state[{what!r}] holds {n!r}, expected integer partition-ids")
        if within is not None and int(n) not in within:
            raise ValueError(
                f"state[{what!r}] holds node {int(n)}, which is not active "
                f"(state['active_nodes'] is {sorted(within)[:20]})"
            )
        partition_ids.append(int(n))
    if len(set(partition_ids)) != len(partition_ids):
        raise ValueError(f"state[{what!r}] lists a node twice: {partition_ids[:20]}")
    return set(partition_ids)


def check_state_values(state: Mapping[str, Any]) -> None:
    """Raise ValueError naming the field if a float array of ``state`` (or of a list
    in it) holds a value that is not finite or beyond :data:`STATE_LIMIT`."""
    for key, value in state.items():
        items = value if isinstance(value, list) else [value]
        for i, arr in enumerate(items):
            if not isinstance(arr, np.ndarray) or arr.dtype.kind != "f":
                continue
            flat = arr.reshape(-1)
            if max_abs(flat) <= STATE_LIMIT:
                continue
            j = first_out_of_range(flat)
            where = f"state[{key!r}]" + (f"[{i}]" if isinstance(value, list) else "")
            raise ValueError(
                f"{where} holds {flat[j].item()!r} at flat index {j}: not finite or beyond the "
                "state range +-2**100 (float32's largest value less a margin of 2**28 for sums)"
            )


def check_header(
    state: Any, fmt: int, name: str, shapes: Sequence[tuple[int, ...]]
) -> dict[str, Any]:
    """``state`` is a dict of layout ``fmt`` written by the optimizer ``name`` for
    ``shapes``; else ValueError. Returns it."""
    if not isinstance(state, dict):
        raise ValueError(f"state must be a dict, got {type(state).__name__}")
    if state.get("format") != fmt:
        raise ValueError(f"state format {state.get('format')!r} is not supported (expected {fmt})")
    if state.get("name") != name:
        raise ValueError(f"state of optimizer {state.get('name')!r} cannot be loaded into {name!r}")
    got = tuple(tuple(int(d) for d in s) for s in state.get("shapes", ()))
    if got != tuple(shapes):
        raise ValueError(
            f"state shapes {list(got)} differ from the optimizer's {[list(s) for s in shapes]}"
        )
    return state


def check_params(state: Mapping[str, Any], name: str, declared: Sequence[str]) -> None:
    """``state["params"]`` names exactly the parameters the optimizer ``name``
    declares; else ValueError naming those it does not declare and those it lacks
    (a state of another version of the rule: none is upgraded)."""
    params = state.get("params")
    if not isinstance(params, dict):
        raise ValueError(f"state['params'] is {params!r}, expected a dict of parameters")
    unknown = sorted(str(k) for k in set(params) - set(declared))
    missing = [k for k in declared if k not in params]
    if unknown or missing:
        differs = [f"parameters {name!r} does not declare: {', '.join(unknown)}"] * bool(unknown)
        differs += [f"no value of {', '.join(missing)}"] * bool(missing)
        raise ValueError(
            f"state of a {name!r} optimizer with {'; '.join(differs)} cannot be loaded: "
            "it was written by another version of the rule, and only states of its "
            'current parameters load (docs/ARCHITECTURE.md, "A rule\'s state")'
        )


def check_layout(
    state: Mapping[str, Any], name: str, layout: Sequence[str], mine: Mapping[str, Any]
) -> None:
    """Raise ValueError naming each parameter of ``layout`` whose value in
    ``state["params"]`` differs from the optimizer's (``mine``)."""
    params = state.get("params")
    if not isinstance(params, dict):
        raise ValueError(f"state['params'] is {params!r}, expected a dict of parameters")
    diff = [k for k in layout if params.get(k) != mine[k]]
    if diff:
        named = ", ".join(f"{k}={params.get(k)!r} (the optimizer's: {mine[k]!r})" for k in diff)
        raise ValueError(
            f"state of a {name!r} optimizer with {named} cannot be loaded: "
            f"the state's buffers belong to that mode; build the optimizer with the "
            f"state's {', '.join(diff)}"
        )


def check_common(state: Mapping[str, Any]) -> tuple[int, set[int]]:
    """The fields every optimizer's state has: ``version`` and every counter an
    integer >= 0, ``active_nodes`` integers without repeats. Returns
    ``(version, active nodes)``; raises ValueError naming the field."""
    version = state_int(state.get("version"), "version")
    for key, value in dict(state.get("counters", {})).items():
        state_int(value, "counters", key)
    active = state_nodes(state.get("active_nodes"), "active_nodes")
    return version, active


def flat_array(value: Any, size: int, what: str) -> np.ndarray:
    """A copy of ``value``, which must be a float32 array of shape ``(size,)``
    (``state[what]``); else ValueError."""
    arr = np.asarray(value)
    if arr.dtype != _F32 or arr.shape != (size,):
        raise ValueError(
            f"state[{what!r}] must be a float32 array of shape ({size},), "
            f"got {arr.dtype} {arr.shape}"
        )
    return arr.copy()
