"""The project's one seed derivation: independent random streams from tuples of integers."""

from __future__ import annotations

import numpy as np

__all__ = ["derive_seed"]


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
