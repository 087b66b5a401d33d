"""The server-cost benchmark's pure parts (benchmarks/server_cost.py), without a
deployment: /proc/<pid>/stat ticks to seconds, the per-reply arithmetic of a probe's
window, and the refusal of CPU sets. Values hand-computed."""

from __future__ import annotations

import math

import pytest

from benchmarks import server_cost as sc
from flwr_gsgm.simulation.virtual_clock import LOOPBACK_SERVER_SECONDS

# A real line's shape (proc(5)): pid, (comm), state, then fields 4...; utime (field 14)
# = 250 ticks, stime (field 15) = 37, cutime/cstime (16, 17) = 900/800 (children: not
# counted). The command holds a space and a ")" to show fields are counted after the
# last ")".
STAT = (
    "4242 (flwr-serverapp) x) S 4200 4242 4242 0 -1 4194304 1000 0 0 0 "
    "250 37 900 800 20 0 7 0 123456 1000000 5000 18446744073709551615"
)


# ------------------------------------------------------------------ /proc stat
def test_stat_cpu_seconds_is_utime_plus_stime_over_the_tick_rate():
    assert sc.stat_cpu_seconds(STAT, 100) == pytest.approx(2.87)  # (250 + 37) / 100
    assert sc.stat_cpu_seconds(STAT, 250) == pytest.approx(1.148)  # (250 + 37) / 250


def test_stat_cpu_seconds_of_a_zombie_line_reads_its_final_times():
    zombie = STAT.replace(") S ", ") Z ", 1)
    assert sc.stat_cpu_seconds(zombie, 100) == pytest.approx(2.87)


@pytest.mark.parametrize("bad", ["", "4242 flwr-serverapp S 1 2", "4242 (x) S 1 2 3"])
def test_stat_cpu_seconds_refuses_what_is_not_a_stat_line(bad):
    with pytest.raises(ValueError, match="not a /proc/<pid>/stat line"):
        sc.stat_cpu_seconds(bad, 100)


def test_the_serverapp_is_recognised_by_its_command_alone():
    assert sc.is_serverapp("/venv/bin/python /venv/bin/flwr-serverapp --serverappio-api-address x")
    assert sc.is_serverapp("flwr-serverapp --token t")
    assert not sc.is_serverapp("/venv/bin/python /venv/bin/flower-superexec --plugin-type x")
    assert not sc.is_serverapp("flwr run /tmp/flwr-serverapp gsgm-local")  # a path, later
    assert not sc.is_serverapp("")  # a zombie's


# ------------------------------------------------------------------ per reply
def probe_rows():
    """Four replies of two nodes, time.time() stamps from 100.0: the first push at
    100.0, the last reply pulled at 104.0 (a window of 4 s). Pushes of 0.1 s each (0.4
    s); pulls: at 101.0 one reply (first pulled 101.2: 0.2 s), at 103.0 two replies
    (first pulled 103.3: 0.3 s, the second after a push, 103.5), at 103.9 one reply
    (first pulled 104.0: 0.1 s): 0.6 s; handling 1.0 s in all, 0.25 s per reply."""

    def row(node, push, pull_start, pulled):
        return {
            "node": node,
            "push_start": push,
            "push_end": push + 0.1,
            "pull_start": pull_start,
            "pulled": pulled,
        }

    return [
        row(1, 100.0, 101.0, 101.2),
        row(2, 100.2, 103.0, 103.3),
        row(1, 101.2, 103.0, 103.5),
        row(2, 103.3, 103.9, 104.0),
    ]


def test_window_and_handling_seconds_of_the_probe_rows():
    rows = probe_rows()
    assert sc.probe_window(rows) == (100.0, 104.0)
    assert sc.handling_seconds(rows) == pytest.approx(0.4 + 0.2 + 0.3 + 0.1)


def test_cpu_at_interpolates_between_samples_and_refuses_outside_them():
    series = [(99.0, 10.0), (101.0, 11.0), (105.0, 13.0)]
    assert sc.cpu_at(series, 99.0) == 10.0
    assert sc.cpu_at(series, 100.0) == pytest.approx(10.5)
    assert sc.cpu_at(series, 101.0) == 11.0
    assert sc.cpu_at(series, 104.0) == pytest.approx(12.5)
    with pytest.raises(sc.MeasureError, match="no samples around 105.500"):
        sc.cpu_at(series, 105.5)
    with pytest.raises(sc.MeasureError, match="samples none"):
        sc.cpu_at([], 100.0)


def test_window_figures_per_reply():
    # ServerApp: 10.5 s of CPU at 100.0, 12.5 s at 104.0: 2.0 s in the window, 0.5 s per
    # reply. SuperLink: 1.0 -> 1.4 (0.1 per reply); nodes: 50 -> 53 over 4 s on 1 core.
    samples = {
        "serverapp": [(99.0, 10.0), (101.0, 11.0), (105.0, 13.0)],
        "superlink": [(99.0, 1.0), (105.0, 1.6)],
        "nodes": [(99.0, 49.25), (105.0, 53.75)],
    }
    got = sc.window_figures(probe_rows(), samples, server_cores=1, node_cores=1)
    assert got["replies"] == 4
    assert got["window_seconds"] == pytest.approx(4.0)
    assert got["serverapp_cpu_seconds"] == pytest.approx(2.0)
    assert got["serverapp_cpu_per_reply"] == pytest.approx(0.5)
    assert got["superlink_cpu_per_reply"] == pytest.approx(0.1)
    assert got["server_cpu_per_reply"] == pytest.approx(0.6)
    assert got["handling_wall_per_reply"] == pytest.approx(0.25)
    assert got["window_wall_per_reply"] == pytest.approx(1.0)
    assert got["server_cores_busy"] == pytest.approx(2.4 / 4)
    assert got["node_cores_busy"] == pytest.approx(3.0 / 4)
    assert got["serverapp_cpu_lifetime"] == 13.0
    assert got["ratio_to_loopback"] == pytest.approx(0.5 / LOOPBACK_SERVER_SECONDS)
    assert got["server_ratio_to_loopback"] == pytest.approx(0.6 / 0.765)
    assert math.isnan(got["superlink_idle_cpu_rate"])  # no idle phase given


def test_window_figures_with_an_idle_phase_before_the_probe():
    # Idle from 90.0 to 99.0: the SuperLink 0.1 -> 1.0 (0.1 CPU s/s), the nodes
    # 40.0 -> 49.0 (1.0). In the 4 s window the SuperLink spent 1.0 s (1.5 -> 2.5),
    # 0.4 s of it at the idle rate: 0.6 s above it, 0.15 s per reply.
    samples = {
        "serverapp": [(99.5, 10.0), (105.0, 13.0)],
        "superlink": [(90.0, 0.1), (99.0, 1.0), (100.0, 1.5), (104.0, 2.5)],
        "nodes": [(90.0, 40.0), (99.0, 49.0), (104.0, 53.0)],
    }
    got = sc.window_figures(probe_rows(), samples, 1, 1, idle_end=99.0)
    assert got["superlink_idle_cpu_rate"] == pytest.approx(0.1)
    assert got["node_idle_cpu_rate"] == pytest.approx(1.0)
    assert got["superlink_cpu_per_reply"] == pytest.approx(0.25)
    assert got["superlink_cpu_per_reply_above_idle"] == pytest.approx(0.15)
    with pytest.raises(sc.MeasureError, match="no idle samples before 90.000"):
        sc.idle_rate(samples["superlink"], 90.0)


def test_window_figures_refuse_a_window_the_samples_do_not_bracket():
    # the ServerApp's last sample (103.0) is before the last reply pulled (104.0)
    samples = {
        "serverapp": [(99.0, 10.0), (103.0, 11.0)],
        "superlink": [(99.0, 1.0), (105.0, 1.6)],
        "nodes": [(99.0, 49.0), (105.0, 53.0)],
    }
    with pytest.raises(sc.MeasureError, match="no samples around 104.000"):
        sc.window_figures(probe_rows(), samples, 1, 1)


def test_per_reply_and_the_replies_asked():
    assert sc.per_reply(7.646, 10) == pytest.approx(0.7646)
    with pytest.raises(sc.MeasureError, match="no reply"):
        sc.per_reply(1.0, 0)
    with pytest.raises(sc.MeasureError, match="no reply"):
        sc.probe_window([])
    # the probe sends each node updates + 1 messages
    assert sc.updates_per_node(100, 10) == 9  # 10 x 10 = 100 replies
    assert sc.updates_per_node(101, 10) == 10  # 110
    assert sc.updates_per_node(5, 2) == 2  # 6
    assert sc.updates_per_node(1, 2) == 1  # 4: two per node at least


# ------------------------------------------------------------------ CPU sets
def test_parse_and_format_cpu_lists():
    assert sc.parse_cpus("0") == {0}
    assert sc.parse_cpus("0-2,5") == {0, 1, 2, 5}
    assert sc.parse_cpus(" 1 , 3 ") == {1, 3}
    assert sc.format_cpus({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    for bad in ("", "a", "1-", "-1", "0,,1"):
        with pytest.raises(sc.CpuSetError, match="expected numbers and ranges"):
            sc.parse_cpus(bad)
    with pytest.raises(sc.CpuSetError, match="the range 3-1 runs backwards"):
        sc.parse_cpus("3-1")


def test_cpu_sets_that_overlap_are_refused_naming_the_cpus():
    with pytest.raises(sc.CpuSetError) as err:
        sc.check_cpu_sets(frozenset({0, 1}), frozenset({1}), {0, 1})
    assert str(err.value) == (
        "--server-cpus 0-1 and --node-cpus 1 overlap on CPU 1: the SuperNodes would share "
        "the server's cores"
    )


def test_cpus_the_machine_lacks_are_refused_naming_them():
    with pytest.raises(sc.CpuSetError) as err:
        sc.check_cpu_sets(frozenset({0}), frozenset({2, 3}), {0, 1})
    assert str(err.value) == ("--node-cpus 2-3: this machine has no CPU 2-3 (CPUs available: 0-1)")
    with pytest.raises(sc.CpuSetError, match="--server-cpus is empty"):
        sc.check_cpu_sets(frozenset(), frozenset({1}), {0, 1})
    sc.check_cpu_sets(frozenset({0}), frozenset({1}), {0, 1})  # the defaults: fine


def test_the_options_refuse_bad_cpu_sets_with_exit_code_2(capsys):
    with pytest.raises(SystemExit) as done:
        sc.parse_args(["--server-cpus", "0", "--node-cpus", "0", "--workdir", "/tmp/x"])
    assert done.value.code == 2
    assert "overlap on CPU 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sc.parse_args(["--node-cpus", "4096", "--workdir", "/tmp/x"])
    assert "this machine has no CPU 4096" in capsys.readouterr().err
