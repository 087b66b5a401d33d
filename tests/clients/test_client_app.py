"""The ClientApp called directly with a Message and a Context, on real data."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, Metadata, RecordDict

from clients.client_app import app
from clients.datasets import load_dataset
from clients.models import build_model
from clients.partitioning import PartitionConfig, load_partition
from clients.training import compute_update

FMNIST_ROOT = Path("/usr/share/datasets/fashion-mnist")
KEYS = [
    "conv1.weight",
    "conv1.bias",
    "conv2.weight",
    "conv2.bias",
    "fc1.weight",
    "fc1.bias",
    "fc2.weight",
    "fc2.bias",
]
RUN_CONFIG = {
    "dataset": "fashion-mnist",
    "data-root": str(FMNIST_ROOT),
    "partitioner": "pathological",
    "classes-per-node": 2,
    "dirichlet-alpha": 0.5,
    "seed": 0,
    "client-threads": 1,
}


def message(content: RecordDict, message_type: str) -> Message:
    metadata = Metadata(
        run_id=1,
        message_id="msg-1",
        src_node_id=1,
        dst_node_id=42,
        reply_to_message_id="",
        group_id="1",
        created_at=time.time(),
        ttl=600.0,
        message_type=message_type,
    )
    return Message(content=content, metadata=metadata)


def context(partition_id=3, num_partitions=10, **run_config) -> Context:
    return Context(
        run_id=1,
        node_id=42,
        node_config={"partition-id": partition_id, "num-partitions": num_partitions},
        state=RecordDict(),
        run_config={**RUN_CONFIG, **run_config},
    )


@pytest.fixture(scope="module")
def weights() -> ArrayRecord:
    return ArrayRecord(build_model("fashion-mnist", seed=0).state_dict())


def train_msg(arrays: ArrayRecord, **config) -> Message:
    return message(RecordDict({"arrays": arrays, "config": ConfigRecord(config)}), "train")


def node_data(partition_id=3):
    train, _ = load_dataset("fashion-mnist", FMNIST_ROOT)
    idx = load_partition(
        "fashion-mnist", FMNIST_ROOT, PartitionConfig("pathological", 10, 2, 0.5, 0), partition_id
    )
    return train.images[idx], train.labels[idx]


def test_train_gradient_round_trip(weights):
    msg = train_msg(
        weights,
        mode="gradient",
        **{
            "batch-size": 32,
            "local-batches": 2,
            "seed": 1234,
            "model-version": 17,
            "virtual-duration": 2.5,
        },
    )
    reply = app(msg, context())
    assert not reply.has_error()
    assert reply.metadata.reply_to_message_id == "msg-1"
    assert reply.metadata.dst_node_id == 1  # back to the sender
    assert set(reply.content.keys()) == {"arrays", "metrics"}
    arrays = reply.content["arrays"]
    assert list(arrays.keys()) == KEYS
    for key, arr in arrays.items():
        assert arr.dtype == "float32"
        assert tuple(arr.shape) == tuple(weights[key].shape)
    metrics = dict(reply.content["metrics"])
    assert set(metrics) == {
        "num-examples",
        "model-version",
        "partition-id",
        "num-partitions",
        "train-loss",
        "compute-time",
        "train-steps",
        "train-seconds",
        "virtual-duration",
    }
    assert metrics["num-examples"] == 64 and isinstance(metrics["num-examples"], int)
    assert metrics["model-version"] == 17
    assert (metrics["partition-id"], metrics["num-partitions"]) == (3, 10)
    assert metrics["virtual-duration"] == 2.5
    assert 0.0 < metrics["compute-time"] < 30.0
    # Two mini-batches of 32 (num-examples 64); no virtual-train-seconds was sent, so
    # the seconds are the wall compute time.
    assert metrics["train-steps"] == 2
    assert metrics["train-seconds"] == metrics["compute-time"]
    # the update is exactly what compute_update gives on the node's partition
    torch.set_num_threads(1)
    model = build_model("fashion-mnist")
    model.load_state_dict(weights.to_torch_state_dict())
    images, labels = node_data()
    expected, loss = compute_update(
        model, images, labels, mode="gradient", batch_size=32, local_batches=2, seed=1234
    )
    assert metrics["train-loss"] == pytest.approx(loss, rel=0, abs=0)
    for got, exp in zip(arrays.to_numpy_ndarrays(), expected):
        np.testing.assert_array_equal(got, exp)


def test_train_is_deterministic_and_seed_dependent(weights):
    ctx = context()
    a = app(train_msg(weights, mode="delta", seed=7, **{"local-steps": 2}), ctx)
    b = app(train_msg(weights, mode="delta", seed=7, **{"local-steps": 2}), ctx)
    c = app(train_msg(weights, mode="delta", seed=8, **{"local-steps": 2}), ctx)
    bytes_a = [x.data for x in a.content["arrays"].values()]
    assert bytes_a == [x.data for x in b.content["arrays"].values()]
    assert bytes_a != [x.data for x in c.content["arrays"].values()]
    assert a.content["metrics"]["num-examples"] == 64


def test_train_with_local_epochs_and_momentum_returns_the_displacement(weights):
    # One epoch at batch-size 1000: ceil(N / 1000) steps, every example once, so
    # num-examples = N; delta mode returns w - w_local as compute_update computes it.
    config = {"batch-size": 1000, "local-epochs": 1, "local-momentum": 0.9, "local-lr": 0.05}
    reply = app(train_msg(weights, mode="delta", seed=5, **config), context())
    images, labels = node_data()
    assert reply.content["metrics"]["num-examples"] == len(labels)
    torch.set_num_threads(1)
    model = build_model("fashion-mnist")
    model.load_state_dict(weights.to_torch_state_dict())
    expected, loss = compute_update(
        model,
        images,
        labels,
        mode="delta",
        batch_size=1000,
        local_lr=0.05,
        local_epochs=1,
        local_momentum=0.9,
        seed=5,
    )
    assert reply.content["metrics"]["train-loss"] == loss
    for got, exp in zip(reply.content["arrays"].to_numpy_ndarrays(), expected):
        np.testing.assert_array_equal(got, exp)
    # the same work in weights mode returns w_local: the displacement is w - w_local,
    # bit for bit (not divided by local-lr)
    local = app(train_msg(weights, mode="weights", seed=5, **config), context())
    for d, w, w_local in zip(
        expected, weights.to_numpy_ndarrays(), local.content["arrays"].to_numpy_ndarrays()
    ):
        np.testing.assert_array_equal(d, w - w_local)
        assert np.abs(d).max() > 0


def test_train_default_is_weights_mode_for_flower_fedavg(weights):
    # What Flower's FedAvg sends: arrays plus {"server-round": r}; no mode, no seed.
    r1 = app(train_msg(weights, **{"server-round": 1}), context())
    metrics = dict(r1.content["metrics"])
    assert metrics["model-version"] == -1
    assert "virtual-duration" not in metrics  # same key set in every reply
    assert metrics["num-examples"] == 32
    new = r1.content["arrays"].to_numpy_ndarrays()
    old = weights.to_numpy_ndarrays()
    # one SGD step with the default lr moved the weights, by a small amount
    steps = [np.abs(n - o).max() for n, o in zip(new, old)]
    assert max(steps) > 0 and max(steps) < 0.1
    # the derived seed depends on the round
    r1b = app(train_msg(weights, **{"server-round": 1}), context())
    r2 = app(train_msg(weights, **{"server-round": 2}), context())
    data = lambda r: [x.data for x in r.content["arrays"].values()]  # noqa: E731
    assert data(r1) == data(r1b) and data(r1) != data(r2)


def test_positional_keys_are_kept(weights):
    numbered = ArrayRecord(weights.to_numpy_ndarrays())  # keys "0".."7"
    reply = app(train_msg(numbered, mode="gradient", seed=3), context())
    assert list(reply.content["arrays"].keys()) == [str(i) for i in range(8)]
    by_name = app(train_msg(weights, mode="gradient", seed=3), context())
    assert [x.data for x in reply.content["arrays"].values()] == [
        x.data for x in by_name.content["arrays"].values()
    ]


def test_received_key_order_is_echoed(weights):
    reordered = ArrayRecord()
    for key in reversed(KEYS):
        reordered[key] = weights[key]
    reply = app(train_msg(reordered, mode="gradient", seed=3), context())
    assert list(reply.content["arrays"].keys()) == list(reversed(KEYS))
    by_name = app(train_msg(weights, mode="gradient", seed=3), context())
    for key in KEYS:
        assert reply.content["arrays"][key].data == by_name.content["arrays"][key].data


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"mode": "newton"}, "mode='newton'"),
        ({"mode": "delta", "local-lr": -0.1}, "local-lr=-0.1"),
        ({"mode": "delta", "local-epochs": -1}, "local-epochs=-1"),
        ({"mode": "weights", "local-momentum": 1.0}, "local-momentum=1.0"),
        ({"mode": "gradient", "batch-size": 0}, "batch-size=0"),
        ({"mode": "gradient", "local-batches": 1.5}, "local-batches=1.5"),
    ],
)
def test_bad_train_config_raises_naming_the_key(weights, config, match):
    with pytest.raises(ValueError, match=match):
        app(train_msg(weights, **config), context())


def test_arrays_that_do_not_fit_the_model_raise(weights):
    arrays = weights.to_numpy_ndarrays()
    with pytest.raises(ValueError, match="Received 7 arrays"):
        app(train_msg(ArrayRecord(arrays[:-1]), mode="gradient"), context())
    arrays[0] = np.zeros((32, 1, 3, 3), dtype=np.float32)
    with pytest.raises(ValueError, match="shape"):
        app(train_msg(ArrayRecord(arrays), mode="gradient"), context())


def test_bad_node_or_run_config_raises_naming_the_key(weights):
    msg = train_msg(weights, mode="gradient")
    bad = Context(run_id=1, node_id=42, node_config={}, state=RecordDict(), run_config=RUN_CONFIG)
    with pytest.raises(ValueError, match="partition-id"):
        app(msg, bad)
    with pytest.raises(ValueError, match="partition-id=10"):
        app(msg, context(partition_id=10))
    with pytest.raises(ValueError, match="classes-per-node=11"):
        app(msg, context(**{"classes-per-node": 11}))
    with pytest.raises(ValueError, match="dirichlet-alpha=0.0"):
        app(msg, context(**{"dirichlet-alpha": 0.0}))
    with pytest.raises(ValueError, match="partitioner='shard'"):
        app(msg, context(partitioner="shard"))
    with pytest.raises(ValueError, match="dataset='mnist'"):
        app(msg, context(dataset="mnist"))
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        app(msg, context(**{"data-root": "/nonexistent/fmnist"}))


def test_query_reports_partition(weights):
    reply = app(message(RecordDict(), "query"), context(partition_id=5))
    assert dict(reply.content["metrics"]) == {
        "partition-id": 5,
        "num-partitions": 10,
        "num-examples": 6000,
    }


def test_evaluate_on_test_images_of_the_node_classes(weights):
    msg = message(RecordDict({"arrays": weights}), "evaluate")
    reply = app(msg, context(partition_id=3))
    metrics = dict(reply.content["metrics"])
    assert set(metrics) == {"num-examples", "eval-loss", "eval-accuracy"}
    assert metrics["num-examples"] == 1000  # of the 2,000 test images of classes {3, 4}
    assert 0.0 <= metrics["eval-accuracy"] <= 1.0
    assert metrics["eval-loss"] == pytest.approx(np.log(10), abs=0.5)  # untrained
    # a node whose partition is classes {3, 4} can be evaluated on all of them
    full = app(msg, context(partition_id=3, **{"eval-max-examples": 5000}))
    assert full.content["metrics"]["num-examples"] == 2000
    again = app(msg, context(partition_id=3))
    assert dict(again.content["metrics"]) == metrics


def test_training_through_the_app_learns_the_node_classes():
    """Weights mode through the app, 150 SGD steps of 32 images: a 2-class node gets far above
    the 50% of guessing between its two classes."""
    arrays = ArrayRecord(build_model("fashion-mnist", seed=0).state_dict())
    reply = app(
        train_msg(arrays, mode="weights", seed=1, **{"local-steps": 150, "local-lr": 0.05}),
        context(partition_id=0),
    )
    trained = reply.content["arrays"]
    result = app(message(RecordDict({"arrays": trained}), "evaluate"), context(partition_id=0))
    assert result.content["metrics"]["eval-accuracy"] > 0.85  # classes {0: T-shirt, 1: trouser}


def test_a_lying_node_sends_its_flipped_move_and_an_honest_one_is_unchanged(weights):
    # partition 3 lies when attackers > 3: it sends w_sent - (w_local - w_sent)
    config = {"server-round": 1, "mode": "weights", "local-steps": 2}
    honest = app(train_msg(weights, **config), context()).content["arrays"].to_numpy_ndarrays()
    lying = app(train_msg(weights, **config), context(attack="sign-flip", attackers=4))
    lie = lying.content["arrays"].to_numpy_ndarrays()
    sent = weights.to_numpy_ndarrays()
    for s, h, got in zip(sent, honest, lie):
        assert np.allclose(got, 2 * s - h, atol=1e-6)
    # partition 3 is honest with 3 attackers (partitions 0, 1, 2)
    again = app(train_msg(weights, **config), context(attack="sign-flip", attackers=3))
    assert all(
        np.array_equal(a, b) for a, b in zip(again.content["arrays"].to_numpy_ndarrays(), honest)
    )
    # label-flip trains on 9 - y: another update than the honest one
    flipped = app(train_msg(weights, **config), context(attack="label-flip", attackers=4))
    moved = flipped.content["arrays"].to_numpy_ndarrays()
    assert not all(np.array_equal(a, b) for a, b in zip(moved, honest))
