"""Cost of every server rule's step beside its memory-traffic floor.

For each rule (and each GSGM variant: slot or table averaging, heavy-ball or ema
momentum, the momentum-only ablation, the step at the cycle's close, and the trimmed
mean of ``trim-fraction`` for GSGM's cycle and FedBuff's buffer) and each kind of step
it takes (an arrival
applied, an arrival into a GSGM slot or a FedBuff buffer, a dispatch that copies
``w``, a cycle close or buffer flush), print the median wall time of the call
(``on_update`` with its validation, or ``on_dispatch``) over the median time of the
plain step ``w -= lr * g`` on the same arrays, beside the step's floor.

The floor is the memory traffic the step cannot avoid, in model-sized float32 arrays
read or written, over the plain step's 3 (read ``g``, read ``w``, write ``w``): at
10M parameters (40 MB an array) every array streams from memory, so a step that
touches ``n`` arrays costs at least ``n / 3`` plain steps. The validation's one
read of the update is counted (an update is checked before it touches the state);
so an ASGD arrival's floor is (1 + 3) / 3 = 1.33. ``over floor`` is the time ratio
over the floor; the target is ``over floor <= 1.5`` for every arrival
step at 10M parameters. Cycle closes, buffer flushes and dispatches are reported
beside, with no target (they happen once per cycle, buffer or update).

The plain step is timed both as written (``w -= lr * g``, a temporary per array)
and as its chunked in-place form (``np.multiply(g, lr, out=t); w -= t`` on cache-
sized chunks); the faster of the two is the reference, so that the ratios are not
flattered by a slow baseline. Update arrays rotate over 3 sets (an update arrives
from the network, not from cache); blocks of plain steps alternate with blocks of
rule calls, so both see the same machine load.

Not a test: run ``python benchmarks/bench_core.py`` (``--quick`` for a smoke run on a
small model; ``tests/core/test_bench_core.py`` runs that).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flwr_gsgm.core.base as core_base  # noqa: E402
from flwr_gsgm.core import OPTIMIZERS, make_optimizer  # noqa: E402

LR = 0.01
NODES = [1, 2, 3, 4]
#: The arrival order: node 1 is fast (3 updates per round of the others), so GSGM
#: starts a slot and folds into it, and the buffered rules fill and flush.
PATTERN = [1, 1, 1, 2, 3, 4]
TARGET = 1.5

#: (label, rule, params): every rule with its defaults, GSGM in each variant.
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("gsgm slot heavy-ball", "gsgm", dict(averaging="slot", momentum_form="heavy-ball")),
    ("gsgm slot ema", "gsgm", dict(averaging="slot", momentum_form="ema")),
    ("gsgm table heavy-ball", "gsgm", dict(averaging="table", momentum_form="heavy-ball")),
    ("gsgm table ema", "gsgm", dict(averaging="table", momentum_form="ema")),
    ("gsgm momentum only", "gsgm", dict(scheduling=False)),
    # The step at the cycle's close (displacements), strict cycles of the 4 nodes, plain
    # and with the trimmed mean of its contributions (int(0.25 x 4) = 1 cut at each end).
    ("gsgm close", "gsgm", dict(displacement=True, cycle_quorum=1.0)),
    ("gsgm close trimmed", "gsgm", dict(displacement=True, cycle_quorum=1.0, trim_fraction=0.25)),
] + [(name, name, {}) for name in OPTIMIZERS if name != "gsgm"]
# FedBuff's buffer of K = 5 kept for its trimmed mean (1 cut at each end).
CASES.insert(
    CASES.index(("fedbuff", "fedbuff", {})) + 1,
    ("fedbuff trimmed", "fedbuff", dict(trim_fraction=0.2)),
)


def model_shapes(total: int) -> list[tuple[int, ...]]:
    """Shapes of a CNN-like model with ``total`` parameters: convs, biases, FCs."""
    shapes: list[tuple[int, ...]] = [(32, 1, 3, 3), (32,), (64, 32, 3, 3), (64,)]
    rest = total - sum(int(np.prod(s)) for s in shapes) - 512 - 10 - 10 * 512
    fc1_in = max(1, rest // 512)
    shapes += [(512, fc1_in), (512,), (10, 512), (10,)]
    used = sum(int(np.prod(s)) for s in shapes)
    if total > used:
        shapes.append((total - used,))  # remainder, e.g. a norm layer
    return shapes


# ------------------------------------------------------------------ the floors
def floor_arrays(opt: Any, rule: str, kind: str, extra: dict[str, int]) -> int:
    """Model-sized arrays a step of ``kind`` must read or write (validation included).

    ``extra``: what the call did beyond its own arrival (``slots``: GSGM slots applied
    at a close; ``rows``: table rows summed again at a close; ``caches``: CA2FL caches
    averaged at a flush; ``kept``: the updates a trimmed mean reads at a close or flush).
    """
    v = 1  # the validation's read of the update
    table = rule == "gsgm" and opt.averaging_in_use == "table"
    trimmed = opt.params.get("trim_fraction", 0.0) > 0
    if kind == "dispatch":
        return 2  # read w, write the copy sent
    if trimmed and kind in ("into buffer", "into cycle"):
        return v + 2  # g; its copy kept (a stale one's weight: in cache, same pass)
    if trimmed and kind in ("flush", "close"):
        # the arrival kept (g; copy), then every kept update read and w; w, and at a
        # GSGM close each pending slot kept as a contribution (slot; copy)
        return v + 2 + extra.get("kept", 0) + 2 + 2 * extra.get("slots", 0)
    if rule == "gsgm" and kind == "into cycle":
        return v + 3  # g, S; S (the step comes at the close)
    if rule in ("asgd", "daasgd"):
        return v + 3  # g, w; w
    if rule == "masgd":
        return v + 5  # g, v, w; v, w
    if rule in ("dcasgd", "fedasync"):
        return v + 4  # g, w, w sent; w
    if rule in ("fedbuff", "fedcompass"):  # FedCompass alone: its FedBuff-like fallback
        return v + (3 if kind == "into buffer" else 5)  # g, B; B (flush: + w; w)
    if rule == "ca2fl":
        arrival = v + 5  # g, cache, B; B, cache
        if kind == "into buffer":
            return arrival
        # flush: + h, w; w (B zeroed in the same pass) and h <- mean of the caches
        return arrival + 3 + extra.get("caches", 0) + 1
    if rule == "ace":
        return v + 7  # g, row, sum, w; row, sum, w
    if rule == "gsgm":
        if kind == "new slot":
            return v + 2  # g; slot
        if kind == "into slot":
            return v + 3  # g, slot; slot
        # applied: g, M, w, S; w, S (table averaging: + row, sum; row, sum)
        applied = v + (10 if table else 6)
        if kind == "applied":
            return applied
        if opt.apply_at_in_use == "close":
            # g, S; S, then w <- w - lr S / k: S, w; w, S zeroed; each pending slot
            # then added to S (slot, S; S)
            return v + 3 + 4 + 3 * extra.get("slots", 0)
        # close: M <- f(S, M): S, M; M, S zeroed; table sum recomputed from its rows;
        # then each pending slot applied as a contribution (its own kernel).
        per_slot = 10 if table else 6
        rows = extra.get("rows", 0) + 1 if table else 0
        return applied + 4 + rows + per_slot * extra.get("slots", 0)
    raise ValueError(f"no floor for rule {rule!r}")


# --------------------------------------------------------------------- timing
def plain_steps(
    w: list[np.ndarray], g: list[np.ndarray], scratch: np.ndarray
) -> tuple[float, float]:
    """Time one ``w -= lr * g`` as written, and its chunked in-place form."""
    t0 = time.perf_counter()
    for a, b in zip(w, g):
        a -= LR * b
    t1 = time.perf_counter()
    for a, b in zip(w, g):
        fa, fb = a.reshape(-1), b.reshape(-1)
        for s in range(0, fa.shape[0], scratch.shape[0]):
            e = min(s + scratch.shape[0], fa.shape[0])
            t = scratch[: e - s]
            np.multiply(fb[s:e], LR, out=t)
            np.subtract(fa[s:e], t, out=fa[s:e])
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def classify(rule: str, opt: Any, outcome: str, before: dict[str, Any]) -> str:
    """The kind of step an arrival was, from the optimizer before and after it."""
    if rule == "gsgm":
        if opt.cycle_index != before["cycle"]:
            return "close"
        if outcome == "applied":
            return "applied"
        if before["in_white"]:  # apply_at = "close": a contribution, deferred to the close
            return "into cycle"
        return "into slot" if before["had_slot"] else "new slot"
    if rule in ("fedbuff", "ca2fl", "fedcompass"):
        return "flush" if outcome == "applied" else "into buffer"
    return "applied"


def bench_case(
    rule: str,
    params: dict[str, Any],
    shapes: Sequence[tuple[int, ...]],
    updates: list[list[np.ndarray]],
    rounds: int,
) -> tuple[dict[str, list[tuple[float, int]]], list[float], list[float], int]:
    """``{kind: [(seconds, floor arrays)]}`` of a rule's calls, the plain steps' times
    (both forms) and the rule's memory: its ``model_copies()`` for the bench's nodes."""
    rng = np.random.default_rng(1)
    weights = [(rng.standard_normal(s) * 0.01).astype(np.float32) for s in shapes]
    w_plain = [a.copy() for a in weights]
    scratch = np.empty(core_base.CHUNK, np.float32)
    opt = make_optimizer(rule, weights, NODES, lr=LR, **params)
    del weights
    sent = {}
    for n in NODES:
        opt.on_dispatch(n)
        sent[n] = opt.version
    keeps_backups = hasattr(opt, "backup_versions")
    times: dict[str, list[tuple[float, int]]] = {}
    plain: list[float] = []
    plain_inplace: list[float] = []
    i = 0
    for r in range(rounds + 1):
        block = [plain_steps(w_plain, updates[(i + j) % 3], scratch) for j in range(len(PATTERN))]
        warm = r > 0  # the first round is a warm-up (first slot, first close, caches)
        if warm:
            plain += [b[0] for b in block]
            plain_inplace += [b[1] for b in block]
        for node in PATTERN:
            g = updates[i % 3]
            i += 1
            before = {
                "cycle": getattr(opt, "cycle_index", 0),
                "had_slot": node in getattr(opt, "slot_counts", {}),
                "in_white": rule == "gsgm" and node in opt.white_list,
                # updates a trimmed mean keeps: the cycle's or the buffer's count
                "kept": getattr(opt, "cycle_count", getattr(opt, "buffer_count", 0)),
                "slots": opt.counters.get("slots_applied", 0),
                "rows": len(getattr(opt, "table", {})) if rule == "gsgm" else 0,
                "caches": len(getattr(opt, "caches", {})) if rule == "ca2fl" else 0,
            }
            t0 = time.perf_counter()
            outcome = opt.on_update(node, g, sent[node]).value
            dt = time.perf_counter() - t0
            t0 = time.perf_counter()
            opt.on_dispatch(node)
            dd = time.perf_counter() - t0
            sent[node] = opt.version
            if not warm:
                continue
            kind = classify(rule, opt, outcome, before)
            extra = {
                "slots": opt.counters.get("slots_applied", 0) - before["slots"],
                "rows": before["rows"],
                "caches": len(getattr(opt, "caches", {})) if rule == "ca2fl" else 0,
                "kept": before["kept"] + 1,
            }
            times.setdefault(kind, []).append((dt, floor_arrays(opt, rule, kind, extra)))
            if keeps_backups:
                times.setdefault("dispatch", []).append((dd, 2))
    return times, plain, plain_inplace, opt.model_copies()


KIND_LABEL = {
    "applied": "arrival applied",
    "new slot": "arrival into new slot",
    "into slot": "arrival into slot",
    "into buffer": "arrival into buffer",
    "into cycle": "arrival into cycle",
    "close": "cycle close",
    "flush": "buffer flush",
    "dispatch": "dispatch (copy of w)",
}
ARRIVALS = ("applied", "new slot", "into slot", "into buffer", "into cycle")


def run(
    sizes: Sequence[int],
    rounds: int,
    out: Callable[[str], None] = print,
    cases: Sequence[tuple[str, str, dict[str, Any]]] = CASES,
) -> list[dict]:
    """Benchmark every case at every size; print the table; return its rows."""
    rows: list[dict] = []
    out(
        f"numpy {np.__version__}, python {platform.python_version()}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs, chunk {core_base.CHUNK}; load average "
        + " ".join(f"{x:.2f}" for x in os.getloadavg())
    )
    out(
        "ratio = median call / median plain step (the faster of `w -= lr * g` and its "
        "chunked in-place form); floor = model-sized arrays read + written / 3; "
        f"copies = model copies the rule keeps ({len(NODES)} nodes; model_copies); "
        f"target: arrival steps at 10M within {TARGET}x of their floor"
    )
    for total in sizes:
        shapes = model_shapes(total)
        rng = np.random.default_rng(0)
        updates = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(3)]
        out("")
        out(f"{total:,} parameters in {len(shapes)} arrays")
        head = (
            f"{'rule / variant':<22} {'step':<22} {'n':>3} {'ms':>8} {'plain ms':>8} "
            f"{'ratio':>6} {'floor':>6} {'over floor':>10} {'copies':>6}  target"
        )
        out(head)
        out("-" * len(head))
        for label, rule, params in cases:
            times, plain, plain_inplace, copies = bench_case(rule, params, shapes, updates, rounds)
            ref = min(statistics.median(plain), statistics.median(plain_inplace))
            for kind in [k for k in KIND_LABEL if k in times]:
                samples = times[kind]
                ms = statistics.median(t for t, _ in samples)
                floor = statistics.median(f for _, f in samples) / 3
                ratio = ms / ref
                over = ratio / floor
                if kind in ARRIVALS and total >= 10_000_000:
                    verdict = "pass" if over <= TARGET else "MISS"
                else:
                    verdict = "-"
                rows.append(
                    dict(
                        size=total,
                        case=label,
                        rule=rule,
                        kind=kind,
                        n=len(samples),
                        ms=1e3 * ms,
                        plain_ms=1e3 * ref,
                        ratio=ratio,
                        floor=floor,
                        over_floor=over,
                        copies=copies,
                        verdict=verdict,
                    )
                )
                out(
                    f"{label:<22} {KIND_LABEL[kind]:<22} {len(samples):>3} {1e3 * ms:>8.2f} "
                    f"{1e3 * ref:>8.2f} {ratio:>6.2f} {floor:>6.2f} {over:>10.2f} "
                    f"{copies:>6}  {verdict}"
                )
            del times
    return rows


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e6, 1e7])
    parser.add_argument("--rounds", type=int, default=8, help="timed rounds of the pattern")
    parser.add_argument("--quick", action="store_true", help="smoke run: 200k params, 1 round")
    parser.add_argument(
        "--cases", nargs="+", default=None, help="only the cases whose label starts so"
    )
    args = parser.parse_args(argv)
    if args.quick:
        sizes, rounds = [200_000], 1
    else:
        sizes, rounds = [int(s) for s in args.sizes], args.rounds
    if rounds < 1 or any(not math.isfinite(s) or s < 10_000 for s in sizes):
        parser.error("--rounds must be >= 1 and every size >= 10000")
    cases = CASES
    if args.cases:
        cases = [c for c in CASES if any(c[0].startswith(x) for x in args.cases)]
    return run(sizes, rounds, cases=cases)


if __name__ == "__main__":
    main()
