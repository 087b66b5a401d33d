"""A norm bound relative to the running update norms, on by default (``max-norm-ratio``).

An update whose L2 norm (over all its arrays) exceeds ``max-norm-ratio`` times the
running median norm is rejected with reason ``"norm-ratio"`` before the server rule
sees it: one node's reply of 1e30 (or 1e6 times its usual size) is blamed on that
node and never reaches the model, while the run's own scale (which shrinks or grows
slowly as training goes) moves the bound. The running median is the larger of the
median of the last :data:`WINDOW` accepted updates (every node's) and, once the node
has :data:`NODE_MIN` accepted updates, the median of its own last
:data:`NODE_WINDOW`: a node whose data make its gradients steadily larger than the
others' (non-IID data) is measured against itself, not rejected for it. The
absolute ``max-norm`` of the server rules (off by default) is a separate check.

Every reply is checked, from the first. During the warm-up (the first
:data:`WARMUP` accepted updates of the run, too few for a median of their own) an
update must stay within (a) :data:`INITIAL_ROOM` times the scale of the initial
model (:func:`initial_scale`: the L2 norm of its trainable weights, at least the
square root of their count), and (b) once one update was accepted, every node
being new, :data:`NEW_NODE_ROOM` x ``max-norm-ratio`` times the median of the
accepted ones. (a) is in weight units and loose enough for every client mode: a
gradient, or a displacement ``w_sent - w_local`` (divided or not by a local learning
rate), of an honest node is far below 1000 times the model's own norm (the
Fashion-MNIST CNN: scale 430, the square root of its 184586 weights, above their
norm 8.9; a gradient at the initial model has a norm of about 1 to 5); a reply
holding 1e6 in every element has 1e6 times the square root of the count, over
1000 times above. Before, the warm-up took its updates unchecked: one such first
reply moved the model to |w| ~ 3e4, then every honest reply was far above the
median and every node was excluded. When every node's replies are over
the bound at once, the model moved rather than the nodes misbehaved: the engine
ends the run as diverged (:mod:`flwr_gsgm.engine.divergence`, check 4) before it would
exclude the nodes.

A node with fewer than :data:`NODE_MIN` accepted updates (new, or back after it was
lost: :meth:`RelativeNormBound.forget` drops its window) has no scale of its own yet,
so it gets :data:`NEW_NODE_ROOM` times more room. Why: while it was away the model
moved towards the other nodes' classes, so its first update on its own classes can be
far larger than the run's median. Seen in a deployment test (3 SuperNodes, 2 classes
each, one killed and replaced): the replacement's first update was 14 times the
median and was rejected; its next ones, on a model that keeps moving without its
classes, risk the same, up to exclusion after ``max-consecutive-rejections``. With
the room such a node is accepted, while a blow-up (1e6 times, 1e30) is still rejected.

With the default ratio 10 the bound sits an order of magnitude above the typical
update: over 1000 updates of the Fashion-MNIST CNN (10 nodes; 2 classes per node,
Dirichlet 0.1, gradient and delta mode) no update exceeded 6.1 times the median of
the last 100.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import numpy as np

from flwr_gsgm.core import UpdateRejected

__all__ = [
    "INITIAL_ROOM",
    "NEW_NODE_ROOM",
    "NODE_MIN",
    "NODE_WINDOW",
    "RelativeNormBound",
    "WARMUP",
    "WINDOW",
    "initial_scale",
    "update_norm",
]

#: Accepted updates (every node's) whose norms form the run's running median.
WINDOW = 100
#: Accepted updates of one node whose norms form its own running median ...
NODE_WINDOW = 20
#: ... once it has at least this many.
NODE_MIN = 3
#: Accepted updates checked against the initial model's scale and each other
#: (the warm-up) before the running median takes over.
WARMUP = 10
#: During the warm-up an update's norm may be at most this many times the initial
#: model's scale (:func:`initial_scale`).
INITIAL_ROOM = 1000.0
#: A node with fewer than NODE_MIN accepted updates is allowed this many times the bound.
NEW_NODE_ROOM = 10.0


def update_norm(update: list[np.ndarray]) -> float:
    """L2 norm over every array of ``update``; NaN if a value is NaN or infinite.

    Summed in the arrays' dtype (one BLAS pass), again in float64 if that overflows,
    so a finite update always has a finite norm (the norm of float32 values fits a
    float64).
    """
    total = 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for a in update:
            flat = a.reshape(-1)
            square = float(np.dot(flat, flat))
            if not math.isfinite(square):
                if not np.isfinite(flat).all():
                    return math.nan  # non-finite values: the rule's own check rejects them
                wide = flat.astype(np.float64)
                square = float(np.dot(wide, wide))
            total += square
    return math.sqrt(total)


def initial_scale(trainable: list[np.ndarray]) -> float:
    """The scale of the initial model for the warm-up: the L2 norm of its trainable
    arrays, at least the square root of their count (the norm of a model of ones, so
    a model initialised at zero still has a scale)."""
    count = sum(int(a.size) for a in trainable)
    return max(update_norm(trainable), math.sqrt(count))


class RelativeNormBound:
    """Rejects updates far larger than the recent accepted ones (or, during the
    warm-up, than the initial model's scale and the early accepted ones).

    Parameters
    ----------
    ratio : float | None
        ``max-norm-ratio`` (> 0); None turns the bound off.
    scale : float | None
        The initial model's scale (:func:`initial_scale`); None: the warm-up checks
        the early updates against each other only.
    """

    def __init__(self, ratio: float | None, scale: float | None = None) -> None:
        self.ratio = ratio
        self.scale = scale
        self.norms: deque[float] = deque(maxlen=WINDOW)
        self.by_node: dict[int, deque[float]] = {}
        self.seen = 0  # accepted updates so far (the warm-up counts them)

    def check(self, partition_id: int, update: list[np.ndarray]) -> float:
        """Return the norm of ``partition_id``'s ``update``, or raise if it is over the bound.

        The bound is ``ratio`` times the larger of the run's median and this node's own
        (once it has :data:`NODE_MIN` accepted updates; before that, the run's median
        with :data:`NEW_NODE_ROOM` times more room). During the warm-up (fewer than
        :data:`WARMUP` accepted updates) every node counts as new, and the norm must
        also stay within :data:`INITIAL_ROOM` times the initial model's scale.

        Raises
        ------
        flwr_gsgm.core.UpdateRejected
            Reason ``"norm-ratio"``; the message gives the norm, the median (or the
            initial scale) and the ratio.
        """
        norm = update_norm(update)
        if self.ratio is None or math.isnan(norm):
            return norm
        if self.seen < WARMUP:
            self._check_warmup(norm)
            if not self.norms:
                return norm
        median, of = float(np.median(self.norms)), f"the last {len(self.norms)} accepted updates"
        own = self.by_node.get(partition_id, ())
        new_node = len(own) < NODE_MIN or self.seen < WARMUP
        if not new_node and float(np.median(own)) > median:
            median, of = float(np.median(own)), f"this node's last {len(own)} accepted updates"
        room = NEW_NODE_ROOM if new_node else 1.0
        if median > 0.0 and not norm <= room * self.ratio * median:  # median 0: no scale yet
            times, who = "", ""
            if new_node:
                times = f"{NEW_NODE_ROOM:g} x "
                who = (
                    f" (the warm-up: fewer than {WARMUP} accepted updates in the run)"
                    if self.seen < WARMUP
                    else f" (a node with fewer than {NODE_MIN} accepted updates)"
                )
            raise UpdateRejected(
                "norm-ratio",
                f"update L2 norm {norm:.6g} exceeds {times}max-norm-ratio={self.ratio:g} x the "
                f"median norm {median:.6g} of {of}{who}",
            )
        return norm

    def _check_warmup(self, norm: float) -> None:
        """During the warm-up: ``norm`` within INITIAL_ROOM x the initial scale."""
        if self.scale is None or norm <= INITIAL_ROOM * self.scale:
            return
        raise UpdateRejected(
            "norm-ratio",
            f"update L2 norm {norm:.6g} exceeds {INITIAL_ROOM:g} x the initial model's scale "
            f"{self.scale:.6g} (the warm-up: fewer than {WARMUP} accepted updates in the run)",
        )

    def forget(self, partition_id: int) -> None:
        """Drop ``partition_id``'s own window: it was lost; its scale fits a model long gone."""
        self.by_node.pop(partition_id, None)

    def accept(self, partition_id: int, norm: float) -> None:
        """The update of ``partition_id`` of norm ``norm`` (from :meth:`check`) was accepted."""
        self.seen += 1
        self.norms.append(norm)
        self.by_node.setdefault(partition_id, deque(maxlen=NODE_WINDOW)).append(norm)

    def state_dict(self) -> dict[str, Any]:
        """The windows and the count, as python values."""
        return {
            "norms": list(self.norms),
            "by_node": {pid: list(d) for pid, d in self.by_node.items()},
            "seen": self.seen,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.norms = deque((float(x) for x in state["norms"]), maxlen=WINDOW)
        self.by_node = {
            int(pid): deque((float(x) for x in d), maxlen=NODE_WINDOW)
            for pid, d in state["by_node"].items()
        }
        self.seen = int(state["seen"])
