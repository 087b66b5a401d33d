"""Presets: validation, expansion into runs, the cost model, the divergence rule."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from simulations.preset import (
    estimate_seconds,
    grid_label,
    load_preset,
    partition_label,
    report_runs,
    setting_label,
    stand_in_tuned,
    tune_runs,
)
from simulations.results import divergence, run_row
from simulations.sweep import dry_run, run_order

PRESETS = Path(__file__).resolve().parents[2] / "simulations" / "presets"


def test_fashion_mnist_preset_expands_to_the_issue_4_sweep():
    preset = load_preset(PRESETS / "fashion_mnist.toml")
    assert preset.seeds == [1, 2, 3] and preset.tune_seed == 0
    assert list(preset.questions) == ["stability", "scale", "noniid", "time-to-target"]
    assert len(preset.methods) == 10
    tuned = stand_in_tuned(preset)
    tune = {m: tune_runs(preset, m, tuned) for m in preset.methods}
    assert len(tune["gsgm"]) == 5 * 2 * 2 * 2 * 2  # lr x beta x form x quorum x averaging
    assert sum(len(v) for v in tune.values()) == 80 + 5 + 5 + 5 + 10 + 5 + 5 + 5 + 5 + 5
    assert all(s.seed == 0 and s.nodes == 10 for v in tune.values() for s in v)
    # ablations start from GSGM's choice
    assert tune["gsgm-beta0"][0].run_config["beta"] == 0.0
    assert tune["gsgm-nosched"][0].run_config["scheduling"] is False
    assert tune["gsgm-nosched"][0].run_config["strategy"] == "gsgm"
    runs = report_runs(preset, tuned)
    # stability 10 methods; scale 4 more sizes x 6; non-IID 6 more partitions x 5; time-to-target shared
    assert len(runs) == 3 * (10 + 4 * 6 + 6 * 5)
    assert {r.seed for r in runs} == {1, 2, 3}
    shared = next(r for r in runs if r.run_id == "runs/gsgm/n10-k2/s1")
    assert shared.questions == ("stability", "scale", "noniid", "time-to-target")
    assert {r.partition_label for r in runs} == {
        "k1",
        "k2",
        "k5",
        "dir0.1",
        "dir0.5",
        "dir1",
        "iid",
    }
    assert {r.nodes for r in runs} == {5, 10, 20, 30, 100}
    # same budget for every method
    assert {r.run_config["max-updates"] for r in runs} == {2000}
    assert {r.run_config["max-updates"] for v in tune.values() for r in v} == {2000}
    assert preset.to_plan()["headline"] == {
        "baselines": ["asgd", "masgd"],
        "settings": ["n10-k2", "n30-k2"],
        "target": 0.2,
        "accuracy_tolerance": 0.0,
        "accuracy_baselines": [],
        "speed_settings": [],
    }
    assert preset.to_plan()["speed_reference"] == ""


def test_scale_preset_expands_to_the_issue_9_sweep():
    preset = load_preset(PRESETS / "fashion_mnist_scale.toml")
    assert preset.tune_nodes == 10 and preset.tune_seed == 0 and preset.seeds == [1, 2, 3]
    runs = report_runs(preset, stand_in_tuned(preset))
    settings = {(r.nodes, r.max_in_flight) for r in runs}
    assert settings == {(10, 0), (30, 0), (30, 20), (100, 0), (100, 20), (300, 0), (300, 20)}
    budget = {r.nodes: r.run_config["max-updates"] for r in runs}
    assert budget == {10: 4000, 30: 4000, 100: 10000, 300: 10000}
    limited = [r for r in runs if r.max_in_flight]
    assert all(r.run_config["max-in-flight"] == 20 and "-f20/" in r.run_id for r in limited)
    assert all("max-in-flight" not in r.run_config for r in runs if not r.max_in_flight)
    at_300 = {r.method for r in runs if r.nodes == 300}
    assert at_300 == {"gsgm", "asgd", "fedbuff", "ca2fl", "ace", "fedavg"}
    # every method at 10 nodes but gsgm-table, which "auto" makes gsgm there
    assert {r.method for r in runs if r.nodes == 10} == set(preset.methods) - {"gsgm-table"}
    table = {(r.nodes, r.max_in_flight) for r in runs if r.method == "gsgm-table"}
    assert table == {(30, 20), (100, 0), (100, 20)}
    # GSGM dispatches by its schedule, the baselines at random (the run config default)
    assert all(r.run_config.get("dispatch") == "scheduled" for r in runs if r.method == "gsgm")
    assert all(
        "dispatch" not in r.run_config for r in runs if r.method in ("asgd", "fedbuff", "ca2fl")
    )
    assert setting_label(300, "k2", 20) == "n300-k2-f20" and setting_label(10, "k2", 20) == "n10-k2"


def test_question_config_and_max_in_flight_expand_and_conflicts_are_refused(tmp_path):
    body = """
[sweep]
reference = "a"
[base]
max-updates = 100
[methods.a]
config = { strategy = "asgd" }
[questions.q]
nodes = [4, 40]
max-in-flight = [0, 8, 40]
partitions = [{ partitioner = "iid" }]
config = { max-updates = 500 }
"""
    preset = load_preset(write(tmp_path, body))
    runs = report_runs(preset, stand_in_tuned(preset))
    # 8 and 40 in flight at 4 nodes are "all"; 40 at 40 nodes too: 3 settings x 3 seeds
    assert sorted({r.run_id.split("/")[2] for r in runs}) == ["n4-iid", "n40-iid", "n40-iid-f8"]
    assert {r.run_config["max-updates"] for r in runs} == {500}
    with pytest.raises(ValueError, match="different run configs"):
        load_preset(
            write(
                tmp_path,
                body
                + """
[questions.r]
nodes = [4]
partitions = [{ partitioner = "iid" }]
config = { max-updates = 600 }
""",
            )
        )
    with pytest.raises(ValueError, match="max-in-flight must be a non-empty list"):
        load_preset(write(tmp_path, body.replace("[0, 8, 40]", "[-1]")))
    with pytest.raises(ValueError, match="'partitioner' is set by partitions"):
        load_preset(write(tmp_path, body.replace("max-updates = 500", 'partitioner = "iid"')))


def test_dry_run_counts_runs_and_estimates_time(tmp_path):
    preset = load_preset(PRESETS / "fashion_mnist.toml", out=tmp_path)
    text = dry_run(preset, tmp_path, jobs=2)
    assert "Total: 322 runs" in text and "with --jobs 2" in text  # 130 tuning + 192 reporting runs
    assert "gsgm                      80" in text
    # each stage counts only its own runs
    assert "Total: 192 runs" in dry_run(preset, tmp_path, jobs=2, stage="report")
    assert "Total: 130 runs" in dry_run(preset, tmp_path, jobs=2, stage="tune")


@pytest.mark.parametrize("name", ["smoke", "cifar10", "cifar100"])
def test_other_presets_load(name):
    preset = load_preset(PRESETS / f"{name}.toml")
    assert report_runs(preset, stand_in_tuned(preset))


def test_cost_model_hand_checked():
    preset = load_preset(PRESETS / "fashion_mnist.toml")
    spec = report_runs(preset, stand_in_tuned(preset), ["stability"])[0]
    est = {"overhead-seconds": 3.0, "updates-per-second": 40.0, "eval-seconds-per-10k": 4.0}
    # 3 + 2000 / 40 + (1 + 2000 / 50) evaluations * 1000 / 10000 * 4 s
    assert estimate_seconds(spec, est) == pytest.approx(3 + 50 + 41 * 0.4)
    sync = next(
        s
        for s in report_runs(preset, stand_in_tuned(preset), ["scale"])
        if s.method == "fedavg" and s.nodes == 30
    )
    # 2000 // 30 = 66 rounds of 30 nodes = 1980 computations, 1 + 1980 // 50 = 40 evaluations
    assert estimate_seconds(sync, est) == pytest.approx(3 + 1980 / 40 + 40 * 0.4)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "p.toml"
    path.write_text(text)
    return path


BASE = """
[sweep]
reference = "a"
seeds = [1, 2]
[tune]
seed = 0
[methods.a]
config = { strategy = "asgd" }
[questions.q]
nodes = [3]
"""


@pytest.mark.parametrize(
    "text, message",
    [
        (
            BASE.replace("seeds = [1, 2]", "seeds = [0, 1]"),
            "tuning seed 0 is also a reporting seed",
        ),
        (
            BASE.replace('strategy = "asgd"', 'strategy = "asgd", sever-lr = 1.0'),
            "unknown run config key 'sever-lr'",
        ),
        (
            BASE.replace('strategy = "asgd"', 'strategy = "asgd", seed = 4'),
            "'seed' is set by the sweep",
        ),
        (BASE.replace('strategy = "asgd"', 'strategy = "sgd"'), "strategy='sgd'"),
        (BASE + 'methods = ["b"]\n', "unknown method 'b'"),
        (BASE + '[methods.c]\ninherit = "zz"\n', "inherits from unknown method 'zz'"),
        (BASE.replace("nodes = [3]", 'nodes = [3]\nkind = "speed"'), "kind 'speed'"),
        (
            BASE
            + '[questions.r]\npartitions = [{ partitioner = "pathological", classes-per-node = 11 }]\n',
            "classes-per-node=11",
        ),
        (BASE.replace("[methods.a]", "[methods.a]\ngrid = { beta = [0.5, 1.5] }"), "beta=1.5"),
        (
            BASE.replace('strategy = "asgd"', 'strategy = "asgd", fedbuff-k = 4'),
            "[methods.a] config: 'fedbuff-k' is not a parameter of strategy 'asgd'",
        ),
        (
            BASE.replace("[methods.a]", "[methods.a]\ngrid = { beta = [0.5, 0.9] }"),
            "[methods.a] grid: 'beta' is not a parameter of strategy 'asgd'",
        ),
        (
            BASE + '[methods.b]\ninherit = "a"\nconfig = { cycle-quorum = 1.0 }\n',
            "[methods.b] config: 'cycle-quorum' is not a parameter of strategy 'asgd'",
        ),
        (
            BASE.replace('strategy = "asgd"', 'strategy = "fedavg", server-learning-rate = 1.0'),
            "'server-learning-rate' is not a parameter of strategy 'fedavg'",
        ),
        (
            BASE.replace(
                "[tune]", 'headline-baselines = ["b"]\nheadline-settings = ["n3-iid"]\n[tune]'
            ),
            "headline-baselines names unknown method 'b'",
        ),
        (
            BASE.replace(
                "[tune]", 'headline-baselines = ["a"]\nheadline-settings = ["n30-k2"]\n[tune]'
            ),
            "headline-settings 'n30-k2' is no question's setting; known: ['n3-iid']",
        ),
        (
            BASE.replace(
                "[tune]",
                'headline-baselines = ["a"]\nheadline-settings = ["n3-iid"]\n'
                "headline-target = 20\n[tune]",
            ),
            "headline-target=20.0",
        ),
        (
            BASE.replace(
                "[tune]",
                'headline-baselines = ["a"]\nheadline-settings = ["n3-iid"]\n'
                "headline-accuracy-tolerance = 1\n[tune]",
            ),
            "headline-accuracy-tolerance=1.0: expected a fraction of accuracy",
        ),
        (
            BASE.replace("[tune]", 'speed-reference = "fedavg"\n[tune]'),
            "speed-reference 'fedavg' is not a method",
        ),
        (
            BASE.replace(
                "[tune]",
                'headline-baselines = ["a"]\nheadline-settings = ["n3-iid"]\n'
                'headline-accuracy-baselines = ["fedbuff"]\n[tune]',
            ),
            "headline-accuracy-baselines names unknown method 'fedbuff'",
        ),
        (
            BASE.replace("[tune]", 'headline-speed-settings = ["n300-k2"]\n[tune]'),
            "headline-speed-settings 'n300-k2' is no question's setting; known: ['n3-iid']",
        ),
        (
            BASE.replace("[tune]", 'headline-speed-settings = ["n3-iid"]\n[tune]'),
            "headline-speed-settings needs a speed-reference",
        ),
    ],
)
def test_bad_presets_are_refused_naming_the_problem(tmp_path, text, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_preset(write(tmp_path, text))


def test_labels():
    assert partition_label({"partitioner": "pathological", "classes-per-node": 5}) == "k5"
    assert partition_label({"partitioner": "dirichlet", "dirichlet-alpha": 1.0}) == "dir1"
    assert partition_label({"partitioner": "iid"}) == "iid"
    assert (
        grid_label({"server-learning-rate": 0.02, "scheduling": False})
        == "server-learning-rate=0.02__scheduling=false"
    )
    assert grid_label({}) == "default"


def metrics(acc, loss=1.0):
    return [{"accuracy": a, "loss": loss} for a in acc]


def test_divergence_rule():
    assert divergence(metrics([0.1, 0.5, 0.7]), 0.7, chance=0.1, margin=0.05) == ""
    assert divergence(metrics([0.1, 0.5, 0.7], loss=math.nan), 0.7, 0.1, 0.05) == "non-finite loss"
    assert divergence(metrics([0.1, math.inf]), 0.5, 0.1, 0.05) == "non-finite accuracy"
    assert (
        divergence(metrics([0.1, 0.6, 0.15]), 0.15, 0.1, 0.05) == "final accuracy at chance"
    )  # <= 15%
    assert divergence(metrics([0.1, 0.6, 0.16]), 0.1501, 0.1, 0.05) == ""
    assert divergence(metrics([0.1, 0.6]), math.nan, 0.1, 0.05) == "final accuracy at chance"


def test_run_row_of_a_pending_and_of_a_failed_run(tmp_path):
    pending = run_row(tmp_path / "nothing", {"run_id": "x"}, chance=0.1, margin=0.05, target=0.7)
    assert pending["status"] == "pending"
    failed = tmp_path / "failed"
    failed.mkdir()
    (failed / "log.txt").write_text("starting\n")
    (failed / "error.txt").write_text("Traceback ...\nFileNotFoundError: no data\n")
    row = run_row(failed, {"run_id": "y"}, chance=0.1, margin=0.05, target=0.7)
    assert (row["status"], row["error"]) == ("failed", "FileNotFoundError: no data")


def _finished_run(path, status, accuracies):
    path.mkdir()
    (path / "summary.json").write_text(
        json.dumps(
            {
                "status": status,
                "status_reason": "no node left to train" if status == "failed" else "",
                "final_accuracy": sum(accuracies[-5:]) / len(accuracies[-5:]),
            }
        )
    )
    lines = ["updates,virtual_time,accuracy,loss"]
    lines += [f"{100 * i},{i}.0,{a},1.0" for i, a in enumerate(accuracies)]
    (path / "metrics.csv").write_text("\n".join(lines) + "\n")
    return path


def test_a_run_that_ran_out_of_nodes_is_failed_unless_its_model_diverged(tmp_path):
    # The engine ended both runs with no node left to train. The first one's model had
    # collapsed to chance (final accuracy, the mean of the last 5 evaluations, 10.5%
    # <= 10% + 5%): the rule diverged, the nodes were excluded because of it. The
    # second one's model was fine (72%): the nodes failed.
    collapsed_acc = [0.1, 0.6, 0.106, 0.104, 0.105, 0.103, 0.107]
    collapsed = _finished_run(tmp_path / "collapsed", "failed", collapsed_acc)
    row = run_row(collapsed, {"run_id": "c"}, chance=0.1, margin=0.05, target=0.7)
    assert (row["status"], row["diverged_reason"]) == ("diverged", "final accuracy at chance")
    assert row["status_reason"] == "no node left to train"
    healthy_acc = [0.1, 0.6, 0.72, 0.73, 0.71, 0.72, 0.72]
    healthy = _finished_run(tmp_path / "healthy", "failed", healthy_acc)
    row = run_row(healthy, {"run_id": "h"}, chance=0.1, margin=0.05, target=0.7)
    assert (row["status"], row["diverged_reason"]) == ("failed", "")
    completed = _finished_run(tmp_path / "completed", "completed", healthy_acc)
    row = run_row(completed, {"run_id": "k"}, chance=0.1, margin=0.05, target=0.7)
    assert row["status"] == "ok"


def test_runs_start_seed_by_seed_in_the_preset_order_otherwise():
    preset = load_preset(PRESETS / "fashion_mnist_scale.toml")
    runs = report_runs(preset, stand_in_tuned(preset), only=["n300"])
    ordered = run_order(runs)
    assert [r.seed for r in ordered] == [1] * 12 + [2] * 12 + [3] * 12
    # within a seed: method, then setting, as the preset lists them
    assert [r.run_id for r in ordered[:4]] == [
        "runs/gsgm/n300-k2/s1",
        "runs/gsgm/n300-k2-f20/s1",
        "runs/asgd/n300-k2/s1",
        "runs/asgd/n300-k2-f20/s1",
    ]
    assert ordered[-1].run_id == "runs/fedavg/n300-k2-f20/s3"
    assert sorted(r.run_id for r in ordered) == sorted(r.run_id for r in runs)
    assert preset.to_plan()["speed_reference"] == "fedavg"
    headline = preset.to_plan()["headline"]
    assert headline["accuracy_tolerance"] == 0.01
    # issue #9: GSGM against the best asynchronous baseline, and faster than FedAvg at 300/20
    assert headline["accuracy_baselines"] == [
        "asgd",
        "masgd",
        "daasgd",
        "fedbuff",
        "ca2fl",
        "ace",
        "aced",
    ]
    assert headline["speed_settings"] == ["n300-k2-f20"]


def test_run_row_reads_client_work_and_device_profile_from_the_runs_config(tmp_path):
    from simulations.results import client_work

    run = _finished_run(tmp_path / "run", "completed", [0.1, 0.6, 0.72])
    (run / "config.json").write_text(
        json.dumps(
            {
                "strategy": "gsgm",
                "client-mode": "weights",
                "local-steps": 5,
                "device-profile": "edge",
            }
        )
    )
    row = run_row(run, {"run_id": "r"}, chance=0.1, margin=0.05, target=0.7)
    assert (row["client_work"], row["device_profile"]) == ("weights, 5 steps", "edge")
    assert client_work({"strategy": "gsgm", "client-mode": "gradient"}) == "gradient, 1 batch"
    assert client_work({"client-mode": "gradient", "local-batches": 4}) == "gradient, 4 batches"
    # Flower's FedAvg trains in weights mode whatever client-mode says; epochs win over steps
    assert client_work({"strategy": "fedavg", "local-steps": 3}) == "weights, 3 steps"
    assert client_work({"client-mode": "delta", "local-epochs": 1, "local-steps": 9}) == (
        "delta, 1 epoch"
    )
    (run / "config.json").write_text(json.dumps({"strategy": "gsgm"}))  # before the time model
    row = run_row(run, {"run_id": "r"}, chance=0.1, margin=0.05, target=0.7)
    assert row["device_profile"] == "uniform"
