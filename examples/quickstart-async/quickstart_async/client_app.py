"""The ClientApp, written for Flower's FedAvg: it returns its trained weights.

No query handler, no protocol of flwr-gsgm: the asynchronous strategies use it as is
(``client_mode="weights"`` on the server).
"""

from __future__ import annotations

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from quickstart_async.task import Net, load_data, test, train

app = ClientApp()


def _node_data(context: Context, split: str):
    pid, n = context.node_config["partition-id"], context.node_config["num-partitions"]
    return load_data(context.run_config["data-root"], split, pid, n)


@app.train()
def train_handler(msg: Message, context: Context) -> Message:
    """Train the received model locally; reply with its weights."""
    net = Net()
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    images, labels = _node_data(context, "train")
    cfg = context.run_config
    # The server may send a learning rate (a schedule, as Flower's quickstarts do);
    # otherwise the run config's.
    lr = float(msg.content["config"].get("lr", cfg["lr"]))
    loss = train(net, images, labels, cfg["local-steps"], cfg["batch-size"], lr)
    metrics = MetricRecord({"train_loss": loss, "num-examples": len(labels)})
    content = RecordDict({"arrays": ArrayRecord(net.state_dict()), "metrics": metrics})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate_handler(msg: Message, context: Context) -> Message:
    """Evaluate the received model on this node's share of the test set."""
    net = Net()
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    images, labels = _node_data(context, "test")
    loss, accuracy = test(net, images, labels)
    metrics = MetricRecord({"eval_loss": loss, "eval_acc": accuracy, "num-examples": len(labels)})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
