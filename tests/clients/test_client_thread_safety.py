"""The ClientApp under threads: the in-process grid calls it from several threads at once.

Its module-level caches (data set, partitioner, a node's partition and evaluation
set) must build each entry once and never hand out a half-built one, whatever the
interleaving: many threads start together on cold caches here, with the file reads
slowed down so the threads really overlap.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from clients import client_app, datasets, partitioning
from clients.models import build_model
from clients.partitioning import PartitionConfig
from flwr_gsgm.simulation.inprocess_grid import InProcessGrid

FMNIST = "/usr/share/datasets/fashion-mnist"
CACHES = (
    datasets._load_cached,
    partitioning._cached_partitioner,
    partitioning._cached_index,
    client_app._train_data,
    client_app._eval_data,
)


@pytest.fixture(autouse=True)
def cold_caches():
    for cache in CACHES:
        cache.cache_clear()
    yield
    for cache in CACHES:
        cache.cache_clear()


@pytest.fixture
def slow_reads(monkeypatch) -> tuple[Counter, list]:
    """Count (and slow down) every IDX file read and every partitioner built."""
    reads: Counter = Counter()
    builds: list = []
    read_idx, build = datasets.read_idx, partitioning._build_partitioner

    def slow_read(path):
        reads[Path(path).name] += 1
        time.sleep(0.05)
        return read_idx(path)

    def counted_build(*args):
        builds.append(args[-1])
        time.sleep(0.05)
        return build(*args)

    monkeypatch.setattr(datasets, "read_idx", slow_read)
    monkeypatch.setattr(partitioning, "_build_partitioner", counted_build)
    return reads, builds


def test_sixteen_threads_build_each_cache_entry_once(slow_reads):
    reads, builds = slow_reads
    config = PartitionConfig("pathological", num_partitions=4, classes_per_node=2, seed=0)
    barrier = threading.Barrier(16)

    def node_data(i: int):
        barrier.wait()  # all 16 threads ask at once, 4 per partition
        return client_app._train_data("fashion-mnist", FMNIST, config, i % 4)

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(node_data, range(16)))
    assert len(reads) == 4 and set(reads.values()) == {1}  # each IDX file read once
    assert builds == [config]  # one partitioner
    for pid in range(4):
        same = [data for i, data in enumerate(got) if i % 4 == pid]
        assert all(data is same[0] for data in same)  # one object per partition
    # The same partitions as one thread computes them.
    for cache in CACHES:
        cache.cache_clear()
    for pid in range(4):
        serial = client_app._train_data("fashion-mnist", FMNIST, config, pid)
        assert torch.equal(serial.labels, got[pid].labels)
        assert torch.equal(serial.images, got[pid].images)


def messages(node_ids) -> list[Message]:
    """A query, a train and an evaluate message for each node."""
    torch.manual_seed(0)
    arrays = ArrayRecord(build_model("fashion-mnist").state_dict())
    out = []
    for node_id in node_ids:
        out.append(Message(RecordDict({"config": ConfigRecord()}), node_id, "query"))
        config = ConfigRecord({"mode": "gradient", "seed": 7, "model-version": 0})
        out.append(Message(RecordDict({"arrays": arrays, "config": config}), node_id, "train"))
        out.append(Message(RecordDict({"arrays": arrays}), node_id, "evaluate"))
    return out


def replies(workers: int) -> list[dict]:
    cfg = {"data-root": FMNIST, "eval-max-examples": 100}
    with InProcessGrid(client_app.app, 8, run_config=cfg, workers=workers) as grid:
        mids = list(grid.push_messages(messages(sorted(grid.get_node_ids()))))
        got = {}
        while len(got) < len(mids):
            for reply in grid.pull_messages([m for m in mids if m not in got]):
                got[reply.metadata.reply_to_message_id] = reply
            time.sleep(0.01)
    out = []
    for mid in mids:
        reply = got[mid]
        assert not reply.has_error(), reply.error.reason
        content = reply.content
        arrays = content.array_records.get("arrays")
        out.append(
            {
                "metrics": {
                    k: v
                    for k, v in content["metrics"].items()
                    if k not in ("compute-time", "train-seconds")
                },
                "arrays": [a.copy() for a in arrays.to_numpy_ndarrays()] if arrays else [],
            }
        )
    return out


def test_the_client_app_on_eight_threads_answers_as_on_one(slow_reads):
    reads, builds = slow_reads
    threaded = replies(workers=8)  # 24 messages to 8 nodes, on cold caches
    assert set(reads.values()) == {1} and len(builds) == 1
    for cache in CACHES:
        cache.cache_clear()
    serial = replies(workers=0)
    assert len(threaded) == len(serial) == 24
    for a, b in zip(threaded, serial):
        assert a["metrics"] == b["metrics"]
        assert all(np.array_equal(x, y) for x, y in zip(a["arrays"], b["arrays"]))


def test_models_are_pooled_across_threads_and_never_shared_between_calls(monkeypatch):
    # The in-process grid runs each call on a new thread: the pool must still reuse
    # models (a per-thread cache built one per message), and two calls at once must
    # never hold the same model.
    built: list = []
    monkeypatch.setattr(client_app, "_idle_models", {})

    def counted_build(name):
        built.append(name)
        return build_model(name)

    monkeypatch.setattr(client_app, "build_model", counted_build)

    def borrow_one():
        with client_app._borrowed_model("fashion-mnist") as model:
            pass
        return id(model)

    ids = []
    for _ in range(5):  # one after another, each on a new thread
        with ThreadPoolExecutor(1) as pool:
            ids.append(pool.submit(borrow_one).result())
    assert len(set(ids)) == 1 and built == ["fashion-mnist"]
    with client_app._borrowed_model("fashion-mnist") as a:
        with client_app._borrowed_model("fashion-mnist") as b:
            assert a is not b
    assert built == ["fashion-mnist"] * 2
    assert len(client_app._idle_models["fashion-mnist"]) == 2
