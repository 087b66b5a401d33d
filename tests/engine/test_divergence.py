"""Issue 22 item 3 and issue 23 items 1-2: one notion of divergence, and runs that say so.

A run whose model diverged ends with status "diverged" and its reason (summary.json,
the last log line), raises RunDiverged, writes model_last_finite.pt rather than
model.pt, and its drivers exit non-zero; the norm bound checks every reply from the
first, and every node over the bound at once is a divergence, not the nodes' fault.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import MetricRecord

from clients.client_app import app as client_app
from clients.models import build_model
from flwr_gsgm.core import UpdateRejected
from flwr_gsgm.engine import divergence
from flwr_gsgm.engine.divergence import DivergenceWatch, evaluation_divergence
from flwr_gsgm.engine.run_end import RunDiverged, RunFailed
from flwr_gsgm.intake.norm_bound import RelativeNormBound, initial_scale
from flwr_gsgm.simulation.inprocess_grid import InProcessGrid
from flwr_gsgm.simulation.virtual_clock import VirtualClock
from flwr_gsgm.strategy.strategies import ASGD, GSGM
from serverapp.app_config import parse_app_config
from serverapp.experiment import run_experiment
from serverapp.server_app import END_MARKER
from serverapp.server_app import main as server_app_main
from simulations import worker
from simulations.results import run_row
from tests.engine.quadratic_app import initial_arrays, make_app

EVEN = VirtualClock(seed=0, base_duration=1.0, slow_fraction=0.0, jitter=0.0)
REJECTED = (
    "replies rejected: 10 of the last 20 updates received were rejected (non-finite or "
    "norm-ratio), the latest of every node that replied among them too (partitions "
    "[0, 1, 2]): the model moved away from every node's updates (too large a learning "
    "rate?); no node is blamed"
)


# ------------------------------------------------------------------ the criteria
def test_the_evaluation_criteria_by_hand():
    ones = [np.ones(2, np.float32)]
    assert divergence.LOSS_GROWTH == 10.0
    # 10 x the initial 2.0 is 20.0: at it, not above, the run goes on.
    assert evaluation_divergence(5, ones, 20.0, 2.0) is None
    assert evaluation_divergence(5, ones, 20.5, 2.0) == (
        "exploding test loss: 20.5 at 5 updates exceeds 10 x the initial evaluation's loss 2"
    )
    assert evaluation_divergence(5, ones, math.nan, 2.0) == "non-finite test loss: nan at 5 updates"
    assert (
        evaluation_divergence(5, ones, math.inf, None) == "non-finite test loss: inf at 5 updates"
    )
    assert evaluation_divergence(5, [np.array([1.0, np.inf])], 1.0, 2.0) == (
        "non-finite weights: the global model holds NaN or inf at 5 updates"
    )
    # No loss, or an initial loss that is no scale (0, NaN): check 3 is off.
    assert evaluation_divergence(5, ones, None, 2.0) is None
    assert evaluation_divergence(5, ones, 1e9, 0.0) is None
    assert evaluation_divergence(5, ones, 1e9, math.nan) is None


def test_the_rejection_window_by_hand():
    watch = DivergenceWatch()
    for k in range(12):  # 12 accepted, round robin over partitions 0, 1, 2
        assert watch.reply(k % 3, None, [0, 1, 2]) is None
    # Then every reply is rejected: the window of 20 holds 12 - (k - 8) accepted and k
    # rejected; at the 10th rejection half of it is, and each node's latest too.
    for k in range(9):
        assert watch.reply(k % 3, "norm-ratio" if k % 2 else "non-finite", [0, 1, 2]) is None
    assert watch.reply(0, "norm-ratio", [0, 1, 2]) == REJECTED
    # A rejection for another reason (the protocol) is no sign of divergence.
    other = DivergenceWatch()
    for k in range(20):
        assert other.reply(k % 3, "metadata", [0, 1, 2]) is None


def test_one_bad_node_among_honest_ones_is_no_divergence():
    # Partition 2 is rejected every time; 0 and 1 are accepted: 1 in 3 of the window,
    # and the honest nodes' latest replies pass.
    watch = DivergenceWatch()
    for k in range(60):
        pid = k % 3
        assert watch.reply(pid, "norm-ratio" if pid == 2 else None, [0, 1, 2]) is None
    # Two of three bad: 2 in 3 of the window, but partition 0's latest passes.
    for k in range(60):
        pid = k % 3
        assert watch.reply(pid, None if pid == 0 else "non-finite", [0, 1, 2]) is None


def test_a_lone_node_diverges_at_its_tenth_rejection_before_its_exclusion():
    watch = DivergenceWatch()
    assert watch.reply(0, None, [0]) is None
    for _ in range(9):
        assert watch.reply(0, "norm-ratio", [0]) is None
    assert watch.reply(0, "norm-ratio", [0]).startswith(
        "replies rejected: 10 of the last 11 updates received"
    )


# --------------------------------------------------- the norm bound's warm-up
def update(norm: float) -> list[np.ndarray]:
    """A two-array update of L2 norm ``norm`` (0.6 and 0.8 of it: a 3-4-5 triangle)."""
    return [np.array([norm * 0.6, 0.0], np.float32), np.array([norm * 0.8], np.float32)]


def test_the_warm_up_checks_every_reply_by_hand():
    # The quadratic model starts at zero: its scale is sqrt(3), that of three ones.
    scale = initial_scale([np.zeros(2, np.float32), np.zeros(1, np.float32)])
    assert scale == pytest.approx(math.sqrt(3))
    bound = RelativeNormBound(10.0, scale)
    poisoned = [np.full(2, 1e6, np.float32), np.full(1, 1e6, np.float32)]  # norm 1e6 sqrt(3)
    with pytest.raises(UpdateRejected) as err:
        bound.check(0, poisoned)
    assert (err.value.reason, err.value.message) == (
        "norm-ratio",
        "update L2 norm 1.73205e+06 exceeds 1000 x the initial model's scale 1.73205 (the "
        "warm-up: fewer than 10 accepted updates in the run)",
    )
    assert bound.check(0, update(1732.0)) == pytest.approx(1732.0)  # within 1000 x 1.73205
    bound.accept(0, bound.check(0, update(1.0)))  # the first accepted: norm 1
    # The next ones: within 10 (NEW_NODE_ROOM) x 10 (ratio) x the median 1 = 100.
    assert bound.check(1, update(100.0)) == pytest.approx(100.0)
    with pytest.raises(UpdateRejected) as err:
        bound.check(1, update(100.5))
    assert err.value.message == (
        "update L2 norm 100.5 exceeds 10 x max-norm-ratio=10 x the median norm 1 of the last 1 "
        "accepted updates (the warm-up: fewer than 10 accepted updates in the run)"
    )


def test_the_cnn_scale_and_a_poisoned_first_reply():
    # The project's CNN: 184586 trainable weights of norm 8.87 at seed 0, so its scale
    # is sqrt(184586) = 429.63, and the warm-up bound 1000 x that = 4.2963e5.
    torch.manual_seed(0)
    params = [p.detach().numpy() for p in build_model("fashion-mnist").parameters()]
    assert sum(p.size for p in params) == 184586
    assert initial_scale(params) == pytest.approx(math.sqrt(184586))
    bound = RelativeNormBound(10.0, initial_scale(params))
    with pytest.raises(UpdateRejected):
        bound.check(0, [np.full_like(p, 1e6) for p in params])  # norm 1e6 x 429.63


def test_honest_first_replies_of_the_cnn_pass(tmp_path):
    # GSGM defaults, 3 nodes, through the warm-up (10) and beyond: nothing rejected.
    cfg = parse_app_config(
        {
            "max-updates": 15,
            "eval-every": 15,
            "eval-examples": 100,
            "output-dir": str(tmp_path),
            "run-name": "honest",
        }
    )
    summary = run_experiment(InProcessGrid(client_app, 3, cfg), cfg)
    assert (summary["status"], summary["rejected"], summary["updates_received"]) == (
        "completed",
        0,
        15,
    )


def poison_first_reply(pid, grad, metrics, seen: Counter):
    seen[pid] += 1
    if seen[pid] == 1:
        grad = {k: np.full_like(v, 1e6) for k, v in grad.items()}
    return grad, metrics


def test_a_poisoned_first_reply_is_rejected_and_the_run_completes(caplog):
    # Issue 23 item 1: 3 nodes, GSGM defaults, partition 1's first reply holds 1e6 in
    # every element. Before: applied, the model went to |w| ~ 3e4, every honest reply was
    # then far above the median and the run failed with every node excluded.
    seen: Counter[int] = Counter()
    app = make_app(misbehave={1: lambda *a: poison_first_reply(*a, seen=seen)})
    result = GSGM(virtual_clock=EVEN).start(
        InProcessGrid(app, 3, run_config={}), initial_arrays(), max_updates=300
    )
    rep = result.report
    assert rep.status == "completed" and rep.status_reason == ""
    assert rep.rejections == {"norm-ratio": 1}
    assert (rep.counters["updates_received"], rep.counters["nodes_excluded"]) == (300, 0)
    (line,) = [r.getMessage() for r in caplog.records if "(norm-ratio)" in r.getMessage()]
    assert line == (
        "[async] rejected update from node 2 (partition 1) (norm-ratio): update L2 norm 1.73205e+06 "
        "exceeds 1000 x the initial model's scale 1.73205 (the warm-up: fewer than 10 "
        "accepted updates in the run)"
    )
    # The optimum of the quadratic: the mean of the three targets and b = 0.5.
    w, b = (a.numpy() for a in result.arrays.values())
    np.testing.assert_allclose(w, [2 / 3, 2 / 3], atol=1e-3)
    np.testing.assert_allclose(b, [0.5], atol=1e-3)


# ------------------------------------------- every node over the bound at once
def scaled_from_call(first: int, factor: float):
    """Misbehaviour: from the node's ``first``-th train call on, ``factor`` x its gradient."""
    seen: Counter[int] = Counter()

    def misbehave(pid, grad, metrics):
        seen[pid] += 1
        if seen[pid] >= first:
            grad = {k: v * np.float32(factor) for k, v in grad.items()}
        return grad, metrics

    return misbehave


def test_every_node_over_the_bound_is_a_divergence_not_their_exclusion():
    # 3 nodes in turn (even clock): calls 1-4 of each are honest (12 accepted), then
    # every reply is 1000 x its gradient, far above 10 x the median (each node has 4
    # accepted: no new-node room). The window of the last 20 holds 10 accepted and 10
    # rejected at update 22: diverged, each node 3 or 4 rejections in a row, none
    # excluded. Before: each was excluded at its 10th rejection in a row, and the run
    # "failed: no node left to train ... norm-ratio".
    misbehave = scaled_from_call(5, 1000.0)
    grid = InProcessGrid(make_app(misbehave={p: misbehave for p in range(3)}), 3, run_config={})
    with pytest.raises(RunDiverged) as err:
        ASGD(server_learning_rate=0.1, virtual_clock=EVEN).start(
            grid, initial_arrays(), max_updates=300
        )
    rep = err.value.result.report
    assert err.value.reason == rep.status_reason == REJECTED
    assert isinstance(err.value, RunFailed) and rep.status == "diverged"
    assert str(err.value) == f"the run diverged: {REJECTED}"
    assert rep.rejections == {"norm-ratio": 10}
    assert (rep.counters["updates_received"], rep.counters["nodes_excluded"]) == (22, 0)
    assert rep.counters["diverged"] == 1
    assert [n["state"] for n in rep.per_node.values()] == ["active"] * 3


def test_too_large_a_learning_rate_ends_diverged_not_failed():
    # ASGD with lr 3 on the quadratic: each step maps w - t to about -2 (w - t), so the
    # gradients double; past the warm-up every node's reply is over 10 x the median and
    # rejected. Before: all three excluded, "failed: no node left ... norm-ratio". Now:
    # diverged at the 10th rejection (every node's latest rejected by then), none excluded.
    grid = InProcessGrid(make_app(), 3, run_config={})
    with pytest.raises(RunDiverged) as err:
        ASGD(server_learning_rate=3.0, virtual_clock=EVEN).start(
            grid, initial_arrays(), max_updates=300
        )
    rep = err.value.result.report
    assert err.value.reason == REJECTED
    assert rep.rejections == {"norm-ratio": 10} and rep.counters["nodes_excluded"] == 0


# ----------------------------------------------- evaluations: loss and weights
def scripted_losses(losses):
    calls = iter(losses)

    def evaluate_fn(updates, arrays):
        return MetricRecord({"accuracy": 0.5, "loss": next(calls)})

    return evaluate_fn


def test_an_exploding_test_loss_stops_the_run_and_keeps_the_last_finite_model():
    # Evaluations at 0, 5 and 10 updates: losses 2, 20 (10 x 2: not above) and 20.5.
    grid = InProcessGrid(make_app(), 2, run_config={})
    with pytest.raises(RunDiverged) as err:
        ASGD(server_learning_rate=0.1, virtual_clock=EVEN).start(
            grid,
            initial_arrays(),
            max_updates=100,
            evaluate_fn=scripted_losses([2.0, 20.0, 20.5]),
            eval_every=5,
        )
    rep = err.value.result.report
    assert err.value.reason == (
        "exploding test loss: 20.5 at 10 updates exceeds 10 x the initial evaluation's loss 2"
    )
    assert [r["updates"] for r in rep.rows] == [0, 5, 10]  # no final evaluation after it
    assert rep.counters["updates_received"] == 10
    updates, model = rep.last_finite
    assert updates == 5 and list(model.keys()) == ["w", "b"]


def test_a_non_finite_test_loss_stops_the_run():
    grid = InProcessGrid(make_app(), 2, run_config={})
    with pytest.raises(RunDiverged) as err:
        ASGD(server_learning_rate=0.1, virtual_clock=EVEN).start(
            grid,
            initial_arrays(),
            max_updates=100,
            evaluate_fn=scripted_losses([2.0, math.nan]),
            eval_every=5,
        )
    assert err.value.reason == "non-finite test loss: nan at 5 updates"
    assert err.value.result.report.last_finite[0] == 0  # the initial model


# ----------------------------------- the outputs and the drivers' exit codes
def diverging_config(tmp_path: Path, **extra) -> dict:
    """ASGD with server lr 50 on the CNN: its test loss explodes within 10 updates."""
    return {
        "strategy": "asgd",
        "server-learning-rate": 50.0,
        "max-updates": 40,
        "eval-every": 10,
        "eval-examples": 200,
        "output-dir": str(tmp_path),
        "run-name": "diverging",
        **extra,
    }


def assert_diverged_outputs(run_dir: Path, reason: str) -> list[str]:
    """summary.json says diverged with ``reason``; no model.pt, the last finite one
    (the initial model's evaluation at 0 updates) as model_last_finite.pt; return the
    metrics.csv lines."""
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["status_reason"], summary["diverged"]) == (
        "diverged",
        reason,
        True,
    )
    assert not (run_dir / "model.pt").exists()
    saved = torch.load(run_dir / "model_last_finite.pt")
    torch.manual_seed(0)  # the initial model of seed 0
    initial = build_model("fashion-mnist").state_dict()
    assert all(torch.equal(saved[k], initial[k]) for k in initial)
    return (run_dir / "metrics.csv").read_text().splitlines()


def exploding(lines: list[str], at: int) -> str:
    """The reason for metrics.csv ``lines`` whose evaluation at ``at`` updates exploded."""
    loss = {int(r.split(",")[0]): float(r.split(",")[5]) for r in lines[1:]}
    assert loss[at] > 10 * loss[0]
    return (
        f"exploding test loss: {loss[at]:.6g} at {at} updates exceeds 10 x the initial "
        f"evaluation's loss {loss[0]:.6g}"
    )


def test_the_server_app_raises_and_logs_a_diverged_run(tmp_path, caplog):
    class Context:
        run_config = diverging_config(tmp_path)

    grid = InProcessGrid(client_app, 2, run_config=Context.run_config)
    with pytest.raises(RunDiverged) as err:
        server_app_main(grid, Context())
    run_dir = tmp_path / "diverging"
    lines = (run_dir / "metrics.csv").read_text().splitlines()
    assert [int(r.split(",")[0]) for r in lines[1:]] == [0, 10]
    assert err.value.reason == exploding(lines, 10)
    assert_diverged_outputs(run_dir, err.value.reason)
    last = caplog.records[-1].getMessage()
    assert last == f"{END_MARKER} diverged: {err.value.reason}"


def test_the_sweep_worker_exits_3_and_runs_csv_counts_a_diverged_run(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    spec = {"nodes": 2, "run_config": diverging_config(tmp_path)}
    (run_dir / "spec.json").write_text(json.dumps(spec))
    assert worker.main([str(run_dir)]) == worker.DIVERGED_EXIT == 3
    assert not (run_dir / "error.txt").exists()  # a result, not a crash
    lines = assert_diverged_outputs(
        run_dir, exploding((run_dir / "metrics.csv").read_text().splitlines(), 10)
    )
    reason = exploding(lines, 10)
    assert capsys.readouterr().out.splitlines()[-1] == f"[flwr-gsgm] run ended: diverged: {reason}"
    row = run_row(run_dir, {"run_id": "run"}, chance=0.1, margin=0.05, target=0.7)
    assert (row["status"], row["diverged_reason"], row["status_reason"]) == (
        "diverged",
        "exploding test loss",
        reason,
    )


def test_a_diverging_fedavgm_run_ends_diverged(tmp_path):
    # Flower's FedAvgM with server lr 100: 2 nodes a round, evaluations at rounds 0, 5
    # and 10 (0, 10 and 20 client trainings); the loss at 20 explodes.
    cfg = parse_app_config(
        diverging_config(tmp_path, strategy="fedavgm", **{"server-learning-rate": 100.0})
    )
    with pytest.raises(RunDiverged) as err:
        run_experiment(InProcessGrid(client_app, 2, cfg), cfg)
    run_dir = tmp_path / "diverging"
    lines = (run_dir / "metrics.csv").read_text().splitlines()
    assert [int(r.split(",")[0]) for r in lines[1:]] == [0, 10, 20]
    assert err.value.reason == exploding(lines, 20) and err.value.result is None
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["status_reason"]) == ("diverged", err.value.reason)
    assert summary["diverged"] is True and summary["updates_received"] == 20


def test_a_diverged_run_leaves_the_previous_checkpoint(tmp_path):
    # checkpoint-every 5: a checkpoint at 5 updates; the run diverges at 10 (scripted
    # loss) and does not overwrite it with the diverged model.
    from flwr_gsgm.checkpoint import files as checkpoint
    from flwr_gsgm.engine.settings import EngineSettings

    path = tmp_path / "checkpoint.pt"
    settings = EngineSettings(checkpoint_every=5, checkpoint_path=path)
    grid = InProcessGrid(make_app(), 2, run_config={})
    with pytest.raises(RunDiverged):
        ASGD(server_learning_rate=0.1, virtual_clock=EVEN, engine=settings).start(
            grid,
            initial_arrays(),
            max_updates=100,
            evaluate_fn=scripted_losses([2.0, 2.0, 30.0]),
            eval_every=5,
        )
    assert checkpoint.load(path)["received"] == 5
