"""Peak memory of each server rule, in model copies, against its documented bound.

Two measurements, both with ``tracemalloc`` (numpy reports its array allocations to
it), as multiples of one model copy (``size(w)`` float32):

1. core: each rule (``flwr_gsgm.core``) from its construction through a run of
   updates in which node 0 is 3x faster than the others, so GSGM keeps pending slots
   and table rows; printed with the bound of docs/USER_GUIDE.md ("Memory per rule") and
   measured / bound;
2. server: a whole asynchronous run on the in-process grid (engine + rule + the
   in-process ClientApp's replies, workers=0) for GSGM (defaults) and ASGD, printing
   both peaks and their difference, which is the difference of the rules' bounds.

Not a test (tests/core/test_core_memory.py asserts the bounds on a 16 MiB model):
``python benchmarks/bench_memory.py [--params 25e6] [--nodes 4]``. It was written
when GSGM measured 9.4 GiB against 6.0 GiB with ASGD for a 600 MB model:
GSGM kept a model-sized copy of ``lr * beta * M`` (now computed per chunk) on top of
``M``, ``S``, the table's rows and sum, and the pending slots.
"""

from __future__ import annotations

import argparse
import sys
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402

from flwr_gsgm.core import make_optimizer  # noqa: E402
from flwr_gsgm.simulation.inprocess_grid import InProcessGrid  # noqa: E402
from flwr_gsgm.simulation.virtual_clock import VirtualClock  # noqa: E402
from flwr_gsgm.strategy.strategies import ASGD, GSGM  # noqa: E402


def bounds(a: int) -> list[tuple[str, str, dict, int]]:
    """(label, rule, params, bound in model copies) with ``a`` active nodes."""
    return [
        ("asgd", "asgd", {}, 1),
        ("daasgd", "daasgd", {}, 1),
        ("masgd", "masgd", {}, 2),
        ("dcasgd", "dcasgd", {}, 1 + a),
        ("fedasync", "fedasync", {}, 1 + a),
        ("fedbuff", "fedbuff", {}, 2),
        ("ca2fl", "ca2fl", {"buffer_size": 3}, 3 + a),
        ("ace", "ace", {}, 2 + a),
        ("gsgm slot", "gsgm", {"averaging": "slot", "cycle_quorum": 1.0}, 2 + a),
        ("gsgm table (defaults)", "gsgm", {}, 3 + 2 * a),
    ]


def core_peak(rule: str, params: dict, size: int, nodes: int) -> float:
    """Peak bytes from the rule's construction through 3 rounds of uneven arrivals."""
    rng = np.random.default_rng(0)
    weights = [rng.standard_normal(size).astype(np.float32)]
    updates = [[rng.standard_normal(size).astype(np.float32)] for _ in range(3)]
    order = []
    for n in range(1, nodes):  # node 0 sends 3 updates per update of each other node
        order += [0, 0, 0, n]
    tracemalloc.start()
    try:
        opt = make_optimizer(rule, weights, list(range(nodes)), lr=0.01, **params)
        sent = {}
        for n in range(nodes):
            opt.on_dispatch(n)
            sent[n] = opt.version
        for i, n in enumerate(order * 3):
            opt.on_update(n, updates[i % 3], sent[n], now=float(i))
            opt.on_dispatch(n)
            sent[n] = opt.version
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def flat_app(size: int) -> ClientApp:
    """A ClientApp whose update is w - 1 (one array of ``size`` float32)."""
    app = ClientApp()

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        cfg = context.node_config
        metrics = MetricRecord(
            {"partition-id": cfg["partition-id"], "num-partitions": cfg["num-partitions"]}
        )
        metrics["num-examples"] = 1
        return Message(RecordDict({"metrics": metrics}), reply_to=msg)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        (w,) = msg.content["arrays"].to_numpy_ndarrays()
        np.subtract(w, 1.0, out=w)
        metrics = MetricRecord(
            {
                "partition-id": int(context.node_config["partition-id"]),
                "model-version": int(msg.content["config"]["model-version"]),
                "num-examples": 1,
            }
        )
        content = RecordDict({"arrays": ArrayRecord({"w": Array(w)}), "metrics": metrics})
        return Message(content, reply_to=msg)

    return app


def server_peak(strategy, size: int, nodes: int, updates: int) -> float:
    initial = ArrayRecord({"w": Array(np.zeros(size, np.float32))})
    grid = InProcessGrid(flat_app(size), nodes, run_config={})
    tracemalloc.start()
    try:
        strategy.start(grid, initial, max_updates=updates, eval_every=updates)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        grid.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=float, default=25e6, help="model size (float32)")
    parser.add_argument("--nodes", type=int, default=4, help="active nodes |A|")
    parser.add_argument("--updates", type=int, default=40, help="updates of the server runs")
    args = parser.parse_args()
    size, nodes = int(args.params), args.nodes
    copy = 4 * size
    print(f"model: {size:,} float32 = {copy / 2**20:.0f} MiB per copy; |A| = {nodes} nodes")
    print(f"{'rule':24s} {'bound':>6s} {'peak':>6s} {'peak/bound':>10s}   (model copies)")
    for label, rule, params, bound in bounds(nodes):
        peak = core_peak(rule, params, size, nodes) / copy
        print(f"{label:24s} {bound:6d} {peak:6.2f} {peak / bound:10.2f}")
    clock = VirtualClock(seed=0)
    gsgm = server_peak(GSGM(virtual_clock=clock), size, nodes, args.updates) / copy
    asgd = server_peak(ASGD(virtual_clock=clock), size, nodes, args.updates) / copy
    extra = bounds(nodes)[-1][3] - bounds(nodes)[0][3]
    print(
        f"whole in-process run, {args.updates} updates: GSGM {gsgm:.2f}, ASGD {asgd:.2f} model "
        f"copies; GSGM / ASGD = {gsgm / asgd:.2f}; difference {gsgm - asgd:.2f} "
        f"(bound difference {extra})"
    )


if __name__ == "__main__":
    main()
