"""The README's `make run RUN_CONFIG=...` example, run exactly as written.

Make wrote `$(RUN_CONFIG)` into the recipe, so the shell stripped the quotes of TOML
strings (`strategy="asgd"` reached Flower as `strategy=asgd`, "invalid format").
The test takes the line from README.md and runs it with `bash -c` in the repository;
only the environment differs from a user's shell: make's VENV points at this test's
interpreter (through MAKEFLAGS, as `make VENV=...` would), FLWR_HOME at a temporary
folder, and the local SuperLink is the test's own, on free ports (local_superlink.py).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.simulation_engine.local_superlink import local_superlink

ROOT = Path(__file__).resolve().parents[2]


def readme_example() -> str:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    lines = [ln for b in blocks for ln in b.splitlines() if ln.startswith("make run RUN_CONFIG=")]
    assert len(lines) == 1, lines
    return lines[0]


def test_the_readme_make_run_example_runs_as_written(tmp_path):
    line = readme_example()
    assert line == """make run RUN_CONFIG='strategy="asgd" max-updates=200 eval-every=50'"""
    # A venv for make: this interpreter's bin folder, already "installed".
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / "bin").symlink_to(Path(sys.executable).parent)
    (venv / ".installed").touch()
    with local_superlink(tmp_path / "flwr-home") as superlink_env:
        env = {
            **{k: v for k, v in superlink_env.items() if k not in ("MAKELEVEL", "MFLAGS")},
            "MAKEFLAGS": f"VENV={venv}",
        }
        proc = subprocess.run(
            ["bash", "-c", line], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200
        )
    out = proc.stdout + proc.stderr
    found = re.search(
        r"\[flwr-gsgm\] final accuracy [\d.]+ \(the mean of the last 5 evaluations; "
        r"the last [\d.]+\), MASD [\d.]+ -> (\S+)",
        out,
    )
    run_dir = Path(found.group(1)) if found else None
    try:
        assert proc.returncode == 0, out[-4000:]
        assert re.search(r"run \d+ completed", out), out[-2000:]
        assert run_dir is not None and run_dir.is_dir(), out[-2000:]
        config = json.loads((run_dir / "config.json").read_text())
        assert (config["strategy"], config["max-updates"], config["eval-every"]) == (
            "asgd",
            200,
            50,
        )
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["updates_received"] == 200 and summary["evaluations"] == 5
        assert summary["rejected"] == 0 and summary["error_replies"] == 0
    finally:
        if run_dir is not None and run_dir.is_dir() and ROOT in run_dir.parents:
            shutil.rmtree(run_dir)
