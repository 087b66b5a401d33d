"""The deployment race's own arithmetic (benchmarks/race_deployment.py), without a
deployment: the emulated speeds, the figures read from metric rows, the medians, the
run configs it sends."""

from __future__ import annotations

import math

import pytest

from benchmarks import race_deployment as race
from flwr_gsgm.config.run_config import parse_run_config
from flwr_gsgm.simulation.virtual_clock import VirtualClock


def args(*extra: str):
    return race.parse_args(["--skip-prediction", *extra])


def test_slow_nodes_are_the_virtual_clocks_choice_at_four_times_the_step():
    a = args("--nodes", "10", "--step-seconds", "0.1")
    seconds = race.node_step_seconds(a)
    slow = {p for p, f in VirtualClock(seed=0).speed_factors(list(range(10))).items() if f > 1}
    assert len(slow) == 2  # round(0.25 x 10)
    assert {p for p, s in seconds.items() if s == pytest.approx(0.4)} == slow
    assert {p for p, s in seconds.items() if s == pytest.approx(0.1)} == set(range(10)) - slow


def test_figures_time_to_target_and_accuracy_at_budget():
    rows = [
        {"wall_time": 0.0, "accuracy": 0.10},
        {"wall_time": 10.0, "accuracy": 0.55},
        {"wall_time": 20.0, "accuracy": 0.72},  # first at or above 0.7
        {"wall_time": 30.0, "accuracy": 0.69},
        {"wall_time": 60.4, "accuracy": 0.75},  # the final evaluation, 0.4 s late: counts
        {"wall_time": 68.0, "accuracy": 0.80},  # a round that ended after the budget
    ]
    got = race.figures(rows, "wall_time", 0.70, 60.0)
    assert got == {"seconds_to_target": 20.0, "accuracy_at_budget": 0.75}
    never = race.figures(rows, "wall_time", 0.9, 60.0)
    assert math.isnan(never["seconds_to_target"])


def test_a_run_that_misses_the_target_counts_as_never_in_the_median():
    assert race._median([30.0, math.nan, 10.0]) == 30.0  # 10, 30, never
    assert math.isnan(race._median([30.0, math.nan, math.nan]))


def test_every_raced_run_config_is_valid_and_ends_at_the_wall_budget(tmp_path):
    a = args("--nodes", "10", "--budget", "300")
    for method in race.METHODS:
        cfg = parse_run_config(race.race_config(method, a, tmp_path, f"r-{method}"))
        assert (cfg["strategy"], cfg["client-mode"], cfg["virtual-clock"]) == (
            method,
            "weights",
            False,
        )
        assert (cfg["max-seconds"], cfg["eval-every"], cfg["min-nodes"]) == (300.0, 10, 10)


def test_run_config_pairs_are_toml_values():
    pairs = race.run_config_pairs({"a": True, "b": "x y", "c": 0.05, "d": 20})
    assert pairs == 'a=true b="x y" c=0.05 d=20'


def test_fedavg_prediction_gets_the_rounds_that_fit_in_the_budget(tmp_path):
    a = args("--nodes", "10", "--budget", "300", "--step-seconds", "0.1")
    cfg = race.prediction_config("fedavg", a, 2.0, tmp_path)
    # a round lasts >= 20 steps x 0.1 s x 4 + 2 s = 10 s: 30 rounds fit, + 1
    assert cfg["max-updates"] == 10 * 31
    assert (cfg["virtual-clock"], cfg["step-seconds"], cfg["latency-seconds"]) == (True, 0.1, 2.0)
    assert "min-nodes" not in cfg


def test_bad_arguments_are_refused_naming_them(capsys):
    with pytest.raises(SystemExit):
        args("--target", "70")
    assert "--target 70.0: expected a fraction in (0, 1)" in capsys.readouterr().err
