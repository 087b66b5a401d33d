"""Lying nodes: plausible updates in a harmful direction, for measuring defences.

A lying node computes its honest update, then sends one of:

- ``sign-flip``: the honest update with its sign flipped (the same norm: a typical one).
  Weights mode: ``w_sent - (w_local - w_sent)``; gradient and delta modes: ``-u``.
- ``noise``: Gaussian noise scaled to the honest update's L2 norm (seeded per message).
  Weights mode: ``w_sent + n``; gradient and delta modes: ``n``.
- ``label-flip``: the honest computation on its data with every label y replaced by
  ``num_classes - 1 - y`` (a data-poisoning node; the update is otherwise honest).

The norm of a lie is the node's own honest norm, the closest a node gets to "the median
norm" of the fleet without seeing the others' updates (the setting of Kardam,
Damaskinos et al., 2018, and AFLGuard, Fang et al., ACSAC 2022: the attacker keeps its
update within the range a norm bound accepts). So the server's norm bound
(:mod:`flwr_gsgm.intake.norm_bound`) does not stop these updates: only their
direction is wrong.

Which nodes lie: the partitions ``0 .. attackers - 1`` (app run config ``attackers``,
``attack``), a fixed choice so that seeds vary the data and the clock, not who lies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # no torch at import: serverapp/app_config.py reads ATTACKS without it
    import torch

__all__ = ["ATTACKS", "flip_labels", "is_attacker", "lie"]

#: ``attack`` run config values; ``none``: every node is honest.
ATTACKS = ("none", "sign-flip", "noise", "label-flip")


def is_attacker(partition_id: int, attack: str, attackers: int) -> bool:
    """True if node ``partition_id`` lies: an attack is set and its partition-id is
    below ``attackers``."""
    return attack != "none" and 0 <= partition_id < attackers


def flip_labels(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """``num_classes - 1 - y`` for every label y (int64, same shape): ``label-flip``."""
    return (num_classes - 1) - labels


def lie(
    attack: str,
    update: list[np.ndarray],
    sent: list[np.ndarray] | None,
    seed: int,
) -> list[np.ndarray]:
    """The lie sent instead of ``update``.

    Parameters
    ----------
    attack : str
        ``sign-flip`` or ``noise`` (``label-flip`` changes the data, not the update:
        the update is returned as is; so is every update for ``none``).
    update : list[np.ndarray]
        The honest reply's arrays (float32): a gradient or a displacement (gradient,
        delta modes), or the new weights w_local (weights mode).
    sent : list[np.ndarray] | None
        Weights mode: the weights w_sent the message carried, in the same order;
        None in gradient and delta modes.
    seed : int
        Seeds the noise (``noise``): the message's own seed, so a run repeats.

    Returns
    -------
    list[np.ndarray]
        float32 arrays of the same shapes. With d the honest displacement (weights
        mode: ``w_local - w_sent``; else the update itself): ``sign-flip`` sends -d,
        ``noise`` sends n with ||n|| = ||d|| over all arrays together (weights mode:
        ``w_sent`` plus that).

    Raises
    ------
    ValueError
        An unknown ``attack``, or ``sent`` whose shapes differ from ``update``'s.
    """
    if attack not in ATTACKS:
        raise ValueError(f"attack {attack!r} is unknown; expected one of {ATTACKS}")
    if attack in ("none", "label-flip"):
        return update
    if sent is not None and [a.shape for a in sent] != [a.shape for a in update]:
        raise ValueError(
            f"sent weights of shapes {[a.shape for a in sent]} do not match the update's "
            f"{[a.shape for a in update]}"
        )
    moves = [u - s for u, s in zip(update, sent)] if sent is not None else update
    if attack == "sign-flip":
        lies = [-m for m in moves]
    else:
        rng = np.random.default_rng(seed)
        noise = [rng.standard_normal(m.shape) for m in moves]
        honest = np.sqrt(sum(float(np.sum(np.square(m, dtype=np.float64))) for m in moves))
        drawn = np.sqrt(sum(float(np.sum(np.square(n))) for n in noise))
        scale = honest / drawn if drawn > 0 else 0.0
        lies = [n * scale for n in noise]
    if sent is not None:
        lies = [s + m for s, m in zip(sent, lies)]
    return [np.asarray(a, dtype=np.float32) for a in lies]
