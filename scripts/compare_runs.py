"""Run a few small real configs in-process and compare their metrics to a reference.

Usage (from the repository root, with the project on PYTHONPATH)::

    python scripts/compare_runs.py record REF_DIR   # write REF_DIR/<name>.csv
    python scripts/compare_runs.py check REF_DIR    # run again, compare; exit 1 on a difference

Each run: 4 nodes, 200 client updates, Fashion-MNIST at
/usr/share/datasets/fashion-mnist, centralized evaluation on 500 test images every
50 updates, on :class:`flwr_gsgm.inprocess_grid.InProcessGrid` with the project's
ClientApp. ``metrics.csv`` is compared byte for byte after dropping the
``wall_time`` column (the only column that depends on the machine), and so is
``summary.json`` without ``wall_seconds``.
"""

from __future__ import annotations

import csv
import io
import json
import sys
import tempfile
from pathlib import Path

RUNS = {
    "gsgm": {"strategy": "gsgm"},
    "asgd": {"strategy": "asgd"},
    "fedbuff": {"strategy": "fedbuff"},
    "gsgm-mif2-scheduled": {"strategy": "gsgm", "max-in-flight": 2, "dispatch": "scheduled"},
    "asgd-mif2-random": {"strategy": "asgd", "max-in-flight": 2, "dispatch": "random"},
}
COMMON = {
    "max-updates": 200,
    "eval-every": 50,
    "eval-examples": 500,
    "seed": 3,
    "data-root": "/usr/share/datasets/fashion-mnist",
}


def _without(text: str, column: str) -> str:
    rows = list(csv.reader(io.StringIO(text)))
    drop = rows[0].index(column)
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows([r[:drop] + r[drop + 1 :] for r in rows])
    return out.getvalue()


def run(name: str) -> str:
    """Run ``RUNS[name]``; return its metrics.csv (no wall_time) and summary (no wall_seconds)."""
    from clients.client_app import app
    from flwr_gsgm.inprocess_grid import InProcessGrid
    from flwr_gsgm.run_config import parse_run_config
    from serverapp.experiment import run_experiment

    cfg = parse_run_config({**COMMON, **RUNS[name]})
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / name
        grid = InProcessGrid(app, 4, cfg)
        run_experiment(grid, cfg, run_dir)
        metrics = _without((run_dir / "metrics.csv").read_text(), "wall_time")
        summary = json.loads((run_dir / "summary.json").read_text())
    summary.pop("wall_seconds")
    return metrics + "\n" + json.dumps(summary, indent=2, sort_keys=True) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("record", "check"):
        print(__doc__, file=sys.stderr)
        return 2
    ref = Path(argv[1])
    ref.mkdir(parents=True, exist_ok=True)
    status = 0
    for name in RUNS:
        got = run(name)
        path = ref / f"{name}.txt"
        if argv[0] == "record":
            path.write_text(got)
            print(f"{name}: recorded -> {path}")
        elif path.read_text() == got:
            print(f"{name}: IDENTICAL")
        else:
            status = 1
            print(f"{name}: DIFFERENT\n--- reference\n{path.read_text()}\n--- now\n{got}")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
