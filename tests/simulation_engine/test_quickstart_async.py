"""examples/quickstart-async through `flwr run` (simulation) on real Fashion-MNIST.

The same FedAvg-style ClientApp (returns its trained weights, no query handler, a CNN
with BatchNorm and its int64 ``num_batches_tracked``) is trained first with Flower's
FedAvg, then with GSGM, ASGD and FedBuff: only the ServerApp's strategy changes (run
config ``strategy``). Every run must end without a rejected reply or divergence
(the asynchronous ones with no ERROR line in their log: no node is sent a query it
cannot answer), above 70% accuracy (on the first EVAL_EXAMPLES test images), with positive BatchNorm
variances and an int64 ``num_batches_tracked`` in its model.pt.

One local SuperLink of the test's own (local_superlink.py: FLWR_HOME in a temporary
folder, runtime dependency installation off, stopped by its PID) serves the four runs.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
from pathlib import Path

import pytest
import torch

from tests.simulation_engine.local_superlink import local_superlink, write_flwr_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "quickstart-async"
NODES = 5
# A short budget: CLIENT_UPDATES client trainings of LOCAL_STEPS SGD steps (FedAvg:
# CLIENT_UPDATES / NODES rounds), evaluated at the start and at the end.
CLIENT_UPDATES = 80
LOCAL_STEPS = 10
EVAL_EXAMPLES = 1000


@pytest.fixture(scope="module")
def flwr_env(tmp_path_factory):
    """The environment for `flwr run` with a local SuperLink simulating NODES nodes."""
    home = tmp_path_factory.mktemp("flwr-home")
    write_flwr_config(home, NODES)
    with local_superlink(home) as env:
        yield env


def run_example(env: dict, strategy: str, out: Path) -> tuple[dict, str]:
    """`flwr run` of the example with ``strategy``; (result.json, the streamed log)."""
    config = (
        f'strategy="{strategy}" output-dir="{out}" client-updates={CLIENT_UPDATES} '
        f"local-steps={LOCAL_STEPS} eval-every={CLIENT_UPDATES} eval-examples={EVAL_EXAMPLES}"
    )
    proc = subprocess.run(
        ["flwr", "run", str(EXAMPLE), "local", "--stream", "--run-config", config],
        cwd=out.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    log = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, log
    assert (out / "result.json").is_file(), log  # written at the end of the ServerApp
    return json.loads((out / "result.json").read_text()), proc.stdout


# In this order: Flower's FedAvg first, then the asynchronous strategies.
@pytest.mark.parametrize("strategy", ["fedavg", "gsgm", "asgd", "fedbuff"])
def test_the_fedavg_client_app_trains_with_each_strategy(flwr_env, tmp_path, strategy):
    result, log = run_example(flwr_env, strategy, tmp_path / strategy)
    accuracy = {int(k): v for k, v in result["accuracy"].items()}
    print(f"{strategy}: accuracy {accuracy}")
    assert sorted(accuracy) == [0, CLIENT_UPDATES], accuracy
    assert accuracy[0] < 0.2  # the untrained CNN is near chance (10 classes)
    assert accuracy[CLIENT_UPDATES] > 0.70, accuracy
    if strategy == "fedavg":
        # Flower's FedAvg logs each round's replies: every node replied, none failed.
        rounds = re.findall(r"aggregate_train: Received (\d+) results and (\d+) failures", log)
        assert rounds == [(str(NODES), "0")] * (CLIENT_UPDATES // NODES), log[-3000:]
    else:
        # The ClientApp has no query handler, and no node is asked one (issue 24 item 2):
        # no ERROR line, where each query used to log a traceback per node.
        assert not [line for line in log.splitlines() if "ERROR" in line], log[-3000:]
        assert "nodes keyed by node id" in log
        counters = result["counters"]
        assert counters["updates_received"] == CLIENT_UPDATES
        assert counters["rejected"] == 0 and counters["diverged"] == 0
        assert counters["error_replies"] == 0 and counters["nodes_lost"] == 0
        # The strategy's own result keeps the buffers' dtypes (FedAvg's: see server_app.py).
        assert result["dtypes"]["bn1.num_batches_tracked"] == "int64"
    state = torch.load(tmp_path / strategy / "model.pt")
    assert all(math.isfinite(float(t.float().abs().max())) for t in state.values())
    for layer in ("bn1", "bn2"):
        assert bool((state[f"{layer}.running_var"] > 0).all()), strategy
        tracked = state[f"{layer}.num_batches_tracked"]
        assert tracked.dtype == torch.int64 and tracked.shape == () and int(tracked) > 0
