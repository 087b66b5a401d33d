"""GSGM: Gradient Scheduling with Global Momentum.

References:
    C. Li, R. Li, H. Wang, Y. Li, P. Zhou, S. Guo, K. Li, "Gradient Scheduling with
    Global Momentum for Non-IID Data Distributed Asynchronous Training",
    arXiv:1902.07848, 2019 (later withdrawn by its authors).
    H. Wang, R. Li, C. Li, P. Zhou, Y. Li, W. Xu, S. Guo, "Gradient Scheduling With
    Global Momentum for Asynchronous Federated Learning in Edge Environment",
    IEEE Internet of Things Journal 9(19):18817-18828, 2022.

The full texts are not public: the update rule below is this project's
reconstruction, defined in ``docs/GSGM.md`` (steps 1-5), not the papers' verbatim
algorithm.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import numpy as np

from .base import Outcome, Parts, PlainKernel, ServerOptimizer, chunks, replace_row
from .params import BETA, TRIM_FRACTION, Param, server_learning_rate
from .robust import least_cutting_fraction, plain_trimmed_mean, trimmed_count, trimmed_step
from .state_checks import state_int, state_nodes

__all__ = ["GSGMRule", "PlainGSGM"]

_F32 = np.dtype(np.float32)
_FORMS = ("heavy-ball", "ema")
_AVERAGING = ("auto", "slot", "table")
_LR_SCALING = ("step", "cycle")
_APPLY_AT = ("auto", "arrival", "close")

# Flower's logger, by its name (the core imports no flwr): its handler prints INFO.
_log = logging.getLogger("flwr")


class GSGMRule(ServerOptimizer):
    r"""Gradient Scheduling with Global Momentum (the project's reconstruction).

    State: weights ``w``, version ``t``, global momentum ``M`` (starts at 0), the
    current cycle's white list ``W`` (active nodes that have not contributed in this
    cycle), the cycle sum ``S`` and count ``k``, and at most one pending slot ``P_i``
    per node with its count ``n_i``.

    When node ``i``'s update ``g_i`` arrives (after validation and the staleness
    bound):

    - if ``i`` is in ``W``, its contribution ``u_i = g_i`` is applied now and ``i``
      leaves ``W``; otherwise it is folded into its slot,
      ``P_i <- P_i + (g_i - P_i) / n_i`` (running mean; :attr:`Outcome.DEFERRED`);
    - apply ``u_i``: heavy-ball ``w <- w - lr * (u_i + beta * M)``, or ema
      ``w <- w - lr * ((1 - beta) * u_i + beta * M)`` (with ``u_i`` alone before the
      first cycle has closed); then ``t += 1; S += u_i; k += 1``;
    - the cycle closes when ``W`` is empty or when ``ceil(cycle_quorum * m)`` of its
      ``m`` members have contributed. Close: heavy-ball ``M <- S / k + beta * M``;
      ema ``M <- beta * M + (1 - beta) * S / k`` (``M <- S / k`` at the first
      close); ``S, k <- 0``; ``W <-`` all active nodes; then every pending slot is
      applied, oldest first, as its node's contribution to the new cycle (the node
      leaves ``W``); a cycle complete again right away closes again.

    Memory (model copies, ``size(w)`` float32 each): ``w``, ``M``, ``S`` and one
    slot per node that has a pending update (``s < |A|`` of them): ``3 + s``, at most
    ``2 + |A|``; the ``"table"`` variant adds one row per active node that has
    contributed and their running sum, ``|A| + 1`` more: at most ``3 + 2 * |A|``.
    Besides, chunk-sized scratch (at most ``CHUNK`` float32 each); a new slot or row
    takes the buffer of a slot applied or dropped before when there is one (no page
    faults), else is allocated while the step runs. Steps are computed as
    ``w - (c * u + lr * beta * M)`` with ``c = lr`` or ``lr * (1 - beta)``: the
    formulas above up to float32 rounding order; the momentum term is computed chunk
    by chunk, not kept.

    Learning rate per cycle (``lr_scaling = "cycle"``, the default): ``lr`` is the
    step per cycle, divided over the contributions that close a cycle. Each
    per-arrival step is ``w <- w - (lr / c) * (u_i + beta * M)`` (heavy-ball) or
    ``w <- w - (lr / c) * ((1 - beta) * u_i + beta * M)`` (ema), with
    ``c = max(1, ceil(cycle_quorum * |A|))`` (``|A|`` the active nodes at the step,
    or ``concurrency`` when fewer nodes train at once; ``c = max(1, |A|)`` with
    ``scheduling = False``). A cycle of ``c`` contributions thus moves ``w`` by
    about ``lr * (mean u + beta * M)`` whatever the number of nodes.

    Step at the cycle's close (``apply_at = "close"``; ``"auto"``, the default, picks it
    when the updates are displacements, ``displacement = True``, and ``"arrival"``, the
    rule above, for gradients): a contribution no longer moves ``w`` when it arrives.
    It is weighted by its staleness ``s`` (in versions, which now count closed cycles),
    ``a = 1 / sqrt(1 + s)`` (FedBuff's weight: Nguyen et al., AISTATS 2022), and summed,
    ``S <- S + a * u_i; k <- k + 1``; a slot folds ``a * g_i``. At the close
    ``w <- w - lr * S / k`` (at ``lr = 1`` FedAvg's step along the mean displacement)
    and ``t += 1``. There is no global momentum in this mode (``M`` stays 0; ``beta``,
    ``momentum_form`` and ``lr_scaling`` are the per-arrival step's): an ema of the
    cycle means lagged FedAvg per client training (docs/GSGM.md).
    With ``trim_fraction`` = f > 0 the cycle keeps its weighted contributions
    ``a * u_i`` instead of their sum and the close steps along their coordinate-wise
    trimmed mean, ``int(f * k)`` cut at each end (Yin et al., ICML 2018;
    :mod:`~flwr_gsgm.core.robust`): a node whose update points the wrong way moves no
    coordinate further than the honest ones around it. An option of this project's.
    A node that contributed to the open cycle, or whose update waits in a slot, is
    held (:meth:`holds`): the engine sends it no work until the cycle closes, so no
    node trains from a model about to be replaced. The quorum closes a cycle without
    its slowest members, whose updates arrive a cycle or more stale and weigh less.
    Averaging is slot averaging (``"table"`` is refused: its per-arrival step is what
    this mode replaces). Why this is the displacement modes' default: docs/GSGM.md,
    "FedAvg parity per client training".

    Args:
        weights: initial weights, a sequence of numpy arrays (copied to float32).
        partition_ids: partition-ids of the initially active nodes; they form the first
            cycle's white list.
        lr: server learning rate eta, > 0.
        beta: global momentum coefficient in [0, 1). ``beta = 0`` gives scheduled
            ASGD (ablation "scheduling only").
        momentum_form: ``"heavy-ball"`` or ``"ema"`` (see above).
        cycle_quorum: fraction in (0, 1] of the cycle's active members (white list at
            the cycle start, less nodes lost since) whose contribution closes the
            cycle; 1.0 = strictly even.
        scheduling: ``False`` is the momentum-only ablation: every arrival is applied
            as ``u_i`` and ``M`` is refreshed from the mean of each consecutive window
            of ``|A|`` applied updates (the window is the cycle; the white list stays
            empty, no slot is used; the quorum is ignored).
        averaging: ``"auto"`` (default: :meth:`auto_averaging` picks ``"table"``, or
            ``"slot"`` when ``concurrency`` is below the number of active nodes; the
            :attr:`averaging_in_use` tells which; a checkpoint loads only into the
            same variant),
            ``"slot"`` (the rule above) or ``"table"``: the scheduled
            contribution ``u_i`` replaces node ``i``'s row of a table of the latest
            contribution of every active node, and the step uses the table mean
            ``d = mean_j T_j`` in place of ``u_i`` (each node weighs ``1/|table|``
            whatever its speed); ``S`` sums ``d`` so ``M`` is momentum on that mean.
            Memory grows by ``|A| * size(w)``.
        lr_scaling: ``"step"`` (``lr`` per step) or ``"cycle"`` (``lr`` per cycle,
            ``lr / c`` per step, see above); a step per arrival only.
        apply_at: ``"auto"`` (default: ``"close"`` when ``displacement``, else
            ``"arrival"``; :attr:`apply_at_in_use` tells which; a checkpoint loads only
            into the same), ``"arrival"`` (a step on every contribution) or
            ``"close"`` (a step along the cycle's staleness-weighted mean at its
            close, with the dispatch hold; see above).
        trim_fraction: f in [0, 0.5), ``apply_at = "close"`` only: the trimmed mean
            above; 0 (default) = the plain mean.
        displacement: the updates are displacements ``w_sent - w_local`` (delta and
            weights client modes), not gradients; set by the strategy from the client
            mode, read by ``apply_at = "auto"`` only.
        concurrency: nodes training at once (set by the strategy from the engine's
            max-in-flight; None = every active node).
        max_staleness: optional staleness bound (see :class:`ServerOptimizer`).
        max_norm: optional L2-norm bound (see :class:`ServerOptimizer`).

    Defaults are declared once, in ``PARAMS`` (listed at the end of this docstring):
    the tuned choice of docs/GSGM.md's protocol, which also says why each option is
    kept and which options were deleted.

    Raises:
        ValueError: a parameter is not declared or out of range; the message names it.

    Extra counters: ``cycles`` (closes), ``cycles_quorum`` (closes by the quorum
    before the white list emptied), ``slots_applied``.

    Node churn: a lost node leaves ``A``, ``W`` and the cycle's members, its slot is
    dropped (counted in ``slots_dropped``) and, in table mode, its row; the cycle may
    close because of it. A node that joins, or rejoins after a loss, is not a member
    of the current cycle: it enters ``W`` at the next cycle, an update it sends
    meanwhile goes to its slot (applied at that next cycle's start), and neither its
    join nor a contribution it made before it was lost counts toward this cycle's
    quorum (that contribution stays in ``S`` and ``k``: it was applied to ``w``).

    The update, written plainly: :class:`PlainGSGM`.
    """

    name: ClassVar[str] = "gsgm"
    PARAMS: ClassVar[tuple[Param, ...]] = (
        BETA,
        Param(
            "momentum_form",
            "ema",
            "momentum form",
            kind=str,
            choices=_FORMS,
            normalize=lambda v: v.replace("_", "-").lower(),
            run_config_key="momentum-form",
        ),
        Param(
            "cycle_quorum",
            0.5,
            "fraction of nodes that closes a cycle",
            low=0.0,
            low_open=True,
            high=1.0,
            run_config_key="cycle-quorum",
        ),
        Param(
            "scheduling",
            True,
            "white-list scheduling (false = momentum only)",
            kind=bool,
            run_config_key="scheduling",
        ),
        # "auto": table with every node in flight (the tuned choice at 10 nodes),
        # slot under a concurrency limit (docs/GSGM.md, "Averaging under a limit").
        Param(
            "averaging",
            "auto",
            "partial averaging variant (auto = slot where the step is at the cycle's "
            "close; else table, or slot under a max-in-flight limit)",
            kind=str,
            choices=_AVERAGING,
            run_config_key="averaging",
        ),
        # Gradient mode: the tuned choice (docs/results/fashion_mnist_scale/tuned.toml),
        # a rate per cycle (lr_scaling), which at 10 nodes and the declared cycle_quorum
        # is the earlier default of 0.02 per step.
        # Displacement modes: the whole staleness-weighted mean displacement of a cycle
        # at its close (apply_at "auto" -> "close"): FedAvg's step per round, and the
        # one that matched FedAvg per client training on seed 0 (docs/GSGM.md, "FedAvg
        # parity per client training"; simulations/presets/fedavg_parity_seed0.toml).
        # With apply_at = "arrival" in a displacement mode 0.25 was the tuned fraction
        # (docs/results/fashion_mnist_realtime/tune.csv): set it.
        server_learning_rate(0.1, displacement=1.0),
        Param(
            "lr_scaling",
            "cycle",
            "server learning rate per step, or per cycle divided over the cycle's contributions",
            kind=str,
            choices=_LR_SCALING,
            run_config_key="lr-scaling",
        ),
        # "auto": a step per arrival for gradients (every published gradient-mode result),
        # at the cycle's close for displacements (docs/GSGM.md, "FedAvg parity per
        # client training": parity with FedAvg per client training on seed 0).
        Param(
            "apply_at",
            "auto",
            "when contributions move the model: arrival, or close (the cycle's weighted "
            "mean at its close, nodes that contributed held until then); auto = close "
            "in delta and weights modes, arrival in gradient mode",
            kind=str,
            choices=_APPLY_AT,
            run_config_key="apply-at",
        ),
        TRIM_FRACTION,
        # Set by the strategy from the client mode, not a run config key of its own.
        Param(
            "displacement",
            False,
            "the updates are displacements (delta and weights modes); apply_at = auto reads it",
            kind=bool,
        ),
        # Set by the strategy from the engine's max-in-flight, not a run config key of
        # its own: staleness grows with the nodes in flight, not with the nodes known.
        Param(
            "concurrency",
            None,
            "nodes training at once (none = every active node); "
            "lr_scaling = cycle counts c over min(|A|, concurrency)",
            kind=int,
            low=1,
            optional=True,
        ),
    )
    STATE_LAYOUT: ClassVar[tuple[str, ...]] = ("averaging", "scheduling", "apply_at")
    _LABELS: ClassVar[dict[str, str]] = {
        "_M": "momentum",
        "_S": "cycle sum",
        "_slots": "slot of node",
        "_table": "table row of node",
        "_table_sum": "table sum",
        "_rows": "cycle contribution",
    }
    _counter_names: ClassVar[tuple[str, ...]] = ServerOptimizer._counter_names + (
        "cycles",
        "cycles_quorum",
        "slots_applied",
    )

    def __init__(
        self, weights: Sequence[np.ndarray], partition_ids: Iterable[int], **params: Any
    ) -> None:
        super().__init__(weights, partition_ids, **params)
        # When contributions move w: "auto" is resolved from the kind of update.
        auto_apply = self._apply_at == "auto"
        self._apply = self.auto_apply_at(self._displacement) if auto_apply else self._apply_at
        self._close_mode = self._apply == "close"
        if self._trim_fraction > 0 and not self._close_mode:
            raise ValueError(
                f"gsgm: trim_fraction={self._trim_fraction} needs apply_at='close' (the "
                "cycle's contributions kept until its close), but apply_at resolves to "
                f"{self._apply!r}: use the delta or weights client mode, or apply_at='close'"
            )
        if self._close_mode and self._averaging == "table":
            raise ValueError(
                "gsgm: averaging='table' steps on every arrival, apply_at='close' at the "
                "cycle's close; use averaging='slot' (or 'auto') with apply_at='close', or "
                "apply_at='arrival' with the table"
            )
        auto = self._averaging == "auto"
        # The variant in use: "auto" is resolved once, from the nodes known now.
        if self._close_mode:
            self._variant = "slot"
        elif auto:
            self._variant = self.auto_averaging(len(self._active), self._concurrency)
        else:
            self._variant = self._averaging
        self._M = np.zeros(self._size, dtype=_F32)
        self._S = np.zeros(self._size, dtype=_F32)
        self._k = 0
        self._momentum_ready = False  # has a cycle closed with k > 0 (set M)?
        self._cycle_index = 0
        self._white: set[int] = set(self._active) if self._scheduling else set()
        # The cycle's members: the white list at its start less the nodes lost since.
        # A node that (re)joins mid-cycle is not one (docs/GSGM.md, "Node churn").
        self._members: set[int] = set(self._white)
        self._contributed: set[int] = set()
        # node -> [flat slot buffer, count]; insertion order = oldest first.
        self._slots: dict[int, list[Any]] = {}
        # table variant: node -> latest contribution, and the rows' sum.
        self._table: dict[int, np.ndarray] = {}
        self._table_sum = np.zeros(self._size, dtype=_F32) if self._variant == "table" else None
        self._scr_c = np.empty_like(self._scr_a)
        # apply_at = "close": the staleness weight of the update being handled.
        self._weight = 1.0
        # trim_fraction > 0: the cycle's weighted contributions (S stays 0).
        self._rows: list[np.ndarray] = []
        # trim_fraction > 0: whether a close that cut some (True) or none (False) was
        # logged; a cycle's size depends on the fleet, so the first of each is logged.
        self._trim_logged: set[bool] = set()

    @staticmethod
    def auto_apply_at(displacement: bool) -> str:
        """What ``apply_at = "auto"`` resolves to: ``"close"`` for displacements (the
        delta and weights client modes), ``"arrival"`` for gradients."""
        return "close" if displacement else "arrival"

    @staticmethod
    def auto_averaging(nodes: int, concurrency: int | None) -> str:
        """What ``averaging = "auto"`` resolves to: ``"table"`` or ``"slot"``.

        ``"slot"`` when a concurrency limit keeps some of the ``nodes`` (the active
        nodes when the rule is built) idle (``concurrency < nodes``), ``"table"``
        otherwise (``concurrency`` None: every node trains at once). Under a limit the
        scheduled dispatch already gives every node its turn, so the table's job
        (weighing each node once whatever its speed) is done at dispatch, and its
        rows of idle nodes are older than any update in flight: at 100 nodes with 20
        in flight they are up to ~120 versions old where a fresh update is ~20
        (docs/GSGM.md, "Averaging under a limit").
        """
        if concurrency is not None and concurrency < nodes:
            return "slot"
        return "table"

    def _copies(self, nodes: int) -> int:
        """Slot averaging: ``w``, ``M``, ``S`` and fewer than ``nodes`` slots (at most
        ``2 + nodes``), and with ``trim_fraction`` > 0 the cycle's contributions, at
        most one per node and one per slot applied at its start (``+ 2 * nodes``); table
        averaging adds a row per node and their sum."""
        if self._variant == "table":
            return 3 + 2 * nodes
        return 2 + nodes + (2 * nodes if self._trim_fraction > 0 else 0)

    # ---------------------------------------------------------------- introspection
    @property
    def averaging_in_use(self) -> str:
        """The averaging variant in use, ``"slot"`` or ``"table"`` (``"auto"`` resolved)."""
        return self._variant

    @property
    def apply_at_in_use(self) -> str:
        """When contributions move ``w``, ``"arrival"`` or ``"close"`` (``"auto"`` resolved)."""
        return self._apply

    def resolved_choices(self) -> dict[str, Any]:
        """The ``"auto"`` parameters resolved: ``{"averaging": "slot" or "table"}`` and
        ``{"apply_at": "arrival" or "close"}``, each when given as ``"auto"``."""
        out: dict[str, Any] = {}
        if self._averaging == "auto":
            out["averaging"] = self._variant
        if self._apply_at == "auto":
            out["apply_at"] = self._apply
        return out

    @property
    def momentum(self) -> np.ndarray:
        """A flat float32 copy of the global momentum ``M``."""
        return self._M.copy()

    @property
    def cycle_sum(self) -> np.ndarray:
        """A flat float32 copy of the current cycle's sum ``S`` (``trim_fraction`` > 0:
        the sum of its kept contributions)."""
        if self._rows:
            return np.sum(self._rows, axis=0, dtype=_F32)
        return self._S.copy()

    @property
    def cycle_count(self) -> int:
        """Number of contributions applied in the current cycle (``k``)."""
        return self._k

    @property
    def cycle_index(self) -> int:
        """Number of cycles closed so far (the first cycle has index 0)."""
        return self._cycle_index

    @property
    def white_list(self) -> frozenset[int]:
        """Active nodes that may still contribute in the current cycle (``W``)."""
        return frozenset(self._white)

    @property
    def members(self) -> frozenset[int]:
        """The current cycle's members: the white list at its start less nodes lost since.

        The quorum counts contributions of members only; a node that joins (or
        rejoins) during the cycle is a member from the next cycle on.
        """
        return frozenset(self._members)

    @property
    def contributed(self) -> frozenset[int]:
        """Nodes that contributed in the current cycle (lost ones included)."""
        return frozenset(self._contributed)

    @property
    def slots(self) -> dict[int, tuple[np.ndarray, int]]:
        """Pending slots, oldest first: node -> (flat float32 copy of P_i, n_i)."""
        return {n: (slot[0].copy(), int(slot[1])) for n, slot in self._slots.items()}

    @property
    def slot_counts(self) -> dict[int, int]:
        """Pending slots, oldest first: node -> n_i (no array copies)."""
        return {n: int(slot[1]) for n, slot in self._slots.items()}

    @property
    def table(self) -> dict[int, np.ndarray]:
        """Table variant: node -> flat float32 copy of its latest contribution."""
        return {n: row.copy() for n, row in self._table.items()}

    @property
    def momentum_ready(self) -> bool:
        """Whether a cycle with contributions has closed (``M`` was set)."""
        return self._momentum_ready

    # ------------------------------------------------------------------------ rule
    def _step_bound(self, norm: float) -> tuple[float, float]:
        # Slots and rows are means of updates (<= u); a contribution (an update, a
        # slot, or the table mean: x2 for the running sum's drift) <= 2u; S sums the
        # cycle's contributions, the table sum the rows; M <= 2u / (1 - beta). One
        # call makes at most 1 + |slots| contributions (a close applies the slots)
        # and as many closes, each step moving w by at most lr * 4u / (1 - beta).
        u = max(self._bound_u, norm)
        per_step = 4.0 * u / (1.0 - self._beta)
        contributions = 1 + len(self._slots)
        w_after = self._bound_w + (2 * contributions + 1) * self._lr * per_step
        terms = len(self._active) + len(self._table) + self._k + contributions + 2
        return w_after + (1.0 + self._lr) * per_step * terms, w_after

    def holds(self, partition_id: int) -> bool:
        """``apply_at = "close"``: True for a node that contributed to the open cycle or
        whose update waits in a slot. Its next work would start from a model the cycle's
        close is about to replace; the engine sends it none until the close."""
        if not self._close_mode:
            return False
        return partition_id in self._contributed or partition_id in self._slots

    def _on_valid(
        self, partition_id: int, parts: Parts, base_version: int, staleness: int, now: float
    ) -> Outcome:
        if self._close_mode:
            # Deferred until the cycle's close; applied if this update closes it.
            self._weight = 1.0 / math.sqrt(1.0 + staleness)
            version = self._version
            contributes = not self._scheduling or partition_id in self._white
            if contributes:
                self._contribute(partition_id, parts)
            else:
                self._fold(partition_id, parts)
            self._advance()
            return Outcome.APPLIED if contributes and self._version != version else Outcome.DEFERRED
        if not self._scheduling or partition_id in self._white:
            self._contribute(partition_id, parts)
            outcome = Outcome.APPLIED
        else:
            self._fold(partition_id, parts)
            outcome = Outcome.DEFERRED
        self._advance()
        if outcome is Outcome.DEFERRED and partition_id not in self._slots:
            outcome = Outcome.APPLIED  # its slot was applied when the cycle closed
        return outcome

    def _joined(self, partition_id: int, now: float) -> None:
        # Enters W at the next cycle; a cycle without members restarts at once.
        self._advance()

    def _lost(self, partition_id: int, now: float) -> None:
        self._white.discard(partition_id)
        self._members.discard(partition_id)
        slot = self._slots.pop(partition_id, None)
        if slot is not None:
            self._counters["slots_dropped"] += 1
            self._release(slot[0])
        row = self._table.pop(partition_id, None) if self._table_sum is not None else None
        if row is not None:
            self._release(row)
            self._recompute_table_sum()
        self._advance()

    # -------------------------------------------------------------------- cycles
    def _close_reason(self) -> str | None:
        if not self._scheduling:
            if self._k > 0 and self._k >= len(self._active):
                return "window"
            return None
        if not self._white:
            # Every member contributed or left. A cycle with nothing applied and no
            # active node has nothing to close; with active nodes (joined during the
            # cycle) it restarts so that they enter the white list.
            return "complete" if (self._k > 0 or self._active) else None
        if self._cycle_quorum < 1.0:
            # Only members count: a node lost after contributing and back since is
            # not one, so neither its earlier contribution nor its join closes the cycle.
            done = len(self._contributed & self._members)
            needed = max(1, math.ceil(self._cycle_quorum * len(self._members) - 1e-9))
            if done >= needed:
                return "quorum"
        return None

    def _advance(self) -> None:
        """Close cycles while one is due."""
        while True:
            reason = self._close_reason()
            if reason is None:
                return
            self._close(reason)

    def _close(self, reason: str) -> None:
        if self._k > 0 and self._close_mode:
            self._close_step()
        elif self._k > 0:
            self._refresh_momentum(self._S, self._k)
            self._S.fill(0.0)
        self._k = 0
        self._cycle_index += 1
        self._counters["cycles"] += 1
        if reason == "quorum":
            self._counters["cycles_quorum"] += 1
        self._contributed = set()
        if self._table_sum is not None:
            self._recompute_table_sum()  # bounds the drift of the running sum
        if not self._scheduling:
            return
        self._white = set(self._active)
        self._members = set(self._white)
        while self._slots:
            partition_id = next(iter(self._slots))
            buf, _count = self._slots.pop(partition_id)
            self._weight = 1.0  # close mode: its updates were weighted when folded
            self._contribute(partition_id, [(0, buf)])
            self._release(buf)
            self._counters["slots_applied"] += 1

    def _close_step(self) -> None:
        """``apply_at = "close"``: ``w <- w - lr * S / k``; ``S <- 0``; ``t += 1``
        (``trim_fraction`` > 0: :meth:`_trimmed_close_step`)."""
        if self._rows:
            self._trimmed_close_step()
            return
        w, a, k, lr = self._w, self._scr_a, self._k, self._lr
        for lo, hi, s in chunks([(0, self._S)]):
            t = a[: hi - lo]
            np.divide(s, k, out=t)
            np.multiply(t, lr, out=t)
            ws = w[lo:hi]
            np.subtract(ws, t, out=ws)
        self._S.fill(0.0)
        self._version += 1

    def _trimmed_close_step(self) -> None:
        """``w <- w - lr * trimmed mean of the cycle's contributions``; ``t += 1``."""
        rows = self._rows
        self._log_trim(len(rows))
        trimmed_step(self._w, rows, self._trim_fraction, self._lr, self._scr_a)
        for row in rows:
            self._release(row)
        self._rows = []
        self._version += 1

    def _log_trim(self, n: int) -> None:
        """Log the first trimmed close that cuts some of its ``n`` contributions (INFO)
        and the first that cuts none (WARNING: ``int(f * n)`` = 0, so that close is the
        plain mean): the cut depends on the cycle's size, which the fleet sets."""
        f = self._trim_fraction
        cut = trimmed_count(n, f)
        if (cut > 0) in self._trim_logged:
            return
        self._trim_logged.add(cut > 0)
        if cut:
            _log.info(
                "gsgm: trimmed close: cut %d of %d contributions at each end (trim_fraction=%g)",
                cut,
                n,
                f,
            )
        else:
            _log.warning(
                "gsgm: trimmed close of %d contributions cut none (int(%g x %d) = 0): it "
                "was the plain mean; trim_fraction >= %g cuts one at each end",
                n,
                f,
                n,
                least_cutting_fraction(n),
            )

    def _refresh_momentum(self, src: np.ndarray, count: int) -> None:
        """Fold the cycle mean ``src / count`` into ``M`` (heavy-ball or ema)."""
        M, beta = self._M, self._beta
        a = self._scr_a
        first = not self._momentum_ready
        ema = self._momentum_form == "ema"
        for lo, hi, s in chunks([(0, src)]):
            m = M[lo:hi]
            if ema and first:
                np.divide(s, count, out=m)  # M <- S / k
                continue
            t = a[: hi - lo]
            np.divide(s, count, out=t)
            if ema:  # M <- beta * M + (1 - beta) * S / k
                np.multiply(t, 1.0 - beta, out=t)
                np.multiply(m, beta, out=m)
                np.add(m, t, out=m)
            else:  # M <- S / k + beta * M
                np.multiply(m, beta, out=m)
                np.add(t, m, out=m)
        self._momentum_ready = True

    # ------------------------------------------------------------------ the steps
    def _contribute(self, partition_id: int, parts: Parts) -> None:
        """Apply ``u`` (``parts``) as ``partition_id``'s contribution to the current cycle
        (``apply_at = "close"``: add it to ``S`` with its staleness weight, no step)."""
        if self._close_mode and self._trim_fraction > 0:
            row = self._copy_new(parts)
            if self._weight != 1.0:
                np.multiply(row, self._weight, out=row)
            self._rows.append(row)
        elif self._close_mode:
            self._accumulate(self._S, parts, self._weight)
        else:
            if self._table_sum is not None:
                self._table_step(partition_id, parts)
            else:
                self._step(parts)
            self._version += 1
        self._k += 1
        self._white.discard(partition_id)
        self._contributed.add(partition_id)

    def _step_lr(self) -> float:
        """Learning rate of one per-arrival step: ``lr``, or ``lr / c`` (lr_scaling)."""
        if self._lr_scaling == "step":
            return self._lr
        n = len(self._active)
        if self._concurrency is not None:
            n = min(n, self._concurrency)
        if self._scheduling:
            c = max(1, math.ceil(self._cycle_quorum * n - 1e-9))
        else:
            c = max(1, n)
        return self._lr / c

    def _coefficients(self) -> tuple[float, float, bool]:
        """``(coef, m_coef, use_m)`` of a per-arrival step (see :meth:`_step`)."""
        lr = self._step_lr()
        if self._momentum_form == "ema" and self._momentum_ready:
            coef = lr * (1.0 - self._beta)
        else:
            coef = lr
        return coef, lr * self._beta, self._beta != 0.0 and self._momentum_ready

    def _step(self, parts: Parts) -> None:
        """``w <- w - (coef * u + lr' * beta * M)``; ``S <- S + u``; ``u = parts``.

        ``lr'`` is the per-step learning rate (``lr``, or ``lr / c`` with
        ``lr_scaling = "cycle"``); ``coef`` is ``lr'`` (heavy-ball, and ema before
        the first close) or ``lr' * (1 - beta)`` (ema). The momentum term
        ``lr' * beta * M`` is computed chunk by chunk in cache (a model-sized copy of
        it would cost memory and save no memory traffic: M is read either way).
        """
        coefs = self._coefficients()
        for lo, hi, u in chunks(parts):
            self._step_chunk(lo, hi, u, coefs)

    def _step_chunk(
        self, lo: int, hi: int, u: np.ndarray, coefs: tuple[float, float, bool]
    ) -> None:
        """One chunk of :meth:`_step`: ``w[lo:hi]`` and ``S[lo:hi]`` along ``u``."""
        coef, m_coef, use_m = coefs
        n = hi - lo
        d = self._scr_a[:n]
        np.multiply(u, coef, out=d)
        if use_m:
            t = self._scr_b[:n]
            np.multiply(self._M[lo:hi], m_coef, out=t)
            np.add(d, t, out=d)
        ws = self._w[lo:hi]
        np.subtract(ws, d, out=ws)
        ss = self._S[lo:hi]
        np.add(ss, u, out=ss)

    def _table_step(self, partition_id: int, parts: Parts) -> None:
        """Table averaging: ``u`` replaces the node's row (the running sum follows:
        ``+ u - row``, or ``+ u`` for a new row), then :meth:`_step` along the table
        mean ``sum / |table|``. One pass over the chunks: a chunk's row and sum are
        updated, then stepped along, while in cache (the same float32 operations, in
        the same order, as a pass for the table and a pass for the step)."""
        row = self._table.get(partition_id)
        new = row is None
        if new:
            row = self._table[partition_id] = self._new_buffer()
        count = len(self._table)
        tsum, a, c = self._table_sum, self._scr_a, self._scr_c
        coefs = self._coefficients()
        for lo, hi, u in chunks(parts):
            ts = tsum[lo:hi]
            replace_row(row[lo:hi], ts, u, a, new)
            mean = c[: hi - lo]
            np.divide(ts, count, out=mean)
            self._step_chunk(lo, hi, mean, coefs)

    def _accumulate(self, dst: np.ndarray, parts: Parts, weight: float) -> None:
        """``dst <- dst + weight * u`` (``u = parts``; no multiplication at weight 1)."""
        a = self._scr_a
        for lo, hi, u in chunks(parts):
            d = dst[lo:hi]
            if weight != 1.0:
                t = a[: hi - lo]
                np.multiply(u, weight, out=t)
                u = t
            np.add(d, u, out=d)

    def _fold(self, partition_id: int, parts: Parts) -> None:
        """Fold ``g`` into the node's slot: ``P <- P + (g - P) / n`` (``apply_at =
        "close"``: ``a * g`` with its staleness weight ``a``)."""
        weight = self._weight if self._close_mode else 1.0
        slot = self._slots.get(partition_id)
        if slot is None:
            buf = self._copy_new(parts)
            if weight != 1.0:
                np.multiply(buf, weight, out=buf)
            self._slots[partition_id] = [buf, 1]
            return
        slot[1] += 1
        buf, count = slot[0], slot[1]
        a, b = self._scr_a, self._scr_b
        for lo, hi, g in chunks(parts):
            t = a[: hi - lo]
            p = buf[lo:hi]
            if weight != 1.0:
                gw = b[: hi - lo]
                np.multiply(g, weight, out=gw)
                g = gw
            np.subtract(g, p, out=t)
            np.divide(t, count, out=t)
            np.add(p, t, out=p)

    def _recompute_table_sum(self) -> None:
        tsum = self._table_sum
        tsum.fill(0.0)
        for partition_id in sorted(self._table):
            np.add(tsum, self._table[partition_id], out=tsum)

    # -------------------------------------------------------------- checkpointing
    def _extra_state(self) -> dict[str, Any]:
        return {
            "momentum": self._M.copy(),
            "cycle_sum": self._S.copy(),
            "cycle_count": self._k,
            "momentum_ready": self._momentum_ready,
            "cycle_index": self._cycle_index,
            "white_list": sorted(self._white),
            "members": sorted(self._members),
            "contributed": sorted(self._contributed),
            "slot_nodes": list(self._slots),
            "slot_counts": [int(s[1]) for s in self._slots.values()],
            "slot_values": [s[0].copy() for s in self._slots.values()],
            "table_nodes": list(self._table),
            "table_values": [row.copy() for row in self._table.values()],
            "table_sum": None if self._table_sum is None else self._table_sum.copy(),
            "averaging_in_use": self._variant,
            "apply_at_in_use": self._apply,
            "cycle_rows": [row.copy() for row in self._rows],
        }

    def _check_state_extra(self, state: dict[str, Any], version: int, active: set[int]) -> None:
        """GSGM's invariants (the params are the state's, which the load restores).

        Counts and indices are integers >= 0 (slot counts >= 1); the white list and
        the nodes with a slot or a table row are active and listed once; the white
        list holds no node that contributed in this cycle; a state with
        ``averaging = "slot"`` has no table (rows or sum) and one with ``"table"`` has
        its sum; without scheduling there is no white list and no slot.
        """
        params = dict(state["params"])
        for key in ("cycle_count", "cycle_index"):
            state_int(state[key], key)
        white = state_nodes(state["white_list"], "white_list", within=active)
        contributed = state_nodes(state["contributed"], "contributed")
        if white & contributed:
            raise ValueError(
                f"state['white_list'] holds node(s) {sorted(white & contributed)} that "
                "contributed in this cycle (state['contributed'])"
            )
        members = state_nodes(state["members"], "members", within=active)
        if not white <= members:
            raise ValueError(
                f"state['white_list'] holds node(s) {sorted(white - members)} that are "
                "not members of the cycle (state['members'])"
            )
        slots = state_nodes(state["slot_nodes"], "slot_nodes", within=active)
        for i, count in enumerate(state["slot_counts"]):
            state_int(count, "slot_counts", i, low=1)
        rows = state_nodes(state["table_nodes"], "table_nodes", within=active)
        variant = state["averaging_in_use"]
        if variant not in ("slot", "table"):
            raise ValueError(
                f"state['averaging_in_use'] is {variant!r}, expected 'slot' or 'table'"
            )
        table = variant == "table"
        if not table and (rows or state["table_sum"] is not None):
            raise ValueError(
                f"state['table_nodes'] / state['table_sum'] hold table-averaging data, but "
                f"the state's averaging is {variant!r}"
            )
        if table and state["table_sum"] is None:
            raise ValueError("state['table_sum'] is None, but the state's averaging is 'table'")
        if not params["scheduling"] and (white or slots):
            raise ValueError(
                "state['white_list'] / state['slot_nodes'] are not empty, but the state's "
                "params have scheduling=False"
            )
        apply_at = state["apply_at_in_use"]
        if apply_at not in ("arrival", "close"):
            raise ValueError(
                f"state['apply_at_in_use'] is {apply_at!r}, expected 'arrival' or 'close'"
            )
        if apply_at == "close" and table:
            raise ValueError("state['apply_at_in_use'] is 'close', but its averaging is 'table'")
        trimming = apply_at == "close" and params["trim_fraction"] > 0
        kept, count = len(state["cycle_rows"]), state["cycle_count"]
        if kept != (count if trimming else 0):
            raise ValueError(
                f"state['cycle_rows'] holds {kept} contribution(s); expected "
                + (f"cycle_count = {count}" if trimming else "none (no trim_fraction at close)")
            )

    def _load_extra(self, state: dict[str, Any]) -> None:
        M = self._flat_array(state["momentum"], "momentum")
        S = self._flat_array(state["cycle_sum"], "cycle_sum")
        partition_ids = [int(n) for n in state["slot_nodes"]]
        counts = [int(c) for c in state["slot_counts"]]
        values = [self._flat_array(v, "slot_values") for v in state["slot_values"]]
        if not len(partition_ids) == len(counts) == len(values):
            raise ValueError("state slot_nodes, slot_counts, slot_values differ in length")
        tnodes = [int(n) for n in state["table_nodes"]]
        tvalues = [self._flat_array(v, "table_values") for v in state["table_values"]]
        if not len(tnodes) == len(tvalues):
            raise ValueError("state table_nodes, table_values differ in length")
        tsum = state["table_sum"]
        # With averaging = "auto" the state's variant is the one chosen when the run
        # started, with its nodes; this optimizer's may have been resolved without them.
        self._variant = state["averaging_in_use"]
        # Likewise apply_at = "auto": the state's choice, made with its client mode.
        self._apply = state["apply_at_in_use"]
        self._close_mode = self._apply == "close"
        self._M[...] = M
        self._S[...] = S
        self._k = int(state["cycle_count"])
        self._momentum_ready = bool(state["momentum_ready"])
        self._cycle_index = int(state["cycle_index"])
        self._white = {int(n) for n in state["white_list"]}
        self._members = {int(n) for n in state["members"]}
        self._contributed = {int(n) for n in state["contributed"]}
        self._slots = {n: [v, c] for n, c, v in zip(partition_ids, counts, values)}
        self._table = dict(zip(tnodes, tvalues))
        self._table_sum = None if tsum is None else self._flat_array(tsum, "table_sum")
        self._rows = [self._flat_array(v, "cycle_rows") for v in state["cycle_rows"]]


# --------------------------------------------------------------------- the plain kernel
class PlainGSGM(PlainKernel):
    """GSGM's update written plainly (:class:`~flwr_gsgm.core.base.PlainKernel`).

    The project's reconstruction (docs/GSGM.md, steps 1-5) of Li et al.,
    arXiv:1902.07848, and Wang et al., IEEE IoT-J 9(19), 2022, as :class:`GSGMRule`'s
    docstring states it. Nodes take turns in cycles: the white list ``W`` holds the
    cycle's members that have not contributed yet; an update of a node outside ``W``
    waits in the node's slot ``P_i``, the running mean of its updates
    ``P_i <- P_i + (g_i - P_i) / n_i`` (``"deferred"``), and is the node's
    contribution to the next cycle. A cycle closes when ``W`` is empty or when
    ``ceil(cycle_quorum * m)`` of its ``m`` members have contributed; the pending slots
    are then applied, oldest first.

    Step per arrival (``apply_at = "arrival"``, the gradient mode's default), for a
    contribution ``u`` (the update, a slot, or, with table averaging, the mean of the
    table of every node's latest contribution after ``T_i <- u``)::

        heavy-ball:  w <- w - lr' * (u + beta * M)
        ema:         w <- w - lr' * ((1 - beta) * u + beta * M)   (lr' * u before the
                                                                   first close)
        at the close, with C the cycle's contributions:
        heavy-ball:  M <- mean(C) + beta * M
        ema:         M <- beta * M + (1 - beta) * mean(C)          (mean(C) the first time)

    ``lr' = lr`` (``lr_scaling = "step"``) or ``lr / max(1, ceil(cycle_quorum * N))``
    (``"cycle"``), ``N = min(|A|, concurrency)`` the nodes training at once
    (``max(1, N)`` without scheduling).

    Step at the close (``apply_at = "close"``, the displacement modes' default; slot
    averaging): a contribution is weighted by its staleness ``s``, ``u = g_i /
    sqrt(1 + s)`` (a slot folds the weighted updates), and kept; at the close
    ``w <- w - lr * mean(C)``, or along the coordinate-wise trimmed mean of ``C`` with
    ``trim_fraction`` > 0 (:func:`~flwr_gsgm.core.robust.plain_trimmed_mean`); no
    momentum.

    Covers every variant the rule accepts: both ``apply_at`` (``"auto"`` resolved from
    ``displacement``), slot and table averaging (``"auto"`` resolved from the nodes and
    ``concurrency`` at the start), both momentum forms, both ``lr_scaling``, any
    ``cycle_quorum`` and ``beta``, ``trim_fraction``, and ``scheduling = False`` (every
    arrival contributes; a window of ``|A|`` contributions is the cycle). Node churn as
    the rule: a lost node leaves ``A``, ``W`` and the members, with its slot and its
    table row; a node that joins is a member from the next cycle. Not covered: the
    dispatch hold (:meth:`GSGMRule.holds`, the engine's to obey). ``w``, ``g``, ``M``,
    the slots, the table rows and the contributions are flat float32 of shape ``(n,)``.
    """

    def __init__(
        self,
        w: np.ndarray,
        nodes: Iterable[int],
        *,
        lr: float,
        beta: float,
        momentum_form: str,
        cycle_quorum: float,
        scheduling: bool,
        averaging: str,
        lr_scaling: str,
        apply_at: str,
        trim_fraction: float,
        displacement: bool,
        concurrency: int | None,
    ) -> None:
        super().__init__(w, nodes, lr)
        self.beta, self.form, self.quorum = beta, momentum_form, cycle_quorum
        self.scheduling, self.lr_scaling = scheduling, lr_scaling
        self.trim_fraction, self.concurrency = trim_fraction, concurrency
        if apply_at == "auto":
            apply_at = "close" if displacement else "arrival"
        self.at_close = apply_at == "close"
        if averaging == "auto":
            limited = concurrency is not None and concurrency < len(self.active)
            averaging = "slot" if limited else "table"
        if self.at_close:
            averaging = "slot"
        self.table: dict[int, np.ndarray] | None = {} if averaging == "table" else None
        self.M = np.zeros_like(self.w)
        self.momentum_ready = False  # has a cycle with contributions closed?
        self.cycle: list[np.ndarray] = []  # C: the contributions of the open cycle
        self.white = set(self.active) if scheduling else set()  # W
        self.members = set(self.white)
        self.contributed: set[int] = set()
        self.slots: dict[int, tuple[np.ndarray, int]] = {}  # node -> (P_i, n_i), oldest first

    def arrive(self, node: int, g: np.ndarray, base_version: int, now: float = 0.0) -> str:
        version = self.version
        if self.at_close:
            g = g / math.sqrt(1 + (self.version - base_version))
        contributes = not self.scheduling or node in self.white
        if contributes:
            self._contribute(node, g)
        else:
            P, n = self.slots.get(node, (0.0, 0))
            self.slots[node] = (P + (g - P) / (n + 1), n + 1)
        self._close_due_cycles()
        if not contributes:
            return "deferred"  # in its slot until the next cycle starts
        if self.at_close and self.version == version:
            return "deferred"  # w moves at the close of the cycle it contributed to
        return "applied"

    def lost(self, node: int, now: float = 0.0) -> None:
        super().lost(node, now)
        self.white.discard(node)
        self.members.discard(node)
        self.slots.pop(node, None)
        if self.table is not None:
            self.table.pop(node, None)
        self._close_due_cycles()

    def joined(self, node: int, now: float = 0.0) -> None:
        super().joined(node, now)
        self._close_due_cycles()

    def _contribute(self, node: int, u: np.ndarray) -> None:
        if not self.at_close:
            if self.table is not None:
                self.table[node] = u
                u = np.mean(list(self.table.values()), axis=0)
            lr = self._step_lr()
            if self.form == "ema" and self.momentum_ready:
                self.w -= lr * ((1 - self.beta) * u + self.beta * self.M)
            else:  # heavy-ball, or ema before the first close (M = 0)
                self.w -= lr * (u + self.beta * self.M)
            self.version += 1
        self.cycle.append(u)
        self.white.discard(node)
        self.contributed.add(node)

    def _step_lr(self) -> float:
        if self.lr_scaling == "step":
            return self.lr
        n = (
            len(self.active)
            if self.concurrency is None
            else min(len(self.active), self.concurrency)
        )
        # - 1e-9: a product such as 0.7 * 10 = 7.000000000000001 is 7 contributions.
        c = math.ceil(self.quorum * n - 1e-9) if self.scheduling else n
        return self.lr / max(1, c)

    def _cycle_due(self) -> bool:
        if not self.scheduling:  # a window of |A| contributions
            return bool(self.cycle) and len(self.cycle) >= len(self.active)
        if not self.white:  # every member contributed or left (nothing to close if
            # nothing was contributed and no node is active)
            return bool(self.cycle) or bool(self.active)
        done = len(self.contributed & self.members)
        return done >= max(1, math.ceil(self.quorum * len(self.members) - 1e-9))

    def _close_due_cycles(self) -> None:
        while self._cycle_due():
            self._close()

    def _close(self) -> None:
        if self.cycle and self.at_close:
            self.w -= self.lr * plain_trimmed_mean(self.cycle, self.trim_fraction)
            self.version += 1
        elif self.cycle:
            mean = np.mean(self.cycle, axis=0)
            if self.form == "heavy-ball":
                self.M = mean + self.beta * self.M
            elif self.momentum_ready:
                self.M = self.beta * self.M + (1 - self.beta) * mean
            else:
                self.M = mean
            self.momentum_ready = True
        self.cycle = []
        self.contributed = set()
        if not self.scheduling:
            return
        self.white = set(self.active)
        self.members = set(self.white)
        while self.slots:  # each pending slot, oldest first, opens the new cycle
            node = next(iter(self.slots))
            P, _ = self.slots.pop(node)
            self._contribute(node, P)
