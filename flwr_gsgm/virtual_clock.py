"""Seeded virtual clock: reproducible compute times for asynchronous simulation.

In a simulation every node runs on the same machine, so real arrival order depends
on the machine's load. The engine instead draws each dispatch's *virtual* duration
when it sends the message, from the node's seeded speed factor and a seeded jitter,
and applies replies in order of virtual finish time
(``docs/ARCHITECTURE.md``, "Making asynchronous simulation reproducible").

Every draw depends only on ``(seed, partition_id, dispatch_index)``, never on the
order in which draws are made, so two runs with the same seed see the same
durations whatever happens in between.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["VirtualClock", "derive_seed"]


def derive_seed(*parts: int, bits: int = 32) -> int:
    """Derive a seed from integers (run seed, partition-id, counter, ...).

    The project's one seed derivation (the engine, the dispatch policies and the
    ClientApp use it). Uses ``numpy.random.SeedSequence``, so different tuples give
    statistically independent streams; negative parts are taken modulo ``2**63``.

    Parameters
    ----------
    *parts : int
        The integers to mix.
    bits : int
        32: an ``int`` in ``[0, 2**32)`` (one 32-bit word of the sequence);
        63: an ``int`` in ``[0, 2**63)`` (one 64-bit word, shifted right by one),
        what ``torch.manual_seed`` and ``numpy`` accept alike.

    Raises
    ------
    ValueError
        If ``bits`` is neither 32 nor 63.
    """
    entropy = [int(p) % 2**63 for p in parts]
    if bits == 32:
        return int(np.random.SeedSequence(entropy).generate_state(1)[0])
    if bits == 63:
        return int(np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint64)[0] >> 1)
    raise ValueError(f"bits must be 32 or 63, got {bits!r}")


@dataclass(frozen=True)
class VirtualClock:
    """Per-node speed factors and per-dispatch virtual durations.

    Parameters
    ----------
    seed : int
        Run seed; every draw is a function of it.
    base_duration : float
        Virtual seconds one client computation takes on a node of speed factor 1.
    slow_fraction : float
        Fraction in [0, 1] of the nodes that are slow. Which partitions are slow is
        a seeded choice of ``round(slow_fraction * num_nodes)`` partitions.
    slow_factor : float
        How many times longer a slow node takes (>= 1).
    jitter : float
        Relative jitter in [0, 1): each duration is multiplied by a factor drawn
        uniformly from ``[1 - jitter, 1 + jitter]``.

    Raises
    ------
    ValueError
        If a parameter is outside its range; the message names it.
    """

    seed: int = 0
    base_duration: float = 1.0
    slow_fraction: float = 0.25
    slow_factor: float = 4.0
    jitter: float = 0.1

    def __post_init__(self) -> None:
        if not self.base_duration > 0:
            raise ValueError(f"base-duration must be > 0 seconds, got {self.base_duration!r}")
        if not 0.0 <= self.slow_fraction <= 1.0:
            raise ValueError(f"slow-fraction must be in [0, 1], got {self.slow_fraction!r}")
        if not self.slow_factor >= 1.0:
            raise ValueError(f"slow-factor must be >= 1, got {self.slow_factor!r}")
        if not 0.0 <= self.jitter < 1.0:
            raise ValueError(f"jitter must be in [0, 1), got {self.jitter!r}")

    def speed_factors(self, partition_ids: list[int]) -> dict[int, float]:
        """Return ``{partition_id: factor}``: 1.0 for fast nodes, ``slow_factor`` for slow.

        The slow set is a seeded choice among the given partition ids (sorted first,
        so the order of the argument does not matter).
        """
        pids = sorted(int(p) for p in partition_ids)
        num_slow = int(round(self.slow_fraction * len(pids)))
        rng = np.random.default_rng(derive_seed(self.seed, 0x5EED))
        slow = set(rng.choice(pids, size=num_slow, replace=False).tolist()) if num_slow else set()
        return {p: (self.slow_factor if p in slow else 1.0) for p in pids}

    def duration(self, speed_factor: float, partition_id: int, dispatch_index: int) -> float:
        """Virtual seconds of the ``dispatch_index``-th computation of a partition."""
        rng = np.random.default_rng(derive_seed(self.seed, int(partition_id), int(dispatch_index)))
        noise = rng.uniform(1.0 - self.jitter, 1.0 + self.jitter)
        return float(self.base_duration * speed_factor * noise)
