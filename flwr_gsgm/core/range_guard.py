"""The range guard: no value of a rule's state leaves +-STATE_LIMIT, nor overflows.

Every server optimizer gets it through :class:`RangeGuard`, a base class of
:class:`~flwr_gsgm.core.base.ServerOptimizer`; a rule only says how far one call can
move its state (:meth:`RangeGuard._step_bound`).

Checking the result of every step exactly would cost a pass over the state (or a
copy to roll back to). Instead each rule bounds what one call can compute from two
tracked numbers: ``_bound_w`` >= |w| and every copy of w, and ``_bound_u`` >= every
update folded into the state (an L2 norm bounds every value). A step whose bound
stays below ``STATE_LIMIT / 2`` runs as is; only one near the limit (an absurd
update, or a state grown huge) runs with a copy of the state to roll back to, and
its result is checked value by value.

A rule without its own ``_step_bound`` is correct but slow: every step of it takes
the exact path, and the first one logs a WARNING naming the rule. Every registered
rule defines one (``tests/core/test_core_step_range.py`` checks it).

This module imports numpy (and the standard library's logging) only.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import numpy as np

__all__ = ["STATE_LIMIT", "RangeGuard", "max_abs"]

#: The largest magnitude any value of an optimizer's state may reach: float32's
#: largest value (about 2**128) less a margin of 2**28, so that a sum of up to 2**28
#: values of the state (a cycle sum, a table sum, a buffer) can never overflow. A step
#: whose result would leave it is rejected with reason ``"step-range"``.
STATE_LIMIT = 2.0**100
# A step whose bound (see ``_step_bound``) stays below this takes the fast path: the
# margin of 2 covers the rounding of the update's norm computed in float32.
_FAST_LIMIT = STATE_LIMIT / 2
# Elements scanned at a time when looking for the first value out of range.
_SCAN = 1 << 18

# Flower's logger, by its name (the core imports no flwr), as gsgm.py logs: its
# handler prints the warning in the run's log with the engine's lines.
_log = logging.getLogger("flwr")
# Rule classes whose missing _step_bound was logged (once per class).
_SLOW_PATH_LOGGED: set[type] = set()


def max_abs(arr: np.ndarray) -> float:
    """The largest magnitude in ``arr`` (NaN if it holds one), without a temporary.

    Args:
        arr: a float array of any shape (an empty one gives 0.0).
    """
    if arr.size == 0:
        return 0.0
    with np.errstate(invalid="ignore"):
        return float(max(arr.max(), -arr.min()))


def first_out_of_range(flat: np.ndarray) -> int | None:
    """Flat index of the first value of ``flat`` (1-D) beyond STATE_LIMIT or NaN; None if none."""
    for lo in range(0, flat.shape[0], _SCAN):
        values = flat[lo : lo + _SCAN]
        if not max_abs(values) <= STATE_LIMIT:
            return lo + int(np.argmax(~(np.abs(values) <= STATE_LIMIT)))
    return None


class RangeGuard:
    """Mixin: run a rule's step so that its result stays within :data:`STATE_LIMIT`.

    The class using it (:class:`~flwr_gsgm.core.base.ServerOptimizer`) provides
    ``name``, ``state_dict()``, ``_load(state)``, ``_reject(reason, message)``,
    ``_counters`` (with ``"range_checks"``) and ``_last_staleness``; it sets
    ``_bound_w`` (None: measure again) and ``_bound_u`` when its state changes
    outside a guarded step. A rule overrides :meth:`_step_bound` and, for its array
    attributes, ``_LABELS`` / ``_W_LIKE`` / ``_DERIVED``.
    """

    #: How the result check names an array attribute (a subclass adds its own).
    _LABELS: ClassVar[dict[str, str]] = {"_w": "weights", "_backups": "weights sent to node"}
    #: Attributes that hold ``w`` or copies of it (bounded by ``_bound_w``).
    _W_LIKE: ClassVar[tuple[str, ...]] = ("_w", "_backups")
    #: Array attributes recomputed from the state (not part of it, never checked).
    _DERIVED: ClassVar[tuple[str, ...]] = ()

    _bound_w: float | None
    _bound_u: float

    def _checked_step(self, partition_id: int, norm: float, step: Callable[[], Any]) -> Any:
        """Run ``step()`` (the rule on a validated update of L2 norm ``norm``) so that
        its result stays within :data:`STATE_LIMIT`; else roll back and reject.

        Returns ``step()``'s result. Raises UpdateRejected (``"step-range"``, the
        state restored bit for bit) or RuntimeError (a step the bound said was safe
        overflowed: a bug of ``_step_bound``).
        """
        if self._bound_w is None:  # a join or a loss may have stepped: measure again
            self._measure_bounds()
        total, w_after = self._step_bound(norm)
        if not total <= _FAST_LIMIT:
            self._measure_bounds()  # the tracked bounds only grow: measure them
            total, w_after = self._step_bound(norm)
        if total <= _FAST_LIMIT:
            with np.errstate(over="raise", invalid="raise"):
                try:
                    outcome = step()
                except FloatingPointError as err:  # the bound is a proof: a bug
                    raise RuntimeError(
                        f"{self.name}: a step bounded by {total:.6g} overflowed ({err}); "
                        "the state is left changed: this is a bug of _step_bound"
                    ) from err
            self._bound_w = w_after
            self._bound_u = max(self._bound_u, norm)
            return outcome
        return self._checked_exactly(partition_id, norm, step)

    def _checked_exactly(self, partition_id: int, norm: float, step: Callable[[], Any]) -> Any:
        """Run ``step()`` with a copy of the state to roll back to; check every value."""
        snapshot = self.state_dict()
        last_staleness = self._last_staleness
        try:
            with np.errstate(over="raise", invalid="raise", divide="raise"):
                outcome = step()
        except FloatingPointError:
            outcome = None
        bad = self._out_of_range()
        if bad is None and outcome is None:
            bad = ("state", math.inf, 0)  # an intermediate overflowed, nothing stored yet
        if bad is not None:
            self._load(snapshot)
            self._last_staleness = last_staleness
            self._counters["range_checks"] += 1  # after the roll-back, which resets it
            label, value, index = bad
            raise self._reject(
                "step-range",
                f"the update of partition-id {partition_id} (L2 norm {norm:.6g}) would take "
                f"the {label} to {value:.6g} at flat index {index}, beyond the state range "
                f"+-2**100 (float32's largest value less a margin of 2**28 for sums); "
                "the state is unchanged",
            )
        self._counters["range_checks"] += 1
        self._measure_bounds()
        return outcome

    def _step_bound(self, norm: float) -> tuple[float, float]:
        """Bounds of one call with an update of L2 norm ``norm``: ``(total, w_after)``.

        ``total`` bounds the magnitude of every value the call may compute or store
        (intermediates included), ``w_after`` that of ``w`` after it, given
        ``|w|, |copies of w| <= self._bound_w`` and ``|every update folded so far|
        <= self._bound_u``. Each rule overrides it: the default, infinity, sends every
        step down the slow path (a copy of the state, then a check of every value:
        correct but slow) and logs a WARNING naming the rule the first time.
        """
        cls = type(self)
        if cls not in _SLOW_PATH_LOGGED:
            _SLOW_PATH_LOGGED.add(cls)
            _log.warning(
                "%s.%s (rule %r) defines no _step_bound: every step of it takes the range "
                "guard's slow path (a copy of the state, then a check of every value); "
                "derive the rule's bound as the shipped rules do (flwr_gsgm/core/range_guard.py)",
                cls.__module__,
                cls.__qualname__,
                getattr(self, "name", ""),
            )
        return math.inf, math.inf

    def _measure_bounds(self) -> None:
        """Set ``_bound_w`` and ``_bound_u`` to the state's exact largest magnitudes.

        ``_bound_u`` then bounds every stored update-derived value (slots, rows,
        caches, sums, momentum), which each rule's ``_step_bound`` accepts in place
        of the largest update folded so far.
        """
        bound_w = bound_u = 0.0
        for attr, _label, arr in self._named_arrays():
            m = max_abs(arr)
            if attr in self._W_LIKE:
                bound_w = max(bound_w, m)
            else:
                bound_u = max(bound_u, m)
        self._bound_w, self._bound_u = bound_w, bound_u

    def _out_of_range(self) -> tuple[str, float, int] | None:
        """The first value of the state beyond :data:`STATE_LIMIT` (or NaN), as
        ``(what, value, flat index)``; None if there is none."""
        for _attr, label, arr in self._named_arrays():
            flat = arr.reshape(-1)
            j = first_out_of_range(flat)
            if j is not None:
                return label, float(flat[j]), j
        return None

    def _named_arrays(self) -> Iterator[tuple[str, str, np.ndarray]]:
        """``(attribute, label, array)`` of every array of the state.

        Scratch buffers (``_scr*``) and those in ``_DERIVED`` (recomputed from the
        state) are left out; arrays held in dicts (per-node slots, rows, caches,
        copies of w) are labelled with their node.
        """
        labels: dict[str, str] = {}
        for klass in reversed(type(self).__mro__):
            labels.update(klass.__dict__.get("_LABELS", {}))
        for attr, value in vars(self).items():
            if attr.startswith("_scr") or attr in self._DERIVED:
                continue
            label = labels.get(attr, attr.lstrip("_"))
            if isinstance(value, np.ndarray):
                yield attr, label, value
            elif isinstance(value, dict):
                for key, item in value.items():
                    if isinstance(item, list) and item and isinstance(item[0], np.ndarray):
                        item = item[0]
                    if isinstance(item, np.ndarray):
                        yield attr, f"{label} {key}", item
