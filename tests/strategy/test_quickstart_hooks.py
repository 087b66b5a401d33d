"""examples/quickstart-async's ServerApp with its hooks, on the in-process grid.

The example shows ``train_config_fn`` (the client lr halved after ``lr-halve-after``
updates) and ``on_evaluate`` (each evaluation logged, the best model written as
``best_model.pt``); the ``flwr run`` version of the example is
tests/simulation_engine/test_quickstart_async.py. A tiny budget on 2 nodes.
"""

from __future__ import annotations

import json
import sys
import tomllib
from collections import Counter
from pathlib import Path

import pytest
import torch
from flwr.app import Context, Message, RecordDict

from flwr_gsgm.simulation.inprocess_grid import InProcessGrid

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "quickstart-async"
sys.path.insert(0, str(EXAMPLE))
from quickstart_async import client_app, server_app  # noqa: E402

DATA_ROOT = Path("/usr/share/datasets/fashion-mnist")
pytestmark = pytest.mark.skipif(not DATA_ROOT.is_dir(), reason="Fashion-MNIST not installed")


def run_config(out: Path, **changes) -> dict:
    """The example's run config (its pyproject.toml) with ``changes`` (keys with ``_``)."""
    config = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    config = dict(config["config"])
    config.update({k.replace("_", "-"): v for k, v in changes.items()})
    config["output-dir"] = str(out)
    return config


def test_the_example_halves_the_lr_and_keeps_the_best_model(tmp_path):
    lrs: list[float] = []

    def recording(msg: Message, context: Context) -> Message:
        if msg.metadata.message_type == "train":
            lrs.append(float(msg.content["config"]["lr"]))
        return client_app.app(msg, context)

    cfg = run_config(
        tmp_path,
        strategy="asgd",
        client_updates=6,
        eval_every=3,
        eval_examples=200,
        local_steps=2,
        lr_halve_after=2,
    )
    grid = InProcessGrid(recording, 2, run_config=cfg)
    server_app.main(
        grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=cfg)
    )
    # 6 train messages: the two first and the one after update 1 at lr 0.1, those
    # after updates 2, 3 and 4 at 0.05 (received + in flight < 6 bounds the rest).
    assert Counter(lrs) == {0.1: 3, 0.05: 3}
    result = json.loads((tmp_path / "result.json").read_text())
    accuracy = {int(k): v for k, v in result["accuracy"].items()}
    assert sorted(accuracy) == [0, 3, 6]
    best = max(accuracy, key=lambda k: (accuracy[k], -k))  # the first of the best
    assert result["best"] == {"updates": best, "accuracy": accuracy[best]}
    state = torch.load(tmp_path / "best_model.pt")
    assert set(state) == set(torch.load(tmp_path / "model.pt"))


def test_without_a_schedule_every_message_carries_the_run_configs_lr(tmp_path):
    # lr-halve-after = 0 (the default): no train_config_fn; the ClientApp uses its
    # run config's lr, as before the example had the hook.
    lrs: list[object] = []

    def recording(msg: Message, context: Context) -> Message:
        if msg.metadata.message_type == "train":
            lrs.append(msg.content["config"].get("lr"))
        return client_app.app(msg, context)

    cfg = run_config(
        tmp_path, strategy="asgd", client_updates=2, eval_every=2, eval_examples=100, local_steps=1
    )
    assert cfg["lr-halve-after"] == 0
    grid = InProcessGrid(recording, 2, run_config=cfg)
    server_app.main(
        grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=cfg)
    )
    assert lrs == [None, None]
