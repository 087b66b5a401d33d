"""Issue 35: what a run says is true. Rejections by reason in the end-of-run counters
and summary.json (item 3), the federated evaluation's metrics live to a hook (item 4),
every JSON file a run writes is strict JSON (item 5).

Node names (item 2) are asserted where each line is made:
tests/intake/test_fedavg_style_clients.py (a node without a partition-id),
tests/nodes/test_failing_nodes.py, tests/engine/test_run_status.py and
tests/nodes/test_node_share.py (per_node keys, exclusions, warnings).
"""

from __future__ import annotations

import io
import json
import logging
import math
import zipfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from clients.client_app import app as client_app
from flwr_gsgm.config import outputs as run_outputs
from flwr_gsgm.config.outputs import strict_json
from flwr_gsgm.engine.federated_evaluation import FederatedEvaluation
from flwr_gsgm.engine.run_end import RunFailed
from flwr_gsgm.simulation.inprocess_grid import InProcessGrid
from flwr_gsgm.simulation.virtual_clock import VirtualClock
from flwr_gsgm.strategy.strategies import ASGD
from serverapp.server_app import main as server_app_main
from tests.engine.quadratic_app import initial_arrays, make_app
from tests.engine.test_federated_evaluation import app_with_evaluate

EVEN = VirtualClock(seed=0, base_duration=1.0, slow_fraction=0.0, jitter=0.0)


def strict_loads(text: str):
    """``json.loads`` that refuses NaN, Infinity and -Infinity, as strict parsers do."""

    def refuse(constant: str):
        raise ValueError(f"not strict JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


# ------------------------------------------------------------------ item 3
def nan_on(calls: set[int]):
    """Misbehaviour: NaN weights on those train messages of the partition (1-based)."""
    seen: Counter[int] = Counter()

    def misbehave(pid, grad, metrics):
        seen[pid] += 1
        if seen[pid] in calls:
            return {"w": np.array([np.nan, 0.0], np.float32), "b": np.zeros(1, np.float32)}, metrics
        return grad, metrics

    return misbehave


def test_rejections_by_reason_are_in_the_end_of_run_line_and_in_summary_json(caplog, tmp_path):
    caplog.set_level(logging.INFO)
    grid = InProcessGrid(make_app(misbehave={1: nan_on({3, 5})}), 3, run_config={})
    result = ASGD(server_learning_rate=0.1, virtual_clock=EVEN).start(
        grid, initial_arrays(), max_updates=30
    )
    counters = result.report.counters
    assert list(counters)[:4] == [
        "updates_received",
        "updates_applied",
        "rejected",
        "rejected_by_reason",
    ]
    assert (counters["updates_received"], counters["updates_applied"]) == (30, 28)
    assert (counters["rejected"], counters["rejected_by_reason"]) == (2, {"non-finite": 2})
    (line,) = [
        r.getMessage()
        for r in caplog.records
        if r.getMessage().startswith("Asynchronous run finished:")
    ]
    assert line.startswith(
        "Asynchronous run finished: {'updates_received': 30, 'updates_applied': 28, "
        "'rejected': 2, 'rejected_by_reason': {'non-finite': 2}, "
    )
    rep = result.report
    summary = run_outputs.summarize(
        result.rows,
        rep.counters,
        rep.rejections,
        rep.staleness_mean,
        rep.staleness_max,
        rep.wall_seconds,
        rep.virtual_seconds,
        report=rep,
    )
    run_outputs.write_summary(tmp_path, summary)
    written = strict_loads((tmp_path / "summary.json").read_text())
    assert (written["updates_received"], written["updates_applied"]) == (30, 28)
    assert (written["rejected"], written["rejected_by_reason"]) == (2, {"non-finite": 2})
    assert written["per_node"]["node 2 (partition 1)"]["rejected"] == 2


# ------------------------------------------------------------------ item 4
def test_on_federated_evaluate_gets_each_aggregate_when_it_arrives():
    calls: list = []
    order: list[tuple[str, int]] = []
    seen: dict[int, dict] = {}

    def on_evaluate(updates, arrays, metrics):
        order.append(("on_evaluate", updates))

    def on_federated_evaluate(updates, metrics):
        order.append(("on_federated_evaluate", updates))
        seen[updates] = dict(metrics)
        metrics["score"] = -1.0  # a copy: the run's results keep theirs

    strategy = ASGD(
        server_learning_rate=0.1,
        virtual_clock=EVEN,
        federated_evaluation=FederatedEvaluation(every=10),
        on_evaluate=on_evaluate,
        on_federated_evaluate=on_federated_evaluate,
    )
    grid = InProcessGrid(app_with_evaluate(calls), 4, run_config={})
    result = strategy.start(grid, initial_arrays(), max_updates=40, eval_every=10)
    assert sorted(seen) == [10, 20, 30, 40]
    for updates, metrics in seen.items():
        assert metrics == dict(result.evaluate_metrics_clientapp[updates])
        # score p weighted by 10 (p + 1) over the 4 nodes: 200 / 100
        assert metrics["score"] == pytest.approx(2.0)
    # Live: the first aggregate came while the run was training, before its last
    # centralized evaluation (at 40 updates).
    assert order.index(("on_federated_evaluate", 10)) < order.index(("on_evaluate", 40))
    assert order[-1] == ("on_federated_evaluate", 40)


# ------------------------------------------------------------------ item 5
def test_the_results_records_hold_no_non_finite_metric():
    # Found by a port of advanced-pytorch: json.dump of train_metrics_clientapp wrote NaN
    # (the train loss at 0 updates). A metric without a value is left out instead.
    strategy = ASGD(server_learning_rate=0.1, virtual_clock=EVEN)
    grid = InProcessGrid(make_app(), 4, run_config={})
    result = strategy.start(grid, initial_arrays(), max_updates=8, eval_every=4)
    assert sorted(result.train_metrics_clientapp) == [0, 4, 8]
    assert dict(result.train_metrics_clientapp[0]) == {"staleness-mean": 0.0}
    assert set(result.train_metrics_clientapp[8]) == {"train-loss", "staleness-mean"}
    records = {
        kind: {step: dict(rec) for step, rec in getattr(result, kind).items()}
        for kind in ("train_metrics_clientapp", "evaluate_metrics_serverapp")
    }
    strict_loads(json.dumps(records))


def test_strict_json_writes_non_finite_numbers_as_null():
    value = {
        "nan": math.nan,
        "inf": [math.inf, -math.inf, np.float32("nan"), np.float64(0.5)],
        "n": np.int64(3),
        "ok": (1.5, True, None, "NaN"),
    }
    assert strict_json(value) == (
        '{"nan": null, "inf": [null, null, null, 0.5], "n": 3, "ok": [1.5, true, null, "NaN"]}'
    )
    with pytest.raises(TypeError):
        strict_json({"a": object()})


def json_texts(run_dir: Path) -> dict[str, str]:
    """Every JSON text of a run folder: its .json files and each checkpoint's state.json."""
    texts = {p.name: p.read_text() for p in sorted(run_dir.glob("*.json"))}
    for path in sorted(run_dir.glob("checkpoint*")):
        raw = path.read_bytes()
        archive = raw[: raw.rindex(b"\nflwr-gsgm-checkpoint")]  # the checksum line after it
        with zipfile.ZipFile(io.BytesIO(archive)) as zf:
            texts[f"{path.name}:state.json"] = zf.read("state.json").decode()
    return texts


def test_every_json_a_run_writes_is_strict_json_at_0_updates_and_after(tmp_path):
    # At 0 updates (every node fails at once): train_loss and MASD are NaN.
    def broken(msg, context):
        if msg.metadata.message_type == "train":
            raise RuntimeError("no GPU")
        return client_app(msg, context)

    common = {"eval-examples": 200, "output-dir": str(tmp_path), "checkpoint-every": 2}
    failed = {**common, "max-updates": 20, "max-node-failures": 1, "run-name": "zero"}

    class Failed:
        run_config = failed

    with pytest.raises(RunFailed):
        server_app_main(InProcessGrid(broken, 2, run_config=failed), Failed())
    done = {**common, "max-updates": 4, "eval-every": 2, "run-name": "four"}

    class Done:
        run_config = done

    server_app_main(InProcessGrid(client_app, 2, run_config=done), Done())
    zero, four = json_texts(tmp_path / "zero"), json_texts(tmp_path / "four")
    assert sorted(zero) == ["config.json", "summary.json"]
    assert sorted(four) == ["checkpoint.pt:state.json", "config.json", "summary.json"]
    for text in [*zero.values(), *four.values()]:
        strict_loads(text)  # raises on NaN / Infinity
    assert strict_loads(zero["summary.json"])["masd"] is None
    assert "nan" in (tmp_path / "zero" / "metrics.csv").read_text()  # train_loss at 0: NaN
    # The checkpoint keeps the NaN train loss of the row at 0 updates, tagged, and a
    # resume gets it back as NaN.
    assert '{"__float__":"nan"}' in four["checkpoint.pt:state.json"]


# ------------------------------------------------------------------ the progress line
@pytest.mark.parametrize("clock", [EVEN, None])
def test_the_progress_line_shows_a_virtual_time_only_under_a_virtual_clock(caplog, clock):
    caplog.set_level(logging.INFO)
    grid = InProcessGrid(make_app(), 2, run_config={})
    ASGD(server_learning_rate=0.1, virtual_clock=clock).start(
        grid, initial_arrays(), max_updates=4, eval_every=2
    )
    lines = [r.getMessage() for r in caplog.records if "[async] updates " in r.getMessage()]
    assert [line.split(" | ")[0] for line in lines] == [
        "[async] updates 0/4",
        "[async] updates 2/4",
        "[async] updates 4/4",
    ]
    # under the virtual clock: "| vtime 2.0 s | wall ..."; under the wall clock the row's
    # virtual time is the wall time, so the line shows "| wall ..." alone
    fields = [line.split(" | ")[2].split(" ")[0] for line in lines]
    assert fields == (["vtime"] * 3 if clock is not None else ["wall"] * 3)
