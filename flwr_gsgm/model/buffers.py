"""The global model's buffers: non-trainable state, never stepped by a server rule.

Buffers are the arrays :class:`~flwr_gsgm.model.layout.ModelLayout` does not train:
BatchNorm ``running_mean`` / ``running_var`` / ``num_batches_tracked`` and any
integer array. A learning rate or momentum on them is meaningless (a running
variance stepped like a weight goes negative), so their rule is:

- a **floating** buffer is the plain mean, over the nodes, of each node's latest
  reported value (the nodes whose latest reply was accepted and not dropped as
  stale, and which have not been lost since), computed in float64 in partition-id
  order and stored in the buffer's dtype. Every node weighs the same, as in GSGM's
  table averaging; running statistics of non-IID nodes describe different data, and
  their mean is what a model trained on all nodes would see. Until a node reports,
  the initial value stays; when every reporting node is lost, the last mean stays.
- an **integer** buffer (``num_batches_tracked``, a flag, a step count) takes the
  value of the latest accepted report, in its own dtype and shape (a 0-d int64 stays
  a 0-d int64): counters and flags have no meaningful mean, and the latest report is
  what the model would hold had the updates arrived one after the other.

A reply reports buffer values (not updates) in every client mode; one that leaves
a buffer out reports nothing for it. Memory: one copy of the floating buffers per
node that has reported (BatchNorm statistics are two vectors per normalised layer,
small next to the weights); each report recomputes the mean over the reporting
nodes, ``O(nodes x floating buffer size)``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flwr_gsgm.model.layout import ModelLayout

__all__ = ["ModelBuffers"]


class ModelBuffers:
    """The buffers of the global model and each node's latest floating report.

    Parameters
    ----------
    layout : ModelLayout
        The model's layout; its ``buffer_keys`` are the buffers.
    initial : dict[str, np.ndarray]
        Initial value of every buffer, the layout's dtypes and shapes (copied).
    """

    def __init__(self, layout: ModelLayout, initial: dict[str, np.ndarray]) -> None:
        self.layout = layout
        self.values = {k: np.array(initial[k], copy=True) for k in layout.buffer_keys}
        self.floating = [k for k in layout.buffer_keys if self.values[k].dtype.kind == "f"]
        # partition-id -> {floating buffer key -> its latest reported value}
        self.latest: dict[int, dict[str, np.ndarray]] = {}

    def record(self, partition_id: int, reported: dict[str, np.ndarray]) -> None:
        """Take ``partition_id``'s reported buffer values (an accepted, applied update).

        ``reported`` holds values checked by :meth:`ModelLayout.match` (dtype, shape,
        finite). The floating buffers it names are re-averaged; its integer buffers
        become the global values.
        """
        row = self.latest.setdefault(int(partition_id), {})
        for key, value in reported.items():
            if key in self.floating:
                row[key] = np.array(value, copy=True)
            else:
                self.values[key] = np.array(value, copy=True)
        self._average([k for k in reported if k in self.floating])

    def forget(self, partition_id: int) -> None:
        """A lost node's reports leave the means (recomputed over the other reporters)."""
        row = self.latest.pop(int(partition_id), None)
        if row:
            self._average(list(row))

    def _average(self, keys: list[str]) -> None:
        for key in keys:
            rows = [self.latest[p][key] for p in sorted(self.latest) if key in self.latest[p]]
            if rows:  # no reporter left: the last mean stays
                mean = np.mean(np.stack(rows), axis=0, dtype=np.float64)
                self.values[key] = mean.astype(self.values[key].dtype)

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The global buffer values and the nodes' latest floating reports (copies)."""
        return {
            "values": {k: v.copy() for k, v in self.values.items()},
            "latest": {p: {k: v.copy() for k, v in row.items()} for p, row in self.latest.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`.

        Raises
        ------
        ValueError
            If the saved buffers' keys, dtypes or shapes differ from the layout's
            (the message names the key).
        """
        values = state["values"]
        if sorted(values) != sorted(self.values):
            raise ValueError(
                f"checkpoint buffers {sorted(values)} differ from the model's {sorted(self.values)}"
            )
        for key, value in values.items():
            spec = self.layout.by_key[key]
            if value.dtype != spec.dtype or tuple(value.shape) != spec.shape:
                raise ValueError(
                    f"checkpoint buffer {key!r} is {value.dtype} {tuple(value.shape)}, "
                    f"the model's is {spec.dtype} {spec.shape}"
                )
        self.values = {k: np.array(values[k], copy=True) for k in self.values}
        self.latest = {
            int(p): {k: np.array(v, copy=True) for k, v in row.items()}
            for p, row in state["latest"].items()
        }
