"""Same seed, same metrics: two real-data runs write identical metrics.csv (wall time aside)."""

from __future__ import annotations

from clients.client_app import app as client_app
from flwr_gsgm.simulation.inprocess_grid import InProcessGrid
from serverapp.app_config import parse_app_config
from serverapp.experiment import run_experiment
from tests.simulation_engine.test_flower_simulation import without_wall_time


def run(tmp_path, name, workers=0, **overrides):
    cfg = parse_app_config(
        {
            "max-updates": 120,
            "eval-every": 40,
            "eval-examples": 2000,
            "classes-per-node": 5,
            **overrides,
        }
    )
    with InProcessGrid(client_app, 3, run_config=cfg, workers=workers) as grid:
        run_experiment(grid, cfg, tmp_path / name)
    return without_wall_time((tmp_path / name / "metrics.csv").read_text())


def test_two_runs_with_the_same_seed_write_identical_metrics(tmp_path):
    first = run(tmp_path, "a")
    assert len(first) == 1 + 4  # header + evaluations at 0, 40, 80, 120
    assert first == run(tmp_path, "b")


def test_another_seed_gives_other_metrics(tmp_path):
    assert run(tmp_path, "a") != run(tmp_path, "c", seed=1)


def test_worker_threads_give_the_same_metrics_as_computing_on_pull(tmp_path):
    assert run(tmp_path, "threads", workers=2) == run(tmp_path, "on-pull", workers=0)
