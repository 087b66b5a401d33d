"""Compare the finished runs of two sweeps' ``runs.csv``, run by run.

Usage::

    python scripts/compare_runs_csv.py REFERENCE_RUNS_CSV NEW_RUNS_CSV [--tolerance PP]

Rows are matched by ``run_id`` (``runs/<method>/<setting>/s<seed>``); only runs that
finished in both (status ``ok`` or ``diverged``) are compared. A run is *identical*
when its status, final accuracy and MASD are equal to the printed precision of
``runs.csv`` (the float64 text), *close* when its status is the same and both figures
are within ``--tolerance`` percentage points (default 0.1), else *different*. Each
different run is printed with both figures.

Why: a sweep re-run on another code version or machine (floating point differs in the
last bits across machines) confirms or replaces the published figures; this says
how many of them it reproduced. Exit code 0 when no run differs, 1 otherwise, 2 on a
bad argument.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulations.results import read_csv  # noqa: E402

FINISHED = ("ok", "diverged")


def _pp(value: float) -> str:
    return "-" if math.isnan(value) else f"{100 * value:.2f}"


def verdict(ref: dict, new: dict, tolerance_pp: float) -> str:
    """``"identical"``, ``"close"`` or ``"different"`` (module docstring)."""
    pairs = [(ref[k], new[k]) for k in ("final_accuracy", "masd")]
    if ref["status"] == new["status"] and all(
        a == b or (math.isnan(a) and math.isnan(b)) for a, b in pairs
    ):
        return "identical"
    close = all(
        (math.isnan(a) and math.isnan(b)) or abs(a - b) * 100 <= tolerance_pp for a, b in pairs
    )
    return "close" if ref["status"] == new["status"] and close else "different"


def compare(ref_rows: list[dict], new_rows: list[dict], tolerance_pp: float) -> tuple[dict, list]:
    """Counts per verdict and the lines of the different runs."""
    ref = {r["run_id"]: r for r in ref_rows if r["status"] in FINISHED}
    counts = {"identical": 0, "close": 0, "different": 0}
    lines = []
    for row in new_rows:
        old = ref.get(row["run_id"])
        if old is None or row["status"] not in FINISHED:
            continue
        v = verdict(old, row, tolerance_pp)
        counts[v] += 1
        if v == "different":
            lines.append(
                f"{row['run_id']}: {old['status']} {_pp(old['final_accuracy'])}% "
                f"MASD {_pp(old['masd'])} -> {row['status']} {_pp(row['final_accuracy'])}% "
                f"MASD {_pp(row['masd'])}"
            )
    return counts, lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reference", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--tolerance", type=float, default=0.1, help="percentage points")
    args = parser.parse_args(argv)
    for path in (args.reference, args.new):
        if not path.is_file():
            parser.error(f"{path}: no such file (expected a sweep's runs.csv)")
    counts, lines = compare(read_csv(args.reference), read_csv(args.new), args.tolerance)
    for line in lines:
        print(line)
    total = sum(counts.values())
    print(
        f"{total} runs finished in both: {counts['identical']} identical, {counts['close']} "
        f"within {args.tolerance:g} pp, {counts['different']} different"
    )
    return 1 if counts["different"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
