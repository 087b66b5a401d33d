"""The quadratic ClientApp of ``quadratic_app`` on a model with BatchNorm-like buffers.

Model: ``w`` (float32 [2]) and ``b`` (float32 [1]), trained exactly as in
``quadratic_app`` (node p returns the gradient ``w - target_p``, ``b - 0.5``), plus
two buffers: ``bn.running_var`` (float32 [2]) and ``bn.num_batches_tracked`` (0-d
int64). Node p reports ``bn.running_var = [p + 1, 2 (p + 1)]`` and
``bn.num_batches_tracked`` = the value it received + 1. Replies list the arrays in
reverse order, so only matching by name can read them; ``edit`` lets a test change
the arrays of one partition's replies.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from tests.engine.quadratic_app import INITIAL, TARGETS, answer_query

Edit = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


def initial_arrays() -> ArrayRecord:
    """``w``, ``b`` as in quadratic_app, then the two buffers (running_var 1, count 0)."""
    arrays = {k: v.copy() for k, v in INITIAL.items()}
    arrays["bn.running_var"] = np.ones(2, np.float32)
    arrays["bn.num_batches_tracked"] = np.array(0, np.int64)
    return ArrayRecord({k: Array(v) for k, v in arrays.items()})


def reported_running_var(pid: int) -> np.ndarray:
    return np.array([pid + 1, 2 * (pid + 1)], np.float32)


def make_app(edit: dict[int, Edit] | None = None, seen_counts: list | None = None) -> ClientApp:
    """The ClientApp; ``seen_counts`` collects every num_batches_tracked received."""
    app = ClientApp()

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        return answer_query(msg, context)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        received = {k: v.numpy() for k, v in msg.content["arrays"].items()}
        count = received["bn.num_batches_tracked"]
        assert count.dtype == np.int64 and count.shape == (), (count.dtype, count.shape)
        if seen_counts is not None:
            seen_counts.append(int(count))
        out = {
            "w": (received["w"] - TARGETS[pid % len(TARGETS)]).astype(np.float32),
            "b": (received["b"] - 0.5).astype(np.float32),
            "bn.running_var": reported_running_var(pid),
            "bn.num_batches_tracked": np.array(count + 1, np.int64),
        }
        if pid in (edit or {}):
            out = edit[pid](out)
        arrays = ArrayRecord({k: Array(out[k]) for k in reversed(list(out))})
        metrics = MetricRecord(
            {
                "partition-id": pid,
                "model-version": int(msg.content["config"]["model-version"]),
                "num-examples": 1,
            }
        )
        return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)

    return app
