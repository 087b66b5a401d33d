"""The deployment race's own arithmetic (benchmarks/race_deployment.py), without a
deployment: the emulated speeds, the validity rule, the figures read from metric rows,
the medians and the summary's exclusion of invalid runs, the run configs it sends and
the device profile file of its prediction. Values hand-computed."""

from __future__ import annotations

import math
import re
import subprocess
import sys
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
def test_a_run_is_valid_up_to_twice_the_reference_round_trip():
    assert race.is_valid("completed", 4.0, 2.0)  # exactly 2 x 2.0
    assert not race.is_valid("completed", 4.01, 2.0)
    assert not race.is_valid("completed", math.nan, 2.0)  # a probe that failed
    assert not race.is_valid("flwr run exit 1", 2.5, 2.0)  # a run that failed


def test_the_larger_of_the_probes_around_a_run_decides():
    row = {"status": "completed", "quiet_round_trip": 0.5}  # not the reference
    race.set_probes(row, {"round_trip": 3.0}, {"round_trip": 3.9}, 2.0)
    assert (row["probe_round_trip"], row["valid"]) == (3.9, True)
    race.set_probes(row, {"round_trip": 4.5}, {"round_trip": 3.0}, 2.0)
    assert (row["probe_round_trip"], row["valid"]) == (4.5, False)
    race.set_probes(row, {"round_trip": 3.0}, None, 2.0)
    assert math.isnan(row["probe_round_trip"]) and row["valid"] is False


def test_the_reference_is_the_first_sessions_start_probe():
    rows = [{"start_round_trip": 7.6}, {"start_round_trip": 9.0}]
    assert race.reference_round_trip(rows, 5.0) == 7.6  # every session against the first
    assert race.reference_round_trip([], 5.0) == 5.0  # the first session: its own


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
        "start_round_trip": 2.0,
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
    assert "the probe on the race's 10 SuperNodes before any run 2.000 s" in text
    assert "valid if its probe round trip <= 2 x the first session's = 4.000 s" in text
    fedavg = table_line(text, "fedavg")
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


def test_the_server_costs_the_reference_round_trip_over_the_nodes(tmp_path):
    # the first session: 10 nodes answering at once took 7.646 s each, quiet latency 1.669 s
    assert race.server_seconds(7.646, 10) == pytest.approx(0.7646)
    assert race.model_latency(1.669, 0.7646) == pytest.approx(0.9044)
    with pytest.raises(race.RaceError, match=r"reference round trip > 0 .* got nan s and 10"):
        race.server_seconds(math.nan, 10)
    with pytest.raises(race.RaceError, match=r"quiet latency 0.500 s does not exceed .* 0.765 s"):
        race.model_latency(0.5, 0.765)
    a = args("--nodes", "10", "--budget", "1200")
    speeds = race.appfl10_step_seconds(10, 2.0, 20)
    profile = race.write_device_profile(tmp_path / "p.csv", speeds, 1.669)
    assert race.profile_latency(profile) == 1.669
    cfg = race.prediction_config("gsgm", a, profile, speeds, 1.669, tmp_path, 0.7646)
    assert (cfg["server-seconds"], cfg["latency-seconds"]) == (0.7646, pytest.approx(0.9044))
    clock = parse_app_config(cfg)
    assert (clock["server-seconds"], clock["device-profile"]) == (0.7646, str(profile))


def test_predict_again_needs_the_rows_and_the_device_profile_file(tmp_path, capsys):
    out = tmp_path / "race.csv"
    code = race.main(["--predict-again", "--out", str(out), "--workdir", str(tmp_path)])
    assert code == 1
    err = capsys.readouterr().err
    assert f"--predict-again needs the race's rows ({out}: 0)" in err
    assert "race-device-profile.csv: missing" in err


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


# ------------------------------------------------------------------ resuming (--repeat)
def full_row(method, repeat, valid=True, seconds=500.0, accuracy=0.72, predicted=None, **extra):
    """A CSV row of the full race (every column), hand-made."""
    speeds = race.appfl10_step_seconds(10, 2.0, 20)
    row = {c: math.nan for c in race.CSV_COLUMNS}
    row.update(
        method=method,
        repeat=repeat,
        order=1,
        speeds="appfl10",
        status="completed",
        valid=valid,
        probe_round_trip=3.0 if valid else 9.0,
        quiet_round_trip=2.0,
        start_round_trip=2.5,
        target_accuracy=0.7,
        wall_seconds_to_target=seconds,
        updates=100,
        evaluations=12,
        accuracy_at_budget=accuracy,
        final_accuracy=accuracy,
        wall_budget_seconds=1200.0,
        nodes=10,
        local_steps=20,
        batch_size=32,
        local_lr=0.05,
        work_scheduling="off",
        fastest_step_seconds=min(speeds.values()),
        median_step_seconds=1.0,
        slowest_step_seconds=max(speeds.values()),
        run_name=f"race-{method}-r{repeat}",
    )
    if predicted is not None:
        row.update(
            predicted_seconds_to_target=predicted,
            predicted_accuracy_at_budget=0.75,
            predicted_updates=90,
        )
    row.update(extra)
    return row


def table_line(text, method):
    """The summary table's line of ``method``."""
    return next(line for line in text.splitlines() if re.match(rf"{method} +\d", line))


def resume_args(tmp_path, *extra):
    return race.parse_args(
        [
            "--quiet-round-trip",
            "2.0",
            "--out",
            str(tmp_path / "race.csv"),
            "--workdir",
            str(tmp_path / "work"),
            *extra,
        ]
    )


class FakeDeployment:
    """What race() uses of a deployment, with no process behind it."""

    def __init__(self, probe_round_trips):
        self.probe_round_trips = list(probe_round_trips)
        self.runs, self.predicted, self.stopped = [], [], False

    def install(self, monkeypatch, seconds):
        """Patch race_deployment: each run of method m reaches the target after
        ``seconds[m]`` (one value per call, in order) and leaves a completed run folder."""
        fake = self

        class Probe:
            def __init__(self, *a):
                pass

            def __call__(self, label):
                return {"round_trip": fake.probe_round_trips.pop(0), "latency": 1.5, "updates": 3}

        def run_method(dep, method, repeat, order, args, base, speeds, name):
            # the CSV already holds every earlier run of this session (written after each)
            fake.runs.append((name, len(race.read_csv(args.out))))
            folder = base / "runs" / name
            folder.mkdir(parents=True)
            (folder / "summary.json").write_text('{"status": "completed"}')
            return full_row(
                method,
                repeat,
                valid=False,
                seconds=seconds[method].pop(0),
                order=order,
                run_name=name,
                probe_round_trip=math.nan,
                start_round_trip=args.start_round_trip,
            )

        def predict(method, args, config, base):
            fake.predicted.append(method)
            return {"seconds_to_target": 400.0, "accuracy_at_budget": 0.8, "updates": 120}

        monkeypatch.setattr(race, "start_deployment", lambda *a: fake)
        monkeypatch.setattr(race, "Probe", Probe)
        monkeypatch.setattr(race, "flwr_run", lambda *a: (0, 1.0))
        monkeypatch.setattr(race, "run_method", run_method)
        monkeypatch.setattr(race, "predict", predict)

    def stop_everything(self):
        self.stopped = True

    def leftover_pids(self):
        return []


def test_repeat_option_takes_repeatable_comma_lists(capsys):
    assert args("--repeat", "3,1", "--repeat", "2", "--repeat", "1").repeat == [1, 2, 3]
    assert args().repeat == [1, 2, 3]  # every one of --repeats
    assert args("--repeats", "2").repeat == [1, 2]
    with pytest.raises(SystemExit):
        args("--repeat", "0")
    assert "--repeat 0: expected integers >= 1" in capsys.readouterr().err


def test_plan_skips_a_valid_repeat_and_reruns_an_invalid_one():
    rows = [full_row("gsgm", 2, valid=True), full_row("fedbuff", 2, valid=False)]
    todo, said = race.plan_runs(rows, list(race.METHODS), [2])
    # repeat 2 starts with the second method: gsgm (skipped), fedbuff, fedcompass, fedavg
    assert todo == [(2, 2, "fedbuff"), (2, 3, "fedcompass"), (2, 4, "fedavg")]
    assert said == [
        "skipped gsgm repeat 2: valid row race-gsgm-r2 in the CSV",
        "re-running fedbuff repeat 2: its row(s) race-fedbuff-r2 are invalid (kept in the CSV, "
        "valid=False)",
    ]


def test_a_rerun_never_reuses_an_earlier_attempts_name(tmp_path):
    rows = [full_row("gsgm", 1, valid=False)]
    assert race.run_name_for("gsgm", 1, rows, tmp_path) == "race-gsgm-r1-a2"
    (tmp_path / "runs" / "race-gsgm-r1-a2").mkdir(parents=True)  # a killed attempt's folder
    assert race.run_name_for("gsgm", 1, rows, tmp_path) == "race-gsgm-r1-a3"
    assert race.run_name_for("gsgm", 2, rows, tmp_path) == "race-gsgm-r2"


def test_csv_rows_read_back_as_written(tmp_path):
    row = full_row("gsgm", 3, valid=False, predicted=410.5, seconds=math.nan)
    race.write_csv(tmp_path / "r.csv", [row])
    (back,) = race.read_csv(tmp_path / "r.csv")
    assert (back["method"], back["repeat"], back["valid"], back["status"]) == (
        "gsgm",
        3,
        False,
        "completed",
    )
    assert back["predicted_seconds_to_target"] == 410.5
    assert math.isnan(back["wall_seconds_to_target"]) and math.isnan(back["latency_seconds"])
    assert race.read_csv(tmp_path / "none.csv") == []
    (tmp_path / "old.csv").write_text("method,repeat,status\nfedavg,1,completed\n")
    with pytest.raises(race.RaceError, match="does not have this race's columns"):
        race.read_csv(tmp_path / "old.csv")


def test_resumed_race_skips_the_valid_row_and_reruns_the_invalid_one(tmp_path, monkeypatch, capsys):
    out = tmp_path / "race.csv"
    race.write_csv(
        out,
        [
            full_row("fedavg", 1, valid=True, predicted=450.0),
            full_row("gsgm", 1, valid=False),  # no prediction yet
        ],
    )
    fake = FakeDeployment([2.2, 2.4])
    fake.install(monkeypatch, {"gsgm": [300.0]})
    assert race.main(["--repeat", "1", "--methods", "fedavg,gsgm", *_resume(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "skipped fedavg repeat 1: valid row race-fedavg-r1 in the CSV" in text
    assert "re-running gsgm repeat 1: its row(s) race-gsgm-r1 are invalid" in text
    assert fake.runs == [("race-gsgm-r1-a2", 2)]  # only gsgm, under a new name
    assert fake.stopped
    assert fake.predicted == ["gsgm"]  # fedavg's prediction is in the CSV: reused
    rows = race.read_csv(out)
    assert [(r["run_name"], r["valid"]) for r in rows] == [
        ("race-fedavg-r1", True),
        ("race-gsgm-r1", False),  # kept, marked invalid
        ("race-gsgm-r1-a2", True),  # probes 2.2 and 2.4 <= 2 x 2.0
    ]
    assert rows[2]["probe_round_trip"] == 2.4 and rows[2]["latency_seconds"] == 1.5
    assert [r["predicted_seconds_to_target"] for r in rows] == [450.0, 400.0, 400.0]
    assert (tmp_path / "race-device-profile.csv").is_file()
    # the summary: gsgm from its valid re-run only, the invalid row named
    assert "medians over the valid runs only (2 of 3)" in text
    gsgm = table_line(text, "gsgm")
    assert gsgm.split()[1:4] == ["1", "1", "300.0"]
    assert "EXCLUDED 1 invalid run(s): race-gsgm-r1 (completed, probe 9.00 s; re-run as " in text
    assert "race-gsgm-r1-a2)." in text and "must be re-run" not in text  # it was


def _resume(tmp_path):
    return [
        "--quiet-round-trip",
        "2.0",
        "--out",
        str(tmp_path / "race.csv"),
        "--workdir",
        str(tmp_path / "work"),
    ]


def test_summary_over_rows_appended_across_two_invocations(tmp_path, monkeypatch, capsys):
    out = tmp_path / "race.csv"
    fake = FakeDeployment([2.0, 2.1, 2.2, 2.0, 2.2, 9.0])  # invocation 2's second run: invalid
    fake.install(monkeypatch, {"fedavg": [600.0, 800.0], "gsgm": [300.0, 200.0]})
    common = ["--methods", "fedavg,gsgm", "--repeats", "2", *_resume(tmp_path)]
    assert race.main(["--repeat", "1", *common]) == 0
    assert len(race.read_csv(out)) == 2
    assert race.main(["--repeat", "2", *common]) == 0
    # every run found the CSV holding the runs before it (written after every run)
    assert fake.runs == [
        ("race-fedavg-r1", 0),
        ("race-gsgm-r1", 1),
        ("race-gsgm-r2", 2),  # repeat 2 starts with gsgm
        ("race-fedavg-r2", 3),
    ]
    assert fake.predicted == ["fedavg", "gsgm"]  # in the first invocation only
    capsys.readouterr()
    assert race.main(["--summary-only", *common]) == 0
    text = capsys.readouterr().out
    rows = race.read_csv(out)
    assert [(r["method"], r["repeat"], r["order"], r["valid"]) for r in rows] == [
        ("fedavg", 1, 1, True),
        ("gsgm", 1, 2, True),
        ("gsgm", 2, 1, True),
        ("fedavg", 2, 2, False),  # its probe after: 9.0 s > 4.0 s
    ]
    assert "medians over the valid runs only (3 of 4)" in text
    gsgm = table_line(text, "gsgm")
    assert gsgm.split()[1:4] == ["2", "2", "250.0"] and gsgm.split()[-1] == "1,2"
    fedavg = table_line(text, "fedavg")
    assert fedavg.split()[1:4] == ["1", "1", "600.0"] and fedavg.split()[-1] == "1"
    assert "without a valid run yet (1 of 4): fedavg r2: run them with --repeat" in text
    assert "FedAvg/GSGM median time to target: 2.40x (target >= 1.5x: met)" in text
    # a third invocation of repetition 1 has nothing to run
    capsys.readouterr()
    monkeypatch.setattr(race, "start_deployment", None)  # would fail if called
    assert race.main(["--repeat", "1", *common]) == 0
    assert "nothing to run" in capsys.readouterr().out


def test_summary_only_prints_the_csvs_summary_and_exits(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(race, "start_deployment", None)  # no deployment: would fail
    monkeypatch.setattr(race, "measure_quiet_round_trip", None)
    out = tmp_path / "race.csv"
    assert race.main(["--summary-only", "--out", str(out)]) == 1
    assert "no rows in" in capsys.readouterr().err
    race.write_csv(
        out,
        [
            full_row("fedavg", 1, seconds=900.0, predicted=1000.0),
            full_row("fedavg", 2, seconds=1100.0, predicted=1000.0, quiet_round_trip=2.4),
            full_row("gsgm", 1, seconds=500.0, predicted=550.0),
            full_row("gsgm", 2, valid=False, seconds=50.0),
        ],
    )
    assert race.main(["--summary-only", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "quiet round trips 2.000-2.400 s" in text  # two sessions' figures
    assert "medians over the valid runs only (3 of 4)" in text
    fedavg = table_line(text, "fedavg")
    assert fedavg.split()[1:6] == ["2", "2", "1000.0", "1000.0", "1.00"]
    assert "EXCLUDED 1 invalid run(s): race-gsgm-r2" in text
    assert "FedAvg/GSGM median time to target: 2.00x (target >= 1.5x: met)" in text
    assert "without a valid run yet (9 of 12): fedbuff r1, fedcompass r1, gsgm r2," in text


def test_a_row_whose_run_folder_did_not_complete_is_ignored(tmp_path, capsys):
    out = tmp_path / "race.csv"
    race.write_csv(out, [full_row("fedavg", 1), full_row("gsgm", 1), full_row("fedbuff", 1)])
    runs = tmp_path / "work" / "runs"
    (runs / "race-fedavg-r1").mkdir(parents=True)  # no summary.json
    (runs / "race-gsgm-r1").mkdir()
    (runs / "race-gsgm-r1" / "summary.json").write_text('{"status": "completed"}')
    a = resume_args(tmp_path, "--skip-prediction")
    rows = race.load_rows(a)
    assert "ignored race-fedavg-r1: its run folder" in capsys.readouterr().out
    assert [r["valid"] for r in rows] == [False, True, True]  # fedbuff: no folder, stands
    assert rows[0]["status"].startswith("ignored: ") and rows[0]["status"].endswith(
        "has no summary.json (was completed)"
    )
    todo, _ = race.plan_runs(rows, ["fedavg", "gsgm", "fedbuff"], [1])
    assert todo == [(1, 1, "fedavg")]
    assert race.mark_incomplete(rows, runs) == []  # marked once


def test_a_csv_of_another_configuration_is_refused(tmp_path):
    race.write_csv(tmp_path / "race.csv", [full_row("fedavg", 1, wall_budget_seconds=300.0)])
    a = resume_args(tmp_path, "--skip-prediction")
    with pytest.raises(race.RaceError, match="another configuration"):
        race.race(a)


def test_race_probe_serves_bench_deployments_probe_client_without_step_seconds(tmp_path):
    """The race's probe ClientApp is bench_deployment.py's, called with the node config's
    ``step-seconds`` left out (no device emulation in the probe), everything else kept."""
    folder = race.race_probe_app(tmp_path / "probe-app")
    assert (folder / "probe_client.py").read_text() == race.PROBE_CLIENT
    assert 'clientapp = "race_probe_client:app"' in (folder / "pyproject.toml").read_text()
    code = f"""
import sys
sys.path.insert(0, {str(folder)!r})
import probe_client
seen = []
probe_client.app = lambda msg, context: seen.append((msg, dict(context.node_config))) or "reply"
import race_probe_client
from flwr.app import Context, RecordDict
context = Context(run_id=1, node_id=2, node_config={{"step-seconds": 0.5, "partition-id": 3}},
                  state=RecordDict(), run_config={{}})
print(race_probe_client.train("msg", context), seen)
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "reply [('msg', {'partition-id': 3})]"
