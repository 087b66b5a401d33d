"""Wall time of one run: the in-process engine against Flower's simulation engine.

Runs the default run config (GSGM, 10 nodes, Fashion-MNIST, 2 classes per node) with
a reduced budget both ways, checks that the two ``metrics.csv`` agree (wall time
aside), and prints the wall times and their ratio:

- "command": the whole ``flwr run`` (SuperLink and Ray start-up included) against the
  whole in-process call;
- "training": the engine's own ``wall_seconds`` from ``summary.json``.

Not a test (it takes minutes and its numbers depend on the machine's load):
``python benchmarks/bench_inprocess_vs_flower.py [--updates 1000] [--nodes 10] [--workers 2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clients.client_app import app as client_app  # noqa: E402
from flwr_gsgm.simulation.inprocess_grid import InProcessGrid  # noqa: E402
from serverapp.app_config import parse_app_config  # noqa: E402
from serverapp.experiment import run_experiment  # noqa: E402


def strip_wall_time(path: Path) -> list[list[str]]:
    rows = [line.split(",") for line in path.read_text().splitlines()]
    col = rows[0].index("wall_time")
    return [r[:col] + r[col + 1 :] for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=1000, help="client updates per run")
    parser.add_argument("--nodes", type=int, default=10, help="simulated SuperNodes")
    parser.add_argument("--workers", type=int, default=2, help="in-process client threads")
    args = parser.parse_args()
    overrides = {"max-updates": args.updates, "run-name": "bench"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        env = {
            **os.environ,
            "FLWR_HOME": str(out / "flwr-home"),
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        }
        cli = [
            f"{k}={json.dumps(v)}"
            for k, v in {**overrides, "output-dir": str(out / "flower")}.items()
        ]
        t0 = time.monotonic()
        subprocess.run(
            ["bash", str(ROOT / "scripts" / "run_simulation.sh"), str(args.nodes), *cli],
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        flower_cmd = time.monotonic() - t0

        cfg = parse_app_config({**overrides, "output-dir": str(out / "inprocess")})
        t0 = time.monotonic()
        with InProcessGrid(client_app, args.nodes, run_config=cfg, workers=args.workers) as grid:
            run_experiment(grid, cfg)
        inproc_cmd = time.monotonic() - t0

        flower_dir, inproc_dir = out / "flower" / "bench", out / "inprocess" / "bench"
        same = strip_wall_time(flower_dir / "metrics.csv") == strip_wall_time(
            inproc_dir / "metrics.csv"
        )
        flower_train = json.loads((flower_dir / "summary.json").read_text())["wall_seconds"]
        inproc_train = json.loads((inproc_dir / "summary.json").read_text())["wall_seconds"]
    print(f"{args.nodes} nodes, {args.updates} client updates; metrics.csv identical: {same}")
    print(f"{'':10} {'flower (s)':>11} {'in-process (s)':>15} {'flower / in-process':>20}")
    print(f"{'command':10} {flower_cmd:11.1f} {inproc_cmd:15.1f} {flower_cmd / inproc_cmd:20.2f}")
    print(
        f"{'training':10} {flower_train:11.1f} {inproc_train:15.1f} "
        f"{flower_train / inproc_train:20.2f}"
    )


if __name__ == "__main__":
    main()
