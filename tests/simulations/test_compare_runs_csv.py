"""scripts/compare_runs_csv.py on hand-made runs.csv files: which runs a re-run reproduced."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from simulations.results import write_csv

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "compare_runs_csv.py"


def rows(*runs):
    return [
        {"run_id": rid, "status": st, "final_accuracy": acc, "masd": masd}
        for rid, st, acc, masd in runs
    ]


def run_script(tmp_path, ref, new, *extra):
    write_csv(tmp_path / "ref.csv", ref)
    write_csv(tmp_path / "new.csv", new)
    cmd = [sys.executable, str(SCRIPT), str(tmp_path / "ref.csv"), str(tmp_path / "new.csv")]
    return subprocess.run([*cmd, *extra], capture_output=True, text=True)


def test_identical_close_and_different_runs_are_counted_and_the_different_named(tmp_path):
    ref = rows(
        ("runs/gsgm/n10-k2/s1", "ok", 0.8379999999999999, 0.0177),
        ("runs/asgd/n10-k2/s1", "ok", 0.81, 0.0228),
        ("runs/ace/n30-k2/s1", "ok", 0.50, 0.03),
        ("runs/ca2fl/n30-k2/s1", "ok", 0.70, 0.02),
        ("runs/fedbuff/n30-k2/s1", "ok", 0.77, 0.02),  # not re-run yet
    )
    new = rows(
        ("runs/gsgm/n10-k2/s1", "ok", 0.8379999999999999, 0.0177),  # identical
        ("runs/asgd/n10-k2/s1", "ok", 0.8109, 0.0228),  # 0.09 pp: close
        ("runs/ace/n30-k2/s1", "diverged", 0.10, 0.01),  # status changed
        ("runs/ca2fl/n30-k2/s1", "ok", 0.7012, 0.02),  # 0.12 pp: different
        ("runs/fedbuff/n30-k2/s1", "pending", float("nan"), float("nan")),
    )
    done = run_script(tmp_path, ref, new)
    assert done.returncode == 1
    assert done.stdout.splitlines() == [
        "runs/ace/n30-k2/s1: ok 50.00% MASD 3.00 -> diverged 10.00% MASD 1.00",
        "runs/ca2fl/n30-k2/s1: ok 70.00% MASD 2.00 -> ok 70.12% MASD 2.00",
        "4 runs finished in both: 1 identical, 1 within 0.1 pp, 2 different",
    ]
    wider = run_script(tmp_path, ref[:2] + ref[3:4], new[:2] + new[3:4], "--tolerance", "0.2")
    assert wider.returncode == 0
    assert (
        wider.stdout.strip() == "3 runs finished in both: 1 identical, 2 within 0.2 pp, 0 different"
    )


def test_a_missing_file_is_named(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "nope.csv"), str(tmp_path / "nope.csv")],
        capture_output=True,
        text=True,
    )
    assert (
        done.returncode == 2
        and "nope.csv: no such file (expected a sweep's runs.csv)" in done.stderr
    )
