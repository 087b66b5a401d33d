"""Client works and device profiles as sweep dimensions: expansion (labels, run ids,
counts), refusals, tuning per (method, work) by the accuracy at the time budget,
accuracy_at_budget and time_to_fedavg_accuracy by hand, and the report's tables."""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path

import pytest

from simulations.preset import (
    PROFILE_KEY,
    load_preset,
    report_runs,
    setting_label,
    stand_in_tuned,
    tune_runs,
    tune_works,
)
from simulations.report import write_report
from simulations.results import accuracy_at_budget, fill_times_to_reference, read_csv, run_row
from simulations.sweep import ExecOptions, _spec_json, dry_run, report_stage, tune_stage

PRESETS = Path(__file__).resolve().parents[2] / "simulations" / "presets"


PRESET = """
[sweep]
name = "w"
seeds = [1, 2]
reference = "gsgm"
speed-reference = "fedavg"
headline-baselines = ["fedavg"]
headline-settings = ["n4-iid-edge"]
headline-speed-settings = ["n4-iid-edge"]
[base]
max-updates = 100
eval-every = 10
[tune]
seed = 0
nodes = 4
partition = { partitioner = "iid" }
device-profile = "edge"
config = { max-seconds = 50.0 }
[client-works.batch]
config = { client-mode = "gradient", local-batches = 1 }
[client-works.steps4]
config = { client-mode = "weights", local-steps = 4 }
[client-works.steps8]
config = { client-mode = "weights", local-steps = 8 }
[methods.gsgm]
config = { strategy = "gsgm" }
grid = { server-learning-rate = [0.01, 0.1] }
[methods.gsgm-beta0]
inherit = "gsgm"
config = { beta = 0.0 }
[methods.fedavg]
config = { strategy = "fedavg" }
client-works = ["steps4", "steps8"]
[questions.q]
nodes = [4, 8]
max-in-flight = [0, 2]
partitions = [{ partitioner = "iid" }]
client-works = ["batch", "steps4", "steps8"]
device-profiles = ["edge", "loopback"]
config = { max-seconds = 100.0, max-updates = 1000 }
[questions.old]
nodes = [4]
methods = ["gsgm"]
partitions = [{ partitioner = "iid" }]
"""


def write(tmp_path: Path, text: str, name: str = "w.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_works_and_profiles_expand_into_labelled_runs(tmp_path):
    preset = load_preset(write(tmp_path, PRESET))
    assert tune_works(preset, "gsgm") == ["", "batch", "steps4", "steps8"]
    assert tune_works(preset, "gsgm-beta0") == ["batch", "steps4", "steps8"]
    assert tune_works(preset, "fedavg") == ["steps4", "steps8"]
    tuned = stand_in_tuned(preset)
    assert sorted(tuned) == [
        "fedavg/steps4",
        "fedavg/steps8",
        "gsgm",
        "gsgm-beta0/batch",
        "gsgm-beta0/steps4",
        "gsgm-beta0/steps8",
        "gsgm/batch",
        "gsgm/steps4",
        "gsgm/steps8",
    ]
    runs = report_runs(preset, tuned)
    # q: (3 + 3 + 2) (method, work) x 4 settings (4 and 8 nodes, all or 2 in flight)
    # x 2 profiles x 2 seeds; old: gsgm with the base config's work, 2 seeds
    assert len(runs) == 8 * 4 * 2 * 2 + 2
    ids = {r.run_id for r in runs}
    assert "runs/gsgm/n4-iid-f2-steps4-edge/s1" in ids
    assert "runs/fedavg/n8-iid-steps8-loopback/s2" in ids
    assert "runs/gsgm/n4-iid/s1" in ids and "runs/gsgm/n4-iid/s2" in ids  # no suffix
    assert not any("fedavg/" in i and "-batch-" in i for i in ids)  # restricted to weights
    run = next(r for r in runs if r.run_id == "runs/gsgm-beta0/n8-iid-f2-steps8-loopback/s2")
    assert (run.client_work, run.device_profile, run.seed, run.nodes) == (
        "steps8",
        "loopback",
        2,
        8,
    )
    assert run.run_config == {
        "max-updates": 1000,  # the question's config
        "eval-every": 10,
        "max-seconds": 100.0,
        "client-mode": "weights",  # the work's
        "local-steps": 8,
        "strategy": "gsgm",  # GSGM's stand-in choice for steps8, then the ablation
        "server-learning-rate": 0.01,
        "beta": 0.0,
        "partitioner": "iid",
        "seed": 2,
        "max-in-flight": 2,
        PROFILE_KEY: "loopback",
    }
    old = next(r for r in runs if r.run_id == "runs/gsgm/n4-iid/s1")
    assert (old.client_work, old.device_profile, old.questions) == ("", "", ("old",))
    assert PROFILE_KEY not in old.run_config and "client-mode" not in old.run_config
    # tuning: 2 grid points per work of gsgm (4 works), in the [tune] setting and budget
    tune = {w: tune_runs(preset, "gsgm", tuned, w) for w in tune_works(preset, "gsgm")}
    assert [s.run_id for s in tune["steps4"]] == [
        "tune/gsgm/steps4/server-learning-rate=0.01",
        "tune/gsgm/steps4/server-learning-rate=0.1",
    ]
    assert tune[""][0].run_id == "tune/gsgm/server-learning-rate=0.01"
    cfg = tune["steps4"][1].run_config
    assert (cfg["max-seconds"], cfg[PROFILE_KEY], cfg["local-steps"], cfg["seed"]) == (
        50.0,
        "edge",
        4,
        0,
    )
    assert tune_runs(preset, "fedavg", tuned, "steps4") == []  # no grid
    # spec.json names the work only when there is one
    assert _spec_json(run)["client_work"] == "steps8"
    assert "client_work" not in _spec_json(old)
    assert setting_label(10, "k2") == "n10-k2"
    assert setting_label(100, "k2", 20, "epoch", "edge") == "n100-k2-f20-epoch-edge"
    assert setting_label(10, "k2", 20, profile="edge") == "n10-k2-edge"  # 20 >= 10: all
    text = dry_run(preset, tmp_path / "out")
    rows = {line.split()[0]: line.split()[1:3] for line in text.splitlines()[4:13]}
    assert rows == {  # (method/work, grid points, done)
        **{k: ["2", "0"] for k in ("gsgm", "gsgm/batch", "gsgm/steps4", "gsgm/steps8")},
        **{k: ["0", "0"] for k in ("fedavg/steps4", "fedavg/steps8")},
        **{f"gsgm-beta0/{w}": ["0", "0"] for w in ("batch", "steps4", "steps8")},
    }
    assert "Tuning on seed 0, 4 nodes, iid, edge devices:" in text
    assert "q                  128   128" in text
    assert "x client works batch, steps4, steps8 x device profiles edge, loopback" in text
    assert preset.to_plan()["questions"]["q"]["client_works"] == ["batch", "steps4", "steps8"]
    assert "client_works" not in preset.to_plan()["questions"]["old"]


@pytest.mark.parametrize(
    "name",
    sorted(p.stem for p in PRESETS.glob("*.toml") if "client-works" not in p.read_text()),
)
def test_a_client_works_table_no_question_uses_changes_no_run(tmp_path, name):
    # The dimension is opt-in: a preset without works, with works declared but no
    # question using them, expands as before.
    text = (PRESETS / f"{name}.toml").read_text()
    before = load_preset(PRESETS / f"{name}.toml")
    after = load_preset(
        write(tmp_path, text + '\n[client-works.epoch]\nconfig = { client-mode = "weights" }\n')
    )
    for preset in (before, after):
        assert all(set(tune_works(preset, m)) == {""} for m in preset.methods)
    runs = [report_runs(p, stand_in_tuned(p)) for p in (before, after)]
    assert [r.__dict__ for r in runs[0]] == [r.__dict__ for r in runs[1]]
    # No client work; each run's profile is the base config's (if any) or one its
    # question lists.
    profiles = {before.base.get("device-profile", "")}
    profiles |= {p for q in before.questions.values() for p in q.device_profiles}
    assert all(not r.client_work and r.device_profile in profiles for r in runs[0])
    assert all(r.run_id.count("/") == 3 for r in runs[0])


REFUSED = [
    (
        PRESET.replace('"batch", "steps4", "steps8"]', '"batch", "epoch"]'),
        "unknown client work 'epoch'",
    ),
    (
        PRESET.replace('client-works = ["steps4", "steps8"]', 'client-works = ["steps2"]'),
        "[methods.fedavg] client-works names unknown client work 'steps2'",
    ),
    (
        PRESET.replace('client-works = ["steps4", "steps8"]\n', "").replace(
            'strategy = "fedavg" }', 'strategy = "fedavg", client-mode = "weights" }'
        ),
        "method 'fedavg' cannot run with client work 'batch': [methods.fedavg] config sets "
        "client-mode = 'weights', [client-works.batch] client-mode = 'gradient'",
    ),
    (
        PRESET.replace('methods = ["gsgm"]', 'methods = ["gsgm", "fedavg"]'),
        "[questions.old]: method 'fedavg' runs only with client works ['steps4', 'steps8'] "
        "([methods.fedavg] client-works), not with the base config's client work",
    ),
    (
        PRESET.replace("server-learning-rate = [0.01, 0.1] }", "local-steps = [2, 4] }"),
        "method 'gsgm' cannot run with client work 'steps4': [methods.gsgm] grid tunes "
        "'local-steps', which [client-works.steps4] sets",
    ),
    (
        PRESET.split("[questions.old]")[0]
        .replace("config = { beta = 0.0 }", 'config = { beta = 0.0 }\nclient-works = ["steps4"]')
        .replace(
            'config = { strategy = "gsgm" }',
            'config = { strategy = "gsgm" }\nclient-works = ["batch"]',
        ),
        "method 'gsgm-beta0' runs with client work 'steps4', but the method it inherits from, "
        "'gsgm', does not",
    ),
    (
        PRESET.replace("max-updates = 1000 }", "max-updates = 1000, local-steps = 2 }"),
        "[questions.q] config: 'local-steps' is set by its client work 'steps4'",
    ),
    (
        PRESET.replace("local-steps = 8 }", "local-steps = 8, strategy = 'asgd' }"),
        "[client-works.steps8] config: 'strategy' is not client work",
    ),
    (
        PRESET.replace("local-steps = 8 }", "local-steps = 0 }"),
        "[client-works.steps8] config: run config local-steps=0: expected an integer > 0",
    ),
    (PRESET.replace("[tune]\n", "[tune]\nmethods = []\n"), "[tune]: unknown key(s) ['methods']"),
    (
        PRESET.replace('device-profile = "edge"\n', 'client-works = ["steps4"]\n'),
        "[questions.q] runs method 'gsgm' with client work 'batch', which [tune] client-works "
        "['steps4'] does not tune it with",
    ),
    (
        PRESET.replace('"edge", "loopback"]', '"edge", "edge"]'),
        "[questions.q] device-profiles: names repeat in ['edge', 'edge']",
    ),
    (
        PRESET.replace('"edge", "loopback"]', '"edge", "phone"]'),
        "(method 'gsgm', client work batch, questions ['q']): run config device-profile='phone'",
    ),
    (
        PRESET.replace(
            'headline-settings = ["n4-iid-edge"]', 'headline-settings = ["n4-iid-phone"]'
        ),
        "headline-settings 'n4-iid-phone' is no question's setting",
    ),
]


def test_a_work_grid_replaces_the_grid_for_that_work(tmp_path):
    text = PRESET.replace(
        "grid = { server-learning-rate = [0.01, 0.1] }",
        "grid = { server-learning-rate = [0.01, 0.1] }\n"
        "work-grid = { steps4 = { server-learning-rate = [0.5, 1.0, 2.0] } }",
    )
    preset = load_preset(write(tmp_path, text))
    tuned = stand_in_tuned(preset)
    lrs = {
        w: [s.run_config["server-learning-rate"] for s in tune_runs(preset, "gsgm", tuned, w)]
        for w in ("batch", "steps4", "steps8")
    }
    assert lrs == {"batch": [0.01, 0.1], "steps4": [0.5, 1.0, 2.0], "steps8": [0.01, 0.1]}
    assert [s.run_id for s in tune_runs(preset, "gsgm", tuned, "steps4")][0] == (
        "tune/gsgm/steps4/server-learning-rate=0.5"
    )
    bad = text.replace("work-grid = { steps4", "work-grid = { steps9")
    with pytest.raises(ValueError, match="work-grid: unknown client work 'steps9'"):
        load_preset(write(tmp_path, bad))


@pytest.mark.parametrize("text, message", REFUSED)
def test_bad_works_and_profiles_are_refused_naming_them(tmp_path, text, message):
    with pytest.raises(ValueError) as err:
        load_preset(write(tmp_path, text))
    assert message in str(err.value)


# ----------------------------------------------------------- fake run folders
def fake_run(run_dir: Path, spec, times, accs, final=None, status="completed") -> None:
    """A finished run folder: metrics.csv rows at ``times`` (virtual s) with ``accs``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "spec.json").write_text(
        json.dumps({"run_config": spec.run_config, "nodes": spec.nodes})
    )
    lines = ["updates,version,virtual_time,wall_time,accuracy,loss"]
    lines += [f"{10 * i},{10 * i},{t},0.1,{a},1.0" for i, (t, a) in enumerate(zip(times, accs))]
    (run_dir / "metrics.csv").write_text("\n".join(lines) + "\n")
    final = sum(accs[-5:]) / len(accs[-5:]) if final is None else final
    summary = {"status": status, "final_accuracy": final, "masd": 0.01, "evaluations": len(accs)}
    (run_dir / "summary.json").write_text(json.dumps({**summary, "virtual_seconds": times[-1]}))


def test_accuracy_at_budget_is_the_last_evaluation_at_or_before_max_seconds(tmp_path):
    # A time-budgeted run: evaluations every 10 updates at 0, 17.5, 35, 49.2 s, then the
    # engine's final evaluation at its last reply's time, 49.9 s (within 50 s).
    rows = [
        {"virtual_time": t, "accuracy": a}
        for t, a in [(0.0, 0.1), (17.5, 0.4), (35.0, 0.55), (49.2, 0.61), (49.9, 0.63)]
    ]
    assert accuracy_at_budget(rows, 50.0) == 0.63
    assert accuracy_at_budget(rows, 49.2) == 0.61  # at the budget counts
    assert accuracy_at_budget(rows, 49.0) == 0.55
    assert math.isnan(accuracy_at_budget(rows, 0.0))  # no budget
    assert math.isnan(accuracy_at_budget(rows[1:], 10.0))  # nothing that early
    run = tmp_path / "r"
    times, accs = [0.0, 17.5, 35.0, 49.2, 60.0], [0.1, 0.4, 0.55, 0.61, 0.7]

    class Spec:
        run_config, nodes = {}, 4

    fake_run(run, Spec, times, accs)
    row = run_row(run, {"run_id": "r"}, chance=0.1, margin=0.05, target=0.5, max_seconds=50.0)
    assert (row["accuracy_at_budget"], row["status"]) == (0.61, "ok")
    assert math.isnan(run_row(run, {}, chance=0.1, margin=0.05, target=0.5)["accuracy_at_budget"])


def test_runs_csv_takes_the_server_learning_rate_the_run_applied(tmp_path):
    # The plan leaves server-learning-rate unset (the strategy's default for the client
    # mode): the row takes summary.json's; without it, the plan's value stays.
    run = tmp_path / "r"

    class Spec:
        run_config, nodes = {}, 4

    fake_run(run, Spec, [0.0, 10.0], [0.1, 0.5])
    base = {"run_id": "r", "server_learning_rate": ""}
    assert run_row(run, base, chance=0.1, margin=0.05, target=0.5)["server_learning_rate"] == ""
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "server_learning_rate": 0.5}))
    row = run_row(run, base, chance=0.1, margin=0.05, target=0.5)
    assert row["server_learning_rate"] == 0.5


def _row(out, method, work, seed, final, status="ok", profile="edge", nodes=4):
    run_id = f"runs/{method}/n{nodes}-iid-{work}-{profile}/s{seed}"
    return {
        "run_id": run_id,
        "run_dir": str(out / run_id),
        "method": method,
        "client_work": work,
        "device_profile": profile,
        "seed": seed,
        "nodes": nodes,
        "max_in_flight": nodes,
        "partition": "iid",
        "status": status,
        "final_accuracy": final,
    }


def _curve(out, row, times, accs):
    d = out / row["run_id"]
    d.mkdir(parents=True, exist_ok=True)
    lines = ["updates,virtual_time,accuracy,loss"]
    lines += [f"{10 * i},{t},{a},1.0" for i, (t, a) in enumerate(zip(times, accs))]
    (d / "metrics.csv").write_text("\n".join(lines) + "\n")


def test_time_to_fedavg_accuracy_takes_fedavg_s_best_work_per_setting_and_seed(tmp_path):
    out = tmp_path
    T = [0.0, 10.0, 20.0, 30.0, 40.0]
    rows = [
        # edge: fedavg/steps4 mean 0.71 beats fedavg/steps8 (0.75, 0.60: mean 0.675)
        _row(out, "fedavg", "steps4", 1, 0.70),
        _row(out, "fedavg", "steps4", 2, 0.72),
        _row(out, "fedavg", "steps8", 1, 0.75),
        _row(out, "fedavg", "steps8", 2, 0.60),
        _row(out, "gsgm", "batch", 1, 0.80),
        _row(out, "gsgm", "batch", 2, 0.80),
        _row(out, "gsgm", "batch", 3, 0.80),  # no fedavg run of seed 3
        _row(out, "gsgm", "steps4", 1, 0.10, status="diverged"),
        # loopback: fedavg/steps4's seed 2 diverged (mean over seed 1: 0.50), steps8 0.65
        _row(out, "fedavg", "steps4", 1, 0.50, profile="loopback"),
        _row(out, "fedavg", "steps4", 2, 0.90, status="diverged", profile="loopback"),
        _row(out, "fedavg", "steps8", 1, 0.60, profile="loopback"),
        _row(out, "fedavg", "steps8", 2, 0.70, profile="loopback"),
        _row(out, "gsgm", "batch", 1, 0.80, profile="loopback"),
        _row(out, "gsgm", "batch", 2, 0.80, profile="loopback"),
    ]
    curves = {
        ("fedavg", "steps4", 1, "edge"): [0.1, 0.3, 0.5, 0.7, 0.7],  # 0.70 first at 30 s
        ("fedavg", "steps4", 2, "edge"): [0.1, 0.3, 0.5, 0.7, 0.72],  # 0.72 at 40 s
        ("fedavg", "steps8", 1, "edge"): [0.1, 0.72, 0.75, 0.75, 0.75],  # 0.70 at 10 s
        ("fedavg", "steps8", 2, "edge"): [0.1, 0.2, 0.3, 0.6, 0.6],  # never 0.72
        ("gsgm", "batch", 1, "edge"): [0.1, 0.69, 0.70, 0.8, 0.8],  # 0.70 at 20 s
        ("gsgm", "batch", 2, "edge"): [0.1, 0.75, 0.8, 0.8, 0.8],  # 0.72 at 10 s
        ("gsgm", "batch", 3, "edge"): [0.1, 0.75, 0.8, 0.8, 0.8],
        ("gsgm", "steps4", 1, "edge"): [0.1, 0.9, 0.1, 0.1, 0.1],
        ("fedavg", "steps4", 1, "loopback"): [0.1, 0.5, 0.5, 0.5, 0.5],
        ("fedavg", "steps4", 2, "loopback"): [0.1, 0.9, 0.9, 0.9, 0.9],
        ("fedavg", "steps8", 1, "loopback"): [0.1, 0.2, 0.6, 0.6, 0.6],  # 0.60 at 20 s
        ("fedavg", "steps8", 2, "loopback"): [0.1, 0.2, 0.3, 0.7, 0.7],  # 0.70 at 30 s
        ("gsgm", "batch", 1, "loopback"): [0.1, 0.65, 0.8, 0.8, 0.8],  # 0.60 at 10 s
        ("gsgm", "batch", 2, "loopback"): [0.1, 0.65, 0.69, 0.71, 0.8],  # 0.70 at 30 s
    }
    for r in rows:
        _curve(out, r, T, curves[(r["method"], r["client_work"], r["seed"], r["device_profile"])])
    fill_times_to_reference(rows, "fedavg", out)
    got = {
        (r["method"], r["client_work"], r["seed"], r["device_profile"]): r[
            "time_to_fedavg_accuracy"
        ]
        for r in rows
    }
    expected = {
        ("fedavg", "steps4", 1, "edge"): 30.0,
        ("fedavg", "steps4", 2, "edge"): 40.0,
        ("fedavg", "steps8", 1, "edge"): 10.0,
        ("fedavg", "steps8", 2, "edge"): math.nan,  # never reaches 0.72
        ("gsgm", "batch", 1, "edge"): 20.0,
        ("gsgm", "batch", 2, "edge"): 10.0,
        ("gsgm", "batch", 3, "edge"): math.nan,  # no reference run of its seed
        ("gsgm", "steps4", 1, "edge"): math.nan,  # not ok
        ("fedavg", "steps4", 1, "loopback"): math.nan,  # 0.5 never reaches 0.60
        ("fedavg", "steps4", 2, "loopback"): math.nan,  # not ok
        ("fedavg", "steps8", 1, "loopback"): 20.0,
        ("fedavg", "steps8", 2, "loopback"): 30.0,
        ("gsgm", "batch", 1, "loopback"): 10.0,
        ("gsgm", "batch", 2, "loopback"): 30.0,
    }
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == value or (math.isnan(value) and math.isnan(got[key])), key
    fill_times_to_reference(rows, "", out)  # no speed reference: NaN everywhere
    assert all(math.isnan(r["time_to_fedavg_accuracy"]) for r in rows)


SWEEP = """
[sweep]
name = "e2e"
seeds = [1, 2]
reference = "gsgm"
speed-reference = "fedavg"
headline-baselines = ["fedavg"]
headline-settings = ["n4-iid-edge"]
[base]
max-updates = 1000
eval-every = 10
[tune]
seed = 0
nodes = 4
partition = { partitioner = "iid" }
config = { max-seconds = 40.0 }
[client-works.batch]
config = { client-mode = "gradient" }
[client-works.steps4]
config = { client-mode = "weights", local-steps = 4 }
[methods.gsgm]
config = { strategy = "gsgm" }
grid = { server-learning-rate = [0.01, 0.1] }
[methods.fedavg]
config = { strategy = "fedavg" }
client-works = ["steps4"]
[questions.q]
title = "Client work"
nodes = [4]
partitions = [{ partitioner = "iid" }]
client-works = ["batch", "steps4"]
device-profiles = ["edge", "loopback"]
config = { max-seconds = 40.0 }
"""

T = [0.0, 10.0, 20.0, 30.0, 40.0, 50.0]


def test_tuning_per_work_by_the_accuracy_at_budget_then_runs_csv_and_report(tmp_path, monkeypatch):
    import simulations.sweep as sweep

    preset = load_preset(write(tmp_path, SWEEP), out=tmp_path / "out")
    out = preset.out
    # (accuracies at T, final accuracy in summary.json) of gsgm's tuning runs: with a
    # 40 s budget the choice is by the accuracy at 40 s, not the final accuracy.
    tune = {
        "tune/gsgm/batch/server-learning-rate=0.01": ([0.1, 0.2, 0.3, 0.4, 0.60, 0.9], 0.9),
        "tune/gsgm/batch/server-learning-rate=0.1": ([0.1, 0.3, 0.5, 0.6, 0.65, 0.66], 0.66),
        "tune/gsgm/steps4/server-learning-rate=0.01": ([0.1, 0.3, 0.5, 0.7, 0.75, 0.5], 0.5),
        "tune/gsgm/steps4/server-learning-rate=0.1": ([0.1, 0.3, 0.5, 0.6, 0.70, 0.8], 0.8),
    }
    for w in ("batch", "steps4"):
        for spec in tune_runs(preset, "gsgm", {}, w):
            accs, final = tune[spec.run_id]
            fake_run(out / spec.run_id, spec, T, accs, final)
    stats: dict[str, int] = {}
    tuned = tune_stage(preset, out, stats, ExecOptions(quiet=True))
    assert stats == {"skipped": 4}
    assert tuned == {
        "gsgm/batch": {"client-mode": "gradient", "strategy": "gsgm", "server-learning-rate": 0.1},
        "gsgm/steps4": {
            "client-mode": "weights",
            "local-steps": 4,
            "strategy": "gsgm",
            "server-learning-rate": 0.01,
        },
        "fedavg/steps4": {"client-mode": "weights", "local-steps": 4, "strategy": "fedavg"},
    }
    data = tomllib.loads((out / "tuned.toml").read_text())
    assert data["methods"] == tuned
    sel = data["selection"]["gsgm/steps4"]
    assert (sel["method"], sel["client-work"], sel["grid-point"]) == (
        "gsgm",
        "steps4",
        "server-learning-rate=0.01",
    )
    assert (sel["accuracy-at-budget"], sel["final-accuracy"]) == (0.75, 0.5)
    assert data["selection"]["gsgm/batch"]["accuracy-at-budget"] == 0.65
    tune_csv = read_csv(out / "tune.csv")
    assert {r["client_work"] for r in tune_csv} == {"batch", "steps4"}
    assert [r["accuracy_at_budget"] for r in tune_csv] == [0.6, 0.65, 0.75, 0.7]

    # The reporting runs use their work's tuned point.
    runs = {r.run_id: r for r in report_runs(preset, tuned)}
    assert len(runs) == 3 * 2 * 2  # (method, work) x profiles x seeds
    assert runs["runs/gsgm/n4-iid-batch-edge/s1"].run_config["server-learning-rate"] == 0.1
    assert runs["runs/gsgm/n4-iid-steps4-edge/s1"].run_config["server-learning-rate"] == 0.01
    # Fake reporting runs: gsgm/batch reaches fedavg's final accuracy (0.6 on seed 1,
    # 0.62 on seed 2, the mean of its last 5 evaluations) at 20 s; gsgm/steps4 at 30 s;
    # fedavg itself at 40 s. At the 40 s budget: the evaluation at 40 s.
    curves = {
        "gsgm/batch": [0.1, 0.5, 0.65, 0.7, 0.72, 0.8],
        "gsgm/steps4": [0.1, 0.3, 0.5, 0.66, 0.68, 0.7],
        "fedavg/steps4": [0.1, 0.2, 0.3, 0.5, 0.62, 0.7],
    }
    for spec in runs.values():
        accs = curves[f"{spec.method}/{spec.client_work}"]
        final = {1: 0.6, 2: 0.62}[spec.seed] if spec.method == "fedavg" else None
        fake_run(out / spec.run_id, spec, T, accs, final)
    monkeypatch.setattr(sweep, "execute", lambda *a, **k: None)
    (out / "plan.json").write_text(json.dumps(preset.to_plan()))  # as run_sweep writes it
    report_stage(preset, out, tuned, {}, None, ExecOptions(quiet=True))
    rows = {r["run_id"]: r for r in read_csv(out / "runs.csv")}
    g = rows["runs/gsgm/n4-iid-batch-loopback/s2"]
    assert (g["client_work"], g["device_profile"], g["status"]) == ("batch", "loopback", "ok")
    assert (g["accuracy_at_budget"], g["time_to_fedavg_accuracy"]) == (0.72, 20.0)
    assert rows["runs/gsgm/n4-iid-steps4-edge/s1"]["time_to_fedavg_accuracy"] == 30.0
    f = rows["runs/fedavg/n4-iid-steps4-edge/s1"]
    assert (f["accuracy_at_budget"], f["time_to_fedavg_accuracy"]) == (0.62, 40.0)

    md = write_report(out, tmp_path / "results" / "RESULTS.md")
    text = md.read_text()
    headings = [line for line in text.splitlines() if line.startswith("### ")]
    assert headings == ["### 4 nodes, IID, edge devices", "### 4 nodes, IID, loopback devices"]
    edge = text[text.index("### 4 nodes, IID, edge") : text.index("### 4 nodes, IID, loopback")]
    head = next(line for line in edge.splitlines() if line.startswith("| method"))
    assert "accuracy at the time budget (%)" in head
    assert "time to fedavg's accuracy (virtual s; seeds that reached it)" in head
    table = [
        line
        for line in edge.splitlines()
        if line.startswith("| ") and not line.startswith("| method")
    ]
    assert [line.split(" | ")[0] for line in table] == [
        "| gsgm/batch",
        "| gsgm/steps4",
        "| fedavg/steps4",
    ]
    # gsgm/batch: ok 2/2, final accuracy = mean of the last 5 (0.5 ... 0.8) = 67.4, at the
    # 40 s budget 72.0 (the evaluation at 40 s, not the one at 50 s),
    # time to fedavg's accuracy 20 s on both seeds
    cells = table[0].split(" | ")
    assert cells[1:4] == ["2/2", "0", "0"]
    assert cells[4] == "67.4 ± 0.0" and cells[7] == "72.0 ± 0.0"
    assert cells[9] == "20 ± 0 (2/2)"
    fig = tmp_path / "results" / "figures" / "e2e" / "q_n4-iid-edge_curves.png"
    assert fig.is_file() and f"({fig.relative_to(md.parent).as_posix()})" in text
    # a time question is plotted per client training too
    fig = tmp_path / "results" / "figures" / "e2e" / "q_n4-iid-edge_curves_trainings.png"
    assert fig.is_file() and f"({fig.relative_to(md.parent).as_posix()})" in text
    # the headline takes each method's best work (gsgm/batch) and does not fail
    assert "Each method with its best client work in each setting." in text
    page = read_csv(md.parent / "runs.csv")
    assert {(r["client_work"], r["device_profile"]) for r in page} == {
        ("batch", "edge"),
        ("steps4", "edge"),
        ("batch", "loopback"),
        ("steps4", "loopback"),
    }
    assert (
        sorted(r["time_to_fedavg_accuracy"] for r in page if r["method"] == "gsgm")[:4]
        == [20.0] * 4
    )


FLEETS = """
[sweep]
name = "f"
seeds = [1]
reference = "gsgm"
[base]
max-updates = 100
[tune]
seed = 0
nodes = 4
partition = { partitioner = "iid" }
[fleets.steady]
config = { availability = "always" }
[fleets.churn]
config = { availability = "smartphones", speed-variance = "throttling" }
[methods.gsgm]
config = { strategy = "gsgm" }
[methods.fedavg]
config = { strategy = "fedavg" }
[questions.q]
nodes = [4]
partitions = [{ partitioner = "iid" }]
device-profiles = ["appfl10"]
fleets = ["steady", "churn"]
[questions.old]
nodes = [4]
methods = ["gsgm"]
partitions = [{ partitioner = "iid" }]
"""


def test_fleets_expand_into_labelled_runs_with_their_config(tmp_path):
    preset = load_preset(write(tmp_path, FLEETS))
    runs = {r.run_id: r for r in report_runs(preset, stand_in_tuned(preset))}
    # q: 2 methods x 2 fleets x 1 seed; old: no fleet, no suffix
    assert sorted(runs) == [
        "runs/fedavg/n4-iid-appfl10-churn/s1",
        "runs/fedavg/n4-iid-appfl10-steady/s1",
        "runs/gsgm/n4-iid-appfl10-churn/s1",
        "runs/gsgm/n4-iid-appfl10-steady/s1",
        "runs/gsgm/n4-iid/s1",
    ]
    churn = runs["runs/gsgm/n4-iid-appfl10-churn/s1"]
    assert churn.fleet == "churn"
    assert churn.run_config["availability"] == "smartphones"
    assert churn.run_config["speed-variance"] == "throttling"
    assert runs["runs/gsgm/n4-iid-appfl10-steady/s1"].run_config["availability"] == "always"
    assert "availability" not in runs["runs/gsgm/n4-iid/s1"].run_config
    assert setting_label(4, "iid", 0, "", "appfl10", "churn") == "n4-iid-appfl10-churn"
    # runs.csv keeps the fleet apart in the setting (its report groups)
    from simulations.results import setting_key

    row = {"nodes": 4, "partition": "iid", "device_profile": "appfl10", "fleet": "churn"}
    assert setting_key(row) == (4, "iid", 0, "appfl10-churn")


@pytest.mark.parametrize(
    "change,message",
    [
        ('fleets = ["steady", "churn"]', 'fleets = ["windy"]'),
        ('config = { availability = "always" }', "config = { max-updates = 5 }"),
    ],
)
def test_bad_fleets_are_refused_naming_them(tmp_path, change, message):
    text = FLEETS.replace(change, message)
    with pytest.raises(ValueError) as err:
        load_preset(write(tmp_path, text))
    assert "windy" in str(err.value) or "are not fleet keys" in str(err.value)
