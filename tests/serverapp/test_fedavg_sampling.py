"""FedAvg with max-in-flight < nodes: Flower samples that many nodes per round, the
rounds keep the client computations equal to max-updates, and a round lasts as long
as its slowest sampled node (virtual clock)."""

from __future__ import annotations

import csv

from clients.client_app import app as client_app
from flwr_gsgm.config.build import virtual_clock_from
from flwr_gsgm.simulation.inprocess_grid import InProcessGrid
from serverapp.app_config import parse_app_config
from serverapp.experiment import run_experiment


class SamplingGrid(InProcessGrid):
    """Notes the partition-ids each synchronous round sent train messages to."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rounds: list[list[int]] = []

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        trained = [
            int(self.contexts[m.metadata.dst_node_id].node_config["partition-id"])
            for m in messages
            if m.metadata.message_type == "train"
        ]
        if trained:
            self.rounds.append(sorted(trained))
        return super().send_and_receive(messages, timeout=timeout)


def test_fedavg_samples_max_in_flight_nodes_and_times_rounds_by_the_slowest_sampled(tmp_path):
    cfg = parse_app_config(
        {
            "strategy": "fedavg",
            "max-updates": 9,
            "eval-every": 2,
            "eval-examples": 200,
            "classes-per-node": 5,
            "max-in-flight": 2,
            "local-steps": 1,
        }
    )
    grid = SamplingGrid(client_app, 4, run_config=cfg)
    summary = run_experiment(grid, cfg, tmp_path / "run")
    # 9 // 2 = 4 rounds of 2 distinct nodes each.
    assert len(grid.rounds) == 4
    assert all(len(set(r)) == 2 for r in grid.rounds)
    with open(tmp_path / "run" / "metrics.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["updates"]) for r in rows] == [0, 2, 4, 6, 8]
    clock = virtual_clock_from(cfg)
    speeds = clock.speed_factors([0, 1, 2, 3])
    expected, t = [0.0], 0.0
    for r, sampled in enumerate(grid.rounds, start=1):
        t += max(clock.duration(speeds[p], p, r - 1) for p in sampled)
        expected.append(round(t, 6))
    assert [float(r["virtual_time"]) for r in rows] == expected
    assert summary["updates_received"] == 8


class ReversingGrid(InProcessGrid):
    """Hands each synchronous round's replies back in reverse order."""

    def send_and_receive(self, messages, *, timeout=None):
        return list(super().send_and_receive(messages, timeout=timeout))[::-1]


def test_fedavg_gives_the_same_bits_whatever_the_order_replies_arrive_in(tmp_path):
    # Flower's FedAvg sums replies in arrival order; float32 sums in another order
    # differ in their last bits. The experiment sorts the replies by node id.
    cfg = parse_app_config(
        {"strategy": "fedavg", "max-updates": 12, "eval-every": 4, "eval-examples": 300}
    )
    outputs = []
    for name, grid_cls in (("arrival", InProcessGrid), ("reversed", ReversingGrid)):
        run_experiment(grid_cls(client_app, 4, run_config=cfg), cfg, tmp_path / name)
        with open(tmp_path / name / "metrics.csv") as fh:
            rows = list(csv.DictReader(fh))
        outputs.append([(r["updates"], r["accuracy"], r["loss"]) for r in rows])
    assert [u for u, _, _ in outputs[0]] == ["0", "4", "8", "12"]
    assert outputs[0] == outputs[1]


def test_fedavg_samples_the_same_nodes_for_the_same_seed(tmp_path):
    # Flower samples with the module-level random; the experiment seeds it with the
    # run's seed, so the rounds repeat (they were one unseeded draw per run before).
    def sampled_rounds(seed: int, name: str) -> list[list[int]]:
        cfg = parse_app_config(
            {
                "strategy": "fedavg",
                "max-updates": 12,
                "eval-every": 12,
                "eval-examples": 100,
                "max-in-flight": 2,
                "seed": seed,
            }
        )
        grid = SamplingGrid(client_app, 5, run_config=cfg)
        run_experiment(grid, cfg, tmp_path / name)
        return grid.rounds

    first = sampled_rounds(1, "a")
    assert len(first) == 6 and all(len(set(r)) == 2 for r in first)
    assert sampled_rounds(1, "b") == first
    assert sampled_rounds(2, "c") != first
