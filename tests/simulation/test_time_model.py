"""The time model of the virtual clock: compute scales with local work, communication
with bytes, the ``uniform`` profile is the old clock bit for bit, and the engine and
Flower's FedAvg charge what the model says (hand-computed durations, jitter off)."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest

from clients.client_app import app as client_app
from flwr_gsgm.simulation.inprocess_grid import InProcessGrid
from flwr_gsgm.simulation.virtual_clock import (
    DEVICE_PROFILES,
    LOOPBACK_LATENCY_SECONDS,
    LOOPBACK_SERVER_SECONDS,
    LOOPBACK_STEP_SECONDS,
    VirtualClock,
    derive_seed,
)
from flwr_gsgm.strategy.strategies import ASGD
from serverapp.app_config import parse_app_config
from serverapp.experiment import run_experiment
from tests.engine.quadratic_app import initial_arrays, make_app

EVEN = {"slow_fraction": 0.0, "jitter": 0.0}


def old_duration(seed, base, speed, pid, index, jitter):
    """The clock before the time model, verbatim: base x speed x uniform jitter."""
    rng = np.random.default_rng(derive_seed(seed, int(pid), int(index)))
    noise = rng.uniform(1.0 - jitter, 1.0 + jitter)
    return float(base * speed * noise)


# ------------------------------------------------------------------ uniform = old clock
def test_uniform_with_one_step_is_the_old_clock_bit_for_bit_whatever_the_bytes():
    clock = VirtualClock(seed=3, base_duration=1.7, slow_fraction=0.25, slow_factor=4.0)
    speeds = clock.speed_factors(list(range(8)))
    assert [p for p, f in speeds.items() if f > 1] == [4, 7]  # the old slow set (seed 3)
    for pid in range(8):
        for index in range(20):
            old = old_duration(3, 1.7, speeds[pid], pid, index, 0.1)
            assert clock.duration(speeds[pid], pid, index) == old
            # uniform charges no communication: the model's bytes change nothing
            assert clock.duration(speeds[pid], pid, index, 1, 738_344) == old


def test_uniform_charges_compute_per_step_and_nothing_for_communication():
    clock = VirtualClock(base_duration=0.5, **EVEN)
    assert clock.duration(1.0, 0, 0, work_steps=1) == 0.5
    assert clock.duration(1.0, 0, 0, work_steps=5) == 2.5
    assert clock.duration(4.0, 0, 0, work_steps=5) == 10.0  # a 4x slower node
    assert clock.communication_seconds(0, 0, 10**9) == 0.0


# ------------------------------------------------------------------ compute
def test_compute_scales_with_steps_with_the_same_jitter():
    clock = VirtualClock(seed=1, base_duration=1.0, slow_fraction=0.0, jitter=0.1)
    one = clock.compute_seconds(1.0, 2, 7, work_steps=1)
    assert 0.9 <= one <= 1.1
    assert clock.compute_seconds(1.0, 2, 7, work_steps=5) == pytest.approx(5 * one, rel=1e-15)


def test_work_steps_per_mode_and_epochs_from_example_counts():
    clock = VirtualClock(partition_examples={0: 100, 1: 64})
    work = {"batch_size": 32, "local_batches": 3, "local_steps": 7}
    assert clock.work_steps(0, "gradient", **work) == 3
    assert clock.work_steps(0, "gradient", **work, local_epochs=2) == 3  # epochs: not gradient
    assert clock.work_steps(0, "delta", **work) == 7
    assert clock.work_steps(0, "weights", **work) == 7
    # 2 epochs x ceil(100 / 32) = 2 x 4; 2 x ceil(64 / 32) = 2 x 2
    assert clock.work_steps(0, "weights", **work, local_epochs=2) == 8
    assert clock.work_steps(1, "delta", **work, local_epochs=2) == 4
    with pytest.raises(ValueError, match="local-epochs = 1 needs .* partition 2"):
        clock.work_steps(2, "weights", **work, local_epochs=1)
    with pytest.raises(ValueError, match="local-epochs = 1 needs .* partition 0"):
        VirtualClock().work_steps(0, "weights", **work, local_epochs=1)
    with pytest.raises(ValueError, match="client mode 'sgd' is unknown"):
        clock.work_steps(0, "sgd", **work)


# ------------------------------------------------------------------ communication
def test_communication_is_latency_plus_bytes_both_ways_over_bandwidth():
    clock = VirtualClock(device_profile="loopback", step_seconds=0.25, latency_seconds=0.5, **EVEN)
    assert clock.bandwidth(3) == 1e9
    # 0.5 s + 2 x 1,000,000 bytes / 1e9 bytes/s = 0.502 s
    assert clock.communication_seconds(3, 0, 1_000_000) == pytest.approx(0.502, rel=1e-15)
    assert clock.communication_seconds(3, 0, 0) == 0.5
    # + compute 4 steps x 0.25 s = 1.0 s
    assert clock.duration(1.0, 3, 0, 4, 1_000_000) == pytest.approx(1.502, rel=1e-15)


def test_edge_bandwidth_is_per_node_and_bytes_cost_in_proportion():
    clock = VirtualClock(device_profile="edge", **EVEN)
    bandwidths = [clock.bandwidth(p) for p in range(5)]
    assert len(set(bandwidths)) == 5  # each node its own
    for p, bw in enumerate(bandwidths):
        # latency 0.05 s + 2 x bytes / that node's bandwidth
        assert clock.communication_seconds(p, 0, 10**6) == pytest.approx(0.05 + 2e6 / bw)
        assert clock.communication_seconds(p, 0, 2 * 10**6) == pytest.approx(0.05 + 4e6 / bw)


def test_communication_jitter_is_its_own_stream():
    jittery = VirtualClock(seed=4, device_profile="loopback", slow_fraction=0.0, jitter=0.2)
    # compute draws the same as the clock without communication (uniform profile)
    compute_only = VirtualClock(seed=4, base_duration=LOOPBACK_STEP_SECONDS, **{"jitter": 0.2})
    assert jittery.compute_seconds(1.0, 1, 3, 2) == compute_only.duration(1.0, 1, 3, 2)
    comm = [jittery.communication_seconds(1, i, 0) for i in range(50)]
    assert all(0.8 * LOOPBACK_LATENCY_SECONDS <= c <= 1.2 * LOOPBACK_LATENCY_SECONDS for c in comm)
    assert len(set(comm)) == 50


# ------------------------------------------------------------------ profiles
def test_profile_values_and_overrides():
    loopback = VirtualClock(device_profile="loopback")
    assert loopback.seconds_per_step == LOOPBACK_STEP_SECONDS == 0.018
    assert loopback.latency == LOOPBACK_LATENCY_SECONDS == 0.904
    # the race's reference probe: 7.646 s for 10 replies at once
    assert loopback.seconds_per_reply == LOOPBACK_SERVER_SECONDS == 0.765
    over = VirtualClock(device_profile="loopback", step_seconds=0.1, latency_seconds=0.3)
    assert (over.seconds_per_step, over.latency) == (0.1, 0.3)
    uniform = VirtualClock(base_duration=2.0)
    assert (uniform.seconds_per_step, uniform.latency) == (2.0, 0.0)
    assert VirtualClock(base_duration=2.0, step_seconds=0.5).seconds_per_step == 0.5
    # loopback keeps the slow set of uniform: a quarter of the nodes slow-factor slower
    assert loopback.speed_factors(list(range(8))) == VirtualClock().speed_factors(list(range(8)))


def test_edge_speeds_are_log_normal_per_node_with_median_one():
    clock = VirtualClock(seed=0, device_profile="edge")
    factors = clock.speed_factors(list(range(4000)))
    logs = np.log(list(factors.values()))
    assert abs(np.median(logs)) < 0.03
    assert np.std(logs) == pytest.approx(DEVICE_PROFILES["edge"].speed_sigma, rel=0.05)
    assert clock.speed_factors([3])[3] == factors[3]  # a node's factor is its own draw


def test_the_server_handles_replies_one_at_a_time_in_order_of_finish():
    clock = VirtualClock(server_seconds=0.5)
    assert clock.seconds_per_reply == 0.5
    # free at 1.0; replies finish at 3.0, 0.2 (queued since before), 3.1, 3.2:
    # 0.2 -> max(1.0, 0.2) + 0.5 = 1.5; 3.0 -> 3.5; 3.1 -> 4.0; 3.2 -> 4.5
    assert clock.serve(1.0, [3.0, 0.2, 3.1, 3.2]) == 4.5
    assert clock.serve(1.0, []) == 1.0
    # without a server cost: the last finish, the same float
    free = VirtualClock()
    assert free.seconds_per_reply == 0.0
    assert free.serve(1.0, [3.0, 0.1 + 0.2]) == 3.0 and free.serve(1.0, [0.5]) == 1.0
    # 0 = the profile's (every built-in profile and a file: none, unless the profile says)
    assert VirtualClock(device_profile="loopback").seconds_per_reply == (
        DEVICE_PROFILES["loopback"].server_seconds
    )


def test_unknown_profile_and_bad_overrides_are_refused():
    with pytest.raises(ValueError, match=r"device-profile 'phone' is unknown; expected one of"):
        VirtualClock(device_profile="phone")
    with pytest.raises(ValueError, match="step-seconds must be a finite number >= 0"):
        VirtualClock(step_seconds=-1.0)
    with pytest.raises(ValueError, match="latency-seconds must be a finite number >= 0"):
        VirtualClock(latency_seconds=math.inf)
    with pytest.raises(ValueError, match=r"server-seconds must be a finite number >= 0 .* -0.5"):
        VirtualClock(server_seconds=-0.5)
    with pytest.raises(ValueError, match="device-profile"):
        parse_app_config({"device-profile": "phone"})


# ------------------------------------------------------------------ the engine charges it
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


def test_the_dispatcher_charges_local_steps_and_the_models_bytes():
    clock = VirtualClock(device_profile="loopback", step_seconds=0.1, latency_seconds=0.5, **EVEN)
    grid = ConfigGrid(make_app(), 4, run_config={})
    strategy = ASGD(
        server_learning_rate=0.1, client_mode="delta", local_steps=5, virtual_clock=clock
    )
    result = strategy.start(grid, initial_arrays(), max_updates=8)
    # 5 steps x 0.1 s + 0.5 s + 2 x 12 bytes (w: 2 float32, b: 1) / 1e9 bytes/s
    each = 5 * 0.1 + 0.5 + 24 / 1e9
    assert [c["virtual-duration"] for c in grid.configs] == [pytest.approx(each)] * 8
    # 2 messages per node; the server, 0.765 s per reply (loopback's), is busy from the
    # first finish on: each next message finishes before the server is free again
    assert result.report.virtual_seconds == pytest.approx(each + 8 * LOOPBACK_SERVER_SECONDS)


def fedavg_rows(run_dir, **time_model) -> list[dict]:
    """metrics.csv of 2 FedAvg rounds of 4 nodes, 3 local steps each, under ``time_model``."""
    cfg = parse_app_config(
        {
            "strategy": "fedavg",
            "max-updates": 8,
            "eval-every": 4,
            "eval-examples": 100,
            "classes-per-node": 5,
            "local-steps": 3,
            "jitter": 0.0,
            **time_model,
        }
    )
    run_experiment(InProcessGrid(client_app, 4, run_config=cfg), cfg, run_dir)
    with open(run_dir / "metrics.csv") as fh:
        return list(csv.DictReader(fh))


def test_a_loopback_fedavg_round_lasts_until_the_server_has_handled_every_reply(tmp_path):
    rows = fedavg_rows(tmp_path / "run", **{"device-profile": "loopback"})
    # 4 nodes, one slow (slow-factor 4); a message is 3 steps x 0.018 s (x 4 on the slow
    # one) + 0.904 s latency + the CNN's 184,586 float32 parameters (738,344 bytes) both
    # ways at 1e9 bytes/s. The 3 fast replies finish at 0.959 s; the server takes 0.765 s
    # each, so the slow one (1.122 s) waits too: the round ends 4 x 0.765 s after 0.959 s.
    fast = 3 * 0.018 + 0.904 + 2 * 738_344 / 1e9
    slow = 3 * 0.018 * 4 + 0.904 + 2 * 738_344 / 1e9
    assert fast + 0.765 > slow  # the slow reply is queued, not waited for
    round_seconds = fast + 4 * 0.765
    assert [int(r["updates"]) for r in rows] == [0, 4, 8]
    assert [float(r["virtual_time"]) for r in rows] == [
        0.0,
        round(round_seconds, 6),
        round(2 * round_seconds, 6),
    ]


def test_the_server_queue_delays_the_next_message_and_the_rounds_end(tmp_path):
    # ASGD on 4 equal nodes, 1 s per message, 0.25 s of server per reply: the 4 first
    # replies finish at 1.0 and are handled at 1.25, 1.5, 1.75, 2.0; each node's next
    # message leaves then and finishes 1 s later: 2.25, 2.5, 2.75, 3.0; handled at
    # 2.5, 2.75, 3.0, 3.25.
    clock = VirtualClock(jitter=0.0, slow_fraction=0.0, server_seconds=0.25)
    grid = ConfigGrid(make_app(), 4, run_config={})
    strategy = ASGD(server_learning_rate=0.1, virtual_clock=clock)
    result = strategy.start(grid, initial_arrays(), max_updates=8)
    assert result.report.virtual_seconds == pytest.approx(3.25)
    # FedAvg: a round of 4 replies that finish together ends 4 x 0.25 s after them
    rows = fedavg_rows(
        tmp_path / "run",
        **{"slow-fraction": 0.0, "step-seconds": 0.5, "server-seconds": 0.25},
    )
    times = [float(r["virtual_time"]) for r in rows]
    assert times == [0.0, 3 * 0.5 + 4 * 0.25, 2 * (3 * 0.5 + 4 * 0.25)]  # 2.5 s a round


def test_the_app_layer_counts_each_partitions_examples_for_epoch_work():
    from serverapp.experiment import partition_examples

    cfg = parse_app_config({"partitioner": "iid"})
    grid = InProcessGrid(client_app, 4, run_config=cfg)
    assert partition_examples(grid, cfg) is None  # no epoch work: not needed
    # 60,000 Fashion-MNIST training images, IID over 4 nodes
    assert partition_examples(grid, {**cfg, "local-epochs": 1}) == {p: 15_000 for p in range(4)}
