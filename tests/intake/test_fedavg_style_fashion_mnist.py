"""A ClientApp written for FedAvg, on real Fashion-MNIST, with GSGM, ASGD and FedBuff.

The ClientApp is what a Flower quickstart has: a CNN with BatchNorm (buffers
``running_mean``, ``running_var`` and the 0-d int64 ``num_batches_tracked``), a
``@app.train()`` that loads the received ``state_dict``, trains a few local SGD
steps at its own learning rate and returns ``ArrayRecord(model.state_dict())`` with
``num-examples`` and ``train_loss``; no query handler, no protocol metadata. Only the
server side changes: ``client_mode="weights"`` (the server learning rate is then a
fraction of each node's displacement, whatever the client's own learning rate). Run on the in-process grid (the ``flwr run`` version is the example
app's test).
"""

from __future__ import annotations

import itertools
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch.nn import functional as F

from clients.datasets import load_dataset

# The CNN of the example app (examples/quickstart-async), the model a user brings.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "quickstart-async"))
from quickstart_async.task import Net  # noqa: E402

from flwr_gsgm.config import outputs as run_outputs
from flwr_gsgm.simulation.inprocess_grid import InProcessGrid
from flwr_gsgm.simulation.virtual_clock import VirtualClock
from flwr_gsgm.strategy.strategies import ASGD, GSGM, FedBuff

DATA_ROOT = "/usr/share/datasets/fashion-mnist"
NUM_NODES = 5
PER_NODE = 2000  # training images per node (IID shards)
LOCAL_LR = 0.05  # the client's own learning rate: it ignores the one the server sends
LOCAL_STEPS = 5
BATCH = 32


# Loaded once, before the grid's worker threads start: the app itself holds no cache.
TRAIN, TEST = load_dataset("fashion-mnist", DATA_ROOT)
SHARDS = torch.randperm(len(TRAIN), generator=torch.Generator().manual_seed(0))[
    : NUM_NODES * PER_NODE
].reshape(NUM_NODES, PER_NODE)
EVAL_ROWS = torch.arange(2000)


def fedavg_client_app() -> ClientApp:
    app = ClientApp()
    counter = itertools.count()
    lock = threading.Lock()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        with lock:
            seed = 1000 * pid + next(counter)
        model = Net()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        model.train()
        optim = torch.optim.SGD(model.parameters(), lr=LOCAL_LR)
        gen = torch.Generator().manual_seed(seed)
        rows = SHARDS[pid]
        losses = []
        for _ in range(LOCAL_STEPS):
            batch = rows[torch.randint(len(rows), (BATCH,), generator=gen)]
            loss = F.cross_entropy(model(TRAIN.images[batch]), TRAIN.labels[batch])
            optim.zero_grad()
            loss.backward()
            optim.step()
            losses.append(loss.item())
        metrics = MetricRecord({"train_loss": float(np.mean(losses)), "num-examples": BATCH})
        content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
        return Message(content, reply_to=msg)

    return app


def accuracy(arrays: ArrayRecord) -> float:
    model = Net()
    model.load_state_dict(arrays.to_torch_state_dict(), strict=True)
    model.eval()
    with torch.no_grad():
        logits = model(TEST.images[EVAL_ROWS])
    return float((logits.argmax(1) == TEST.labels[EVAL_ROWS]).float().mean())


STRATEGIES = {
    # ASGD at eta = 1.0: each arrival applies the node's whole displacement; FedBuff and
    # GSGM keep their displacement-mode defaults (0.5 of the mean displacement of K = 5
    # arrivals; 0.5 per cycle). local-lr is left at its default, 0.05: the server
    # learning rate does not depend on it.
    "gsgm": lambda: GSGM(client_mode="weights", virtual_clock=VirtualClock()),
    "asgd": lambda: ASGD(
        server_learning_rate=1.0, client_mode="weights", virtual_clock=VirtualClock()
    ),
    "fedbuff": lambda: FedBuff(client_mode="weights", virtual_clock=VirtualClock()),
}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_fedavg_client_app_with_batchnorm_trains_asynchronously(name, tmp_path):
    torch.manual_seed(0)
    initial = ArrayRecord(Net().state_dict())  # with int64 num_batches_tracked
    assert initial["bn1.num_batches_tracked"].numpy().dtype == np.int64
    with InProcessGrid(fedavg_client_app(), NUM_NODES, run_config={}, workers=2) as grid:
        result = STRATEGIES[name]().start(grid, initial, max_updates=200, eval_every=200)
    report = result.report
    assert report.rejections == {}
    assert report.counters["diverged"] == 0
    assert report.counters["updates_received"] == 200
    saved = np.load(run_outputs.write_model(tmp_path, result.arrays), allow_pickle=False)
    state = dict(saved)  # model.npz: the arrays by key, in order
    for layer in ("bn1", "bn2"):
        assert bool((state[f"{layer}.running_var"] > 0).all()), state[f"{layer}.running_var"]
        count = state[f"{layer}.num_batches_tracked"]
        assert count.dtype == np.int64 and count.shape == ()
        # Every reply adds LOCAL_STEPS to the count it was sent; the latest one is kept.
        assert int(count) >= LOCAL_STEPS and int(count) % LOCAL_STEPS == 0
    assert list(state) == list(initial.keys())  # the buffers are in model.npz
    pt = torch.load(run_outputs.write_model(tmp_path, result.arrays, "model.pt"))
    assert list(pt) == list(state) and all(np.array_equal(pt[k].numpy(), state[k]) for k in pt)
    acc = accuracy(result.arrays)
    print(f"{name}: accuracy {acc:.3f} after 200 updates")
    assert acc > 0.70, acc
