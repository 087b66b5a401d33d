"""Cost of one GSGM update relative to a plain in-place SGD step.

For 1M and 10M float32 parameters, split into a few arrays like a small model, print
the median wall time of one ``GSGMRule.on_update`` (heavy-ball; validation included)
over the median time of one in-place ``w -= lr * g`` on the same arrays:

- "apply": every arrival is applied (round robin over 4 nodes; every 4th arrival
  also closes the cycle and refreshes M);
- "mixed": a fast node sends 3 updates per cycle (applied, new slot, slot fold)
  among 3 slower ones; the close then also applies the slot.

The update arrays rotate over 3 different sets in both timings (an update arrives
fresh from the network, so it is not in cache). Blocks of baseline steps alternate
with GSGM cycles so both see the same machine load; each ratio uses the baseline
samples of its own run. The "hot" column times the baseline alone in a tight loop
(its arrays stay in cache: the most favourable case for the baseline), and the
"hot" ratios divide by it: the conservative figure. Medians per kind of arrival are
printed too: a cycle close costs more (M refresh, slot steps) but happens once per
cycle.

Target (issue 2): ratio <= 4. Not a test: run ``python benchmarks/bench_core.py``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flwr_gsgm.core.base as core_base  # noqa: E402
from flwr_gsgm.core import GSGMRule  # noqa: E402


def model_shapes(total: int) -> list[tuple[int, ...]]:
    """Shapes of a CNN-like model with ``total`` parameters: convs, biases, FCs."""
    shapes: list[tuple[int, ...]] = [(32, 1, 3, 3), (32,), (64, 32, 3, 3), (64,)]
    rest = total - sum(int(np.prod(s)) for s in shapes) - 512 - 10 - 10 * 512
    fc1_in = rest // 512
    shapes += [(512, fc1_in), (512,), (10, 512), (10,)]
    used = sum(int(np.prod(s)) for s in shapes)
    shapes.append((total - used,))  # remainder, e.g. a norm layer
    return shapes


def median_ms(samples: list[float]) -> float:
    return 1e3 * statistics.median(samples)


def baseline_step(w: list[np.ndarray], g: list[np.ndarray], lr: float) -> float:
    """Time one in-place ``w -= lr * g`` over all arrays."""
    t0 = time.perf_counter()
    for a, b in zip(w, g):
        a -= lr * b
    return time.perf_counter() - t0


def bench(shapes, updates, pattern, cycles, lr):
    """Per-arrival GSGM times, labelled with what the arrival did, and baseline times.

    Blocks alternate: ``len(pattern)`` back-to-back baseline steps, then one GSGM
    cycle of arrivals, so that both see the same machine load over time while the
    baseline still runs back to back on its own arrays (cache-warm, as in a plain
    timing loop).
    """
    rng = np.random.default_rng(1)
    weights = [rng.standard_normal(s).astype(np.float32) * 0.01 for s in shapes]
    w_base = [a.copy() for a in weights]
    opt = GSGMRule(weights, [1, 2, 3, 4], lr=lr, beta=0.5)
    times: dict[str, list[float]] = {}
    base: list[float] = []
    i = 0
    for c in range(cycles + 1):
        block = [
            baseline_step(w_base, updates[(i + j) % len(updates)], lr) for j in range(len(pattern))
        ]
        if c > 0:  # the first block is a warm-up
            base += block
        for node in pattern:
            g = updates[i % len(updates)]
            i += 1
            had_slot = node in opt.slot_counts
            cycle = opt.cycle_index
            t0 = time.perf_counter()
            outcome = opt.on_update(node, g, opt.version)
            dt = time.perf_counter() - t0
            if c == 0:
                continue
            if opt.cycle_index != cycle:
                kind = "close"
            elif outcome.value == "applied":
                kind = "applied"
            else:
                kind = "slot-fold" if had_slot else "slot-new"
            times.setdefault(kind, []).append(dt)
            times.setdefault("all", []).append(dt)
    return times, base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e6, 1e7])
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument(
        "--chunk", type=int, default=None, help="override flwr_gsgm.core.base.CHUNK (elements)"
    )
    args = parser.parse_args()
    if args.chunk:
        core_base.CHUNK = args.chunk

    lr = 0.01
    print(
        f"numpy {np.__version__}, python {platform.python_version()}, "
        f"{platform.machine()}, {os.cpu_count()} CPUs, chunk {core_base.CHUNK}; "
        "times are medians in ms"
    )
    print("ratio = GSGM median / baseline median; 'hot' = baseline alone in a tight loop")
    print(
        f"{'params':>10} {'arrays':>6} {'w-=lr*g':>8} {'hot':>6} | {'apply':>6} "
        f"{'ratio':>5} {'hot':>5} | {'mixed':>6} {'ratio':>5} {'hot':>5} | "
        "mixed by kind: median ms (count)"
    )
    for size in args.sizes:
        total = int(size)
        shapes = model_shapes(total)
        rng = np.random.default_rng(0)
        updates = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(3)]
        w_hot = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        hot = median_ms([baseline_step(w_hot, updates[j % 3], lr) for j in range(60)][3:])
        del w_hot
        apply_t, apply_b = bench(shapes, updates, [1, 2, 3, 4], args.cycles, lr)
        mixed_t, mixed_b = bench(shapes, updates, [1, 1, 2, 1, 3, 4], args.cycles, lr)
        base = median_ms(apply_b + mixed_b)
        apply_ms = median_ms(apply_t["all"])
        mixed_ms = median_ms(mixed_t["all"])
        print(
            f"{total:>10,} {len(shapes):>6} {base:>8.2f} {hot:>6.2f} | {apply_ms:>6.2f} "
            f"{apply_ms / median_ms(apply_b):>5.2f} {apply_ms / hot:>5.2f} | "
            f"{mixed_ms:>6.2f} {mixed_ms / median_ms(mixed_b):>5.2f} "
            f"{mixed_ms / hot:>5.2f} | " + kinds(mixed_t)
        )
        print(f"{'':>10} {'':>6} {'':>8} {'':>6} | apply by kind: " + kinds(apply_t))


def kinds(times: dict[str, list[float]]) -> str:
    return ", ".join(f"{k} {median_ms(v):.2f} ({len(v)})" for k, v in times.items() if k != "all")


if __name__ == "__main__":
    main()
