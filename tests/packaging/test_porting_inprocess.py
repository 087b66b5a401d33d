"""docs/PORTING.md, "On the in-process grid": its block runs as written from an app's
folder (a small app of quickstart-pytorch's layout: ``pytorchexample.client_app`` and
``pytorchexample.server_app``, the run config in ``pyproject.toml``)."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PORTING = (ROOT / "docs" / "PORTING.md").read_text()

PYPROJECT = """\
[tool.flwr.app.config]
num-server-rounds = 2
learning-rate = 0.1
"""

CLIENT_APP = """
import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()
seen = []  # (partition-id, num-partitions, lr) of every train message


@app.train()
def train(msg, context):
    pid, parts = context.node_config["partition-id"], context.node_config["num-partitions"]
    lr = msg.content["config"]["lr"]
    seen.append((pid, parts, lr))
    w = msg.content["arrays"]["w"].numpy() * np.float32(1 - lr)  # a step towards 0
    content = RecordDict(
        {"arrays": ArrayRecord({"w": Array(w)}), "metrics": MetricRecord({"num-examples": 5})}
    )
    return Message(content, reply_to=msg)
"""

SERVER_APP = """
import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord
from flwr.serverapp import ServerApp
from flwr_gsgm import GSGM

app = ServerApp()
results = []


@app.main()
def main(grid, context):
    nodes = len(list(grid.get_node_ids()))
    strategy = GSGM(client_mode="weights")
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord({"w": Array(np.ones(3, np.float32))}),
        train_config=ConfigRecord({"lr": context.run_config["learning-rate"]}),
        max_updates=context.run_config["num-server-rounds"] * nodes,
    )
    results.append(result)
"""


def in_process_block() -> str:
    """The Python block of PORTING.md's "On the in-process grid" section."""
    section = PORTING.split("### On the in-process grid", 1)[1].split("\n#", 1)[0]
    (block,) = re.findall(r"^```python\n(.*?)^```", section, re.S | re.M)
    return block


def test_the_in_process_block_runs_the_apps_serverapp(tmp_path, monkeypatch):
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    package = tmp_path / "pytorchexample"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "client_app.py").write_text(textwrap.dedent(CLIENT_APP))
    (package / "server_app.py").write_text(textwrap.dedent(SERVER_APP))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.split(".")[0] == "pytorchexample"]:
        monkeypatch.delitem(sys.modules, name)
    exec(in_process_block(), {})
    from pytorchexample import client_app, server_app

    # 10 nodes, 2 "rounds": 20 client trainings, each node as Flower's simulation names
    # it (partition-id of 10) and at the run config's lr, read from pyproject.toml.
    assert sorted(client_app.seen) == sorted((p, 10, 0.1) for p in range(10) for _ in range(2))
    (result,) = server_app.results
    assert result.report.counters["updates_received"] == 20
    for name in ("pytorchexample.client_app", "pytorchexample.server_app", "pytorchexample"):
        sys.modules.pop(name, None)  # another test's app of the same name imports afresh


def outputs_block() -> str:
    """The Python block of PORTING.md's "The result" section (metrics.csv, summary.json)."""
    section = PORTING.split("## The result", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"^```python\n(.*?)^```", section, re.S | re.M)
    return block


def test_the_outputs_block_writes_metrics_csv_and_summary_json(tmp_path, monkeypatch):
    # A ServerApp of the user's writes no output file; the block writes the two the
    # project's app writes, from an AsyncResult, with the wheel's functions.
    import json

    from flwr_gsgm import GSGM, InProcessGrid
    from tests.engine.quadratic_app import initial_arrays, make_app

    with InProcessGrid(make_app(), 3, run_config={}) as grid:
        result = GSGM().start(grid, initial_arrays(), max_updates=6, eval_every=3)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))  # the block writes under Path.home()
    exec(outputs_block(), {"result": result})
    run_dir = tmp_path / "gsgm-outputs" / "gsgm-run"
    lines = (run_dir / "metrics.csv").read_text().splitlines()
    assert lines[0] == (
        "updates,version,virtual_time,wall_time,accuracy,loss,staleness_mean,"
        "staleness_max,train_loss,deferred,rejected,dropped"
    )
    assert [line.split(",")[0] for line in lines[1:]] == ["0", "3", "6"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["evaluations"], summary["updates_received"]) == (
        "completed",
        3,
        6,
    )
