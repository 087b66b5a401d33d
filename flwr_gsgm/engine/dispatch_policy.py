"""Dispatch policies: which idle node the engine sends work to when a slot frees.

With a concurrency limit (``max-in-flight`` below the number of nodes, as in
production asynchronous FL: FedBuff, Papaya) fewer nodes train at once than there
are nodes, so whenever a node replies (or errors, or is lost) the engine must choose
the next idle active node. A :class:`DispatchPolicy` makes that choice:

- ``random`` (:class:`RandomDispatch`): uniform among the idle nodes, from a numpy
  ``Generator`` seeded from the run seed, so a run is reproducible (the setup of
  FedBuff and CA2FL);
- ``scheduled`` (:class:`ScheduledDispatch`): GSGM's white list applied at dispatch
  time: the idle node that has contributed least goes first (fewest updates received
  from it; ties: the one whose last reply came earliest; then the lowest
  partition-id), so per-node update counts stay even while no node's work is wasted.

A policy's state (the generator's state, the counts) is part of the engine's
checkpoint (:meth:`DispatchPolicy.state_dict`), so a resumed run picks the same
nodes as an uninterrupted one.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from flwr_gsgm.simulation.virtual_clock import derive_seed

__all__ = [
    "DispatchPolicy",
    "RandomDispatch",
    "ScheduledDispatch",
    "DISPATCH_POLICIES",
    "make_dispatch_policy",
]

# Mixed into the run seed so the dispatch stream is independent of the clock's draws.
_DISPATCH_STREAM = 0xD15A7C4


class DispatchPolicy(ABC):
    """Chooses the next node to dispatch to among the idle active ones."""

    name: str = ""

    @abstractmethod
    def pick(self, idle: list[int]) -> int:
        """Return one partition-id of ``idle`` (non-empty; its order does not matter).

        Raises
        ------
        ValueError
            If ``idle`` is empty.
        """

    def on_reply(self, partition_id: int, now: float, counted: bool) -> None:
        """Record a reply of ``partition_id`` at engine time ``now`` (seconds).

        ``counted`` is True for an update received (applied, deferred, dropped or
        rejected: it counts against ``max-updates``) and False for an error reply.
        """

    def state_dict(self) -> dict[str, Any]:
        """The policy's state (python values only), for checkpoints."""
        return {"name": self.name}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output.

        Raises
        ------
        ValueError
            If the state belongs to another policy.
        """
        if state.get("name") != self.name:
            raise ValueError(
                f"checkpoint was written with dispatch={state.get('name')!r}, this run has "
                f"dispatch={self.name!r}; resume with the same dispatch policy"
            )


def _check_idle(idle: list[int]) -> None:
    if not idle:
        raise ValueError("no idle node to pick from")


class RandomDispatch(DispatchPolicy):
    """Uniform choice among the idle nodes, seeded from the run seed.

    Parameters
    ----------
    seed : int
        Run seed; the generator is seeded with ``derive_seed(seed, 0xD15A7C4)``.
        One draw is made per :meth:`pick` (even with one idle node), so the stream
        depends only on the sequence of picks.
    """

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(derive_seed(int(seed), _DISPATCH_STREAM))

    def pick(self, idle: list[int]) -> int:
        _check_idle(idle)
        ordered = sorted(idle)
        return ordered[int(self.rng.integers(len(ordered)))]

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "bit_generator": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.rng.bit_generator.state = state["bit_generator"]


class ScheduledDispatch(DispatchPolicy):
    """Least-contributed idle node first (GSGM's white list at dispatch time).

    Order: fewest updates received from the node (error replies do not count), then
    the earliest last reply (engine time in seconds; a node that never replied comes
    first), then the lowest partition-id. A node that joins later starts at 0
    updates, so it is preferred until it has caught up.
    """

    name = "scheduled"

    def __init__(self, seed: int = 0) -> None:
        del seed  # deterministic: no randomness
        self.updates: dict[int, int] = {}
        self.last_reply: dict[int, float] = {}

    def pick(self, idle: list[int]) -> int:
        _check_idle(idle)
        return min(
            idle, key=lambda p: (self.updates.get(p, 0), self.last_reply.get(p, -math.inf), p)
        )

    def on_reply(self, partition_id: int, now: float, counted: bool) -> None:
        if counted:
            self.updates[partition_id] = self.updates.get(partition_id, 0) + 1
        self.last_reply[partition_id] = float(now)

    def state_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "updates": dict(self.updates),
            "last_reply": dict(self.last_reply),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.updates = {int(p): int(n) for p, n in state["updates"].items()}
        self.last_reply = {int(p): float(t) for p, t in state["last_reply"].items()}


DISPATCH_POLICIES: dict[str, type[DispatchPolicy]] = {
    "random": RandomDispatch,
    "scheduled": ScheduledDispatch,
}


def make_dispatch_policy(name: str, seed: int = 0) -> DispatchPolicy:
    """Build the policy called ``name`` ("random" or "scheduled") for run seed ``seed``.

    Raises
    ------
    ValueError
        If ``name`` is not a known policy; the message names the ``dispatch`` key.
    """
    if name not in DISPATCH_POLICIES:
        raise ValueError(f"dispatch must be one of {', '.join(DISPATCH_POLICIES)}, got {name!r}")
    return DISPATCH_POLICIES[name](seed)
