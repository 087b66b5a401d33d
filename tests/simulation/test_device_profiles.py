"""Device profiles of the time model beyond uniform/edge/loopback: ``appfl10`` (APPFL's
measured seconds per step, FedCompass) and a profile file of the user's own fleet
(CSV or TOML), with hand-computed factors and durations (jitter off) and the exact
line and field of a malformed file in the refusal."""

from __future__ import annotations

import math
import re

import pytest

from flwr_gsgm.config.build import virtual_clock_from
from flwr_gsgm.config.run_config import parse_run_config
from flwr_gsgm.simulation.inprocess_grid import InProcessGrid
from flwr_gsgm.simulation.virtual_clock import VirtualClock
from flwr_gsgm.strategy.strategies import ASGD
from tests.engine.quadratic_app import initial_arrays, make_app

# The 3-node fleet of the file tests: seconds per step 0.1 / 0.4 / 0.2 (median 0.2),
# node 1 with free bytes (empty bandwidth), node 2 with no latency.
FLEET_CSV = """\
partition-id,step-seconds,bandwidth,latency-seconds
0,0.1,1000000,0.05
1,0.4,,0.2
2,0.2,2e6,0
"""
FLEET_TOML = """\
[[node]]
partition-id = 0
step-seconds = 0.1
bandwidth = 1_000_000
latency-seconds = 0.05

[[node]]
partition-id = 1
step-seconds = 0.4
bandwidth = inf
latency-seconds = 0.2

[[node]]
partition-id = 2
step-seconds = 0.2
bandwidth = 2e6
latency-seconds = 0
"""
# 5 steps of work, 1,000,000 model bytes each way, jitter 0:
#   node 0: 5 x 0.1 + 0.05 + 2 x 1e6 / 1e6 = 0.5 + 0.05 + 2 = 2.55 s
#   node 1: 5 x 0.4 + 0.2 + 0 (free bytes)  = 2.0 + 0.2     = 2.2 s
#   node 2: 5 x 0.2 + 0   + 2 x 1e6 / 2e6   = 1.0 + 1.0     = 2.0 s
FLEET_DURATIONS = {0: 2.55, 1: 2.2, 2: 2.0}


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ------------------------------------------------------------------ appfl10
def test_appfl10_factors_are_appfl_seconds_over_their_median():
    clock = VirtualClock(device_profile="appfl10", jitter=0.0)
    # median of the 10 measured seconds per step: (0.284 + 0.340) / 2 = 0.312
    factors = clock.speed_factors([0, 4, 8, 13])
    assert factors == pytest.approx(
        {0: 0.244 / 0.312, 4: 0.581 / 0.312, 8: 0.099 / 0.312, 13: 0.102 / 0.312}, rel=1e-15
    )
    # 0.78205, 1.86218, 0.31731; partition 13 is device 13 % 10 = 3 (0.102 s)
    assert factors == pytest.approx({0: 0.78205, 4: 1.86218, 8: 0.31731, 13: 0.32692}, abs=1e-5)
    ten = clock.speed_factors(list(range(10)))
    assert max(ten.values()) / min(ten.values()) == pytest.approx(0.889 / 0.099)  # 9.0x
    # seconds per step at factor 1: edge's median device, 4 x 0.018 s; edge's network
    assert (clock.seconds_per_step, clock.latency) == (0.072, 0.05)
    edge = VirtualClock(device_profile="edge")
    assert [clock.bandwidth(p) for p in range(5)] == [edge.bandwidth(p) for p in range(5)]
    # node 4, 2 steps, no bytes: 2 x 0.072 x 0.581 / 0.312 + 0.05 = 0.268154 + 0.05 s
    assert clock.duration(factors[4], 4, 0, 2) == pytest.approx(0.318154, abs=1e-6)


def test_appfl10_ignores_the_slow_set():
    plain = VirtualClock(device_profile="appfl10")
    slowed = VirtualClock(device_profile="appfl10", slow_fraction=1.0, slow_factor=9.0)
    assert slowed.speed_factors(list(range(20))) == plain.speed_factors(list(range(20)))


# ------------------------------------------------------------------ profile files
@pytest.mark.parametrize("name,text", [("fleet.csv", FLEET_CSV), ("fleet.toml", FLEET_TOML)])
def test_a_profile_file_times_each_node_by_its_own_entry(tmp_path, name, text):
    clock = VirtualClock(device_profile=write(tmp_path, name, text), jitter=0.0)
    assert clock.seconds_per_step == 0.2  # the median node's
    factors = clock.speed_factors([2, 0, 1])
    assert factors == {0: 0.5, 1: 2.0, 2: 1.0}  # 0.1 / 0.2, 0.4 / 0.2, 0.2 / 0.2
    assert [clock.bandwidth(p) for p in range(3)] == [1e6, math.inf, 2e6]
    assert [clock.latency_of(p) for p in range(3)] == [0.05, 0.2, 0.0]
    for pid, seconds in FLEET_DURATIONS.items():
        assert clock.duration(factors[pid], pid, 0, 5, 1_000_000) == pytest.approx(
            seconds, rel=1e-12
        )


def test_jitter_and_overrides_apply_to_a_profile_file(tmp_path):
    path = write(tmp_path, "fleet.csv", FLEET_CSV)
    clock = VirtualClock(seed=5, device_profile=path, jitter=0.2)
    # compute: the clock's jitter stream, as a uniform clock at the median's 0.2 s per step
    same = VirtualClock(seed=5, base_duration=0.2, slow_fraction=0.0, jitter=0.2)
    for index in range(5):
        assert clock.compute_seconds(0.5, 0, index, 5) == same.compute_seconds(0.5, 0, index, 5)
    comm = [clock.communication_seconds(1, i) for i in range(20)]  # node 1: 0.2 s latency
    assert all(0.8 * 0.2 <= c <= 1.2 * 0.2 for c in comm) and len(set(comm)) == 20
    # step-seconds scales the median node (factors stay); latency-seconds sets every node's
    over = VirtualClock(device_profile=path, step_seconds=1.0, latency_seconds=0.5, jitter=0.0)
    assert over.speed_factors([0, 1, 2]) == {0: 0.5, 1: 2.0, 2: 1.0}
    # node 1, 5 steps: 5 x 1.0 x 2.0 + 0.5 s (its own bytes are free)
    assert over.duration(2.0, 1, 0, 5, 1_000_000) == 10.5


def test_a_partition_without_an_entry_is_refused_naming_it_and_the_files_ids(tmp_path):
    path = write(tmp_path, "fleet.csv", FLEET_CSV)
    clock = VirtualClock(device_profile=path)
    expected = re.escape(
        f"partition-id 3 has no entry in device profile file {path!r}; it has "
        "partition-ids [0, 1, 2]"
    )
    with pytest.raises(ValueError, match=expected):
        clock.speed_factors([0, 1, 2, 3])
    with pytest.raises(ValueError, match=expected):
        clock.communication_seconds(3, 0, 100)
    with pytest.raises(ValueError, match=expected):
        clock.latency_of(3)


BAD_CSV = [
    (  # a column missing from the header
        "partition-id,step-seconds,bandwidth\n0,0.1,1e6\n",
        "line 1: missing column(s) ['latency-seconds']; expected partition-id, "
        "step-seconds, bandwidth, latency-seconds, optionally online-intervals, "
        "mean-online-seconds, mean-offline-seconds",
    ),
    (  # an unknown column
        "partition-id,step-seconds,bandwidth,latency-seconds,gpu\n0,0.1,1e6,0,a100\n",
        "line 1: unknown column(s) ['gpu']",
    ),
    (  # not a number, on the third line
        FLEET_CSV.replace("1,0.4,", "1,fast,"),
        "line 3: step-seconds = 'fast': expected a finite number > 0 (seconds)",
    ),
    (  # negative seconds per step
        FLEET_CSV.replace("2,0.2,", "2,-0.2,"),
        "line 4: step-seconds = '-0.2': expected a finite number > 0 (seconds)",
    ),
    (  # a partition-id twice (after a blank line: line numbers count it)
        FLEET_CSV + "\n0,0.3,1e6,0.05\n",
        "line 6: partition-id = 0: expected each partition-id once; it is already on line 2",
    ),
    (  # a partition-id that is not an integer
        FLEET_CSV.replace("2,0.2,", "2.5,0.2,"),
        "line 4: partition-id = '2.5': expected an integer >= 0",
    ),
    (  # a zero bandwidth
        FLEET_CSV.replace("1000000", "0"),
        "line 2: bandwidth = '0': expected a number > 0 (bytes per second), or empty or inf",
    ),
    (  # a negative latency
        FLEET_CSV.replace(",0.2\n", ",-1\n"),
        "line 3: latency-seconds = '-1': expected a finite number >= 0 (seconds)",
    ),
    (  # a field short
        FLEET_CSV.replace("2,0.2,2e6,0", "2,0.2,2e6"),
        "line 4: 3 fields; expected 4 (partition-id,step-seconds,bandwidth,latency-seconds)",
    ),
    ("", "line 1: empty; expected a header row"),
    ("partition-id,step-seconds,bandwidth,latency-seconds\n", ": no node; expected one entry"),
]


@pytest.mark.parametrize("text,message", BAD_CSV)
def test_a_malformed_csv_is_refused_naming_the_line_and_the_field(tmp_path, text, message):
    path = write(tmp_path, "fleet.csv", text)
    with pytest.raises(ValueError, match=re.escape(f"device profile file {path!r}")) as err:
        VirtualClock(device_profile=path)
    assert message in str(err.value)


BAD_TOML = [
    (
        FLEET_TOML.replace("step-seconds = 0.4\n", ""),
        "[[node]] 2 (counting from 1): missing key(s) ['step-seconds']",
    ),
    (
        FLEET_TOML.replace("step-seconds = 0.4", 'step-seconds = "fast"'),
        "[[node]] 2 (counting from 1): step-seconds = 'fast': expected a finite number > 0",
    ),
    (
        FLEET_TOML.replace("step-seconds = 0.2", "step-seconds = -0.2"),
        "[[node]] 3 (counting from 1): step-seconds = -0.2: expected a finite number > 0",
    ),
    (
        FLEET_TOML.replace("partition-id = 2", "partition-id = 1"),
        "[[node]] 3 (counting from 1): partition-id = 1: expected each partition-id once; "
        "it is already on [[node]] 2 (counting from 1)",
    ),
    (
        FLEET_TOML.replace("partition-id = 2", "partition-id = 2.0"),
        "[[node]] 3 (counting from 1): partition-id = 2.0: expected an integer >= 0",
    ),
    ("[fleet]\nsize = 3\n", "unknown top-level key(s) ['fleet']; expected only [[node]] tables"),
    ("[[node]\n", "not valid TOML"),
]


@pytest.mark.parametrize("text,message", BAD_TOML)
def test_a_malformed_toml_is_refused_naming_the_node_and_the_field(tmp_path, text, message):
    path = write(tmp_path, "fleet.toml", text)
    with pytest.raises(ValueError, match=re.escape(f"device profile file {path!r}")) as err:
        VirtualClock(device_profile=path)
    assert message in str(err.value)


def test_the_file_is_read_once_when_the_clock_is_built(tmp_path):
    path = write(tmp_path, "fleet.csv", FLEET_CSV)
    clock = VirtualClock(device_profile=path, jitter=0.0)
    (tmp_path / "fleet.csv").unlink()  # what the clock holds does not depend on the file
    assert clock.speed_factors([0, 1, 2]) == {0: 0.5, 1: 2.0, 2: 1.0}
    with pytest.raises(ValueError, match="fleet.csv': no such file"):
        VirtualClock(device_profile=path)


# ------------------------------------------------------------------ the run config
def test_the_run_config_takes_a_name_or_an_existing_profile_file(tmp_path):
    csv_path = write(tmp_path, "fleet.csv", FLEET_CSV)
    toml_path = write(tmp_path, "Fleet.TOML", FLEET_TOML)
    for value in ("uniform", "edge", "loopback", "appfl10", csv_path, toml_path):
        assert parse_run_config({"device-profile": value})["device-profile"] == value
    cfg = parse_run_config({"device-profile": csv_path, "jitter": 0.0})
    assert virtual_clock_from(cfg).speed_factors([0, 1, 2]) == {0: 0.5, 1: 2.0, 2: 1.0}
    expected = (
        "expected one of uniform, edge, loopback, appfl10, or the path of an existing .csv "
        "or .toml profile file"
    )
    txt = write(tmp_path, "fleet.txt", FLEET_CSV)
    for value in ("phone", str(tmp_path / "missing.csv"), txt):
        with pytest.raises(ValueError, match=re.escape(f"device-profile={value!r}: {expected}")):
            parse_run_config({"device-profile": value})


class ConfigGrid(InProcessGrid):
    """Notes the config of every train message pushed."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.configs: list[dict] = []

    def push_messages(self, messages):
        messages = list(messages)
        self.configs += [
            dict(m.content["config"]) for m in messages if m.metadata.message_type == "train"
        ]
        return super().push_messages(messages)


def test_the_engine_charges_each_node_its_files_entry(tmp_path):
    path = write(tmp_path, "fleet.csv", FLEET_CSV)
    clock = VirtualClock(device_profile=path, jitter=0.0)
    grid = ConfigGrid(make_app(), 3, run_config={})
    strategy = ASGD(
        server_learning_rate=0.1, client_mode="delta", local_steps=5, virtual_clock=clock
    )
    strategy.start(grid, initial_arrays(), max_updates=3)
    # 5 steps at the node's seconds per step + its latency + 2 x 12 bytes (the quadratic
    # model's w: 2 float32, b: 1) over its bandwidth
    each = [5 * 0.1 + 0.05 + 24 / 1e6, 5 * 0.4 + 0.2, 5 * 0.2 + 0.0 + 24 / 2e6]
    charged = sorted(c["virtual-duration"] for c in grid.configs[:3])
    assert charged == pytest.approx(sorted(each), rel=1e-12)
