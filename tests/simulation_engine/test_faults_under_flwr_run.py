"""Issue 12 items 1 and 6 under ``flwr run`` (Flower's simulation engine, Ray).

A copy of the project whose ``clientapp`` component is one of the misbehaving
ClientApps of ``faulty_apps.py`` runs through ``scripts/run_simulation.sh`` (what
``make run`` calls). Each run must end within ``BOUND`` seconds with a clear status:
the script's exit code, its message, and ``summary.json``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

from tests.simulation_engine.local_superlink import local_superlink
from tests.simulation_engine.test_flower_simulation import ROOT

# Wall seconds the script may take here (the local SuperLink is up before it starts):
# Ray's start on a loaded 2-core machine (up to a minute), the run itself, and
# END_GRACE after the ServerApp ended.
BOUND = 600
END_GRACE = 20


def project_copy(tmp_path: Path, clientapp: str) -> Path:
    """The project's tracked source files, with ``clientapp`` as the ClientApp component."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    copy = tmp_path / "project"
    for name in listed:
        if name.endswith((".py", ".toml", ".sh")) or name == ".gitignore":
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, copy / name)
    pyproject = copy / "pyproject.toml"
    lines = pyproject.read_text().splitlines()
    lines = [
        f'clientapp = "tests.simulation_engine.faulty_apps:{clientapp}"'
        if line.startswith("clientapp = ")
        else line
        for line in lines
    ]
    pyproject.write_text("\n".join(lines) + "\n")
    return copy


def flwr_run(tmp_path: Path, clientapp: str, num_nodes: int, overrides: dict) -> tuple:
    """Run the copy under ``flwr run``; return (exit code, output, run folder, seconds)."""

    def toml(v: object) -> str:
        return f'"{v}"' if isinstance(v, str) else str(v)

    project = project_copy(tmp_path, clientapp)
    out = tmp_path / "outputs"
    config = {
        "max-updates": 20,
        "eval-every": 20,
        "eval-examples": 200,
        **overrides,
        "output-dir": str(out),
        "run-name": "sim",
    }
    # A local SuperLink of the test's own (local_superlink.py), stopped with every
    # process it started (the hung ClientApp's Ray worker too) when the test ends.
    with local_superlink(tmp_path / "flwr-home") as env:
        t0 = time.monotonic()
        proc = subprocess.run(
            [
                "bash",
                str(project / "scripts" / "run_simulation.sh"),
                str(num_nodes),
                *[f"{k}={toml(v)}" for k, v in config.items()],
            ],
            env={**env, "END_GRACE": str(END_GRACE)},
            capture_output=True,
            text=True,
            timeout=BOUND,
        )
        seconds = time.monotonic() - t0
    return proc.returncode, proc.stdout + proc.stderr, out / "sim", seconds


def test_a_hung_client_app_under_flwr_run(tmp_path):
    # Partition 0's ClientApp never returns. The engine excludes it after its first
    # time-out and trains with the others; Flower's runtime then waits for the hung
    # call, so the script stops it END_GRACE s after the ServerApp ended and exits 1.
    code, output, run_dir, seconds = flwr_run(
        tmp_path,
        "hung_partition_0",
        3,
        {"dispatch-timeout": 20.0, "message-ttl": 40.0, "max-node-failures": 1},
    )
    assert code == 1, output[-3000:]
    assert (
        "the ServerApp ended (completed) but Flower's simulation runtime did not end the run "
        f"within END_GRACE={END_GRACE} s: a ClientApp call that never returns holds it"
    ) in output, output[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["updates_received"] == 20
    # Flower draws node ids at random; the partition-id names the node.
    (hung,) = [k for k in summary["per_node"] if re.fullmatch(r"node \d+ \(partition 0\)", k)]
    assert summary["per_node"][hung]["excluded"] == (
        "1 failures in a row (max-node-failures=1); last: no reply within dispatch-timeout=20.0 s"
    )
    assert summary["nodes_excluded"] == 1 and summary["dispatch_timeouts"] == 1
    assert seconds < BOUND


def test_a_ttl_shorter_than_training_under_flwr_run(tmp_path):
    # Every train takes 30 s, the TTL is 8 s and the per-dispatch deadline 5 s: every
    # node times out twice and is excluded; the run fails, naming why, and the script
    # exits 1.
    code, output, run_dir, seconds = flwr_run(
        tmp_path,
        "slow_training",
        2,
        {"message-ttl": 8.0, "dispatch-timeout": 5.0, "max-node-failures": 2},
    )
    assert code == 1, output[-3000:]
    why = "2 failures in a row (max-node-failures=2); last: no reply within dispatch-timeout=5.0 s"
    # Flower draws node ids at random; the partition-id names each node.
    reason = re.escape(
        "no node left to train after 0 of 20 updates: node NODEID (partition 0) excluded "
        f"({why}); node NODEID (partition 1) excluded ({why})"
    ).replace("NODEID", r"\d+")
    assert re.search(f"run ended: failed: {reason}", output), output[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert re.fullmatch(reason, summary["status_reason"]), summary["status_reason"]
    assert seconds < BOUND


def test_a_ttl_below_the_dispatch_deadline_is_refused_under_flwr_run(tmp_path):
    # The deployment case: message-ttl=10 with a deadline of 100 s.
    code, output, run_dir, _ = flwr_run(
        tmp_path, "slow_training", 2, {"message-ttl": 10.0, "dispatch-timeout": 100.0}
    )
    assert code == 1, output[-3000:]
    assert (
        "[flwr-gsgm] run ended: failed: run config message-ttl=10.0 must be greater than "
        "dispatch-timeout=100.0"
    ) in output, output[-3000:]
    assert not run_dir.exists()  # refused before the run folder was made


def test_a_diverging_run_under_flwr_run(tmp_path):
    # ASGD with server lr 50 on the CNN: the test loss at 10 updates explodes (above 10 x
    # the initial evaluation's, flwr_gsgm.engine.divergence). The ServerApp writes the outputs,
    # logs "run ended: diverged: ..." and raises; the script exits 3 (diverged).
    code, output, run_dir, seconds = flwr_run(
        tmp_path,
        "unchanged",
        2,
        {"strategy": "asgd", "server-learning-rate": 50.0, "max-updates": 40, "eval-every": 10},
    )
    assert code == 3, output[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "diverged", summary
    reason = summary["status_reason"]
    assert reason.startswith("exploding test loss: ") and " at 10 updates exceeds 10 x " in reason
    assert f"run ended: diverged: {reason}" in output, output[-3000:]
    assert "diverged: " + reason in output.splitlines()[-1], output[-3000:]
    assert not (run_dir / "model.pt").exists() and (run_dir / "model_last_finite.pt").is_file()
    assert seconds < BOUND
