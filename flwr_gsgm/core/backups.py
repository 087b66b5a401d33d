"""Copies of the weights sent to each node, for the rules that need ``w_tau``.

DC-ASGD compensates the delay with ``w_t - w_tau`` and FedAsync rebuilds the node's
model from ``w_tau``: both need the exact weights a node computed on. The engine
reports every send with ``on_dispatch(partition_id)``; the optimizer then keeps one
``size(w)`` float32 copy per node (reused from one dispatch to the next, dropped
when the node is lost) and the version it was taken at.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from .base import ServerOptimizer, _check_partition_id

__all__ = ["DispatchBackups"]


class DispatchBackups(ServerOptimizer):
    """Base of the rules that keep the weights sent to each node.

    ``on_dispatch(partition_id)`` copies the current ``w`` for that node (raises
    ValueError if the node is not active). An update whose ``base_version`` is not
    the version of the node's last dispatch (or with no dispatch at all) is rejected
    with reason ``"base-version"``: the weights it was computed on are not known.

    Memory: one ``size(w)`` float32 copy per active node that has been dispatched to.
    """

    def __init__(
        self, weights: Sequence[np.ndarray], partition_ids: Iterable[int], **params: Any
    ) -> None:
        super().__init__(weights, partition_ids, **params)
        # node -> [flat copy of w at dispatch, version at dispatch]
        self._backups: dict[int, list[Any]] = {}

    def on_dispatch(self, partition_id: int) -> None:
        partition_id = _check_partition_id(partition_id)
        if partition_id not in self._active:
            raise ValueError(f"on_dispatch: partition-id {partition_id} is not active")
        entry = self._backups.get(partition_id)
        if entry is None:
            self._backups[partition_id] = [self._w.copy(), self._version]
        else:
            np.copyto(entry[0], self._w)
            entry[1] = self._version

    def _copies(self, nodes: int) -> int:
        """``w`` and the weights sent to each active node."""
        return 1 + nodes

    @property
    def backup_versions(self) -> dict[int, int]:
        """node -> version of the weights last dispatched to it."""
        return {n: int(v) for n, (_, v) in self._backups.items()}

    def _check_extra(self, partition_id: int, base_version: int) -> tuple[str, str] | None:
        entry = self._backups.get(partition_id)
        if entry is None:
            return (
                "base-version",
                f"no weights were dispatched to partition-id {partition_id}; expected on_dispatch "
                f"before its update (base_version {base_version})",
            )
        if entry[1] != base_version:
            return (
                "base-version",
                f"base_version {base_version} from partition-id {partition_id} differs from the "
                f"version {entry[1]} of the weights last dispatched to it",
            )
        return None

    def _lost(self, partition_id: int, now: float) -> None:
        self._backups.pop(partition_id, None)

    def _extra_state(self) -> dict[str, Any]:
        return {
            "backup_nodes": list(self._backups),
            "backup_versions": [int(v) for _, v in self._backups.values()],
            "backup_values": [b.copy() for b, _ in self._backups.values()],
        }

    def _load_extra(self, state: dict[str, Any]) -> None:
        partition_ids = [int(n) for n in state["backup_nodes"]]
        versions = [int(v) for v in state["backup_versions"]]
        values = [self._flat_array(v, "backup_values") for v in state["backup_values"]]
        if not len(partition_ids) == len(versions) == len(values):
            raise ValueError("state backup_nodes, backup_versions, backup_values differ")
        self._backups = {n: [b, v] for n, v, b in zip(partition_ids, versions, values)}
