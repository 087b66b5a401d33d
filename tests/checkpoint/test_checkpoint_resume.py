"""A ServerApp killed mid-run (SIGKILL) and resumed from its checkpoint ends exactly
like an uninterrupted run: same final weights, same metrics.csv (wall time aside)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks import soak_deployment as soak
from clients.client_app import app as client_app
from flwr_gsgm.engine.reply_log import read_lineage
from flwr_gsgm.simulation.inprocess_grid import InProcessGrid
from serverapp.app_config import parse_app_config
from serverapp.experiment import run_experiment
from tests.simulation_engine.test_flower_simulation import without_wall_time

ROOT = Path(__file__).resolve().parents[2]
CONFIG = {
    "max-updates": 160,
    "eval-every": 20,
    "eval-examples": 1000,
    "classes-per-node": 5,
    "checkpoint-every": 20,
    "run-name": "run",
}

# The same experiment as a separate process, so it can be killed like a ServerApp.
CHILD = """
import json, sys
from clients.client_app import app
from serverapp.experiment import run_experiment
from flwr_gsgm.simulation.inprocess_grid import InProcessGrid
from serverapp.app_config import parse_app_config
from pathlib import Path
cfg = parse_app_config(json.loads(sys.argv[1]))
run_experiment(InProcessGrid(app, 3, run_config=cfg), cfg, Path(sys.argv[2]))
"""


def run_in_process(run_dir: Path, **overrides) -> None:
    cfg = parse_app_config({**CONFIG, **overrides})
    run_experiment(InProcessGrid(client_app, 3, run_config=cfg), cfg, run_dir)


def kill_after_second_checkpoint(run_dir: Path) -> int:
    """Start the run in a child process, SIGKILL it once it has checkpointed twice."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps(CONFIG), str(run_dir)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    ckpt, seen, deadline = run_dir / "checkpoint.pt", set(), time.monotonic() + 300
    try:
        while len(seen) < 2 and child.poll() is None and time.monotonic() < deadline:
            if ckpt.exists():
                seen.add(ckpt.stat().st_mtime_ns)
            time.sleep(0.02)
        assert child.poll() is None, "the run ended before it could be killed"
        os.kill(child.pid, signal.SIGKILL)
        return child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()


def test_killed_and_resumed_run_equals_uninterrupted_run(tmp_path):
    run_in_process(tmp_path / "whole")

    interrupted = tmp_path / "interrupted"
    assert kill_after_second_checkpoint(interrupted) == -signal.SIGKILL
    assert not (interrupted / "summary.json").exists()  # it really died mid-run
    run_in_process(interrupted, resume=True)

    whole = without_wall_time((tmp_path / "whole" / "metrics.csv").read_text())
    resumed = without_wall_time((interrupted / "metrics.csv").read_text())
    assert len(whole) == 1 + 9  # header + evaluations at 0, 20, ..., 160
    assert resumed == whole
    a = torch.load(tmp_path / "whole" / "model.pt")
    b = torch.load(interrupted / "model.pt")
    assert list(a) == list(b)
    assert all(torch.equal(a[k], b[k]) for k in a)

    # The reply log: the resumed run's history is the whole run's, reply by reply
    # (message ids aside: a resumed run's messages are new), each counted once.
    lineage = read_lineage(interrupted / "replies.csv")
    summary = json.loads((interrupted / "summary.json").read_text())
    assert len(lineage.resumes) == 1 and lineage.resumes[0] in (20, 40, 60)
    assert soak.check_accounted(lineage, summary).passed
    assert soak.check_applied_once(lineage).passed
    history = [
        (r["dispatch"], r["partition_id"], r["outcome"], r["received"]) for r in lineage.kept
    ]
    whole_log = read_lineage(tmp_path / "whole" / "replies.csv")
    assert whole_log.resumes == [] and whole_log.lost == []
    assert history == [
        (r["dispatch"], r["partition_id"], r["outcome"], r["received"]) for r in whole_log.kept
    ]
    assert sum(r["event"] == "update" for r in lineage.kept) == 160


def test_checkpointing_does_not_change_the_run(tmp_path):
    run_in_process(tmp_path / "with", **{"max-updates": 60})
    run_in_process(tmp_path / "without", **{"max-updates": 60, "checkpoint-every": 0})
    assert without_wall_time((tmp_path / "with" / "metrics.csv").read_text()) == without_wall_time(
        (tmp_path / "without" / "metrics.csv").read_text()
    )


def test_sigterm_saves_a_checkpoint_and_the_resumed_run_equals_the_whole_run(tmp_path):
    # Periodic checkpoints off in practice (every 1000 > 160 updates): the only
    # checkpoint is the one SIGTERM makes, at whatever update the run had reached.
    config = {**CONFIG, "checkpoint-every": 1000}
    run_in_process(tmp_path / "whole", **{"checkpoint-every": 1000})
    stopped = tmp_path / "stopped"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps(config), str(stopped)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in child.stderr:  # progress lines: wait until training is under way
            if "[async] updates 60/160" in line:
                child.send_signal(signal.SIGTERM)
                break
        _, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode != 0
    saved_at = int(re.search(r"checkpoint saved at (\d+) updates", err).group(1))
    assert 60 <= saved_at < 160  # it stopped mid-run
    assert (stopped / "checkpoint.pt").exists() and not (stopped / "summary.json").exists()
    run_in_process(stopped, resume=True, **{"checkpoint-every": 1000})
    assert without_wall_time((stopped / "metrics.csv").read_text()) == without_wall_time(
        (tmp_path / "whole" / "metrics.csv").read_text()
    )
