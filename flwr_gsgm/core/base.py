"""The server optimizers' contract: the base class every rule derives from.

A server optimizer owns the global weights ``w`` of an asynchronous run and changes
them, update by update, with its rule. The engine calls it with the update of one
node together with the version of the weights that node was sent
(``base_version``); the optimizer validates the update, applies its staleness bound,
then its rule, and reports what happened as an :class:`Outcome`.

Storage and cost. The weights live in ONE contiguous flat float32 buffer; the
``weights`` property returns float32 views of it shaped like the arrays the
optimizer was built with (the caller copies them before sending them away). Rules
run in place, chunk by chunk, with a few chunk-sized float32 scratch buffers
(at most :data:`CHUNK` elements each, 256 KiB): no model-sized allocation per
update beyond what a rule itself keeps (a GSGM slot, a DC-ASGD backup), and a
model-sized buffer a rule releases is reused for its next one. Working on
cache-sized chunks also keeps a multi-term rule close to the memory traffic of a
plain ``w -= lr * g`` (``benchmarks/bench_core.py``).

What lives elsewhere: the outcomes and rejection reasons in
:mod:`~flwr_gsgm.core.outcomes` (re-exported here), the range guard every rule gets
(no value of the state beyond :data:`STATE_LIMIT`) in
:mod:`~flwr_gsgm.core.range_guard`, the checks of a checkpoint state in
:mod:`~flwr_gsgm.core.state_checks`, the declared parameters in
:mod:`~flwr_gsgm.core.params` and the name -> class registry in
:mod:`~flwr_gsgm.core.registry`.

This module and its package import numpy only (never flwr, never torch).
"""

from __future__ import annotations

import abc
import math
import numbers
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar

import numpy as np

from . import state_checks
from .outcomes import CORE_REASONS, INTAKE_REASONS, REASONS, Outcome, UpdateRejected
from .params import Param, describe, resolve, server_learning_rate
from .range_guard import STATE_LIMIT, RangeGuard, max_abs
from .registry import register

__all__ = [
    "CHUNK",
    "STATE_LIMIT",
    "CORE_REASONS",
    "INTAKE_REASONS",
    "REASONS",
    "Outcome",
    "PlainKernel",
    "ServerOptimizer",
    "UpdateRejected",
]

#: Number of float32 elements the rules process at a time (256 KiB per buffer), so
#: that the operands of one chunk (up to 7 buffers: update, w, M, S, scratch) stay in
#: a 2 MiB L2 cache between the element-wise steps while the per-call overhead of
#: numpy stays small. At 10M parameters, against 2**18: the same for ASGD, 15-30%
#: faster for the rules of several terms (GSGM table 135 against 187 ms an arrival,
#: DC-ASGD 53 against 62, FedAsync 51 against 67; 2**15 and 2**17 in between or no
#: better). The chunk size changes no result: every kernel is element-wise.
CHUNK = 1 << 16

_F32 = np.dtype(np.float32)

#: Version of the layout returned by ``state_dict``.
STATE_FORMAT = 1

# A source of float32 values laid out like ``w``: a list of ``(offset, flat view)``
# pairs, each covering ``flat.size`` elements of ``w`` starting at ``offset``.
Parts = list[tuple[int, np.ndarray]]


# --------------------------------------------------------------------------- helpers
def _check_partition_id(value: Any) -> int:
    """Return a partition-id as a plain int, else raise ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"partition-id must be an integer, got {value!r}")
    return int(value)


def _check_now(now: Any) -> float:
    if isinstance(now, bool) or not isinstance(now, numbers.Real) or not math.isfinite(now):
        raise ValueError(f"now must be a finite number of seconds, got {now!r}")
    return float(now)


def _check_float32_cast(arr: np.ndarray, what: str) -> None:
    """Raise ValueError if copying ``arr`` to float32 changes a value beyond rounding.

    A finite value out of float32 range would become infinity; an integer not exactly
    representable in float32 would become another integer. Float32 input passes as is.
    """
    if arr.dtype == _F32 or arr.size == 0:
        return
    with np.errstate(over="ignore", invalid="ignore"):
        cast = arr.astype(_F32)
        if arr.dtype.kind == "f":
            bad = np.isfinite(arr) & ~np.isfinite(cast)
            if bad.any():
                j = int(np.argmax(bad.reshape(-1)))
                raise ValueError(
                    f"{what} holds {arr.reshape(-1)[j].item()!r} ({arr.dtype}) at flat index "
                    f"{j}: out of float32 range (|x| <= {float(np.finfo(_F32).max):.8g})"
                )
            return
        # Integers: compared through float64, exact below 2**53; above, as python ints.
        back = cast.astype(np.float64) != arr.astype(np.float64)
        flat, flat_cast = arr.reshape(-1), cast.reshape(-1)
        for k in np.flatnonzero(np.abs(flat.astype(np.float64)) >= 2.0**53):
            if int(flat[k]) != int(flat_cast[k]):
                back.reshape(-1)[k] = True
                break
    if back.any():
        j = int(np.argmax(back.reshape(-1)))
        value = arr.reshape(-1)[j].item()
        raise ValueError(
            f"{what} holds {value!r} ({arr.dtype}) at flat index {j}: not exactly "
            f"representable in float32 (it would become {float(cast.reshape(-1)[j])!r})"
        )


def chunks(parts: Parts) -> Iterator[tuple[int, int, np.ndarray]]:
    """Yield ``(lo, hi, values)``: ``values`` covers ``w[lo:hi]``, at most CHUNK long."""
    chunk = CHUNK
    for off, flat in parts:
        n = flat.shape[0]
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            yield off + s, off + e, flat[s:e]


def replace_row(
    row: np.ndarray, total: np.ndarray, update: np.ndarray, scratch: np.ndarray, new: bool
) -> None:
    """One chunk of a table of latest updates: ``row <- update`` and ``total`` kept the
    sum of the rows (``+ update`` for a new row, ``+ (update - row)`` for an old one).

    All four arrays are float32 chunks of one length; ``scratch`` is overwritten.
    GSGM's table averaging and ACE keep such a table.
    """
    if new:
        np.copyto(row, update)
        np.add(total, update, out=total)
    else:
        t = scratch[: row.shape[0]]
        np.subtract(update, row, out=t)
        np.add(total, t, out=total)
        np.copyto(row, update)


# ---------------------------------------------------------------- the plain kernels
class PlainKernel:
    """The shape of every rule's plain reference kernel.

    Beside its fast path (``_on_valid`` and the hooks: ``out=`` kernels over
    :func:`chunks` with chunk-sized scratch), each rule's module keeps its update
    written plainly, as ``torch.optim.sgd``'s ``_single_tensor_sgd`` stands beside its
    foreach path: one arrival at a time, whole-vector numpy expressions over flat
    float32 arrays, read as the formulas of the rule's docstring and paper. No chunks,
    no scratch buffers, no ``out=``: every expression allocates, so a kernel is slower
    and larger than the rule. It is there to be read, and to check the fast path
    against (``tests/core/test_plain_kernels.py``, to float32 rounding: the two
    order their operations differently); it never runs a federation.

    State, plain attributes: ``w``, the weights, flat float32 of shape ``(n,)`` (the
    rule's :attr:`ServerOptimizer.flat_weights`; the arrays of the model laid end to
    end); ``version`` (t, the steps taken on ``w``); ``active``, the set of active
    partition-ids; ``lr``; and the rule's own arrays, flat float32 of shape ``(n,)``.

    Calls, as the engine's on the rule, validation aside:

    - ``dispatch(node)``: the engine sent ``w`` (at ``version``) to ``node``;
    - ``arrive(node, g, base_version, now) -> str``: ``node``'s update ``g`` (flat
      float32, shape ``(n,)``: a gradient, or a displacement ``w_sent - w_local``),
      computed on the weights of version ``base_version``, arrives at time ``now``
      (seconds); returns the :class:`Outcome`'s value, ``"applied"``, ``"deferred"`` or
      ``"stale"``. The staleness is ``version - base_version``;
    - ``lost(node, now)``: an active node leaves; ``joined(node, now)``: a node that is
      not active joins.

    A kernel takes the rule's own parameters as keyword arguments, all of them, with
    no default (the defaults are declared once, in the rule's ``PARAMS``). Not in a
    kernel: validation, ``max_staleness`` and ``max_norm`` (the base class's, the same
    for every rule: a kernel is its rule with both unset), the range guard, counters
    and checkpoints.
    """

    def __init__(self, w: np.ndarray, nodes: Iterable[int], lr: float) -> None:
        self.w = np.array(w, dtype=np.float32).reshape(-1)  # a copy
        self.version = 0
        self.active = set(nodes)
        self.lr = lr

    def dispatch(self, node: int) -> None:
        """The engine sent ``w`` to ``node`` (nothing to keep for most rules)."""

    def arrive(self, node: int, g: np.ndarray, base_version: int, now: float = 0.0) -> str:
        """Apply ``node``'s update ``g``; the outcome's value."""
        raise NotImplementedError

    def lost(self, node: int, now: float = 0.0) -> None:
        """``node`` (active) leaves."""
        self.active.discard(node)

    def joined(self, node: int, now: float = 0.0) -> None:
        """``node`` (not active) joins."""
        self.active.add(node)


# ------------------------------------------------------------------------ the base
class ServerOptimizer(RangeGuard, abc.ABC):
    """Base class of the server optimizers (GSGM and the asynchronous baselines).

    Args:
        weights: the initial global weights, a non-empty sequence of numpy arrays of
            any shapes (for example ``ArrayRecord.to_numpy_ndarrays()``). They are
            copied, cast to float32, into one contiguous flat buffer.
        partition_ids: partition-ids of the initially active nodes (integers; may be empty).
        **params: the parameters declared in ``PARAMS`` by the class and its bases
            (keyword only; a missing one takes its declared default). Declared here
            for every rule:

            - ``lr``: server learning rate eta, > 0. Each rule declares its own
              defaults, one for gradients and one for displacements (delta and
              weights modes), in its ``PARAMS``
              (:func:`~flwr_gsgm.core.params.server_learning_rate`), listed in its
              docstring.
            - ``max_staleness``: optional staleness bound s_max >= 0: a valid update
              with staleness ``version - base_version`` above it is dropped
              (:attr:`Outcome.STALE`). Default None (no bound).
            - ``max_norm``: optional bound > 0 on the L2 norm of an update taken over
              all its arrays; a larger update is rejected with reason ``"norm"``.
              Default None (no bound).

    Raises:
        ValueError: a parameter that is not declared or out of range (the message
            names it, the value and what was expected), ``weights`` is empty, not
            real numbers, an integer array (the rules step float32 weights and never
            cast an integer array, whose float32 copy would change its dtype and,
            above ``2**24``, its values: keep integer arrays such as BatchNorm's
            ``num_batches_tracked`` out of the optimizer), holds NaN or infinity, or
            a float value out of float32 range (``|x| > 3.4028235e38``, which a
            float32 copy would turn into infinity). The message names the array
            (``weights[i]``), the value and its index. A float64 value in range is
            rounded to the nearest float32.
        TypeError: ``weights`` is a single array instead of a sequence of arrays.

    Validation of ``on_update`` happens before anything changes, in this order (cheap
    checks first): ``"unknown-node"`` (not the partition-id of an active node), ``"base-version"``
    (not an int in ``[0, version]``, or, for the rules that keep the weights sent,
    no dispatch recorded at that version), ``"num-arrays"``, per array
    ``"dtype"`` (must be a numpy float32 array) and ``"shape"``, ``"non-finite"``
    (NaN or infinity), ``"norm"``. A failing update raises :class:`UpdateRejected`
    after ``counters["rejected"]`` is incremented; nothing else changes. Then the
    result of the step is checked (``"step-range"``): no value of the state may end
    beyond :data:`STATE_LIMIT` nor overflow on the way; such a step is rolled back,
    bit for bit, and rejected the same way (see ``_checked_step``).

    Counters (``counters`` returns a copy): ``arrivals`` (valid updates),
    ``applied`` / ``deferred`` / ``stale`` (their outcomes, so that
    ``arrivals == applied + deferred + stale``), ``rejected``, ``range_checks``
    (steps checked value by value because their bound came near the range),
    ``slots_dropped``
    (GSGM slots of lost nodes), plus rule-specific ones. ``version`` counts the steps
    taken on ``w`` (t of the spec); it is not always ``applied``: a FedBuff step
    consumes several arrivals, a GSGM slot step applies an averaged set of arrivals.
    """

    #: Key of the class in :data:`flwr_gsgm.core.registry.OPTIMIZERS`; a class that
    #: sets it registers itself there when its module is imported.
    name: ClassVar[str] = ""
    #: This class's own parameters; :meth:`declared_params` adds the inherited ones.
    PARAMS: ClassVar[tuple[Param, ...]] = (
        # Only a rule that declares no lr of its own uses these defaults: every
        # registered rule declares its own (tests/core/test_core_params.py).
        server_learning_rate(0.02, displacement=0.1),
        Param(
            "max_staleness",
            None,
            "drop updates staler than this",
            kind=int,
            low=0,
            optional=True,
            run_config_key="max-staleness",
        ),
        Param(
            "max_norm",
            None,
            "reject updates with a larger L2 norm",
            low=0.0,
            low_open=True,
            optional=True,
            run_config_key="max-norm",
        ),
    )
    #: Parameters that shape the state (which buffers exist and what they mean): a
    #: state is loaded only into an optimizer with the same values of these.
    STATE_LAYOUT: ClassVar[tuple[str, ...]] = ()
    #: The work scheduler a rule needs in place of the run's work-scheduling (FedCompass:
    #: "compass"), or None. The engine builds it from :meth:`schedule_params` and hands
    #: the state the two share to :meth:`share_schedule`.
    WORK_SCHEDULER: ClassVar[str | None] = None
    _counter_names: ClassVar[tuple[str, ...]] = (
        "arrivals",
        "applied",
        "deferred",
        "stale",
        "rejected",
        "slots_dropped",
        "range_checks",
    )

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__doc__ and ("PARAMS" in cls.__dict__ or cls.__dict__.get("name")):
            # The documented defaults are the declared ones: generated, not written.
            cls.__doc__ = cls.__doc__.rstrip() + "\n" + describe(cls.declared_params())
        if cls.__dict__.get("name"):
            register(cls)

    @classmethod
    def declared_params(cls) -> tuple[Param, ...]:
        """Every parameter of the class, base ones first, in declaration order.

        A class may redeclare an inherited parameter (same name) to change its
        default or range; the redeclaration takes the inherited one's place.
        """
        params: dict[str, Param] = {}
        for klass in reversed(cls.__mro__):
            for p in klass.__dict__.get("PARAMS", ()):
                params[p.name] = p
        return tuple(params.values())

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """``{name: declared default}`` of every parameter of the class."""
        return {p.name: p.default for p in cls.declared_params()}

    def __init__(
        self,
        weights: Sequence[np.ndarray],
        partition_ids: Iterable[int],
        **params: Any,
    ) -> None:
        # Parameters first: a bad one fails before the buffers are allocated.
        values = resolve(self.name or type(self).__name__, self.declared_params(), params)
        self._param_names: tuple[str, ...] = tuple(values)
        for key, value in values.items():
            setattr(self, "_" + key, value)
        if isinstance(weights, np.ndarray):
            raise TypeError(
                "weights must be a sequence of numpy arrays (one per model tensor), "
                "got a single numpy.ndarray; wrap it in a list"
            )
        arrays = []
        for i, a in enumerate(weights):
            arr = np.asarray(a)
            if arr.dtype.kind in "iu":
                raise ValueError(
                    f"weights[{i}] is an integer array ({arr.dtype}): the server rules step "
                    "float32 weights and never cast an integer array (its float32 copy would "
                    "change its dtype, and above 2**24 its values); keep integer arrays, such "
                    "as BatchNorm's num_batches_tracked, out of the optimizer's weights"
                )
            if arr.dtype.kind != "f":
                raise ValueError(f"weights[{i}] must hold real numbers, got dtype {arr.dtype}")
            _check_float32_cast(arr, f"weights[{i}]")
            arrays.append(arr)
        if not arrays:
            raise ValueError("weights must hold at least one array, got none")
        self._shapes: tuple[tuple[int, ...], ...] = tuple(a.shape for a in arrays)
        sizes = [int(a.size) for a in arrays]
        self._offsets: tuple[int, ...] = tuple(int(x) for x in np.cumsum([0] + sizes[:-1]))
        self._sizes: tuple[int, ...] = tuple(sizes)
        self._size = int(sum(sizes))
        self._w = np.empty(self._size, dtype=_F32)
        self._w_views = self._views(self._w)
        for view, a in zip(self._w_views, arrays):
            np.copyto(view, a, casting="unsafe")
        scratch = max(1, min(CHUNK, self._size))
        self._scr_a = np.empty(scratch, dtype=_F32)
        self._scr_b = np.empty(scratch, dtype=_F32)
        # Model-sized buffers a rule released (a GSGM slot applied at a close), kept
        # for the next one it needs: a fresh one faults in a page per 4 KiB on its
        # first write, which costs a third of a plain step at 10M parameters.
        self._scr_pool: list[np.ndarray] = []

        for i, view in enumerate(self._w_views):
            if max_abs(view) <= STATE_LIMIT:  # no temporary array: also catches NaN
                continue
            flat = view.reshape(-1)
            j = int(np.argmax(~(np.abs(flat) <= STATE_LIMIT)))
            if not np.isfinite(flat[j]):
                raise ValueError(
                    f"weights[{i}] holds {flat[j].item()!r} at flat index {j}; "
                    "weights must be finite (no NaN or infinity)"
                )
            raise ValueError(
                f"weights[{i}] holds {flat[j].item()!r} at flat index {j}: beyond the state "
                "range +-2**100 (float32's largest value less a margin of 2**28 for sums)"
            )

        self._version = 0
        self._active: set[int] = {_check_partition_id(n) for n in partition_ids}
        self._counters: dict[str, int] = {k: 0 for k in self._counter_names}
        self._last_staleness: int | None = None
        # Bounds of the result check (see _checked_step): |w| and the updates so far.
        self._bound_w: float | None = max_abs(self._w)
        self._bound_u = 0.0

    # ------------------------------------------------------------------ read-only API
    @property
    def weights(self) -> list[np.ndarray]:
        """The global weights: float32 views of the internal buffer, input shapes.

        The views stay valid for the optimizer's lifetime and change with it; copy
        them before sending them away or keeping them.
        """
        return list(self._w_views)

    @property
    def flat_weights(self) -> np.ndarray:
        """The global weights as one read-only flat float32 view."""
        v = self._w.view()
        v.flags.writeable = False
        return v

    @property
    def version(self) -> int:
        """Number of steps applied to ``w`` so far (t of the spec)."""
        return self._version

    @property
    def counters(self) -> dict[str, int]:
        """A copy of the event counters (see the class docstring)."""
        return dict(self._counters)

    @property
    def last_staleness(self) -> int | None:
        """Staleness ``version - base_version`` (in versions) of the last valid update.

        The value the staleness bound and the rule saw, computed once in
        :meth:`on_update`; None before the first valid update. The engine records it
        instead of computing its own.
        """
        return self._last_staleness

    @property
    def active_nodes(self) -> frozenset[int]:
        """The nodes whose updates are accepted."""
        return frozenset(self._active)

    @property
    def params(self) -> dict[str, Any]:
        """The constructor parameters (hyperparameters) of this optimizer."""
        return {k: getattr(self, "_" + k) for k in self._param_names}

    def resolved_choices(self) -> dict[str, Any]:
        """``{param: value in use}`` for each parameter given as ``"auto"`` (none here)."""
        return {}

    def model_copies(self, nodes: int | None = None) -> int:
        """Most model copies the rule keeps at once (the memory per rule the engine
        checks against the memory available at start).

        A model copy is ``size(w)`` float32 (4 bytes per trainable value); the bound
        includes the transients of a step (``tests/core/test_core_memory.py``), not
        the chunk-sized scratch. ``nodes``: the number of active nodes (default: the
        rule's own). Here ``w`` alone (1); a rule that keeps more overrides
        :meth:`_copies`.
        """
        return self._copies(len(self._active) if nodes is None else int(nodes))

    def _copies(self, nodes: int) -> int:
        """:meth:`model_copies` with ``nodes`` active nodes: ``w`` alone."""
        return 1

    # ------------------------------------------------------------------ engine calls
    def on_dispatch(self, partition_id: int) -> None:
        """The engine sent the current weights (at ``version``) to ``partition_id``.

        No-op by default; DC-ASGD and FedAsync keep a copy of the weights sent.
        """
        return None

    def schedule_params(self) -> dict[str, Any]:
        """Keyword arguments of the :attr:`WORK_SCHEDULER` this rule needs (none here)."""
        return {}

    def share_schedule(self, book: Any) -> None:
        """Hook: the state this rule shares with its :attr:`WORK_SCHEDULER` (given by the
        engine before the first dispatch). Ignored here: a rule without one needs none."""

    def holds(self, partition_id: int) -> bool:
        """Whether the engine should send ``partition_id`` no work now.

        Asked by the engine for each idle active node before it dispatches; False
        (the default) for every rule but GSGM with ``apply_at = "close"``, which holds
        a node that contributed to the open cycle until the cycle closes.
        """
        return False

    def on_update(
        self,
        partition_id: int,
        update: Sequence[np.ndarray],
        base_version: int,
        now: float = 0.0,
    ) -> Outcome:
        """Validate one node's update, apply the staleness bound, then the rule.

        Args:
            partition_id: partition-id of the active node that computed ``update``.
            update: arrays shaped like ``weights``, float32, finite (a gradient or a
                displacement ``w_sent - w_local``: the rule steps against it). An
                array that shares memory with the optimizer's own buffers (a view of
                ``weights``, say) is copied before the rule runs, so the rule's
                writes do not change it.
            base_version: the ``version`` of the weights the node computed on.
            now: the engine's clock in seconds (virtual seconds in simulation),
                passed to the rule's hooks (FedCompass's ``_tick`` reads it for its
                groups' deadlines).

        Returns:
            The :class:`Outcome` of the update.

        Raises:
            UpdateRejected: validation failed, or (reason ``"step-range"``) the step
                would take a value of the state beyond :data:`STATE_LIMIT` or overflow
                float32; ``counters["rejected"]`` was incremented and nothing else
                changed.
            ValueError: ``now`` is not a finite number (a caller bug; not counted).
        """
        now = _check_now(now)
        parts, norm = self._validate(partition_id, update, base_version)
        partition_id = int(partition_id)
        base = int(base_version)
        return self._checked_step(
            partition_id, norm, lambda: self._handle_update(partition_id, parts, base, now)
        )

    def _handle_update(
        self, partition_id: int, parts: Parts, base_version: int, now: float
    ) -> Outcome:
        """The clock, the staleness bound, then the rule, for a validated update."""
        self._tick(now)
        self._counters["arrivals"] += 1
        staleness = self._version - base_version
        self._last_staleness = staleness
        if self._max_staleness is not None and staleness > self._max_staleness:
            outcome = self._on_stale(partition_id, now)
        else:
            outcome = self._on_valid(partition_id, parts, base_version, staleness, now)
        self._counters[outcome.value] += 1
        return outcome

    def on_node_joined(self, partition_id: int, now: float = 0.0) -> None:
        """``partition_id`` becomes active (no-op if it already is)."""
        partition_id = _check_partition_id(partition_id)
        now = _check_now(now)
        if partition_id in self._active:
            return
        self._tick(now)
        self._active.add(partition_id)
        self._joined(partition_id, now)
        self._bound_w = None  # it may have closed a cycle and stepped: measure again

    def on_node_lost(self, partition_id: int, now: float = 0.0) -> None:
        """``partition_id`` failed, timed out or left (no-op if it is not active).

        Its later updates are rejected with reason ``"unknown-node"``.
        """
        partition_id = _check_partition_id(partition_id)
        now = _check_now(now)
        if partition_id not in self._active:
            return
        self._tick(now)
        self._active.discard(partition_id)
        self._lost(partition_id, now)
        self._bound_w = None  # it may have closed a cycle and stepped: measure again

    # ---------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the run bit-identically.

        Deep copies; numpy arrays and plain python values (int, float, str, bool,
        None, lists, dicts) only, so ``pickle`` and ``torch.save`` can store it.
        """
        state: dict[str, Any] = {
            "format": STATE_FORMAT,
            "name": self.name,
            "shapes": [list(s) for s in self._shapes],
            "params": self.params,
            "weights": self._w.copy(),
            "version": self._version,
            "counters": dict(self._counters),
            "active_nodes": sorted(self._active),
        }
        state.update(self._extra_state())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict()`` (of an optimizer of the same class and shapes).

        Hyperparameters are restored too, as in PyTorch optimizers, except those of
        :attr:`STATE_LAYOUT`, which must already be equal: a state never switches the
        optimizer's mode. The state's params must be the rule's declared ones: a
        state written by a version of the rule with other parameters is refused, not
        upgraded.
        The arrays of ``weights`` keep their identity (values are copied into the
        buffer).

        Raises:
            ValueError: the state belongs to another optimizer, other shapes, other
                parameters (the message names them) or a different layout (a
                :attr:`STATE_LAYOUT` parameter differs: the message names each), or is
                inconsistent (a count or version that is not an integer >= 0, a node
                listed twice, a rule's node that is not in ``active_nodes``, rule data
                its params do not have: see :meth:`_check_state`); the message names
                the field. The optimizer is
                then left unchanged.
        """
        state_checks.check_header(state, STATE_FORMAT, self.name, self._shapes)
        state_checks.check_params(state, self.name, self._param_names)
        self._check_layout(state)
        self._check_state(state)
        backup = self.state_dict()
        try:
            self._load(state)
        except Exception:
            self._load(backup)
            raise
        self._measure_bounds()

    # ------------------------------------------------------------ subclass interface
    def next_deadline(self) -> float | None:
        """The earliest engine time (seconds) at which the rule acts by itself, with no
        update, join or loss: a deadline it keeps (FedCompass's group deadlines); None
        (the default) if it has none. The engine calls :meth:`on_deadline` just past it
        when nothing else happens before."""
        return None

    def on_deadline(self, now: float) -> None:
        """The clock reads ``now``, past :meth:`next_deadline`, with no other event:
        the rule does what its deadlines say (APPFL's timer for FedCompass)."""
        self._tick(_check_now(now))
        self._bound_w = None  # it may have stepped: measure again

    @abc.abstractmethod
    def _on_valid(
        self, partition_id: int, parts: Parts, base_version: int, staleness: int, now: float
    ) -> Outcome:
        """Apply the rule to a validated, fresh-enough update."""

    def _tick(self, now: float) -> None:
        """Hook: the clock reads ``now`` at an event, before the event changes state."""

    def _on_stale(self, partition_id: int, now: float) -> Outcome:
        """A valid update over the staleness bound arrived; it is dropped."""
        return Outcome.STALE

    def _joined(self, partition_id: int, now: float) -> None:
        """Hook: ``partition_id`` was added to the active set."""

    def _lost(self, partition_id: int, now: float) -> None:
        """Hook: ``partition_id`` was removed from the active set."""

    def _check_extra(self, partition_id: int, base_version: int) -> tuple[str, str] | None:
        """Hook: rule-specific validation; return ``(reason, message)`` to reject."""
        return None

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra(self, state: dict[str, Any]) -> None:
        pass

    # -------------------------------------------------------------------- internals
    def _views(self, flat: np.ndarray) -> list[np.ndarray]:
        return [
            flat[o : o + n].reshape(s) for o, n, s in zip(self._offsets, self._sizes, self._shapes)
        ]

    def _flat_array(self, value: Any, what: str) -> np.ndarray:
        """A copy of ``state[what]``, which must be a flat float32 array of ``w``'s size."""
        return state_checks.flat_array(value, self._size, what)

    def _check_layout(self, state: dict[str, Any]) -> None:
        """Raise ValueError naming each :attr:`STATE_LAYOUT` parameter the state differs in."""
        state_checks.check_layout(state, self.name, self.STATE_LAYOUT, self.params)

    def _check_state(self, state: dict[str, Any]) -> None:
        """Raise ValueError, naming the field, if ``state`` is not consistent.

        Checks the plain fields before anything changes: ``version`` and every
        counter an integer >= 0, ``active_nodes`` integers without repeats; then the
        rule's own fields (:meth:`_check_state_extra`).
        """
        try:
            version, active = state_checks.check_common(state)
            self._check_state_extra(state, version, active)
        except (TypeError, KeyError) as err:
            raise ValueError(f"state is malformed: {err!r}") from None
        state_checks.check_state_values(state)

    def _check_state_extra(self, state: dict[str, Any], version: int, active: set[int]) -> None:
        """Hook: validate the rule's fields of ``state`` (raise ValueError naming one)."""

    def _load(self, state: dict[str, Any]) -> None:
        params = dict(state["params"])  # the declared names (check_params)
        weights = self._flat_array(state["weights"], "weights")
        counters = {str(k): int(v) for k, v in dict(state["counters"]).items()}
        for k, v in params.items():
            setattr(self, "_" + k, v)
        np.copyto(self._w, weights)
        self._version = int(state["version"])
        self._counters = {k: 0 for k in self._counter_names}
        self._counters.update(counters)
        self._active = {int(n) for n in state["active_nodes"]}
        self._load_extra(state)

    def _owned_buffers(self) -> list[np.ndarray]:
        """The arrays this optimizer owns and writes (attributes, in dicts and lists)."""
        found = []
        for value in vars(self).values():
            items = value.values() if isinstance(value, dict) else (value,)
            for item in items:
                if isinstance(item, np.ndarray):
                    found.append(item)
                elif isinstance(item, list):
                    found.extend(x for x in item if isinstance(x, np.ndarray))
        return found

    def _reject(self, reason: str, message: str) -> UpdateRejected:
        self._counters["rejected"] += 1
        return UpdateRejected(reason, message)

    def _validate(self, partition_id: Any, update: Any, base_version: Any) -> tuple[Parts, float]:
        """Return the update as parts of ``w`` and its L2 norm, or raise UpdateRejected."""
        if (
            isinstance(partition_id, bool)
            or not isinstance(partition_id, numbers.Integral)
            or int(partition_id) not in self._active
        ):
            raise self._reject(
                "unknown-node",
                f"partition-id {partition_id!r} is not active "
                f"(active: {sorted(self._active)[:20]}"
                f"{'...' if len(self._active) > 20 else ''})",
            )
        partition_id = int(partition_id)
        if (
            isinstance(base_version, bool)
            or not isinstance(base_version, numbers.Integral)
            or not 0 <= int(base_version) <= self._version
        ):
            raise self._reject(
                "base-version",
                f"base_version {base_version!r} from partition-id {partition_id} is not an "
                f"integer in [0, {self._version}] (the current version)",
            )
        extra = self._check_extra(partition_id, int(base_version))
        if extra is not None:
            raise self._reject(*extra)
        n_expected = len(self._shapes)
        if isinstance(update, np.ndarray):
            raise self._reject(
                "num-arrays",
                f"expected a sequence of {n_expected} arrays, got a single numpy.ndarray",
            )
        try:
            n_got = len(update)
        except TypeError:
            raise self._reject(
                "num-arrays",
                f"expected a sequence of {n_expected} arrays, got {type(update).__name__}",
            ) from None
        if n_got != n_expected:
            raise self._reject("num-arrays", f"expected {n_expected} arrays, got {n_got}")
        for i, (a, shape) in enumerate(zip(update, self._shapes)):
            if not isinstance(a, np.ndarray):
                raise self._reject(
                    "dtype",
                    f"array {i} is a {type(a).__name__}, expected a numpy float32 array",
                )
            if a.dtype != _F32:
                why = ""
                if a.dtype.kind in "fiu":
                    try:
                        _check_float32_cast(a, "it")
                    except ValueError as err:  # name the real problem of the values too
                        why = f"; {err}"
                raise self._reject(
                    "dtype", f"array {i} has dtype {a.dtype.str}, expected float32 (<f4){why}"
                )
            if a.shape != shape:
                raise self._reject("shape", f"array {i} has shape {a.shape}, expected {shape}")
        parts: Parts = []
        sq = 0.0
        owned = None
        # One BLAS pass per array: a sum of squares is finite iff every value is
        # finite (squares are >= 0, nothing cancels), unless it overflows float32.
        with np.errstate(over="ignore", invalid="ignore"):
            for i, a in enumerate(update):
                flat = a.reshape(-1)
                s = float(np.dot(flat, flat))
                if not math.isfinite(s):
                    finite = np.isfinite(flat)
                    if not finite.all():
                        j = int(np.argmin(finite))
                        raise self._reject(
                            "non-finite",
                            f"array {i} holds {flat[j]!r} at flat index {j} "
                            f"({int(finite.size - finite.sum())} non-finite values); "
                            "expected finite values",
                        )
                    s = float(np.dot(flat.astype(np.float64), flat.astype(np.float64)))
                sq += s
                owned = self._owned_buffers() if owned is None else owned
                if any(np.may_share_memory(flat, buf) for buf in owned):
                    # A view of w (or another buffer of ours) would change under the
                    # rule's own writes: the rule works on a copy.
                    flat = flat.copy()
                parts.append((self._offsets[i], flat))
        norm = math.sqrt(sq)
        if self._max_norm is not None and not norm <= self._max_norm:
            raise self._reject(
                "norm",
                f"update L2 norm {norm:.6g} exceeds max_norm {self._max_norm:.6g}",
            )
        return parts, norm

    # Element-wise kernels shared by the rules (all in place, chunked).
    def _sgd_step(self, parts: Parts, lr: float) -> None:
        """``w <- w - lr * u``."""
        w, a = self._w, self._scr_a
        for lo, hi, u in chunks(parts):
            t = a[: hi - lo]
            np.multiply(u, lr, out=t)
            ws = w[lo:hi]
            np.subtract(ws, t, out=ws)

    def _copy_new(self, parts: Parts) -> np.ndarray:
        """A flat float32 buffer of ``w``'s size holding ``parts`` (which cover it)."""
        buf = self._new_buffer()
        for off, flat in parts:
            buf[off : off + flat.shape[0]] = flat
        return buf

    def _new_buffer(self) -> np.ndarray:
        """A flat float32 buffer of ``w``'s size, contents undefined: a released one
        (:meth:`_release`) if there is one, else a new one."""
        return self._scr_pool.pop() if self._scr_pool else np.empty(self._size, dtype=_F32)

    def _release(self, buf: np.ndarray) -> None:
        """Keep ``buf``, a model-sized buffer the rule no longer uses, for
        :meth:`_new_buffer`. The pool never holds more buffers than the rule once used
        at the same time, so the memory bound (:meth:`model_copies`) still holds."""
        self._scr_pool.append(buf)
