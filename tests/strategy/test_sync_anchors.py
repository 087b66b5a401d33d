"""The synchronous time-budget anchors: time-budget FedAvg's step assignment, FedNova's
normalised averaging, both on the in-process grid, and both in the app's runner."""

from __future__ import annotations

import csv
import logging

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flwr_gsgm.simulation.inprocess_grid import InProcessGrid
from flwr_gsgm.strategy.fednova import FedNova, fednova_aggregate, normalising_steps
from flwr_gsgm.strategy.time_budget_fedavg import TimeBudgetFedAvg
from tests.engine.quadratic_app import answer_query

#: Seconds per step of partitions 0, 1, 2 (partition 2 slows to 0.8 s from round 2 on).
SECONDS_PER_STEP = (0.1, 0.2, 0.4)
#: Partition p pulls the 1-vector "w" toward TARGET[p] (weights mode, lr 0.5).
TARGET = (1.0, 2.0, 4.0)


def weights_app(
    received: list[tuple[int, int, int]], honours: bool = True, slows: bool = False
) -> ClientApp:
    """Weights mode on 0.5 * (w - TARGET[p])^2: ``local-steps`` SGD steps at lr 0.5
    (5 if it does not honour them), reporting num-examples = p + 1, ``train-steps`` and
    ``train-seconds`` = steps x the partition's seconds per step."""
    app = ClientApp()

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        return answer_query(msg, context)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        config = msg.content["config"]
        asked = int(config["local-steps"])
        received.append((int(config["server-round"]), pid, asked))
        assert config["local-epochs"] == 0
        steps = asked if honours else 5
        (w,) = msg.content["arrays"].to_numpy_ndarrays()
        for _ in range(steps):
            w = w - np.float32(0.5) * (w - np.float32(TARGET[pid]))
        speed = SECONDS_PER_STEP[pid]
        if slows and pid == 2 and int(config["server-round"]) >= 2:
            speed = 0.8
        metrics = {
            "num-examples": pid + 1,
            "partition-id": pid,
            "train-steps": steps,
            "train-seconds": steps * speed,
        }
        content = {"arrays": ArrayRecord({"w": Array(w)}), "metrics": MetricRecord(metrics)}
        return Message(RecordDict(content), reply_to=msg)

    return app


def start(strategy, app: ClientApp, rounds: int):
    grid = InProcessGrid(app, 3, run_config={})
    initial = ArrayRecord({"w": Array(np.zeros(1, np.float32))})
    config = ConfigRecord({"local-steps": 20, "local-epochs": 0})
    return strategy.start(grid, initial, num_rounds=rounds, train_config=config)


def by_round(received: list[tuple[int, int, int]]) -> dict[int, dict[int, int]]:
    out: dict[int, dict[int, int]] = {}
    for server_round, pid, steps in received:
        out.setdefault(server_round, {})[pid] = steps
    return out


# ----------------------------------------------------------------- time-budget FedAvg
def test_time_budget_fedavg_gives_each_node_the_median_nodes_time():
    received: list[tuple[int, int, int]] = []
    strategy = TimeBudgetFedAvg(min_available_nodes=3, fraction_evaluate=0.0)
    start(strategy, weights_app(received, slows=True), rounds=3)
    steps = by_round(received)
    # Round 1: the run's own 20 steps. Their times, 2, 4 and 8 s, make the target the
    # median, 4 s: round 2 asks 4 / 0.1 = 40, 4 / 0.2 = 20, 4 / 0.4 = 10 steps.
    assert steps[1] == {0: 20, 1: 20, 2: 20}
    assert steps[2] == {0: 40, 1: 20, 2: 10}
    # Partition 2 took 0.8 s per step in round 2: its average is 0.5 x 0.4 + 0.5 x 0.8
    # = 0.6 s; the own-work times are 2, 4 and 12 s, the median still 4 s, so it gets
    # round(4 / 0.6) = 7 steps (within [ceil(20 / 4), 20 x 4] = [5, 80]).
    assert steps[3] == {0: 40, 1: 20, 2: 7}
    assert strategy.work.describe() == "equal-time"


def test_time_budget_fedavg_averages_as_fedavg():
    received: list[tuple[int, int, int]] = []
    strategy = TimeBudgetFedAvg(min_available_nodes=3, fraction_evaluate=0.0)
    result = start(strategy, weights_app(received), rounds=2)
    # Round 1: 20 steps at lr 0.5 from w = 0 end at t (1 - 0.5^20) each; weighted by
    # num-examples 1, 2, 3: (1 + 2 x 2 + 3 x 4) / 6 x (1 - 0.5^20) = 17/6 x (1 - 2^-20).
    w1 = 17 / 6 * (1 - 0.5**20)
    # Round 2: 40, 20, 10 steps from w1: t + (w1 - t) 0.5^k.
    ends = [t + (w1 - t) * 0.5**k for t, k in zip(TARGET, (40, 20, 10))]
    w2 = (ends[0] + 2 * ends[1] + 3 * ends[2]) / 6
    assert float(result.arrays["w"].numpy()[0]) == pytest.approx(w2, rel=1e-6)


def test_a_client_that_ignores_local_steps_turns_scheduling_off_once(caplog):
    received: list[tuple[int, int, int]] = []
    strategy = TimeBudgetFedAvg(min_available_nodes=3, fraction_evaluate=0.0)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        result = start(strategy, weights_app(received, honours=False), rounds=3)
    steps = by_round(received)
    # Round 1 asks 20 steps and every node does 5: its own work is 5 steps, of 0.5, 1
    # and 2 s. Round 2 asks for the median's 1 s: 10, 5 and round(1 / 0.4) = 2 steps;
    # nodes 0 and 2 do 5 again: the first of them read turns scheduling off, and round 3
    # is the run's own work again.
    assert steps[1] == {0: 20, 1: 20, 2: 20}
    assert steps[2] == {0: 10, 1: 5, 2: 2}
    assert steps[3] == {0: 20, 1: 20, 2: 20}
    assert strategy.work.off_reason is not None
    assert "did 5 local steps where" in strategy.work.off_reason
    assert "its ClientApp ignores local-steps" in strategy.work.off_reason
    said = [r for r in caplog.records if "work scheduling off" in r.getMessage()]
    assert len(said) == 1
    assert result.arrays is not None


# --------------------------------------------------------------------------- FedNova
def test_normalising_steps_with_and_without_momentum():
    assert normalising_steps(8) == 8.0
    # rho = 0.5: counters 1, 1.5, 1.75 sum to 4.25 for 3 steps.
    assert normalising_steps(2, 0.5) == pytest.approx(2.5)
    assert normalising_steps(3, 0.5) == pytest.approx(4.25)
    with pytest.raises(ValueError, match="steps must be an integer >= 1, got 0"):
        normalising_steps(0)
    with pytest.raises(ValueError, match=r"local_momentum must be in \[0, 1\), got 1.0"):
        normalising_steps(3, 1.0)


def test_fednova_aggregation_by_hand():
    w = {"w": np.array([1.0, -2.0], np.float32)}
    # Node A: 2 steps, 10 examples, displacement (0.2, 0.4); node B: 8 steps, 30
    # examples, displacement (1.6, -0.8). p = 0.25, 0.75; tau_eff = 0.5 + 6 = 6.5;
    # sum p d / tau = 0.25 (0.1, 0.2) + 0.75 (0.2, -0.1) = (0.175, -0.025);
    # w' = w - 6.5 (0.175, -0.025) = (1 - 1.1375, -2 + 0.1625) = (-0.1375, -1.8375).
    a = {"w": np.array([0.8, -2.4], np.float32)}
    b = {"w": np.array([-0.6, -1.2], np.float32)}
    new = fednova_aggregate(w, [(a, 10, 2), (b, 30, 8)])
    assert new["w"].dtype == np.float32
    np.testing.assert_allclose(new["w"], [-0.1375, -1.8375], rtol=1e-6)
    # FedAvg would give 0.25 a + 0.75 b = (-0.25, -1.5): B's 8 steps pull it further.
    # With server learning rate 0.5 the step halves: w - 3.25 (0.175, -0.025).
    half = fednova_aggregate(w, [(a, 10, 2), (b, 30, 8)], server_learning_rate=0.5)
    np.testing.assert_allclose(half["w"], [1 - 0.56875, -2 + 0.08125], rtol=1e-6)
    # Local momentum 0.5: a_A = 2.5, a_B = (8 - 0.5 (1 - 0.5^8) / 0.5) / 0.5 = 14.0078125;
    # tau_eff = 0.25 x 2.5 + 0.75 x 14.0078125 = 11.130859375.
    a_b = (8 - (1 - 0.5**8)) / 0.5
    tau_eff = 0.25 * 2.5 + 0.75 * a_b
    step = 0.25 * np.array([0.2, 0.4]) / 2.5 + 0.75 * np.array([1.6, -0.8]) / a_b
    mom = fednova_aggregate(w, [(a, 10, 2), (b, 30, 8)], local_momentum=0.5)
    np.testing.assert_allclose(mom["w"], np.array([1.0, -2.0]) - tau_eff * step, rtol=1e-6)


def test_fednova_aggregation_refuses_what_it_cannot_average():
    w = {"w": np.zeros(2, np.float32)}
    with pytest.raises(ValueError, match="a reply's array 'w' has shape \\(3,\\); expected"):
        fednova_aggregate(w, [({"w": np.zeros(3, np.float32)}, 1, 1)])
    with pytest.raises(ValueError, match="a reply has no array 'w'"):
        fednova_aggregate(w, [({"v": np.zeros(2, np.float32)}, 1, 1)])
    with pytest.raises(ValueError, match="num-examples must be a finite number > 0"):
        fednova_aggregate(w, [({"w": np.zeros(2, np.float32)}, 0, 1)])
    with pytest.raises(ValueError, match="server_learning_rate must be > 0, got 0"):
        FedNova(server_learning_rate=0)


def test_fednova_on_the_in_process_grid_by_hand():
    received: list[tuple[int, int, int]] = []
    strategy = FedNova(min_available_nodes=3, fraction_evaluate=0.0)
    result = start(strategy, weights_app(received), rounds=2)
    steps = by_round(received)
    assert steps[2] == {0: 40, 1: 20, 2: 10}
    # Round 1: equal steps (20), so FedNova is FedAvg: w1 = 17/6 (1 - 2^-20).
    w1 = 17 / 6 * (1 - 0.5**20)
    # Round 2: d_i = (w1 - t_i)(1 - 0.5^k_i), p = 1/6, 2/6, 3/6, tau = 40, 20, 10.
    p = np.array([1, 2, 3]) / 6
    tau = np.array([40, 20, 10])
    d = np.array([(w1 - t) * (1 - 0.5**k) for t, k in zip(TARGET, tau)])
    w2 = w1 - (p @ tau) * (p @ (d / tau))
    assert float(result.arrays["w"].numpy()[0]) == pytest.approx(w2, rel=1e-6)
    fedavg = w1 - p @ d
    assert abs(w2 - fedavg) > 0.1  # the normalisation matters here


# ------------------------------------------------------------------------ the runner
class StepsGrid(InProcessGrid):
    """Notes, per synchronous round, each partition's local-steps and virtual-train-seconds."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rounds: list[dict[int, tuple[int, int, float]]] = []

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        sent = {}
        for m in messages:
            if m.metadata.message_type == "train":
                config = m.content["config"]
                pid = int(self.contexts[m.metadata.dst_node_id].node_config["partition-id"])
                sent[pid] = (
                    int(config["local-steps"]),
                    int(config["local-epochs"]),
                    config.get("virtual-train-seconds"),
                )
        if sent:
            self.rounds.append(sent)
        return super().send_and_receive(messages, timeout=timeout)


@pytest.mark.parametrize("strategy", ["time-budget-fedavg", "fednova"])
def test_the_runner_times_each_round_by_the_steps_each_node_was_sent(tmp_path, strategy):
    from clients.client_app import app as client_app
    from flwr_gsgm.config.build import virtual_clock_from
    from serverapp.app_config import parse_app_config
    from serverapp.experiment import run_experiment

    cfg = parse_app_config(
        {
            "strategy": strategy,
            "max-updates": 12,
            "eval-every": 4,
            "eval-examples": 200,
            "classes-per-node": 5,
            "local-steps": 4,
            "slow-fraction": 0.25,
            "slow-factor": 4.0,
            "jitter": 0.0,
        }
    )
    grid = StepsGrid(client_app, 4, run_config=cfg)
    summary = run_experiment(grid, cfg, tmp_path / "run")
    clock = virtual_clock_from(cfg)
    speeds = clock.speed_factors([0, 1, 2, 3])
    (slow,) = [p for p, f in speeds.items() if f == 4.0]
    assert len(grid.rounds) == 3
    # Round 1: the run's 4 steps. Then the fast nodes take 4 s, the slow one 16 s: the
    # median, 4 s, keeps 4 steps for the fast ones and gives the slow one round(4 / 4)
    # = 1 step (= ceil(4 / 4), the least it may get).
    assert {p: s for p, (s, _, _) in grid.rounds[0].items()} == {0: 4, 1: 4, 2: 4, 3: 4}
    for sent in grid.rounds[1:]:
        assert {p: s for p, (s, _, _) in sent.items()} == {
            p: 1 if p == slow else 4 for p in range(4)
        }
    for r, sent in enumerate(grid.rounds):
        for p, (steps, epochs, train_seconds) in sent.items():
            assert epochs == 0
            assert train_seconds == clock.compute_seconds(speeds[p], p, r, steps)
    with open(tmp_path / "run" / "metrics.csv") as fh:
        rows = list(csv.DictReader(fh))
    # uniform profile, 1 s per step, no jitter: round 1 lasts 16 s, rounds 2-3 4 s each.
    assert [float(r["virtual_time"]) for r in rows] == [0.0, 16.0, 20.0, 24.0]
    # summary.json: each node (named by node id, partition + 1 here) at its measured
    # seconds per step (1 s, the slow one 4 s) and the steps of its last round.
    assert summary["work_scheduling"] == {
        "state": "equal-time",
        "nodes": {
            f"node {p + 1}": {
                "seconds_per_step": 4.0 if p == slow else 1.0,
                "local_steps_sent": 1 if p == slow else 4,
            }
            for p in range(4)
        },
    }
    assert summary["updates_received"] == 12
