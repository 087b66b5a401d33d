"""The ServerApp: Flower's FedAvg, or an asynchronous strategy of flwr-gsgm.

Run config ``strategy`` picks it; the ClientApp is the same for all of them. The
asynchronous run shows the strategy's two hooks for what a FedAvg subclass does: a
learning-rate schedule (``train_config_fn``, FedAvg's ``configure_train`` override;
run config ``lr-halve-after``) and a callback on each evaluation (``on_evaluate``:
logging, and the best model kept, written as ``best_model.pt``).
"""

from __future__ import annotations

from logging import INFO
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from flwr_gsgm import ASGD, GSGM, FedBuff
from flwr_gsgm.config.outputs import strict_json
from quickstart_async.task import Net, load_data, test

app = ServerApp()
ASYNC_STRATEGIES = {"gsgm": GSGM, "asgd": ASGD, "fedbuff": FedBuff}


#: The server's step, a fraction of each node's displacement w_sent - w_returned
#: (whatever the clients' lr). FedBuff: 1.0, a step is the mean displacement of K = 5
#: replies (a FedAvg round). ASGD: 0.3, each reply moves the model by 0.3 of its node's
#: displacement. GSGM: 0.7 per cycle (its rate is per cycle, with momentum).
#: Measured in-process, 5 nodes, 10 local steps, replies in arrival order (accuracy on
#: 2,000 test images). Client lr 0.1, 50 updates: ASGD 0.751 at 0.3, 0.471 at 0.5; GSGM
#: 0.762 at 0.7; FedBuff 0.763 at 1.0. Client lr 0.05, 100 updates: ASGD 0.782 at 0.3,
#: 0.732 at 0.5.
SERVER_LEARNING_RATES = {"fedbuff": 1.0, "asgd": 0.3, "gsgm": 0.7}


def run_fedavg(grid: Grid, initial: ArrayRecord, cfg, nodes: int, evaluate):
    """Flower's FedAvg, every node every round: ``client-updates`` / nodes rounds."""
    rounds = cfg["client-updates"] // nodes
    every = max(1, cfg["eval-every"] // nodes)  # evaluation rounds, as updates / nodes

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if server_round % every and server_round != rounds:
            return None
        return evaluate(arrays)

    strategy = FedAvg(fraction_evaluate=0.0)
    result = strategy.start(grid, initial, num_rounds=rounds, evaluate_fn=evaluate_fn)
    return result, {}, None


def lr_schedule(lr: float, halve_after: int):
    """``train_config_fn``: the client lr ``lr``, halved once ``halve_after`` client
    updates were received (FedAvg's "halve the lr at round r" is about r x nodes
    updates); 0: no schedule (None: every message carries the same config)."""
    if halve_after <= 0:
        return None

    def train_config_fn(node_id: int, model_version: int, updates_received: int) -> ConfigRecord:
        # Sent as "lr" in this one train message, over the train config.
        return ConfigRecord({"lr": lr if updates_received < halve_after else lr / 2})

    return train_config_fn


class BestModel:
    """``on_evaluate``: logs each evaluation and keeps the model of the best accuracy.

    Replace the log line with ``wandb.log(dict(metrics), step=updates)`` to log to W&B.
    """

    def __init__(self) -> None:
        self.updates: int | None = None
        self.accuracy = -1.0
        self.arrays: ArrayRecord | None = None

    def __call__(self, updates: int, arrays: ArrayRecord, metrics: MetricRecord) -> None:
        log(INFO, "[quickstart] evaluation at %d updates: %s", updates, dict(metrics))
        if metrics["accuracy"] > self.accuracy:  # NaN (no evaluation) is never the best
            # arrays is a copy of its own: kept as it is, no further copy.
            self.updates, self.accuracy, self.arrays = updates, metrics["accuracy"], arrays


def run_async(grid: Grid, initial: ArrayRecord, cfg, nodes: int, evaluate):
    """GSGM, ASGD or FedBuff for ``client-updates`` client updates."""
    # The ClientApp returns weights: the server forms each update from the weights
    # it sent, the displacement w_sent - w_returned, and applies its own rule.
    name = cfg["strategy"]
    best = BestModel()
    strategy = ASYNC_STRATEGIES[name](
        client_mode="weights",
        server_learning_rate=SERVER_LEARNING_RATES[name],
        train_config_fn=lr_schedule(cfg["lr"], cfg["lr-halve-after"]),
        on_evaluate=best,
    )
    result = strategy.start(
        grid,
        initial,
        max_updates=cfg["client-updates"],
        evaluate_fn=lambda step, arrays: evaluate(arrays),
        eval_every=cfg["eval-every"],
    )
    return result, result.report.counters, best


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Train for ``client-updates`` client trainings; save model.pt and result.json."""
    cfg = context.run_config
    if cfg["strategy"] not in ("fedavg", *ASYNC_STRATEGIES):
        raise ValueError(f"strategy {cfg['strategy']!r}: expected fedavg, gsgm, asgd or fedbuff")
    torch.manual_seed(0)
    net = Net()
    initial = ArrayRecord(net.state_dict())  # float32 weights, float32 and int64 buffers
    test_images, test_labels = load_data(cfg["data-root"], "test")
    n = cfg["eval-examples"]
    test_images, test_labels = test_images[:n], test_labels[:n]

    def evaluate(arrays: ArrayRecord) -> MetricRecord:
        net.load_state_dict(arrays.to_torch_state_dict())
        loss, accuracy = test(net, test_images, test_labels)
        return MetricRecord({"accuracy": accuracy, "loss": loss})

    nodes = len(list(grid.get_node_ids()))
    run = run_fedavg if cfg["strategy"] == "fedavg" else run_async
    result, counters, best = run(grid, initial, cfg, nodes, evaluate)
    # FedAvg's evaluations are keyed by round, the asynchronous ones by client updates.
    per_step = nodes if cfg["strategy"] == "fedavg" else 1
    out = Path(cfg["output-dir"]).expanduser()
    write_outputs(out, cfg["strategy"], initial, result, counters, per_step, best)


def write_outputs(
    out: Path, name: str, initial: ArrayRecord, result, counters, per_step, best=None
) -> None:
    """model.pt (the final state_dict), result.json (accuracy by client updates) and,
    with ``best`` (the asynchronous runs' :class:`BestModel`), best_model.pt."""
    out.mkdir(parents=True, exist_ok=True)
    state = result.arrays.to_torch_state_dict()
    dtypes = {key: str(tensor.dtype).removeprefix("torch.") for key, tensor in state.items()}
    # Flower's FedAvg averages every array in floating point (num_batches_tracked comes
    # back as float64); the asynchronous strategies keep every array's dtype.
    initial_state = initial.to_torch_state_dict()
    state = {key: tensor.to(initial_state[key].dtype) for key, tensor in state.items()}
    torch.save(state, out / "model.pt")
    if best is not None and best.arrays is not None:
        torch.save(best.arrays.to_torch_state_dict(), out / "best_model.pt")
    metrics = result.evaluate_metrics_serverapp.items()
    accuracy = {int(k) * per_step: float(v["accuracy"]) for k, v in metrics}
    summary = {"strategy": name, "accuracy": accuracy, "counters": counters, "dtypes": dtypes}
    if best is not None and best.arrays is not None:
        summary["best"] = {"updates": best.updates, "accuracy": best.accuracy}
    # strict JSON: an accuracy or loss of NaN (no evaluation yet) is written as null
    (out / "result.json").write_text(strict_json(summary, indent=2) + "\n")
