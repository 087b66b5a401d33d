"""The tuning rule (best final accuracy, ties to lower MASD, diverged runs never
chosen) on synthetic tables, and the tune stage on pre-made run folders."""

from __future__ import annotations

import json
import math
import os
import signal
import time
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

from simulations.preset import load_preset, report_runs, tune_runs
from simulations.results import read_csv
from simulations.sweep import (
    ExecOptions,
    SweepError,
    execute,
    pick_best,
    read_tuned,
    tune_stage,
    write_tuned,
)


def row(acc, masd, status="ok"):
    return {"final_accuracy": acc, "masd": masd, "status": status}


def test_best_final_accuracy_wins():
    rows = [row(0.70, 0.01), row(0.75, 0.05), row(0.72, 0.02)]
    assert pick_best(rows) == (1, False)


def test_exact_tie_goes_to_lower_masd_then_to_the_earlier_grid_point():
    rows = [row(0.75, 0.04), row(0.70, 0.001), row(0.75, 0.03), row(0.75, 0.03)]
    assert pick_best(rows) == (2, False)


def test_tie_tolerance_widens_the_tie():
    rows = [row(0.750, 0.04), row(0.748, 0.02), row(0.740, 0.001)]
    assert pick_best(rows, tie_tolerance=0.0) == (0, False)
    assert pick_best(rows, tie_tolerance=0.005) == (1, False)
    assert pick_best(rows, tie_tolerance=0.02) == (2, False)


def test_diverged_and_failed_runs_are_never_chosen():
    rows = [
        row(0.90, 0.01, "diverged"),
        row(0.60, 0.05),
        row(math.nan, math.nan, "failed"),
        row(0.61, 0.09),
    ]
    assert pick_best(rows) == (3, False)


def test_nan_masd_loses_a_tie():
    rows = [row(0.8, math.nan), row(0.8, 0.05)]
    assert pick_best(rows) == (1, False)


def test_all_diverged_keeps_the_best_finite_accuracy_and_flags_it():
    rows = [row(0.12, 0.0, "diverged"), row(0.14, 0.0, "diverged"), row("", "", "failed")]
    assert pick_best(rows) == (1, True)
    assert pick_best([row("", "", "failed")]) == (0, True)
    with pytest.raises(ValueError):
        pick_best([])


PRESET = """
[sweep]
name = "t"
seeds = [1, 2]
tie-tolerance = 0.0
[base]
max-updates = 100
eval-every = 10
[tune]
seed = 0
nodes = 4
partition = { partitioner = "pathological", classes-per-node = 2 }
[methods.gsgm]
config = { strategy = "gsgm" }
grid = { server-learning-rate = [0.01, 0.1], beta = [0.5, 0.9] }
[methods.gsgm-beta0]
inherit = "gsgm"
config = { beta = 0.0 }
grid = { server-learning-rate = [0.01, 0.1] }
[methods.asgd]
config = { strategy = "asgd", server-learning-rate = 0.03 }
[questions.q]
nodes = [4, 8]
partitions = [{ partitioner = "iid" }]
"""

# (final accuracy, MASD, non-finite loss?) of each fake tuning run
FAKE = {
    "tune/gsgm/server-learning-rate=0.01__beta=0.5": (0.70, 0.020, False),
    "tune/gsgm/server-learning-rate=0.01__beta=0.9": (0.80, 0.030, False),
    "tune/gsgm/server-learning-rate=0.1__beta=0.5": (
        0.80,
        0.010,
        False,
    ),  # ties on accuracy, lower MASD: chosen
    "tune/gsgm/server-learning-rate=0.1__beta=0.9": (
        0.95,
        0.001,
        True,
    ),  # best but diverged (NaN loss)
    "tune/gsgm-beta0/server-learning-rate=0.01": (0.60, 0.01, False),
    "tune/gsgm-beta0/server-learning-rate=0.1": (0.65, 0.02, False),
}


def fake_run(run_dir: Path, spec_json: dict, acc: float, masd: float, nan_loss: bool) -> None:
    """A finished run folder as the worker leaves it."""
    run_dir.mkdir(parents=True)
    (run_dir / "spec.json").write_text(json.dumps(spec_json))
    lines = ["updates,version,virtual_time,wall_time,accuracy,loss"]
    for i in range(11):
        loss = "nan" if nan_loss and i == 10 else "1.0"
        lines.append(f"{10 * i},{10 * i},{i}.0,0.1,{acc},{loss}")
    (run_dir / "metrics.csv").write_text("\n".join(lines) + "\n")
    (run_dir / "summary.json").write_text(
        json.dumps(
            {
                "final_accuracy": acc,
                "masd": masd,
                "accuracy_std": 0.0,
                "evaluations": 11,
                "rejected_by_reason": {},
            }
        )
    )


def test_tune_stage_picks_by_the_rule_and_writes_tuned_toml(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text(PRESET)
    preset = load_preset(path, out=tmp_path / "out")
    out = preset.out
    # gsgm's tuning runs exist already (resume); gsgm-beta0's depend on gsgm's choice.
    for spec in tune_runs(preset, "gsgm", {}):
        acc, masd, nan = FAKE[spec.run_id]
        fake_run(
            out / spec.run_id, {"run_config": spec.run_config, "nodes": spec.nodes}, acc, masd, nan
        )
    chosen_gsgm = {"strategy": "gsgm", "server-learning-rate": 0.1, "beta": 0.5}
    for spec in tune_runs(preset, "gsgm-beta0", {"gsgm": chosen_gsgm}):
        assert spec.run_config["beta"] == 0.0 and spec.run_config["seed"] == 0
        acc, masd, nan = FAKE[spec.run_id]
        fake_run(
            out / spec.run_id, {"run_config": spec.run_config, "nodes": spec.nodes}, acc, masd, nan
        )

    stats = {}
    tuned = tune_stage(preset, out, stats, ExecOptions(quiet=True))
    assert stats == {"skipped": 6}  # nothing ran
    assert tuned == {
        "gsgm": chosen_gsgm,
        "gsgm-beta0": {"strategy": "gsgm", "server-learning-rate": 0.1, "beta": 0.0},
        "asgd": {"strategy": "asgd", "server-learning-rate": 0.03},
    }
    data = tomllib.loads((out / "tuned.toml").read_text())
    assert data["methods"] == tuned
    sel = data["selection"]["gsgm"]
    assert sel["grid-point"] == "server-learning-rate=0.1__beta=0.5"
    assert (sel["final-accuracy"], sel["masd"], sel["candidates"], sel["diverged"]) == (
        0.8,
        0.01,
        4,
        1,
    )
    assert sel["all-diverged"] is False
    assert data["selection"]["asgd"] == {"grid-point": "default", "candidates": 0}
    tune_csv = (out / "tune.csv").read_text().splitlines()
    assert len(tune_csv) == 1 + 6
    assert sum(line.endswith(",true") for line in tune_csv) == 2

    # Reporting runs use the tuned configs, on the reporting seeds only.
    runs = report_runs(preset, tuned)
    assert len(runs) == 3 * 2 * 2  # methods x nodes x seeds
    assert {r.seed for r in runs} == {1, 2}
    g = next(r for r in runs if r.method == "gsgm")
    assert g.run_config["server-learning-rate"] == 0.1 and g.run_config["beta"] == 0.5
    assert g.run_config["partitioner"] == "iid"


def test_a_run_folder_of_another_config_stops_the_sweep(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text(PRESET)
    preset = load_preset(path, out=tmp_path / "out")
    spec = tune_runs(preset, "gsgm", {})[0]
    fake_run(
        preset.out / spec.run_id,
        {"run_config": {**spec.run_config, "server-learning-rate": 0.5}, "nodes": 4},
        0.5,
        0.01,
        False,
    )
    with pytest.raises(SweepError, match="different config"):
        execute([spec], preset.out, "x", {}, ExecOptions(quiet=True))


def test_a_run_folder_that_names_a_key_by_its_old_name_is_resumed_not_refused(tmp_path):
    # Results recorded before server-lr became server-learning-rate are the same run.
    path = tmp_path / "t.toml"
    path.write_text(PRESET)
    preset = load_preset(path, out=tmp_path / "out")
    spec = tune_runs(preset, "gsgm", {})[0]
    old_names = {
        ("server-lr" if k == "server-learning-rate" else k): v for k, v in spec.run_config.items()
    }
    assert "server-lr" in old_names
    fake_run(preset.out / spec.run_id, {"run_config": old_names, "nodes": 4}, 0.5, 0.01, False)
    summary = (preset.out / spec.run_id / "summary.json").read_bytes()
    stats: dict[str, int] = {}
    execute([spec], preset.out, "x", stats, ExecOptions(quiet=True))
    assert stats == {"skipped": 1}
    assert (preset.out / spec.run_id / "summary.json").read_bytes() == summary


def test_an_interrupted_report_stage_still_writes_runs_csv(tmp_path, monkeypatch):
    # A session's end stops the sweep midway: what finished must still be reportable.
    import simulations.sweep as sweep

    path = tmp_path / "t.toml"
    path.write_text(PRESET)
    preset = load_preset(path, out=tmp_path / "out")
    tuned = {m: {"strategy": "gsgm" if m != "asgd" else "asgd"} for m in preset.methods}
    first = report_runs(preset, tuned)[0]

    def one_run_then_ctrl_c(specs, out, *args, **kwargs):
        spec_json = {"run_config": first.run_config, "nodes": first.nodes}
        fake_run(out / first.run_id, spec_json, 0.75, 0.02, False)
        raise KeyboardInterrupt

    monkeypatch.setattr(sweep, "execute", one_run_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        sweep.report_stage(preset, preset.out, tuned, {}, None, ExecOptions(quiet=True))
    rows = read_csv(preset.out / "runs.csv")
    assert len(rows) == 3 * 2 * 2
    assert [r["status"] for r in rows].count("pending") == 11
    done = next(r for r in rows if r["run_id"] == first.run_id)
    assert (done["status"], done["final_accuracy"]) == ("ok", 0.75)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_a_background_sigint_stop_the_sweep_as_ctrl_c_does(signum):
    # A session's end sends SIGTERM; `sweep ... &` without job control ignores SIGINT.
    import simulations.sweep as sweep

    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        sweep.stop_on_signals()
        with pytest.raises(KeyboardInterrupt, match=f"signal {int(signum)}"):
            os.kill(os.getpid(), signum)
            time.sleep(5)  # the handler runs at once, in this (the main) thread
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def test_write_tuned_writes_the_header_and_the_tables_with_tomli_w(tmp_path):
    preset = SimpleNamespace(
        path="simulations/presets/x.toml",
        tune_seed=0,
        tune_nodes=10,
        tune_partition={"partitioner": "pathological", "classes-per-node": 2},
        tie_tolerance=0.0,
        seeds=[1, 2, 3],
    )
    tuned = {"gsgm/epoch": {"client-mode": "weights", "local-epochs": 1, "beta": 0.5}}
    selection = {
        "gsgm/epoch": {"method": "gsgm", "final-accuracy": 0.8, "masd": math.nan},
        "asgd": {"grid-point": "default", "candidates": 0, "all-diverged": False},
    }
    path = write_tuned(tmp_path / "tuned.toml", preset, tuned, selection)
    assert path.read_text() == (
        "# Tuned choices of `python -m simulations.sweep simulations/presets/x.toml`.\n"
        "# Tuning: seed 0, 10 nodes, partition k2; rule: best final accuracy among runs that"
        " did not\n"
        "# diverge, ties (within 0) to the lower MASD. The reporting seeds [1, 2, 3] use"
        " [methods.*].\n"
        "\n"
        '[methods."gsgm/epoch"]\n'
        'client-mode = "weights"\n'
        "local-epochs = 1\n"
        "beta = 0.5\n"
        "\n"
        '[selection."gsgm/epoch"]\n'
        'method = "gsgm"\n'
        "final-accuracy = 0.8\n"
        "masd = nan\n"
        "\n"
        "[selection.asgd]\n"
        'grid-point = "default"\n'
        "candidates = 0\n"
        "all-diverged = false\n"
    )
    assert read_tuned(path) == tuned
