"""Availability and speed variance in the time model: when nodes are online, what a
message to a node that goes offline costs (the engine and Flower's FedAvg), the
slowdowns' draws, and a bad availability entry refused with its line (hand-computed
times, jitter off)."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
from flwr.common.constant import HEARTBEAT_DEFAULT_INTERVAL, HEARTBEAT_PATIENCE

from clients.client_app import app as client_app
from flwr_gsgm.engine import clock as engine_clock
from flwr_gsgm.simulation.availability import (
    AVAILABILITY_MODELS,
    DROPOUT_PER_ROUND,
    Availability,
    OnOffModel,
)
from flwr_gsgm.simulation.inprocess_grid import InProcessGrid
from flwr_gsgm.simulation.speed_variance import SPEED_VARIANCE_MODELS, slowdown
from flwr_gsgm.simulation.virtual_clock import OFFLINE_DETECTION_SECONDS, VirtualClock
from flwr_gsgm.strategy.strategies import ASGD
from serverapp.app_config import parse_app_config
from serverapp.experiment import run_experiment
from tests.engine.quadratic_app import initial_arrays, make_app


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ------------------------------------------------------------------ the intervals
def test_a_node_offline_from_3_to_7_loses_a_message_sent_at_2_that_lasts_2():
    online = Availability("device-profile", nodes={0: ((0.0, 3.0), (7.0, 100.0))})
    assert [online.online(0, t) for t in (0.0, 2.9, 3.0, 6.9, 7.0, 99.9, 100.0)] == [
        True,
        True,
        False,
        False,
        True,
        True,
        False,
    ]
    assert online.loss(0, 2.0, 4.0) == (3.0, 7.0)  # lost at 3 s, back at 7 s
    assert online.loss(0, 0.0, 3.0) is None  # its reply arrives as the node leaves
    assert online.loss(0, 4.0, 5.0) == (4.0, 7.0)  # sent to an offline node: lost at once
    assert online.loss(0, 98.0, 101.0) == (100.0, math.inf)  # never back after its last
    assert online.offline_from(0, 1.0) == 3.0 and online.online_from(0, 5.0) == 7.0


def test_always_is_online_for_ever_and_draws_nothing():
    online = Availability()
    assert online.always and online.online(3, 1e9) and online.loss(3, 0.0, 1e9) is None
    assert online.offline_from(3, 5.0) == math.inf and online.online_from(3, 5.0) == 5.0


def test_the_two_state_model_is_the_same_whatever_the_order_of_the_questions():
    model = OnOffModel(mean_online_seconds=10.0, mean_offline_seconds=5.0)
    a = Availability("device-profile", seed=3, nodes={0: model, 1: model})
    b = Availability("device-profile", seed=3, nodes={0: model, 1: model})
    times = np.linspace(0.0, 500.0, 2001)
    forward = [(a.online(0, t), a.online(1, t)) for t in times]
    backward = [(b.online(0, t), b.online(1, t)) for t in times[::-1]][::-1]
    assert forward == backward
    # node 1 has its own stream: not node 0's intervals
    assert [x for x, _ in forward] != [y for _, y in forward]


def test_the_two_state_model_is_online_its_stationary_fraction_of_the_time():
    # Long-run fraction online = 10 / (10 + 5) = 2/3; over 200 nodes x 20,000 s the
    # sampled fraction is within 1 pp of it (about 27,000 intervals).
    model = OnOffModel(mean_online_seconds=10.0, mean_offline_seconds=5.0)
    online = Availability("device-profile", seed=0, nodes={p: model for p in range(200)})
    times = np.arange(0.0, 20_000.0, 7.3)
    fraction = np.mean([[online.online(p, t) for t in times] for p in range(200)])
    assert model.online_fraction == pytest.approx(2 / 3)
    assert fraction == pytest.approx(2 / 3, abs=0.01)


def test_the_smartphones_model_drops_8_percent_of_a_round_of_the_fleet():
    model = AVAILABILITY_MODELS["smartphones"]
    # 1 - exp(-1 / m) = 0.08 per round  =>  m = 1 / -ln(0.92) = 11.99 rounds
    assert model.in_rounds and model.mean_online_seconds == pytest.approx(11.993, abs=1e-3)
    assert 1 - math.exp(-1 / model.mean_online_seconds) == pytest.approx(DROPOUT_PER_ROUND)
    assert model.online_fraction == 0.5
    # In seconds once the fleet's round is known: a round of 5 s, 59.97 s online.
    online = Availability("smartphones", seed=0, round_seconds=5.0)
    assert online.model.mean_online_seconds == pytest.approx(59.965, abs=1e-3)
    # Over many nodes, 8% of those online at a round's start leave within it.
    starts = np.arange(0.0, 2000.0, 5.0)
    left = [
        online.offline_from(p, t) < t + 5.0
        for p in range(200)
        for t in starts
        if online.online(p, t)
    ]
    assert np.mean(left) == pytest.approx(0.08, abs=0.01)
    with pytest.raises(ValueError, match="counts in rounds of the fleet: expected round_seconds"):
        Availability("smartphones")


def test_the_engine_sizes_the_round_by_the_median_nodes_message(caplog):
    # 3 equal nodes of 0.5 s per step, 4 steps, no latency: a round is 2 s, and the
    # smartphones model's mean online interval 2 x 11.993 = 23.99 s.
    clock = VirtualClock(
        jitter=0.0, slow_fraction=0.0, step_seconds=0.5, availability="smartphones"
    )
    virtual = engine_clock.VirtualTime(clock)
    assert virtual.online is None  # not before the fleet is known
    virtual.start_fleet({0: 1.0, 1: 1.0, 2: 4.0}, {"mode": "delta", "local-steps": 4}, 0)
    assert virtual.online.round_seconds == 2.0  # the median of 2, 2 and 8 s
    assert virtual.online.model.mean_online_seconds == pytest.approx(23.986, abs=1e-3)


def test_offline_detection_is_flowers_heartbeat_expiry():
    # Pinned to Flower's constants: a Flower that changes them changes the model.
    assert HEARTBEAT_PATIENCE * HEARTBEAT_DEFAULT_INTERVAL == 60
    assert OFFLINE_DETECTION_SECONDS == 60.0


# ------------------------------------------------------------------ speed variance
def test_the_throttling_draws_for_a_seed():
    model = SPEED_VARIANCE_MODELS["throttling"]
    assert model.factor == 1.5 and model.probability == 0.5 and model.mean_factor == 1.25
    draws = [slowdown("throttling", 0, 0, i) for i in range(8)]
    # Each draw is its own stream (seed, tag, partition, message): throttled when
    # uniform() < 0.5, recomputed here from the stream.
    from flwr_gsgm.simulation.seeds import derive_seed

    expected = [
        1.5 if np.random.default_rng(derive_seed(0, 0x5104, 0, i)).uniform() < 0.5 else 1.0
        for i in range(8)
    ]
    assert draws == expected
    assert set(draws) == {1.0, 1.5}  # both happen in 8 draws for seed 0
    many = [slowdown("throttling", 0, p, i) for p in range(20) for i in range(200)]
    assert np.mean(many) == pytest.approx(1.25, abs=0.02)
    assert slowdown("none", 0, 0, 0) == 1.0


def test_speed_variance_multiplies_the_compute_time_only():
    plain = VirtualClock(jitter=0.0, slow_fraction=0.0, base_duration=2.0)
    varied = VirtualClock(
        jitter=0.0, slow_fraction=0.0, base_duration=2.0, speed_variance="throttling"
    )
    for i in range(6):
        factor = slowdown("throttling", 0, 1, i)
        assert varied.compute_seconds(1.0, 1, i, 3) == 6.0 * factor
        assert plain.compute_seconds(1.0, 1, i, 3) == 6.0


# ------------------------------------------------------------------ profile files
FLEET = """\
partition-id,step-seconds,bandwidth,latency-seconds,online-intervals
0,2.0,,0,0:3 7:1000
1,1.5,,0,0:1000
"""


def test_a_profile_files_availability_is_read_and_used(tmp_path):
    path = write(tmp_path, "fleet.csv", FLEET)
    clock = VirtualClock(device_profile=path, availability="device-profile", jitter=0.0)
    assert clock.availability_of().loss(0, 2.0, 4.0) == (3.0, 7.0)
    means = write(
        tmp_path,
        "means.toml",
        "[[node]]\npartition-id = 0\nstep-seconds = 1.0\nbandwidth = inf\n"
        "latency-seconds = 0\nmean-online-seconds = 60\nmean-offline-seconds = 30\n",
    )
    clock = VirtualClock(device_profile=means, availability="device-profile")
    assert clock.availability_of()._own[0] == OnOffModel(60.0, 30.0, "the device profile file")


BAD = [
    (  # an interval that ends before it starts, on the third line
        FLEET.replace("0:1000\n", "5:3\n"),
        "line 3: online-intervals = '5:3': expected online intervals start:end",
    ),
    (  # overlapping intervals
        FLEET.replace("0:3 7:1000", "0:8 7:1000"),
        "line 2: online-intervals = '0:8 7:1000': expected online intervals",
    ),
    (  # not numbers
        FLEET.replace("0:3 7:1000", "morning"),
        "line 2: online-intervals = 'morning': expected online intervals",
    ),
    (  # one mean without the other
        "partition-id,step-seconds,bandwidth,latency-seconds,mean-online-seconds\n0,1,,0,60\n",
        "line 2: mean-online-seconds without mean-offline-seconds",
    ),
    (  # a negative mean
        "partition-id,step-seconds,bandwidth,latency-seconds,mean-online-seconds,"
        "mean-offline-seconds\n0,1,,0,60,-3\n",
        "line 2: mean-offline-seconds = '-3': expected a finite number > 0 (seconds)",
    ),
]


@pytest.mark.parametrize("text,message", BAD)
def test_a_bad_availability_entry_is_refused_with_its_line(tmp_path, text, message):
    path = write(tmp_path, "fleet.csv", text)
    with pytest.raises(ValueError, match=f"device profile file {path!r}") as err:
        VirtualClock(device_profile=path, availability="device-profile")
    assert message in str(err.value)


def test_availability_and_its_file_must_agree(tmp_path):
    path = write(tmp_path, "fleet.csv", FLEET)
    with pytest.raises(ValueError, match="gives the availability of partition-ids \\[0, 1\\]"):
        VirtualClock(device_profile=path)  # availability "always" would ignore it
    with pytest.raises(ValueError, match="needs device-profile to be a profile file"):
        VirtualClock(availability="device-profile")
    partial = write(tmp_path, "partial.csv", FLEET.replace("0:1000", ""))
    with pytest.raises(ValueError, match="for partition-ids \\[1\\]; expected them for every"):
        VirtualClock(device_profile=partial, availability="device-profile")
    with pytest.raises(ValueError, match="availability 'weekends' is unknown"):
        VirtualClock(availability="weekends")
    with pytest.raises(ValueError, match="speed-variance 'hot' is unknown"):
        VirtualClock(speed_variance="hot")
    with pytest.raises(ValueError, match="offline-detection-seconds must be"):
        VirtualClock(offline_detection_seconds=-1.0)
    with pytest.raises(ValueError, match="availability"):
        parse_app_config({"availability": "weekends"})
    with pytest.raises(ValueError, match="availability='smartphones' needs virtual-clock=true"):
        parse_app_config({"availability": "smartphones", "virtual-clock": False})
    with pytest.raises(ValueError, match="speed-variance='throttling' needs virtual-clock"):
        parse_app_config({"speed-variance": "throttling", "virtual-clock": False})


# ------------------------------------------------------------------ the engine
def sends(monkeypatch) -> list[tuple[int, float]]:
    """Records (partition-id, virtual second) of every train message stamped."""
    seen: list[tuple[int, float]] = []
    stamp = engine_clock.VirtualTime.stamp

    def noted(self, config, speed, pid, index, message_bytes):
        seen.append((pid, self.now()))
        return stamp(self, config, speed, pid, index, message_bytes)

    monkeypatch.setattr(engine_clock.VirtualTime, "stamp", noted)
    return seen


def test_the_engine_loses_the_message_and_sends_the_next_when_the_node_is_back(
    tmp_path, monkeypatch
):
    # Node 0: 2 s a message, online [0, 3) and [7, 1000); node 1: 1.5 s, always online.
    # Node 0's message sent at 2 s would end at 4 s: lost at 3 s (the server told at
    # once: offline-detection-seconds 0); node 0 is back at 7 s and gets its next
    # message then, although no reply is due at 7 s (node 1's are at 6 and 7.5 s).
    path = write(tmp_path, "fleet.csv", FLEET)
    clock = VirtualClock(
        device_profile=path,
        availability="device-profile",
        offline_detection_seconds=0.0,
        jitter=0.0,
    )
    seen = sends(monkeypatch)
    strategy = ASGD(server_learning_rate=0.1, virtual_clock=clock)
    result = strategy.start(InProcessGrid(make_app(), 2, run_config={}), initial_arrays(), 12)
    node0 = [t for p, t in seen if p == 0]
    node1 = [t for p, t in seen if p == 1]
    assert node0[:4] == [0.0, 2.0, 7.0, 9.0]
    assert node1[:6] == [0.0, 1.5, 3.0, 4.5, 6.0, 7.5]
    c = result.report.counters
    assert c["lost_in_flight"] == 1 and c["nodes_lost"] == 1 and c["nodes_joined"] == 1
    # every reply that came is counted once, and the lost message apart: 12 received
    # and applied (ASGD applies each), 1 lost
    assert c["updates_received"] == 12 and c["updates_applied"] == 12


def test_the_loss_is_known_when_flower_would_know_it(tmp_path, monkeypatch):
    # The same fleet with Flower's heartbeat expiry (60 s): the loss at 3 s is known at
    # 63 s; node 0, back since 7 s, gets its next message at 63 s.
    path = write(tmp_path, "fleet.csv", FLEET)
    clock = VirtualClock(device_profile=path, availability="device-profile", jitter=0.0)
    seen = sends(monkeypatch)
    strategy = ASGD(server_learning_rate=0.1, virtual_clock=clock)
    strategy.start(InProcessGrid(make_app(), 2, run_config={}), initial_arrays(), 50)
    assert [t for p, t in seen if p == 0][:3] == [0.0, 2.0, 63.0]


# ------------------------------------------------------------------ Flower's FedAvg
def fedavg_rows(run_dir, profile: str, **cfg) -> list[dict]:
    """metrics.csv of FedAvg rounds of 2 nodes under ``profile``, one step each."""
    config = parse_app_config(
        {
            "strategy": "fedavg",
            "max-updates": 6,
            "eval-every": 2,
            "eval-examples": 100,
            "classes-per-node": 5,
            "local-steps": 1,
            "jitter": 0.0,
            "device-profile": profile,
            "availability": "device-profile",
            **cfg,
        }
    )
    run_experiment(InProcessGrid(client_app, 2, run_config=config), config, run_dir)
    with open(run_dir / "metrics.csv") as fh:
        return list(csv.DictReader(fh))


ROUNDS = """\
partition-id,step-seconds,bandwidth,latency-seconds,online-intervals
0,2.0,,0,0:3 5:1000
1,1.0,,0,0:1000
"""


def test_a_fedavg_round_with_a_lost_node_ends_at_its_timeout(tmp_path):
    # Round 1 (0 s): both nodes train; node 0 (2 s) is back by 2 s, node 1 by 1 s:
    # the round ends at 2 s. Round 2 (2 s): node 0 would be back at 4 s but leaves at
    # 3 s; the server would learn of it at 3 + 60 s, so the round ends at its timeout,
    # 2 + 10 = 12 s, with node 1's reply alone. Round 3 (12 s): both online, 2 s.
    rows = fedavg_rows(
        tmp_path / "run", write(tmp_path, "r.csv", ROUNDS), **{"dispatch-timeout": 10.0}
    )
    assert [float(r["virtual_time"]) for r in rows] == [0.0, 2.0, 12.0, 14.0]
    assert [int(r["updates"]) for r in rows] == [0, 2, 3, 5]
    # Nothing lost uncounted: 6 messages = 5 replies averaged + 1 lost in flight.
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    counts = {k: summary[k] for k in ("updates_received", "updates_applied", "lost_in_flight")}
    assert counts == {"updates_received": 5, "updates_applied": 5, "lost_in_flight": 1}
    assert summary["dispatch_timeouts"] == 0


def test_a_fedavg_round_ends_at_the_error_when_the_server_learns_first(tmp_path):
    # The same with the node saying goodbye (detection 0 s): round 2 ends when the last
    # message is answered, node 0's error at 3 s. Round 3 waits for 2 nodes online
    # (Flower's default min_available_nodes): node 0 is back at 5 s; it ends at 7 s.
    rows = fedavg_rows(
        tmp_path / "run",
        write(tmp_path, "r.csv", ROUNDS),
        **{"dispatch-timeout": 10.0, "offline-detection-seconds": 0.0, "max-updates": 8},
    )
    assert [float(r["virtual_time"]) for r in rows] == [0.0, 2.0, 3.0, 7.0, 9.0]
    assert [int(r["updates"]) for r in rows] == [0, 2, 3, 5, 7]


# ------------------------------------------------------------------ energy
def test_joules_of_a_two_node_run(tmp_path):
    # A Raspberry Pi 4: 3.06 W idle (0.6 A x 5.1 V), 6.12 W computing (1.2 A x 5.1 V),
    # communicating at idle. Two equal nodes, 1 s a message, no network: 4 messages
    # end at 2 s. Joules = 3.06 W x 2 nodes x 2 s + 4 x (6.12 - 3.06) W x 1 s = 24.48.
    clock = VirtualClock(
        jitter=0.0, slow_fraction=0.0, base_duration=1.0, device_power="raspberry-pi-4"
    )
    strategy = ASGD(server_learning_rate=0.1, virtual_clock=clock)
    grid = InProcessGrid(make_app(), 2, run_config={})
    result = strategy.start(
        grid, initial_arrays(), 4, evaluate_fn=lambda n, arrays: None, eval_every=2
    )
    rows = result.report.rows
    assert [r["virtual_time"] for r in rows] == [0.0, 1.0, 2.0]
    assert [r["joules"] for r in rows] == [0.0, pytest.approx(12.24), pytest.approx(24.48)]
    # Flower's FedAvg on the same fleet: 2 rounds of 1 s, the same 4 messages, 24.48 J.
    config = parse_app_config(
        {
            "strategy": "fedavg",
            "max-updates": 4,
            "eval-every": 2,
            "eval-examples": 100,
            "classes-per-node": 5,
            "local-steps": 1,
            "jitter": 0.0,
            "slow-fraction": 0.0,
            "device-power": "raspberry-pi-4",
        }
    )
    run_experiment(InProcessGrid(client_app, 2, run_config=config), config, tmp_path / "run")
    with open(tmp_path / "run" / "metrics.csv") as fh:
        fedavg = list(csv.DictReader(fh))
    assert [float(r["joules"]) for r in fedavg] == [0.0, 12.24, 24.48]
