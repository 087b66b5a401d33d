"""Issue 12, item 6: runs that end early and call it success, on the in-process grid.

A run waits out an outage of every node (back-off) and, for up to rejoin-timeout, nodes
that left; with no node left it fails with the reason (RunFailed, summary.json
"status"); one huge reply is rejected by the relative norm bound and blamed on its
node; per-node counts and warnings land in the report.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import Counter

import numpy as np
import pytest
from flwr.app import MetricRecord

from clients.client_app import app as client_app
from flwr_gsgm.core import UpdateRejected
from flwr_gsgm.engine.async_engine import EngineSettings
from flwr_gsgm.engine.run_end import RunFailed
from flwr_gsgm.intake.norm_bound import RelativeNormBound
from flwr_gsgm.simulation.inprocess_grid import InProcessGrid
from flwr_gsgm.simulation.virtual_clock import VirtualClock
from flwr_gsgm.strategy.strategies import ASGD, GSGM
from serverapp.server_app import main as server_app_main
from tests.engine.quadratic_app import initial_arrays, make_app

EVEN = VirtualClock(seed=0, base_duration=1.0, slow_fraction=0.0, jitter=0.0)


def failing_calls(calls: set[int]):
    """Misbehaviour: raise on the given train calls (1-based) of each partition."""
    seen: Counter[int] = Counter()

    def misbehave(pid, grad, metrics):
        seen[pid] += 1
        if seen[pid] in calls:
            raise RuntimeError(f"outage: call {seen[pid]} of partition {pid}")
        return grad, metrics

    return misbehave


def test_an_outage_of_every_node_at_once_is_waited_out():
    # 10 nodes, each failing its 2nd, 3rd and 4th train message at the same virtual
    # times: all back off together (nothing in flight: the virtual clock jumps to the
    # end of the back-offs), come back and the run reaches its budget.
    outage = failing_calls({2, 3, 4})
    grid = InProcessGrid(make_app(misbehave={p: outage for p in range(10)}), 10, run_config={})
    result = ASGD(server_learning_rate=0.1, virtual_clock=EVEN).start(
        grid, initial_arrays(), max_updates=200
    )
    c = result.report.counters
    assert result.report.status == "completed"
    assert c["updates_received"] == 200
    assert (c["error_replies"], c["node_backoffs"], c["nodes_excluded"]) == (30, 30, 0)
    # Failures at t = 2, 4 and 7; back-offs of 1, 2 and 4 s; training again from t = 11.
    assert result.report.virtual_seconds == 11 + 200 / 10 - 1


class VanishingGrid(InProcessGrid):
    """All nodes vanish at ``vanish()``; ``come_back()`` brings node 1 (partition 0)
    back under its old node id (a SuperNode restarted with the same key)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gone: dict[int, dict] = {}

    def vanish(self) -> None:
        for node_id, context in list(self.contexts.items()):
            self.gone[node_id] = dict(context.node_config)
            self.remove_node(node_id)

    def come_back(self) -> None:
        self.add_node(self.gone[1], node_id=1)


class OnLogLine(logging.Handler):
    """Calls ``action`` once, when the engine logs a line containing ``text``."""

    def __init__(self, text: str, action) -> None:
        super().__init__()
        self.text, self.action, self.done = text, action, False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.done and self.text in record.getMessage():
            self.done = True
            self.action()


def vanish_at(grid: VanishingGrid, step: int):
    def evaluate_fn(updates, arrays):
        if updates == step and not grid.gone:
            grid.vanish()
        return MetricRecord({"accuracy": 0.0, "loss": 0.0})

    return evaluate_fn


def deployment(**engine) -> ASGD:
    settings = EngineSettings(dispatch_timeout=0.2, node_refresh_interval=0.0, **engine)
    return ASGD(server_learning_rate=0.1, virtual_clock=None, engine=settings)


def test_nodes_that_left_are_waited_for_within_rejoin_timeout_then_the_run_fails(caplog):
    grid = VanishingGrid(make_app(), 2, run_config={})
    with pytest.raises(RunFailed) as err:
        deployment(rejoin_timeout=0.3).start(
            grid, initial_arrays(), max_updates=100, evaluate_fn=vanish_at(grid, 10), eval_every=10
        )
    report = err.value.result.report
    received = report.counters["updates_received"]
    assert err.value.reason == (
        f"no node left to train after {received} of 100 updates: node 1 lost (left the federation); "
        "node 2 lost (left the federation); none came back within rejoin-timeout=0.3 s"
    )
    assert report.status == "failed" and report.status_reason == err.value.reason
    assert report.counters["nodes_lost"] == 2 and report.counters["dispatch_timeouts"] == 2
    assert [n["state"] for n in report.per_node.values()] == ["lost", "lost"]
    messages = [r.getMessage() for r in caplog.records]
    assert (
        "[async] no node left to train; waiting up to rejoin-timeout=0.3 s for node 1, node 2 "
        "to come back"
    ) in messages


def test_a_node_back_within_rejoin_timeout_lets_the_run_complete():
    # Node 1 restarts as soon as the run starts waiting for the nodes that left.
    grid = VanishingGrid(make_app(), 2, run_config={})
    handler = OnLogLine("no node left to train; waiting", grid.come_back)
    logging.getLogger("flwr").addHandler(handler)
    try:
        result = deployment(rejoin_timeout=120.0).start(
            grid, initial_arrays(), max_updates=100, evaluate_fn=vanish_at(grid, 10), eval_every=10
        )
    finally:
        logging.getLogger("flwr").removeHandler(handler)
    assert handler.done
    c = result.report.counters
    assert result.report.status == "completed" and c["updates_received"] == 100
    assert (c["nodes_lost"], c["nodes_joined"]) == (2, 1)
    # Without a virtual clock the nodes are not queried: named by node id alone.
    assert result.report.per_node["node 1"]["state"] == "active"
    assert result.report.per_node["node 2"]["state"] == "lost"


def huge(pid, grad, metrics):
    return {"w": np.array([1e30, 0.0], np.float32), "b": np.zeros(1, np.float32)}, metrics


def scaled(pid, grad, metrics):
    return {k: v * np.float32(1e6) for k, v in grad.items()}, metrics


def nan(pid, grad, metrics):
    return {"w": np.array([np.nan, 0.0], np.float32), "b": np.zeros(1, np.float32)}, metrics


def once(bad, call: int):
    """Misbehaviour: ``bad`` on the ``call``-th train message of the partition only."""
    seen = Counter()

    def misbehave(pid, grad, metrics):
        seen[pid] += 1
        return bad(pid, grad, metrics) if seen[pid] == call else (grad, metrics)

    return misbehave


def run_with(bad, **engine):
    grid = InProcessGrid(make_app(misbehave={2: once(bad, 8)}), 3, run_config={})
    strategy = ASGD(server_learning_rate=0.1, virtual_clock=EVEN, engine=EngineSettings(**engine))
    return strategy.start(grid, initial_arrays(), max_updates=90)


@pytest.mark.parametrize("bad, norm, far", [(huge, "1e+30", 1e25), (scaled, "502584", 4.0)])
def test_one_huge_reply_is_rejected_blamed_on_its_node_and_the_run_goes_on(bad, norm, far, caplog):
    # Partition 2's 8th reply (update 22 or so, after the 10 of the warm-up) is 1e30,
    # or 1e6 times its gradient. GSGM-free ASGD, no max-norm: only the relative bound
    # (on by default, 10 x the running median) stands between it and the model.
    result = run_with(bad)
    rep = result.report
    assert rep.rejections == {"norm-ratio": 1}
    assert rep.per_node["node 3 (partition 2)"]["rejected"] == 1
    assert (
        rep.per_node["node 1 (partition 0)"]["rejected"]
        == rep.per_node["node 2 (partition 1)"]["rejected"]
        == 0
    )
    assert rep.status == "completed" and rep.counters["updates_received"] == 90
    assert rep.counters["diverged"] == 0
    (line,) = [r.getMessage() for r in caplog.records if "(norm-ratio)" in r.getMessage()]
    # Partition 2 had 7 accepted updates (t = 1..7), whose median is above the run's.
    assert line == (
        f"[async] rejected update from node 3 (partition 2) (norm-ratio): update L2 norm {norm} exceeds "
        "max-norm-ratio=10 x the median norm 0.756865 of this node's last 7 accepted updates"
    )
    # The model is bit for bit that of a run where the same reply was rejected otherwise.
    same = run_with(nan)
    assert same.report.rejections == {"non-finite": 1}
    for key in ("w", "b"):
        np.testing.assert_array_equal(result.arrays[key].numpy(), same.arrays[key].numpy())
    assert np.abs(result.arrays["w"].numpy()).max() < 3.0  # near the targets, |t| <= 2.3
    # Without the bound the one reply throws the model far off (1e30: to about -1e29).
    unbounded = run_with(bad, max_norm_ratio=None)
    assert unbounded.report.rejections == {}
    assert np.abs(unbounded.arrays["w"].numpy()).max() > far


def test_per_node_counts_and_a_warning_when_a_node_is_mostly_dropped_as_stale():
    # 4 nodes, one 10x slower; max-staleness 4: the slow node's updates arrive about
    # 30 versions late, so every one of them is dropped.
    clock = VirtualClock(seed=1, base_duration=1.0, slow_fraction=0.25, slow_factor=10.0, jitter=0)
    (slow,) = [p for p, f in clock.speed_factors(list(range(4))).items() if f > 1]
    grid = InProcessGrid(make_app(), 4, run_config={})
    result = ASGD(server_learning_rate=0.1, virtual_clock=clock, max_staleness=4).start(
        grid, initial_arrays(), max_updates=200
    )
    rep = result.report
    mine = rep.per_node[f"node {slow + 1} (partition {slow})"]
    assert mine["updates_received"] >= 4
    assert mine["updates_stale"] == mine["updates_received"]
    assert rep.warnings == [
        f"node {slow + 1} (partition {slow}): {mine['updates_stale']} of its {mine['updates_received']} updates "
        "were dropped as stale (max-staleness=4); the model is biased toward the other nodes "
        "(raise max-staleness)"
    ]
    for name in ("updates_received", "updates_applied", "updates_stale"):
        assert sum(n[name] for n in rep.per_node.values()) == rep.counters[name]
    assert [n["state"] for n in rep.per_node.values()] == ["active"] * 4


def test_a_warning_when_the_model_waits_on_a_silent_node():
    # GSGM with cycle-quorum 1.0 (deployment order): partition 0 does not answer, so no
    # cycle closes and the model stops changing while the others keep sending updates.
    # Partition 0 answers once the warning is logged (then the cycle closes).
    release = threading.Event()
    inner = make_app()

    def app(msg, context):
        if msg.metadata.message_type == "train" and context.node_config["partition-id"] == 0:
            release.wait()
        return inner(msg, context)

    handler = OnLogLine("warning: the model has not changed", release.set)
    logging.getLogger("flwr").addHandler(handler)
    try:
        grid = InProcessGrid(app, 3, run_config={}, workers=3)
        strategy = GSGM(server_learning_rate=0.1, cycle_quorum=1.0, virtual_clock=None)
        result = strategy.start(grid, initial_arrays(), max_updates=60)
        grid.close()
    finally:
        logging.getLogger("flwr").removeHandler(handler)
        release.set()
    assert handler.done
    # Each of partitions 1 and 2 steps the model with its first update (version 2); all
    # later ones wait in their slots for partition 0. 30 = 10 x 3 active nodes. The
    # model reaches version 2 at update 2, or at update 3 if partition 1's second reply
    # arrived before partition 2's first (arrival order: replies of worker threads).
    (warning,) = result.report.warnings
    since = int(re.search(r"silent since update (\d+) ", warning).group(1))
    assert since in (2, 3), warning
    assert warning == (
        "the model has not changed over 30 updates received (version 2): it waits on "
        f"node 1, silent since update {since} (lower cycle-quorum, set a cycle "
        "budget or a shorter dispatch-timeout)"
    )


def test_a_failed_run_writes_its_status_and_the_server_app_raises(tmp_path):
    # The project's ServerApp and ClientApp, every node failing: summary.json says
    # "failed" and why, and the ServerApp raises with the reason (flwr run: failed).
    def broken(msg, context):
        if msg.metadata.message_type == "train":
            raise RuntimeError("no GPU")
        return client_app(msg, context)

    class Context:
        run_config = {
            "max-updates": 20,
            "eval-examples": 200,
            "max-node-failures": 1,
            "output-dir": str(tmp_path),
            "run-name": "broken",
        }

    grid = InProcessGrid(broken, 2, run_config=Context.run_config)
    with pytest.raises(RunFailed) as err:
        server_app_main(grid, Context())
    summary = json.loads((tmp_path / "broken" / "summary.json").read_text())
    why = (
        "1 failures in a row (max-node-failures=1); last: error reply (code 2: the ClientApp "
        "raised an exception: RuntimeError: no GPU)"
    )
    assert summary["status"] == "failed"
    assert (
        summary["status_reason"]
        == err.value.reason
        == (
            f"no node left to train after 0 of 20 updates: node 1 (partition 0) excluded ({why}); "
            f"node 2 (partition 1) excluded ({why})"
        )
    )
    assert summary["nodes_excluded"] == 2 and summary["error_replies"] == 2
    assert summary["per_node"]["node 1 (partition 0)"]["state"] == "excluded"
    assert (tmp_path / "broken" / "metrics.csv").read_text().count("\n") == 2  # header + t=0


def update(norm: float) -> list[np.ndarray]:
    """A two-array update of L2 norm ``norm`` (0.6 and 0.8 of it: a 3-4-5 triangle)."""
    return [np.array([norm * 0.6, 0.0], np.float32), np.array([norm * 0.8], np.float32)]


def test_the_relative_norm_bound_by_hand():
    bound = RelativeNormBound(10.0)
    for norm in [1.0] * 7 + [12.0] * 3:  # the warm-up: 10 updates, within 100 x the median
        pid = 1 if norm == 12.0 else 0
        bound.accept(pid, bound.check(pid, update(norm)))
    # Partition 0 against the run's median (1): 10 passes, 10.5 does not.
    assert bound.check(0, update(10.0)) == pytest.approx(10.0)
    with pytest.raises(UpdateRejected) as err:
        bound.check(0, update(10.5))
    assert (err.value.reason, err.value.message) == (
        "norm-ratio",
        "update L2 norm 10.5 exceeds max-norm-ratio=10 x the median norm 1 of the last 10 "
        "accepted updates",
    )
    # Partition 1 (larger gradients: non-IID data) against its own median, 12.
    assert bound.check(1, update(100.0)) == pytest.approx(100.0)
    with pytest.raises(UpdateRejected) as err:
        bound.check(1, update(1e30))
    assert err.value.message == (
        "update L2 norm 1e+30 exceeds max-norm-ratio=10 x the median norm 12 of this node's "
        "last 3 accepted updates"
    )
    # A NaN is left to the rule's own non-finite check; the bound can be off.
    assert np.isnan(bound.check(0, [np.array([np.nan, 0.0], np.float32)]))
    assert RelativeNormBound(None).check(0, update(1e30)) == pytest.approx(1e30)


def test_a_new_or_returning_node_gets_ten_times_more_room():
    bound = RelativeNormBound(10.0)
    for _ in range(10):  # the warm-up, partition 0: run median 1
        bound.accept(0, bound.check(0, update(1.0)))
    # Partition 2 has no accepted update: 10 x 10 x 1 = 100 is its bound.
    assert bound.check(2, update(56.0)) == pytest.approx(56.0)
    with pytest.raises(UpdateRejected) as err:
        bound.check(2, update(100.5))
    assert err.value.message == (
        "update L2 norm 100.5 exceeds 10 x max-norm-ratio=10 x the median norm 1 of the last "
        "10 accepted updates (a node with fewer than 3 accepted updates)"
    )
    for norm in (2.0, 1.0, 1.0):  # three accepted: own median 1, the plain bound 10
        bound.accept(2, bound.check(2, update(norm)))
    with pytest.raises(UpdateRejected):
        bound.check(2, update(56.0))
    # Lost, it is new again when it comes back: 56 passes.
    bound.forget(2)
    assert bound.check(2, update(56.0)) == pytest.approx(56.0)


def test_a_failed_run_names_five_partitions_and_counts_the_rest():
    from types import SimpleNamespace

    from flwr_gsgm.engine.run_end import NAMED_IN_REASON, RunEnd

    why = "10 rejected updates in a row"
    nodes = {
        pid: SimpleNamespace(
            state="lost" if pid == 7 else "excluded",
            excluded="" if pid == 7 else why,
            name=f"node {pid + 1} (partition {pid})",
        )
        for pid in range(8)
    }
    nodes[7].may_return = False
    end = RunEnd(max_updates=50, rejoin_timeout=1.0, members=SimpleNamespace(nodes=nodes))
    assert end.nothing_in_flight(received=12) and end.failed
    assert NAMED_IN_REASON == 5
    assert end.reason == (
        "no node left to train after 12 of 50 updates: "
        + "; ".join(f"node {pid + 1} (partition {pid}) excluded ({why})" for pid in range(5))
        + "; 3 more nodes (2 excluded, 1 lost; each logged when it happened)"
    )
