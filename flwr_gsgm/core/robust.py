"""The coordinate-wise trimmed mean of the updates a rule keeps.

Reference:
    D. Yin, Y. Chen, K. Ramchandran, P. Bartlett, "Byzantine-Robust Distributed
    Learning: Towards Optimal Statistical Rates", ICML 2018 (PMLR 80): the
    coordinate-wise trimmed mean. Flower's ``FedTrimmedAvg`` computes the same over a
    round's replies, cutting ``int(beta * n)`` of ``n`` at each end.

An asynchronous rule that keeps several recent updates before it steps (FedBuff's
buffer, GSGM's cycle) can take this statistic of them instead of their mean, so that
a node whose update points the wrong way at a plausible norm moves no coordinate
further than the honest updates around it (run config ``trim-fraction``,
:data:`~flwr_gsgm.core.params.TRIM_FRACTION`). What it stops and what it does not:
docs/FAULTS.md, "A node that lies within the norm bound".

This module imports numpy only (and the core's chunking, and math).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .base import CHUNK, chunks

__all__ = [
    "least_cutting_fraction",
    "plain_trimmed_mean",
    "sort_columns",
    "trimmed_count",
    "trimmed_mean_chunk",
    "trimmed_step",
]


def trimmed_count(n: int, fraction: float) -> int:
    """Updates cut at each end of ``n`` per coordinate: ``int(fraction * n)``, as
    Flower's FedTrimmedAvg (5 updates at 0.2: 1 at each end, the mean of the middle 3)."""
    return int(fraction * n)


def least_cutting_fraction(n: int) -> float:
    """The smallest fraction, to 3 decimals, that cuts one of ``n`` at each end
    (``trimmed_count(n, f) >= 1``): 0.2 for 5, 0.334 for 3 (0.333 x 3 cuts none)."""
    return math.ceil(1000 / max(n, 1)) / 1000


def trimmed_mean_chunk(
    rows: Sequence[np.ndarray], lo: int, hi: int, cut: int, out: np.ndarray, stack: np.ndarray
) -> None:
    """``out[:] =`` per coordinate ``j`` in ``[lo, hi)``, the mean of ``rows[i][j]``
    over ``i`` after cutting the ``cut`` smallest and the ``cut`` largest values.

    Parameters
    ----------
    rows : Sequence[np.ndarray]
        ``n`` flat float32 arrays of the same size (``n > 2 * cut``).
    lo, hi : int
        The chunk of coordinates.
    cut : int
        Values cut at each end (:func:`trimmed_count`).
    out : np.ndarray
        float32, shape ``(hi - lo,)``: the result.
    stack : np.ndarray
        float32 scratch of shape at least ``(n, hi - lo)`` (overwritten).

    Raises
    ------
    ValueError
        If ``n <= 2 * cut`` (nothing would be left to average).
    """
    n = len(rows)
    if n <= 2 * cut:
        raise ValueError(f"a trimmed mean of {n} update(s) cutting {cut} at each end keeps none")
    s = stack[:n, : hi - lo]
    for i, row in enumerate(rows):
        s[i] = row[lo:hi]
    if cut:
        sort_columns(s, out)  # out: the scratch row, overwritten by the mean below
        s = s[cut : n - cut]
    np.mean(s, axis=0, out=out)


#: Up to this many rows :func:`sort_columns` uses its sorting network. numpy sorts
#: along axis 0 one column at a time (n strided values each): for 5 rows of a
#: 65536-value chunk 2.9 ms against the network's 0.28 ms; the network's n(n-1)/2
#: passes catch up near 50 rows (27.0 against 28.9 ms), so from 41 rows numpy sorts.
NETWORK_ROWS = 40


def sort_columns(s: np.ndarray, tmp: np.ndarray) -> None:
    """Sort every column of ``s`` in place, ascending, as ``s.sort(axis=0)`` does.

    Up to :data:`NETWORK_ROWS` rows: an odd-even transposition network (n rounds of
    compare-exchanges of neighbouring rows, each an element-wise ``minimum`` and
    ``maximum`` over a whole row in cache); the same values in the same places as
    numpy's sort, so the trimmed mean that follows is the same to the bit
    (``tests/core/test_core_robust.py``). Above it: numpy's sort.

    Parameters
    ----------
    s : np.ndarray
        float32, shape ``(n, m)``, finite (the engine validates updates before).
    tmp : np.ndarray
        float32 scratch of shape ``(m,)`` (overwritten).
    """
    n = s.shape[0]
    if n > NETWORK_ROWS:
        s.sort(axis=0)
        return
    for r in range(n):  # n rounds sort any input (Knuth, TAOCP 3, 5.3.4)
        for i in range(r % 2, n - 1, 2):
            a, b = s[i], s[i + 1]
            np.minimum(a, b, out=tmp)
            np.maximum(a, b, out=b)
            a[...] = tmp


def trimmed_step(
    w: np.ndarray, rows: Sequence[np.ndarray], fraction: float, lr: float, scratch: np.ndarray
) -> None:
    """``w <- w - lr * trimmed mean of rows``, chunk by chunk in cache.

    Parameters
    ----------
    w : np.ndarray
        The flat float32 weights, updated in place.
    rows : Sequence[np.ndarray]
        The kept updates, flat float32 of ``w``'s size.
    fraction : float
        The fraction cut at each end (:func:`trimmed_count` of ``len(rows)``).
    lr : float
        The server learning rate.
    scratch : np.ndarray
        float32 of at least ``min(CHUNK, size)`` elements (overwritten).
    """
    cut = trimmed_count(len(rows), fraction)
    stack = np.empty((len(rows), min(CHUNK, w.shape[0])), dtype=np.float32)
    for lo, hi, ws in chunks([(0, w)]):
        t = scratch[: hi - lo]
        trimmed_mean_chunk(rows, lo, hi, cut, t, stack)
        np.multiply(t, lr, out=t)
        np.subtract(ws, t, out=ws)


def plain_trimmed_mean(rows: Sequence[np.ndarray], fraction: float) -> np.ndarray:
    """The coordinate-wise trimmed mean written plainly, for the rules' plain kernels
    (:class:`~flwr_gsgm.core.base.PlainKernel`): per coordinate, sort the ``n`` values,
    cut ``int(fraction * n)`` at each end and average the rest (Yin et al., ICML 2018);
    ``fraction`` 0: the mean.

    Parameters
    ----------
    rows : Sequence[np.ndarray]
        ``n`` flat float32 arrays of shape ``(m,)``.
    fraction : float
        In [0, 0.5): the fraction cut at each end.

    Returns
    -------
    np.ndarray
        float32, shape ``(m,)``.
    """
    n = len(rows)
    cut = trimmed_count(n, fraction)
    values = np.sort(np.stack(rows), axis=0)  # shape (n, m), every column ascending
    return values[cut : n - cut].mean(axis=0)
