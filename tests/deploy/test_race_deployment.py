"""The deployment race's own arithmetic (benchmarks/race_deployment.py), without a
deployment: the emulated speeds, the validity rule, the figures read from metric rows,
the medians and the summary's exclusion of invalid runs, the run configs it sends and
the device profile file of its prediction. Values hand-computed."""

from __future__ import annotations

import math
import threading

import pytest

from benchmarks import race_deployment as race
from flwr_gsgm.config.run_config import parse_run_config
from flwr_gsgm.simulation.virtual_clock import VirtualClock
from serverapp.app_config import parse_app_config


def args(*extra: str):
    return race.parse_args(["--skip-prediction", *extra])


# ------------------------------------------------------------------ speeds
def test_appfl10_fastest_update_lasts_five_quiet_round_trips():
    # quiet round trip 2.0 s, 20 steps: the fastest node (APPFL 0.099 s, ratio 0.099 /
    # 0.312 of the median) needs 5 x 2.0 = 10 s for 20 steps: 0.5 s per step; node p
    # runs at 0.5 x APPFL[p] / 0.099, rounded up to the millisecond.
    seconds = race.appfl10_step_seconds(10, 2.0, 20)
    assert seconds[8] == 0.5
    assert 20 * seconds[8] >= 10.0
    assert seconds[7] == 4.490  # 0.5 x 0.889 / 0.099 = 4.4899
    assert seconds[0] == 1.233  # 0.5 x 0.244 / 0.099 = 1.2323
    assert seconds[3] == 0.516  # 0.5 x 0.102 / 0.099 = 0.5152
    assert seconds[9] == 1.435  # 0.5 x 0.284 / 0.099 = 1.4343
    assert all(20 * s >= 10.0 for s in seconds.values())
    assert seconds[1] == 1.718  # 0.5 x 0.340 / 0.099 = 1.7172


def test_appfl10_scales_to_the_fastest_of_the_raced_nodes():
    # 3 nodes: APPFL 0.244, 0.340, 0.112; the fastest, node 2, gets 1 x 4.0 s / 20 = 0.2 s
    seconds = race.appfl10_step_seconds(3, 4.0, 20, multiple=1.0)
    assert seconds == {0: 0.436, 1: 0.608, 2: 0.2}  # 0.2 x 0.244/0.112 = 0.4357, 0.6071
    # node 10 repeats device 0 (i % 10)
    assert race.appfl10_step_seconds(11, 2.0, 20)[10] == race.appfl10_step_seconds(11, 2.0, 20)[0]


def test_slow_quarter_is_the_virtual_clocks_choice_at_four_times_the_step():
    seconds = race.slow_quarter_step_seconds(10, 0.1)
    slow = {p for p, f in VirtualClock(seed=0).speed_factors(list(range(10))).items() if f > 1}
    assert len(slow) == 2  # round(0.25 x 10)
    assert {p for p, s in seconds.items() if s == pytest.approx(0.4)} == slow
    assert {p for p, s in seconds.items() if s == pytest.approx(0.1)} == set(range(10)) - slow


def test_speeds_option_picks_the_configuration():
    assert race.node_step_seconds(args("--nodes", "10"), 2.0)[8] == 0.5
    quarter = race.node_step_seconds(args("--nodes", "10", "--speeds", "slow-quarter"), 2.0)
    assert sorted(set(quarter.values())) == pytest.approx([0.1, 0.4])


# ------------------------------------------------------------------ validity
def test_a_run_is_valid_up_to_twice_the_quiet_round_trip():
    assert race.is_valid("completed", 4.0, 2.0)  # exactly 2 x 2.0
    assert not race.is_valid("completed", 4.01, 2.0)
    assert not race.is_valid("completed", math.nan, 2.0)  # a probe that failed
    assert not race.is_valid("flwr run exit 1", 2.5, 2.0)  # a run that failed


def test_the_larger_of_the_probes_around_a_run_decides():
    row = {"status": "completed", "quiet_round_trip": 2.0}
    race.set_probes(row, {"round_trip": 3.0}, {"round_trip": 3.9})
    assert (row["probe_round_trip"], row["valid"]) == (3.9, True)
    race.set_probes(row, {"round_trip": 4.5}, {"round_trip": 3.0})
    assert (row["probe_round_trip"], row["valid"]) == (4.5, False)
    race.set_probes(row, {"round_trip": 3.0}, None)
    assert math.isnan(row["probe_round_trip"]) and row["valid"] is False


def test_probe_figures_leave_out_cold_and_error_replies():
    rows = [
        {"index": 0, "push_start": 0.0, "pulled": 9.0, "t-start": 1.0, "t-end": 2.0},  # cold
        {"index": 1, "push_start": 10.0, "pulled": 12.0, "t-start": 10.5, "t-end": 10.7},
        {"index": 2, "push_start": 20.0, "pulled": 23.0, "t-start": 20.5, "t-end": 20.6},
        {"index": 3, "push_start": 30.0, "pulled": 34.0, "t-start": 31.0, "t-end": 31.5},
        {"index": 4, "push_start": 40.0, "pulled": 99.0, "error": "lost"},
    ]
    got = race.probe_figures(rows)
    assert got["round_trip"] == 3.0  # median of 2, 3, 4
    assert got["latency"] == pytest.approx(2.9)  # median of 1.8, 2.9, 3.5
    assert got["updates"] == 3
    with pytest.raises(race.RaceError, match="timed no update"):
        race.probe_figures(rows[:1])


# ------------------------------------------------------------------ figures, summary
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


def _row(method, repeat, valid, seconds, accuracy, updates, probe=3.0):
    return {
        "method": method,
        "repeat": repeat,
        "run_name": f"race-{method}-r{repeat}",
        "status": "completed",
        "valid": valid,
        "probe_round_trip": probe,
        "wall_seconds_to_target": seconds,
        "predicted_seconds_to_target": 100.0,
        "accuracy_at_budget": accuracy,
        "predicted_accuracy_at_budget": 0.7,
        "final_accuracy": accuracy,
        "updates": updates,
        "predicted_updates": 50,
    }


ROWS = [
    _row("fedavg", 1, True, 100.0, 0.70, 40),
    _row("fedavg", 2, False, 10.0, 0.99, 400, probe=9.0),  # invalid: left out
    _row("fedavg", 3, True, 120.0, 0.72, 60),
    _row("gsgm", 1, False, 5.0, 0.90, 500, probe=math.nan),  # invalid: the only gsgm run
]


def test_medians_are_over_valid_runs_only():
    med = race.method_medians(ROWS, race.METHODS)
    assert set(med) == {"fedavg"}  # gsgm has no valid run
    assert med["fedavg"]["runs"] == 2
    assert med["fedavg"]["time"] == 110.0  # (100 + 120) / 2, not the invalid 10
    assert med["fedavg"]["acc"] == pytest.approx(0.71)
    assert med["fedavg"]["updates"] == 50


def test_summary_says_how_many_runs_were_excluded_and_to_rerun_them():
    a = args("--nodes", "10", "--quiet-round-trip", "2.0")
    text = race.summary_text(ROWS, a, race.appfl10_step_seconds(10, 2.0, 20))
    assert "medians over the valid runs only (2 of 4)" in text
    assert "EXCLUDED 2 invalid run(s): race-fedavg-r2 (completed, probe 9.00 s)" in text
    assert "race-gsgm-r1 (completed, probe nan s)" in text
    assert "must be re-run on a quiet machine" in text
    assert "valid if its probe round trip <= 2 x that = 4.000 s" in text
    fedavg = next(line for line in text.splitlines() if line.startswith("fedavg "))
    assert fedavg.split()[1:4] == ["2", "2", "110.0"]  # runs, reached, median seconds
    assert not any(line.startswith("gsgm ") for line in text.splitlines())


# ------------------------------------------------------------------ run configs
def test_every_raced_run_config_is_valid_and_ends_at_the_wall_budget(tmp_path):
    a = args("--nodes", "10", "--budget", "300")
    for method in race.METHODS:
        cfg = parse_run_config(race.race_config(method, a, tmp_path, f"r-{method}", 89.8))
        assert (cfg["strategy"], cfg["client-mode"], cfg["virtual-clock"]) == (
            method,
            "weights",
            False,
        )
        assert (cfg["max-seconds"], cfg["eval-every"], cfg["min-nodes"]) == (300.0, 10, 10)
        assert cfg["local-steps"] == 20
        # 3 x 89.8 + 60 = 329.4 s per dispatch, the TTL its default 600 s
        assert (cfg["dispatch-timeout"], cfg["message-ttl"]) == (pytest.approx(329.4), 600.0)
    gsgm = parse_run_config(race.race_config("gsgm", a, tmp_path, "g"))
    assert gsgm["work-scheduling"] == "equal-time"
    fedbuff = parse_run_config(race.race_config("fedbuff", a, tmp_path, "b"))
    assert fedbuff["work-scheduling"] == "off"
    assert [race.work_scheduling(race.race_config(m, a, tmp_path, m)) for m in race.METHODS] == [
        "off",
        "equal-time",
        "off",
        "compass",
    ]


def test_run_config_pairs_are_toml_values():
    pairs = race.run_config_pairs({"a": True, "b": "x y", "c": 0.05, "d": 20})
    assert pairs == 'a=true b="x y" c=0.05 d=20'


def test_device_profile_file_gives_the_virtual_clock_the_emulated_speeds(tmp_path):
    speeds = race.appfl10_step_seconds(10, 2.0, 20)
    path = race.write_device_profile(tmp_path / "p.csv", speeds, 1.5)
    lines = path.read_text().splitlines()
    assert lines[0] == "partition-id,step-seconds,bandwidth,latency-seconds"
    assert lines[9] == "8,0.5,,1.5"
    clock = VirtualClock(device_profile=str(path), jitter=0.0)
    factors = clock.speed_factors(list(range(10)))
    for p in range(10):  # seconds per step of node p = the emulated ones
        assert clock.seconds_per_step * factors[p] == pytest.approx(speeds[p])
        assert clock.latency_of(p) == 1.5
    assert clock.duration(factors[8], 8, 0, work_steps=20) == pytest.approx(10.0 + 1.5)


def test_fedavg_prediction_gets_the_rounds_that_fit_in_the_budget(tmp_path):
    a = args("--nodes", "10", "--budget", "1200")
    speeds = race.appfl10_step_seconds(10, 2.0, 20)
    profile = race.write_device_profile(tmp_path / "p.csv", speeds, 2.0)
    cfg = race.prediction_config("fedavg", a, profile, speeds, 2.0, tmp_path)
    # a round lasts >= 20 steps x 4.49 s + 2 s = 91.8 s: ceil(1200 / 91.8) = 14, + 1
    assert cfg["max-updates"] == 10 * 15
    assert (cfg["virtual-clock"], cfg["device-profile"], cfg["jitter"]) == (
        True,
        str(profile),
        0.0,
    )
    assert (cfg["step-seconds"], cfg["latency-seconds"]) == (0.0, 0.0)  # the file's own
    assert "min-nodes" not in cfg and "dispatch-timeout" not in cfg
    for method in race.METHODS:
        parse_app_config(race.prediction_config(method, a, profile, speeds, 2.0, tmp_path))


# ------------------------------------------------------------------ arguments, exit
def test_quick_and_full_defaults():
    full = args()
    assert (full.nodes, full.repeats, full.budget, full.speeds) == (10, 3, 1200.0, "appfl10")
    assert (full.round_trip_multiple, full.quiet_round_trip) == (5.0, None)
    assert full.methods == ["fedavg", "gsgm", "fedbuff", "fedcompass"]
    quick = args("--quick")
    assert (quick.nodes, quick.repeats, quick.budget, quick.round_trip_multiple) == (
        3,
        1,
        60.0,
        1.0,
    )
    assert args("--quiet-round-trip", "2.2").quiet_round_trip == 2.2


def test_bad_arguments_are_refused_naming_them(capsys):
    with pytest.raises(SystemExit):
        args("--target", "70")
    assert "--target 70.0: expected a fraction in (0, 1)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        args("--quiet-round-trip", "0")
    assert "--quiet-round-trip 0.0: expected seconds > 0" in capsys.readouterr().err


def test_client_threads_are_joined_before_exit():
    release = threading.Event()
    thread = threading.Thread(target=release.wait, name=race.CLIENT_THREAD_NAME, daemon=True)
    thread.start()
    assert race.join_client_threads(timeout=0.05) == [race.CLIENT_THREAD_NAME]
    release.set()
    assert race.join_client_threads(timeout=5) == []
    assert not thread.is_alive()
