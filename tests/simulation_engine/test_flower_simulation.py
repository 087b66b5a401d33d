"""End to end through Flower's simulation engine: `flwr run .` on real Fashion-MNIST.

Runs scripts/run_simulation.sh (the script `make run` uses) with its own FLWR_HOME,
so the test exercises the Flower App exactly as a user runs it; the local SuperLink
that `flwr run` uses is the test's own (tests/simulation_engine/local_superlink.py).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from clients.client_app import app as client_app
from flwr_gsgm.simulation.inprocess_grid import InProcessGrid
from serverapp.experiment import run_experiment
from tests.simulation_engine.local_superlink import local_superlink

ROOT = Path(__file__).resolve().parents[2]


def run_script(tmp_path: Path, num_nodes: int, overrides: dict[str, object]):
    """scripts/run_simulation.sh with a local SuperLink of the test's own (see
    local_superlink.py); the finished process, its output captured."""

    def toml(v: object) -> str:
        return f'"{v}"' if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else str(v)

    config = {**overrides, "output-dir": str(tmp_path / "outputs"), "run-name": "sim"}
    with local_superlink(tmp_path / "flwr-home") as env:
        return subprocess.run(
            [
                "bash",
                str(ROOT / "scripts" / "run_simulation.sh"),
                str(num_nodes),
                *[f"{k}={toml(v)}" for k, v in config.items()],
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )


def run_flower_simulation(tmp_path: Path, num_nodes: int, overrides: dict[str, object]) -> Path:
    """Run the app in Flower's simulation engine; return the run folder."""
    proc = run_script(tmp_path, num_nodes, overrides)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tmp_path / "outputs" / "sim"


SMALL_RUN = {
    "max-updates": 400,
    "eval-every": 50,
    "partitioner": "dirichlet",
    "dirichlet-alpha": 1.0,
}


def without_wall_time(csv_text: str) -> list[list[str]]:
    rows = [line.split(",") for line in csv_text.splitlines()]
    col = rows[0].index("wall_time")
    return [r[:col] + r[col + 1 :] for r in rows]


def test_gsgm_learns_real_fashion_mnist_in_flower_simulation(tmp_path):
    run_dir = run_flower_simulation(tmp_path, 4, SMALL_RUN)
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = (run_dir / "metrics.csv").read_text().splitlines()
    assert summary["updates_received"] == 400
    assert summary["rejected"] == 0 and summary["error_replies"] == 0
    assert len(rows) == 1 + 9  # header + evaluations at 0, 50, ..., 400
    first_acc = float(rows[1].split(",")[4])
    assert first_acc < 0.2  # an untrained CNN is at chance (10 classes)
    assert summary["final_accuracy"] > 0.5  # well above chance after 400 updates
    assert (run_dir / "accuracy.png").stat().st_size > 10_000
    assert json.loads((run_dir / "config.json").read_text())["strategy"] == "gsgm"

    # The in-process engine (same strategy, engine and ClientApp, no Ray, no SuperLink)
    # reproduces the Flower simulation's metrics exactly: the virtual clock fixes the
    # order in which replies are applied, whatever the transport.
    cfg = json.loads((run_dir / "config.json").read_text())
    inproc_dir = tmp_path / "inprocess"
    run_experiment(InProcessGrid(client_app, 4, run_config=cfg), cfg, inproc_dir)
    assert without_wall_time((inproc_dir / "metrics.csv").read_text()) == without_wall_time(
        (run_dir / "metrics.csv").read_text()
    )


def test_a_failing_run_makes_the_script_fail(tmp_path):
    # data-root without data: the ServerApp raises FileNotFoundError before training;
    # flwr run --stream itself exits 0, the script must not.
    proc = run_script(tmp_path, 2, {"data-root": str(tmp_path / "no-data")})
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert 'ended with status "finished:failed"' in proc.stderr, proc.stderr[-3000:]
    assert "sudo apt-get install dataset-fashion-mnist" in proc.stdout, proc.stdout[-3000:]
