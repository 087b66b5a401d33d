"""A tiny ClientApp for engine tests: node p returns the gradient of 0.5 * ||w - target_p||^2.

It follows the message protocol of ``clients/client_app.py`` (arrays under
"arrays", metrics partition-id / model-version / num-examples / train-loss) and can
misbehave on purpose for chosen partitions.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

# Partition p pulls w toward TARGETS[p % 4]; the optimum of the sum is their mean.
TARGETS = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 2.0]], dtype=np.float32)
INITIAL = {"w": np.zeros(2, np.float32), "b": np.zeros(1, np.float32)}

Misbehaviour = Callable[[int, dict[str, np.ndarray], MetricRecord], tuple[dict, MetricRecord]]


def initial_arrays() -> ArrayRecord:
    """The model: a 2-vector "w" and a scalar "b" (float32)."""
    return ArrayRecord({k: Array(v.copy()) for k, v in INITIAL.items()})


def answer_query(msg: Message, context: Context, **extra: int) -> Message:
    """The start-up query's reply: the node config's partition-id and num-partitions
    (plus ``extra`` metrics), as the project's ClientApp answers it."""
    cfg = context.node_config
    metrics = {"partition-id": cfg["partition-id"], "num-partitions": cfg["num-partitions"]}
    return Message(RecordDict({"metrics": MetricRecord({**metrics, **extra})}), reply_to=msg)


def make_app(
    misbehave: dict[int, Misbehaviour] | None = None,
    raise_for: set[int] = frozenset(),
    calls: list | None = None,
) -> ClientApp:
    """Build the ClientApp; ``raise_for`` partitions raise, ``misbehave`` ones edit their reply."""
    app = ClientApp()

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        return answer_query(msg, context, **{"num-examples": 1})

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        if calls is not None:
            calls.append((pid, int(msg.content["config"]["model-version"])))
        if pid in raise_for:
            raise RuntimeError(f"partition {pid} fails on purpose")
        arrays = msg.content["arrays"].to_numpy_ndarrays()
        w, b = arrays
        grad = {
            "w": (w - TARGETS[pid % len(TARGETS)]).astype(np.float32),
            "b": (b - 0.5).astype(np.float32),
        }
        metrics = MetricRecord(
            {
                "partition-id": pid,
                "model-version": int(msg.content["config"]["model-version"]),
                "num-examples": 1,
                "train-loss": float(0.5 * np.sum(grad["w"] ** 2)),
            }
        )
        extra: dict = {}
        if pid in (misbehave or {}):
            # (grad, metrics), or (grad, metrics, more records for the reply)
            grad, metrics, *more = misbehave[pid](pid, grad, metrics)
            extra = more[0] if more else {}
        return Message(
            RecordDict(
                {
                    "arrays": ArrayRecord({k: Array(v) for k, v in grad.items()}),
                    "metrics": metrics,
                    **extra,
                }
            ),
            reply_to=msg,
        )

    return app
