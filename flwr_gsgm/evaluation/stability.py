"""Training-stability figures of ``docs/GSGM.md`` ("Measuring stability").

All functions take the sequence of test accuracies at the evaluation points of one
run (fractions in [0, 1], oldest first) and use its second half, where the run is
past its initial rise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = [
    "second_half",
    "masd",
    "accuracy_std",
    "final_accuracy",
    "time_to_target",
    "stability_improvement",
]


def second_half(values: Sequence[float]) -> np.ndarray:
    """Return the last ``ceil(n / 2)`` values as float64 (the whole list if n < 2)."""
    arr = np.asarray(values, dtype=np.float64)
    return arr[len(arr) // 2 :]


def masd(accuracies: Sequence[float]) -> float:
    """Mean absolute successive difference over the second half: mean |a_{j+1} - a_j|.

    Returns NaN when the second half has fewer than two points.
    """
    half = second_half(accuracies)
    if len(half) < 2:
        return math.nan
    return float(np.mean(np.abs(np.diff(half))))


def accuracy_std(accuracies: Sequence[float]) -> float:
    """Population standard deviation of accuracy over the second half (NaN if empty)."""
    half = second_half(accuracies)
    return float(np.std(half)) if len(half) else math.nan


#: Evaluations averaged into the final accuracy (:func:`final_accuracy`): one
#: evaluation's noise is averaged out, as GSGM.md's metrics say.
FINAL_WINDOW = 5


def final_accuracy(accuracies: Sequence[float], last: int = FINAL_WINDOW) -> float:
    """Mean of the last ``last`` evaluations (NaN if there are none)."""
    arr = np.asarray(accuracies, dtype=np.float64)
    return float(np.mean(arr[-last:])) if len(arr) else math.nan


def time_to_target(times: Sequence[float], accuracies: Sequence[float], target: float) -> float:
    """First time (same unit as ``times``) at which accuracy reaches ``target``; NaN if never."""
    for t, acc in zip(times, accuracies):
        if acc >= target:
            return float(t)
    return math.nan


def stability_improvement(masd_a: float, masd_b: float) -> float:
    """Stability improvement of A over B: ``1 - MASD_A / MASD_B`` (NaN if MASD_B is 0)."""
    return 1.0 - masd_a / masd_b if masd_b else math.nan
