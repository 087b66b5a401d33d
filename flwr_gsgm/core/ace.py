"""ACE / ACED: all-client engagement, a step along the mean of every node's latest update.

Reference:
    X. Chang, M. Yao, S. V. Krishnamurthy, C. R. Shelton, A. Chakraborty, A. Swami,
    S. Oymak, A. Roy-Chowdhury, "Mitigating Participation Imbalance Bias in
    Asynchronous Federated Learning", arXiv:2511.19066, 2025.

Implemented: ACE keeps a table ``U`` with the latest update of every node; on every
arrival ``U_i <- Delta_i`` and the server steps at once (no buffer) along the mean
of the rows, so each node weighs the same whatever its speed. ACED, the delay-aware
variant, is the same class with ``max_row_age`` set: only rows at most that many
versions old enter the mean (the authors' preliminary value: 50).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import numpy as np

from .base import Outcome, Parts, PlainKernel, ServerOptimizer, chunks, replace_row
from .params import Param, server_learning_rate

__all__ = ["ACERule", "PlainACE"]

_F32 = np.dtype(np.float32)


class ACERule(ServerOptimizer):
    r"""ACE: ``U_i <- Delta_i``, then ``w <- w - lr * mean_j U_j`` on every arrival.

    State: one row ``U_j`` (flat float32) per active node whose latest update is in
    the table, the row's base version ``b_j`` (the version of the weights that
    update was computed on, i.e. its dispatch version), and the running sum
    ``Sigma = sum_j U_j``.

    When node ``i``'s update ``Delta_i`` arrives with staleness
    ``s = version - base_version`` (after validation and ``max_staleness``):

    - ACED only (``max_row_age`` set): if ``s > max_row_age`` the update can never
      enter a mean; it is dropped (:attr:`Outcome.STALE`), no step is taken, and
      the node's previous row (older still) leaves the table. This is the only
      case where no row would be young enough, since the arriving row is the
      youngest: these no-step arrivals are counted in ``stale``.
    - ``U_i <- Delta_i``, ``b_i <- base_version`` (``Sigma`` updated in place);
    - ACED only: every row with age ``version - b_j > max_row_age`` leaves the
      table (ages only grow, so it never comes back; the node's next update
      re-enters), counted in ``rows_expired``;
    - ``w <- w - lr * Sigma / |U|`` over the ``|U|`` rows present (the arriving
      one included); ``version += 1``; :attr:`Outcome.APPLIED`.

    The mean runs over the rows present, not over ``|A|``: a node that has not
    sent yet (or whose row expired) is absent rather than counted as zero.

    Args:
        weights: initial weights, a sequence of numpy arrays (copied to float32).
        partition_ids: partition-ids of the initially active nodes.
        lr: server learning rate eta, > 0.
        max_row_age: ``None`` (default) for ACE; an int >= 0 for ACED, the largest
            row age in versions (since the row's base version) that enters the
            mean. The authors' preliminary value is 50.
        max_staleness: optional staleness bound (see :class:`ServerOptimizer`).
        max_norm: optional L2-norm bound (see :class:`ServerOptimizer`).

    Raises:
        ValueError: a parameter is out of range; the message names it.

    Extra counters: ``rows_expired`` (rows that left by age, ACED), ``resyncs``
    (recomputes of ``Sigma`` from the rows).

    Node churn: a lost node's row leaves the table (``Sigma`` recomputed).

    Memory: ``w``, ``Sigma`` and one row per active node in the table: at most
    ``(|A| + 2) * size(w)`` float32 with ``w``, plus chunk-sized scratch. Cost: 4
    element-wise passes per arrival (row replace and sum update, step), one more
    per expired row (subtracted from ``Sigma``, or ``Sigma`` recomputed when that
    is cheaper), and a recompute of ``Sigma`` from the rows (``|U| + 1`` passes,
    in increasing node order) after every ``|U|`` row changes, which bounds the
    float32 drift of the running sum (about 1 pass per arrival amortised).

    The update, written plainly: :class:`PlainACE`.
    """

    name: ClassVar[str] = "ace"
    PARAMS: ClassVar[tuple[Param, ...]] = (
        # Displacement modes: every arrival steps the declared fraction along the mean
        # displacement of the table, tuned at 10 nodes, seed 0 (docs/GSGM.md, "Client
        # modes").
        server_learning_rate(0.02, displacement=0.1),
        Param(
            "max_row_age",
            None,
            "ACED: rows older than this many versions leave the mean (none = ACE)",
            kind=int,
            low=0,
            optional=True,
            run_config_key="max-row-age",
        ),
    )

    def _copies(self, nodes: int) -> int:
        """``w``, the table sum and a row per active node."""
        return 2 + nodes

    _counter_names: ClassVar[tuple[str, ...]] = ServerOptimizer._counter_names + (
        "rows_expired",
        "resyncs",
    )

    def __init__(
        self, weights: Sequence[np.ndarray], partition_ids: Iterable[int], **params: Any
    ) -> None:
        super().__init__(weights, partition_ids, **params)
        # node -> [flat row, base version]
        self._rows: dict[int, list[Any]] = {}
        self._sum = np.zeros(self._size, dtype=_F32)
        self._changes = 0  # row changes since Sigma was last recomputed

    _LABELS: ClassVar[dict[str, str]] = {"_rows": "row of node", "_sum": "table sum"}

    def _step_bound(self, norm: float) -> tuple[float, float]:
        # Rows <= u; Sigma sums them (x2 for the rounding drift of a running sum).
        u = max(self._bound_u, norm)
        terms = 2.0 * (len(self._rows) + 3)
        w_after = self._bound_w + self._lr * terms * u
        return w_after + (1.0 + self._lr) * terms * u, w_after

    # ---------------------------------------------------------------- introspection
    @property
    def table(self) -> dict[int, np.ndarray]:
        """node -> flat float32 copy of its row ``U_j``."""
        return {n: r.copy() for n, (r, _) in self._rows.items()}

    @property
    def row_versions(self) -> dict[int, int]:
        """node -> base version ``b_j`` of its row."""
        return {n: int(b) for n, (_, b) in self._rows.items()}

    @property
    def table_sum(self) -> np.ndarray:
        """A flat float32 copy of the running sum ``Sigma`` of the rows."""
        return self._sum.copy()

    # ------------------------------------------------------------------------ rule
    def _on_valid(
        self, partition_id: int, parts: Parts, base_version: int, staleness: int, now: float
    ) -> Outcome:
        age = self._max_row_age
        if age is not None and staleness > age:
            if partition_id in self._rows:  # older still: it has expired too
                self._counters["rows_expired"] += 1
                self._remove([partition_id])
            return Outcome.STALE
        # Rows the put leaves too old (never the node's own: its staleness <= age).
        limit = None if age is None else self._version - age
        old = [
            n
            for n, (_, b) in self._rows.items()
            if limit is not None and b < limit and n != partition_id
        ]
        rows_after = len(self._rows) + (partition_id not in self._rows)
        if not old and self._changes + 1 < rows_after:
            # Neither an expiry nor a resync between the put and the step: both in one
            # pass over the chunks (the same operations, in the same order).
            self._put(partition_id, parts, base_version, step=True)
        else:
            self._put(partition_id, parts, base_version)
            old = [] if limit is None else [n for n, (_, b) in self._rows.items() if b < limit]
            if old:
                self._counters["rows_expired"] += len(old)
                self._remove(old)
            if self._changes >= len(self._rows):
                self._resync()
            n = len(self._rows)
            for lo, hi, s in chunks([(0, self._sum)]):
                self._step_chunk(lo, hi, s, n)
        self._version += 1
        return Outcome.APPLIED

    def _step_chunk(self, lo: int, hi: int, s: np.ndarray, n: int) -> None:
        """``w[lo:hi] <- w[lo:hi] - lr * (s / n)``, ``s`` the chunk of ``Sigma``."""
        t = self._scr_a[: hi - lo]
        np.divide(s, n, out=t)
        np.multiply(t, self._lr, out=t)
        ws = self._w[lo:hi]
        np.subtract(ws, t, out=ws)

    def _put(self, partition_id: int, parts: Parts, base_version: int, step: bool = False) -> None:
        """``U_i <- Delta_i``; ``Sigma <- Sigma + Delta_i - U_i(old)``; with ``step``,
        each chunk of ``w`` then steps along its chunk of ``Sigma / |rows|``."""
        total = self._sum
        entry = self._rows.get(partition_id)
        new = entry is None
        if new:
            entry = self._rows[partition_id] = [self._new_buffer(), base_version]
        row, a, n = entry[0], self._scr_a, len(self._rows)
        for lo, hi, g in chunks(parts):
            ts = total[lo:hi]
            replace_row(row[lo:hi], ts, g, a, new)
            if step:
                self._step_chunk(lo, hi, ts, n)
        entry[1] = base_version
        self._changes += 1

    def _remove(self, partition_ids: list[int]) -> None:
        """Drop the rows of ``nodes``: subtract them, or recompute if cheaper."""
        gone = [self._rows.pop(n)[0] for n in partition_ids]
        if len(gone) >= len(self._rows) + 1:
            self._resync()
        else:
            for row in gone:
                np.subtract(self._sum, row, out=self._sum)
            self._changes += len(gone)
        for row in gone:
            self._release(row)

    def _resync(self) -> None:
        """``Sigma <- sum of the rows`` in increasing node order."""
        total = self._sum
        total.fill(0.0)
        for partition_id in sorted(self._rows):
            np.add(total, self._rows[partition_id][0], out=total)
        self._changes = 0
        self._counters["resyncs"] += 1

    def _lost(self, partition_id: int, now: float) -> None:
        if self._rows.pop(partition_id, None) is not None:
            self._resync()

    # -------------------------------------------------------------- checkpointing
    def _extra_state(self) -> dict[str, Any]:
        return {
            "table_nodes": list(self._rows),
            "table_versions": [int(b) for _, b in self._rows.values()],
            "table_values": [r.copy() for r, _ in self._rows.values()],
            "table_sum": self._sum.copy(),
            "table_changes": self._changes,
        }

    def _load_extra(self, state: dict[str, Any]) -> None:
        partition_ids = [int(n) for n in state["table_nodes"]]
        versions = [int(b) for b in state["table_versions"]]
        values = [self._flat_array(v, "table_values") for v in state["table_values"]]
        if not len(partition_ids) == len(versions) == len(values):
            raise ValueError("state table_nodes, table_versions, table_values differ in length")
        total = self._flat_array(state["table_sum"], "table_sum")
        self._rows = {n: [v, b] for n, b, v in zip(partition_ids, versions, values)}
        self._sum[...] = total
        self._changes = int(state["table_changes"])


# --------------------------------------------------------------------- the plain kernel
class PlainACE(PlainKernel):
    """ACE's update written plainly (:class:`~flwr_gsgm.core.base.PlainKernel`).

    Chang et al., arXiv:2511.19066: a table ``U`` holds the latest update of every
    node, and every arrival steps along the mean of the rows present::

        U_i <- g_i; w <- w - lr * mean_j U_j; t += 1

    ACED (``max_row_age`` = A, an int): a row computed on weights more than A versions
    old (``version - b_j > A``, ``b_j`` its base version) leaves the table; an update
    that old already is dropped (``"stale"``, no step) and takes its node's previous
    row with it. A lost node's row leaves. Rows are flat float32 of shape ``(n,)``.
    """

    def __init__(
        self, w: np.ndarray, nodes: Iterable[int], *, lr: float, max_row_age: int | None
    ) -> None:
        super().__init__(w, nodes, lr)
        self.max_row_age = max_row_age
        self.rows: dict[int, tuple[np.ndarray, int]] = {}  # node -> (U_j, b_j)

    def _too_old(self, base_version: int) -> bool:
        return self.max_row_age is not None and self.version - base_version > self.max_row_age

    def arrive(self, node: int, g: np.ndarray, base_version: int, now: float = 0.0) -> str:
        if self._too_old(base_version):
            self.rows.pop(node, None)
            return "stale"
        self.rows[node] = (g.copy(), base_version)
        self.rows = {j: (U, b) for j, (U, b) in self.rows.items() if not self._too_old(b)}
        self.w -= self.lr * np.mean([U for U, _ in self.rows.values()], axis=0)
        self.version += 1
        return "applied"

    def lost(self, node: int, now: float = 0.0) -> None:
        super().lost(node, now)
        self.rows.pop(node, None)
