"""FedCompass: semi-asynchronous aggregation of arrival groups, weighted by staleness.

Reference:
    Z. Li, P. Chaturvedi, S. He, H. Chen, G. Singh, V. Kindratenko, E. A. Huerta,
    K. Kim, R. Madduri, "FedCompass: Efficient Cross-Silo Federated Learning on
    Heterogeneous Client Devices Using a Computing Power-Aware Scheduler", ICLR 2024,
    arXiv 2309.14675. Public code: APPFL (github.com/APPFL/APPFL), its
    ``CompassScheduler`` (``src/appfl/scheduler/compass_scheduler.py``) and
    ``FedCompassAggregator`` (``src/appfl/aggregator/fedcompass_aggregator.py``), and
    the original server ``ServerFedCompass``; the declared defaults
    (``FedCompassRule.PARAMS``) are its FedCompass configuration's
    (``examples/resources/configs/mnist/server_fedcompass.yaml``): alpha 0.9,
    polynomial staleness with exponent a = 0.5, equal client weights, lambda
    (``latest_time_factor``) 1.5, ``min_local_steps`` 20, ``max_local_steps`` 100,
    ``speed_momentum`` 0.9.

The COMPASS scheduler (the step assignment, its arrival groups and their deadlines)
lives in :mod:`flwr_gsgm.scheduling.compass`: the engine builds it for this rule
(:attr:`FedCompassRule.WORK_SCHEDULER`) and hands both the same book of arrival
groups (:meth:`FedCompassRule.share_schedule`). This module is the aggregation:

- each valid update Delta_i (a descent direction: a gradient or the displacement
  ``w_sent - w_local``) counts with ``c_i = s(tau_i) / N``, ``s(tau) = (1 + tau)^-a``
  (the paper's polynomial staleness), ``tau_i`` its staleness in versions and
  ``N = min(concurrency, |A|)``, the nodes training at once: APPFL's equal weights
  ``1 / num_clients`` (``FedCompassAggregator.aggregate``), all of whose clients
  always train. Under a concurrency limit (``concurrency``, the engine's
  ``max-in-flight``) only that many are in flight, and dividing by every active
  node would shrink each server step by ``|A| / concurrency`` (5x for 100 nodes with
  20 in flight);
- a node without a group (its first, unscheduled, message) is applied alone on
  arrival: ``w <- w - eta * c_i * Delta_i`` (APPFL ``_single_update``);
- a group member back by its group's deadline is buffered in its group; a member
  back after it goes to the general buffer;
- a group is aggregated once every member is back, or at the first event after its
  deadline with the members back by then: ``w <- w - eta * (G + B)``, G the group's
  sum of ``c_i * Delta_i``, B the general buffer's; both are emptied and ``version``
  moves by one (APPFL ``_group_aggregation``, ``gradient_based``);
- without a scheduler (a rule built alone), or once it turned itself off (a ClientApp
  that reports no ``train-steps``), every arrival goes to the general buffer,
  aggregated every ``buffer_size`` arrivals: FedBuff-like, with the same ``c_i``.

eta's displacement-mode default is APPFL's ``alpha``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, Protocol

import numpy as np

from .base import Outcome, Parts, PlainKernel, ServerOptimizer, chunks
from .params import Param, server_learning_rate

__all__ = ["ArrivalBook", "FedCompassRule", "PlainFedCompass"]

# What an arrival is, as the shared book answers (flwr_gsgm.scheduling.compass, which
# this numpy-only package does not import; a test checks the two agree).
GROUP, LATE, SINGLE, OFF = "group", "late", "single", "off"


class ArrivalBook(Protocol):
    """What the rule reads and writes of the arrival groups it shares with the
    scheduler (:class:`flwr_gsgm.scheduling.compass.ArrivalGroups`)."""

    def arrive(self, partition_id: int, now: float) -> tuple[str, int | None]: ...

    def due(self, now: float) -> list[int]: ...

    def close(self, gid: int) -> list[int]: ...

    def leave(self, partition_id: int) -> None: ...

    def release(self, partition_id: int) -> None: ...

    def next_deadline(self) -> float | None: ...


class FedCompassRule(ServerOptimizer):
    """FedCompass: ``w <- w - lr * (G + B)`` once a group is back, each update ``(1+tau)^-a / N``.

    G is the group's sum, B the general buffer's (late members); the module docstring
    has the rule.

    Outcomes: an update applied by this call (alone, or closing its group, or filling
    the fallback buffer) is :attr:`Outcome.APPLIED`; a buffered one
    :attr:`Outcome.DEFERRED`. A group whose deadline passed is aggregated at the
    rule's next event (an arrival, a join or a loss), before that event.

    Simplifications against the paper and APPFL (docs/GSGM.md, "Baselines"):

    - a deadline is acted on at the first event after it, not by a timer at the
      instant; the members released then get new work at that event;
    - the staleness weight of a buffered update is taken at its arrival (APPFL's
      original ``ServerFedCompass.buffer``), not at aggregation (its current
      aggregator): they differ only for a member buffered while another group
      aggregated;
    - N is ``min(concurrency, |A|)`` when the update arrives, the nodes in flight
      (APPFL: the fixed number of clients, all of which always train); the weights
      are equal (APPFL's ``weights: equal``), not by sample count;
    - the fallback without a scheduler (FedBuff-like, ``buffer_size``) is this
      project's; APPFL has none.

    Args:
        weights: initial weights, a sequence of numpy arrays (copied to float32).
        partition_ids: partition-ids of the initially active nodes.
        lr: eta, > 0 (its displacement-mode default is APPFL's alpha).
        min_local_steps, max_local_steps: Q_min and Q_max of the scheduler, absolute
            local step counts (APPFL's; 20 and 100), ``1 <= Q_min <= Q_max``.
        latest_factor: lambda >= 1 of a group's deadline.
        staleness_exponent: a >= 0 of ``s(tau) = (1 + tau)^-a``.
        speed_momentum: the scheduler's weight of a node's newest speed measurement.
        buffer_size: K >= 1 of the fallback without a scheduler.
        concurrency: nodes training at once, N's cap (None: every active node; a
            strategy leaves it None and the engine's ``max-in-flight`` fills it).
        max_staleness, max_norm: see :class:`ServerOptimizer`.

    Raises:
        ValueError: a parameter out of range, or ``min_local_steps >
            max_local_steps``; the message names the values.

    Memory: ``w``, the general buffer, and one sum per group with members back
    (at most one per active node) while a scheduler is shared: ``2 + |A|`` copies;
    ``2`` without one.

    The update, written plainly: :class:`PlainFedCompass`.
    """

    name: ClassVar[str] = "fedcompass"
    WORK_SCHEDULER: ClassVar[str | None] = "compass"
    PARAMS: ClassVar[tuple[Param, ...]] = (
        # Displacement modes: APPFL's alpha on sum_i Delta_i / N: a round in which every
        # node arrives once moves w by alpha of the nodes' mean displacement.
        # Gradient mode (not the paper's: no local steps to schedule): the declared rate
        # / N per gradient, at 10 nodes ASGD's gradient step (ASGDRule.PARAMS).
        server_learning_rate(0.2, displacement=0.9),
        # Absolute step counts, as APPFL's scheduler_kwargs (its example configs,
        # e.g. examples/resources/configs/mnist/server_fedcompass.yaml: 20 and 100),
        # not fractions of a node's own work: own work (an epoch of 19 steps here) as
        # Q_max kept FedCompass to one epoch where the other methods go up to 4x.
        Param(
            "min_local_steps",
            20,
            "Q_min, least local steps of a scheduled message (APPFL's min_local_steps)",
            kind=int,
            low=1,
            run_config_key="fedcompass-min-local-steps",
        ),
        Param(
            "max_local_steps",
            100,
            "Q_max, most local steps of a scheduled message (APPFL's max_local_steps)",
            kind=int,
            low=1,
            run_config_key="fedcompass-max-local-steps",
        ),
        Param(
            "latest_factor",
            1.5,
            "deadline factor lambda: a group's latest over its expected arrival",
            low=1.0,
            run_config_key="fedcompass-lambda",
        ),
        Param(
            "staleness_exponent",
            0.5,
            "staleness exponent a of the weight (1 + tau)^-a",
            low=0.0,
            run_config_key="fedcompass-a",
        ),
        Param(
            "speed_momentum",
            0.9,
            "weight of a node's newest speed measurement",
            low=0.0,
            low_open=True,
            high=1.0,
        ),
        Param("buffer_size", 5, "buffer size K", kind=int, low=1, run_config_key="fedbuff-k"),
        # Set from the engine's max-in-flight (RuleSpec fills a None), not a run config
        # key of its own: N counts the nodes in flight, as APPFL's clients all are.
        Param(
            "concurrency",
            None,
            "nodes training at once (none = every active node); N = min(|A|, concurrency)",
            kind=int,
            low=1,
            optional=True,
        ),
    )

    def __init__(
        self, weights: Sequence[np.ndarray], partition_ids: Iterable[int], **params: Any
    ) -> None:
        super().__init__(weights, partition_ids, **params)
        if self._min_local_steps > self._max_local_steps:
            raise ValueError(
                f"min_local_steps ({self._min_local_steps!r}) must be at most "
                f"max_local_steps ({self._max_local_steps!r}): Q_min <= Q_max"
            )
        self._general = np.zeros(self._size, dtype=np.float32)
        self._general_count = 0
        self._groups: dict[int, np.ndarray] = {}  # group id -> sum of c_i * Delta_i
        self._group_counts: dict[int, int] = {}
        self._book: ArrivalBook | None = None

    _LABELS: ClassVar[dict[str, str]] = {"_general": "general buffer", "_groups": "group buffer"}

    # ------------------------------------------------------------ the scheduler
    def schedule_params(self) -> dict[str, Any]:
        """The :class:`~flwr_gsgm.scheduling.compass.CompassScheduler`'s arguments."""
        return {
            "min_local_steps": self._min_local_steps,
            "max_local_steps": self._max_local_steps,
            "latest_factor": self._latest_factor,
            "smoothing": self._speed_momentum,
        }

    def share_schedule(self, book: Any) -> None:
        """Read the arrival groups from ``book`` (an :class:`ArrivalBook`) from now on."""
        self._book = book

    # ------------------------------------------------------------------ figures
    def _copies(self, nodes: int) -> int:
        """``w``, the general buffer and, with a scheduler, a group sum per node."""
        return 2 + (nodes if self._book is not None else 0)

    @property
    def buffered(self) -> dict[Any, int]:
        """Updates waiting: ``{"general": count, group id: count, ...}``."""
        return {"general": self._general_count, **self._group_counts}

    def in_flight(self) -> int:
        """N: the nodes training at once, ``min(concurrency, |A|)`` (at least 1)."""
        n = len(self._active)
        if self._concurrency is not None:
            n = min(n, self._concurrency)
        return max(1, n)

    def weight(self, staleness: int) -> float:
        """``c = (1 + staleness)^-a / N`` of an update arriving now, N = :meth:`in_flight`.

        APPFL (``FedCompassAggregator.aggregate``): ``alpha_t = alpha *
        staleness_fn(staleness) * weight`` with ``weight = 1.0 / num_clients``; its
        clients all train at once, so N is the number in flight, not of active nodes.
        """
        return (1.0 + staleness) ** (-self._staleness_exponent) / self.in_flight()

    def _step_bound(self, norm: float) -> tuple[float, float]:
        # Every buffered entry and the new one weigh c <= 1; this call may aggregate
        # them all (in several groups), each entry at most once.
        k = self._general_count + sum(self._group_counts.values()) + 1
        u = max(self._bound_u, norm)
        w_after = self._bound_w + self._lr * k * u
        return w_after + (1.0 + self._lr) * k * u, w_after

    # ---------------------------------------------------------------- the rule
    def next_deadline(self) -> float | None:
        """The earliest deadline of a group with members back and members still out:
        when APPFL's timer would aggregate it without them (None: no such group)."""
        if self._book is None:
            return None
        return self._book.next_deadline()

    def _tick(self, now: float) -> None:
        # Groups whose deadline passed are aggregated before the event (APPFL's timer).
        self._aggregate_due(now)

    def _on_valid(
        self, partition_id: int, parts: Parts, base_version: int, staleness: int, now: float
    ) -> Outcome:
        c = self.weight(staleness)
        book = self._book
        kind, gid = book.arrive(partition_id, now) if book is not None else (OFF, None)
        if kind == SINGLE:
            self._single_step(parts, c)
            return Outcome.APPLIED
        if kind == GROUP:
            assert gid is not None
            buf = self._groups.get(gid)
            if buf is None:
                buf = self._groups[gid] = self._new_buffer()
                buf.fill(0.0)
                self._group_counts[gid] = 0
            self._accumulate(buf, parts, c)
            self._group_counts[gid] += 1
            return Outcome.APPLIED if gid in self._aggregate_due(now) else Outcome.DEFERRED
        self._accumulate(self._general, parts, c)  # late, or no scheduler
        self._general_count += 1
        if kind == OFF and self._general_count >= self._buffer_size:
            self._aggregate(None)
            return Outcome.APPLIED
        return Outcome.DEFERRED

    def _on_stale(self, partition_id: int, now: float) -> Outcome:
        # Dropped: its group waits for it no more (and may be complete now).
        if self._book is not None:
            self._book.leave(partition_id)
            self._aggregate_due(now)
        return Outcome.STALE

    def _lost(self, partition_id: int, now: float) -> None:
        # Its group waits for it no more; an update it left in a buffer stays.
        if self._book is not None:
            self._book.leave(partition_id)
            self._book.release(partition_id)
            self._aggregate_due(now)

    def _aggregate_due(self, now: float) -> list[int]:
        """Aggregate the groups the book says are due at ``now``; their ids."""
        if self._book is None:
            return []
        done = self._book.due(now)
        for gid in done:
            self._aggregate(gid)
            self._book.close(gid)
        return done

    def _aggregate(self, gid: int | None) -> None:
        """``w <- w - lr * (G + B)``: group ``gid``'s sum (none: the general buffer
        alone) and the general buffer, both emptied; one version."""
        buf = self._groups.pop(gid, None) if gid is not None else None
        self._group_counts.pop(gid, None)
        w, a, gen, lr = self._w, self._scr_a, self._general, self._lr
        for lo, hi, ws in chunks([(0, w)]):
            t = a[: hi - lo]
            if buf is None:
                np.copyto(t, gen[lo:hi])
            else:
                np.add(buf[lo:hi], gen[lo:hi], out=t)
            np.multiply(t, lr, out=t)
            np.subtract(ws, t, out=ws)
        gen.fill(0.0)
        self._general_count = 0
        if buf is not None:
            self._release(buf)
        self._version += 1

    def _single_step(self, parts: Parts, c: float) -> None:
        """``w <- w - lr * (c * Delta)``: an update without a group, alone."""
        w, a, lr = self._w, self._scr_a, self._lr
        for lo, hi, u in chunks(parts):
            t = a[: hi - lo]
            np.multiply(u, c, out=t)
            np.multiply(t, lr, out=t)
            ws = w[lo:hi]
            np.subtract(ws, t, out=ws)
        self._version += 1

    def _accumulate(self, buf: np.ndarray, parts: Parts, c: float) -> None:
        """``buf <- buf + c * Delta``."""
        a = self._scr_a
        for lo, hi, u in chunks(parts):
            t = a[: hi - lo]
            np.multiply(u, c, out=t)
            bs = buf[lo:hi]
            np.add(bs, t, out=bs)

    # ---------------------------------------------------------------- checkpoints
    def _extra_state(self) -> dict[str, Any]:
        return {
            "general_sum": self._general.copy(),
            "general_count": self._general_count,
            "group_ids": list(self._groups),
            "group_sums": [b.copy() for b in self._groups.values()],
            "group_counts": [self._group_counts[g] for g in self._groups],
        }

    def _check_state_extra(self, state: dict[str, Any], version: int, active: set[int]) -> None:
        ids, sums, counts = state["group_ids"], state["group_sums"], state["group_counts"]
        if not len(ids) == len(sums) == len(counts):
            raise ValueError(
                f"state group_ids, group_sums and group_counts differ in length "
                f"({len(ids)}, {len(sums)}, {len(counts)})"
            )
        named = [("general_count", state["general_count"])]
        named += [("group_counts", c) for c in counts]
        for what, n in named:
            if isinstance(n, bool) or int(n) != n or n < 0:
                raise ValueError(f"state {what} must hold integers >= 0, got {n!r}")

    def _load_extra(self, state: dict[str, Any]) -> None:
        general = self._flat_array(state["general_sum"], "general_sum")
        sums = [self._flat_array(v, "group_sums") for v in state["group_sums"]]
        self._general[...] = general
        self._general_count = int(state["general_count"])
        ids = [int(g) for g in state["group_ids"]]
        self._groups = dict(zip(ids, sums))
        self._group_counts = {g: int(c) for g, c in zip(ids, state["group_counts"])}


# --------------------------------------------------------------------- the plain kernel
class PlainFedCompass(PlainKernel):
    """FedCompass's aggregation written plainly (:class:`~flwr_gsgm.core.base.PlainKernel`).

    Li et al., ICLR 2024, as APPFL's ``FedCompassAggregator``: an update of staleness
    ``tau`` counts with ``c = (1 + tau)^-a / N``, ``N = min(concurrency, |A|)``. What
    an arrival is, and which groups are due, the arrival groups ``book`` say (an
    :class:`ArrivalBook` the scheduler fills; the rule's own, not shared with it)::

        no group (a first message):   w <- w - lr * c * g; t += 1        ("applied")
        on time in its group:         G <- G + c * g                     ("deferred")
        after its group's deadline:   B <- B + c * g                     ("deferred")
        a group due:                  w <- w - lr * (G + B); G, B <- 0; t += 1

    A group is due once every member is back or, at the first event after its
    deadline, with the members back by then: due groups are aggregated at every event
    (an arrival, a loss, a join, :meth:`deadline`) before it, and an arrival that
    completes its group is ``"applied"``. Without a book every update goes to ``B``,
    and every ``buffer_size``-th steps ``w <- w - lr * B``. ``G`` (one per group),
    ``B``, ``w`` and ``g`` are flat float32 of shape ``(n,)``. The scheduler's
    parameters (local steps, deadline factor, speed momentum) are not the kernel's.
    """

    def __init__(
        self,
        w: np.ndarray,
        nodes: Iterable[int],
        *,
        lr: float,
        staleness_exponent: float,
        buffer_size: int,
        concurrency: int | None,
        book: ArrivalBook | None = None,
    ) -> None:
        super().__init__(w, nodes, lr)
        self.a, self.K, self.concurrency = staleness_exponent, buffer_size, concurrency
        self.book = book
        self.G: dict[int, np.ndarray] = {}  # group id -> sum of its members' c * g
        self.B = np.zeros_like(self.w)  # the general buffer
        self.b = 0  # updates in B

    def arrive(self, node: int, g: np.ndarray, base_version: int, now: float = 0.0) -> str:
        self.deadline(now)
        tau = self.version - base_version
        n = (
            len(self.active)
            if self.concurrency is None
            else min(len(self.active), self.concurrency)
        )
        c = (1 + tau) ** (-self.a) / max(1, n)
        kind, gid = self.book.arrive(node, now) if self.book is not None else (OFF, None)
        if kind == SINGLE:
            self.w -= self.lr * c * g
            self.version += 1
            return "applied"
        if kind == GROUP:
            self.G[gid] = self.G.get(gid, 0) + c * g
            return "applied" if gid in self.deadline(now) else "deferred"
        self.B += c * g  # late, or no book
        self.b += 1
        if kind == OFF and self.b >= self.K:
            self._aggregate(None)
            return "applied"
        return "deferred"

    def deadline(self, now: float) -> list[int]:
        """Aggregate the groups due at ``now``; their ids."""
        if self.book is None:
            return []
        due = self.book.due(now)
        for gid in due:
            self._aggregate(gid)
            self.book.close(gid)
        return due

    def _aggregate(self, gid: int | None) -> None:
        G = self.G.pop(gid, 0) if gid is not None else 0
        self.w -= self.lr * (G + self.B)
        self.B = np.zeros_like(self.w)
        self.b = 0
        self.version += 1

    def lost(self, node: int, now: float = 0.0) -> None:
        self.deadline(now)
        super().lost(node, now)
        if self.book is not None:  # its group waits for it no more
            self.book.leave(node)
            self.book.release(node)
            self.deadline(now)

    def joined(self, node: int, now: float = 0.0) -> None:
        self.deadline(now)
        super().joined(node, now)
