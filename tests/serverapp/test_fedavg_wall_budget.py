"""FedAvg's max-seconds: a wall-clock budget in deployment (virtual-clock = false), a
virtual one under the virtual clock, as for the asynchronous strategies. No real
waiting: the engine clock's ``time.monotonic`` is a fake one that each training round
moves by 4 s."""

from __future__ import annotations

import csv
from types import SimpleNamespace

import flwr_gsgm.engine.clock as engine_clock
import serverapp.experiment as experiment
from clients.client_app import app as client_app
from flwr_gsgm.simulation.inprocess_grid import InProcessGrid
from serverapp.app_config import parse_app_config
from serverapp.experiment import run_experiment

ROUND_SECONDS = 4.0


class TimedGrid(InProcessGrid):
    """Each synchronous training round lasts ROUND_SECONDS on ``clock``."""

    def __init__(self, clock: dict[str, float], *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.clock = clock
        self.train_rounds = 0

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        replies = super().send_and_receive(messages, timeout=timeout)
        if any(m.metadata.message_type == "train" for m in messages):
            self.train_rounds += 1
            self.clock["now"] += ROUND_SECONDS
        return replies


def run(tmp_path, monkeypatch, **run_config):
    clock = {"now": 0.0}
    fake = SimpleNamespace(monotonic=lambda: clock["now"])
    monkeypatch.setattr(experiment, "time", fake)  # the summary's wall seconds
    monkeypatch.setattr(engine_clock, "time", fake)  # the engine clock: budget, wall_time
    cfg = parse_app_config(
        {
            "strategy": "fedavg",
            "max-updates": 40,  # 10 rounds of 4 nodes without a budget
            "eval-every": 8,  # every second round
            "eval-examples": 100,
            "local-steps": 1,
            **run_config,
        }
    )
    grid = TimedGrid(clock, client_app, 4, run_config=cfg)
    summary = run_experiment(grid, cfg, tmp_path / "run")
    with open(tmp_path / "run" / "metrics.csv") as fh:
        rows = list(csv.DictReader(fh))
    return grid, summary, rows


def test_no_round_starts_after_the_wall_budget(tmp_path, monkeypatch):
    grid, summary, rows = run(
        tmp_path, monkeypatch, **{"virtual-clock": False, "max-seconds": 10.0}
    )
    # rounds start at 0, 4 and 8 s (< 10 s); the 4th would start at 12 s >= 10 s
    assert grid.train_rounds == 3
    assert summary["updates_received"] == 12
    # evaluations at rounds 0 and 2 (8 updates), then the last round's model (round 3)
    assert [int(r["updates"]) for r in rows] == [0, 8, 12]
    assert [float(r["wall_time"]) for r in rows] == [0.0, 8.0, 12.0]
    # in a deployment the engine clock is the wall clock, for FedAvg as for GSGM
    assert [float(r["virtual_time"]) for r in rows] == [0.0, 8.0, 12.0]


def test_max_seconds_under_the_virtual_clock_is_a_virtual_budget(tmp_path, monkeypatch):
    # uniform profile, jitter 0: a round lasts its slow node's 4 x 1.0 s, so rounds end
    # at 4, 8, 12 virtual seconds; the third ends past 10 s and is not applied.
    grid, summary, rows = run(tmp_path, monkeypatch, **{"max-seconds": 10.0, "jitter": 0.0})
    assert grid.train_rounds == 3  # the third round ran, its model was discarded
    assert summary["updates_received"] == 8
    assert [int(r["updates"]) for r in rows] == [0, 8]
    assert [float(r["virtual_time"]) for r in rows] == [0.0, 8.0]
    assert summary["virtual_seconds"] == 8.0
