"""Flower ClientApp of flwr-gsgm: local data, local computation, one reply per message.

Load it as ``clients.client_app:app``. The app is stateless: every reply depends
only on the message, the run config and the node config (nothing is kept in
``context.state``), which is what makes asynchronous simulations reproducible.

Message protocol
================
Any ClientApp (any ML framework) that follows this protocol works with the
flwr-gsgm server. Keys are kebab-case; record names are Flower's conventions.

Node config (``context.node_config``; set by the simulation engine, or by
``flower-supernode --node-config "partition-id=0 num-partitions=10"``):

- ``partition-id`` (int, ``0 <= id < num-partitions``): which partition of the
  training set this node holds; the server keys its per-node state on it.
- ``num-partitions`` (int >= 1).
- ``data-dir`` (str, optional): train on the node's own images, a torchvision
  ``ImageFolder`` tree of class folders named by class index or class name, instead
  of partition ``partition-id`` of the data set (:mod:`clients.local_data`); images
  are converted to the model's input (grayscale 28x28 for Fashion-MNIST).
- ``cache-dir`` (str, optional): keep the node's decoded training (and evaluation)
  data in this folder so that the next message's ClientApp process reads them back
  instead of re-reading and re-partitioning the data set (:mod:`clients.local_data`).
- ``device`` (str, ``"auto"``): ``auto`` (CUDA if available, else CPU), ``cpu``,
  ``cuda`` or ``cuda:<i>`` (:mod:`clients.device`).
- ``step-seconds`` (float >= 0, 0 = off): emulate a device whose local step (an SGD
  step in delta and weights modes, a mini-batch gradient in gradient mode) lasts this
  many seconds: after the real computation of a train message the handler sleeps the
  remainder of ``steps x step-seconds`` (no sleep if the computation took longer), so
  that on one fast machine the nodes run at the speeds of the emulated devices
  (``benchmarks/race_deployment.py``; :func:`emulate_device`).

Run config (``context.run_config``, ``[tool.flwr.app.config]``), all optional:

- ``dataset`` (str, ``"fashion-mnist"``): dataset name (:mod:`clients.datasets`).
- ``data-root`` (str, ``"/usr/share/datasets/fashion-mnist"``): its files.
- ``partitioner`` (str, ``"pathological"``): ``iid``, ``pathological`` or
  ``dirichlet`` (:mod:`clients.partitioning`).
- ``classes-per-node`` (int, 2): k of ``pathological``, in 1..num_classes.
- ``dirichlet-alpha`` (float, 0.5): alpha of ``dirichlet``, > 0.
- ``examples-per-node`` (int, 0): at most this many training examples per node, a
  seeded subset of its partition (0: all).
- ``seed`` (int, 0): partitioning seed (and fallback mini-batch seed, see below).
- ``client-threads`` (int, 1): torch CPU threads of this process.
- ``eval-max-examples`` (int, 1000): cap of the evaluate set.
- ``attack`` (str, ``"none"``) and ``attackers`` (int, 0): the nodes of partition-id
  below ``attackers`` lie (``sign-flip``, ``noise`` or ``label-flip``: :mod:`clients.attacks`),
  to measure what the server's defences stop; off by default.

``query`` message (``message_type="query"``; optional for the server: a node that
cannot answer it is keyed by its node id); content ignored. Reply content:

- ``"metrics"``: MetricRecord ``{"partition-id": int, "num-partitions": int,
  "num-examples": int}`` (size of the node's training partition).

``train`` message (``message_type="train"``). Content:

- ``"arrays"``: ArrayRecord, the global weights w (float32; keyed by the model's
  ``state_dict`` names in ``state_dict`` order, or by any keys in that order,
  e.g. ``"0".."7"``).
- ``"config"``: ConfigRecord (all optional):

  - ``"mode"`` (str): ``"gradient"``, ``"delta"`` or ``"weights"``; absent ->
    ``"weights"`` (so Flower's own FedAvg / FedAvgM work unchanged).
  - ``"batch-size"`` (int, 32), ``"local-batches"`` (int, 1: B, gradient mode),
    ``"local-steps"`` (int, 1: E, delta and weights modes), ``"local-epochs"``
    (int, 0: delta and weights modes, passes over the partition, each
    ceil(N / batch-size) SGD steps; 0 = ``local-steps`` steps), ``"local-lr"``
    (float, 0.05: SGD learning rate, delta and weights modes), ``"local-momentum"``
    (float in [0, 1), 0: SGD momentum of torch.optim.SGD, delta and weights modes;
    FedAvg-style clients use 0.9; the buffer starts at zero in every message).
  - ``"seed"`` (int): per-dispatch seed of the mini-batch sampling, chosen by the
    server. Absent -> derived from (run config ``seed``, ``partition-id``,
    ``"server-round"`` or 0); an asynchronous server must send it, otherwise every
    dispatch of a node in the same round draws the same batches.
  - ``"model-version"`` (int): echoed back; ``"virtual-duration"`` (float,
    seconds): echoed back if present; ``"server-round"`` (int, sent by Flower's
    strategies): only used for the seed.

  Reply content:

  - ``"arrays"``: ArrayRecord with the same keys, order and shapes as received,
    float32 values: the update. ``gradient``: mean gradient of B mini-batches at w;
    ``delta``: the displacement w - w_local after the local SGD steps (not divided
    by local-lr); ``weights``: w_local. The server's rule steps against the first
    two; from ``weights`` the server forms the displacement w - w_local itself,
    from the weights it sent.
  - ``"metrics"``: MetricRecord ``{"num-examples": int (example-gradients
    computed: min(batch-size, N) * B or * E, or N * local-epochs),
    "model-version": int (echo, -1 if
    absent), "partition-id": int, "num-partitions": int, "train-loss": float
    (mean cross-entropy of the mini-batches used), "compute-time": float (wall
    seconds of the local computation), "train-steps": int (SGD steps or
    mini-batches done), "train-seconds": float (seconds of training: the message's
    ``virtual-train-seconds`` under the virtual clock, else compute-time plus
    sleep-time; what work scheduling reads), "virtual-duration": float (only if sent),
    "sleep-time": float (only with node config ``step-seconds`` > 0: wall seconds
    slept after the computation to emulate the device, ``max(0, steps x step-seconds
    - compute-time)``)}``.

``evaluate`` message (``message_type="evaluate"``). Content ``"arrays"`` as for
train (``"config"`` ignored). The node evaluates w on the test-set images whose
class occurs in its training partition (its own label distribution's support;
the training partition is left whole), at most ``eval-max-examples`` of them (a
fixed subset drawn with the partitioning seed and the partition-id); with a
``data-dir``, on the images of ``<data-dir>/test`` if that folder exists, else on
the training images (same cap). Reply content:

- ``"metrics"``: MetricRecord ``{"num-examples": int, "eval-loss": float (mean
  cross-entropy), "eval-accuracy": float (fraction in [0, 1])}``.

Errors (bad config value, unknown mode, weights that do not fit the model, missing
dataset files) are raised as exceptions naming the key; Flower turns them into an
error reply (``Message.has_error()``) that the server counts.

Preprocessing, for ports to other frameworks: images are Fashion-MNIST uint8
``[N, 1, 28, 28]``, normalised as ``(x / 255 - 0.2860) / 0.3530`` inside the model
(:mod:`clients.models`); loss is mean cross-entropy; SGD has no weight decay,
and momentum only with ``local-momentum``.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from cachetools.func import lru_cache
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp

from clients.attacks import ATTACKS, flip_labels, is_attacker, lie
from clients.datasets import ImageData, dataset_info, load_dataset
from clients.device import choose_device
from clients.local_data import (
    disk_cached,
    folder_fingerprint,
    image_folder_split,
    load_image_folder,
)
from clients.models import build_model
from clients.partitioning import PartitionConfig, load_partition
from clients.training import (
    MODES,
    compute_update,
    evaluate,
    num_examples_used,
    steps_per_message,
)
from flwr_gsgm.simulation.virtual_clock import derive_seed

__all__ = ["DEFAULT_RUN_CONFIG", "DEFAULT_TRAIN_CONFIG", "RunSettings", "app", "emulate_device"]

DEFAULT_RUN_CONFIG: dict[str, object] = {
    "dataset": "fashion-mnist",
    "data-root": "/usr/share/datasets/fashion-mnist",
    "partitioner": "pathological",
    "classes-per-node": 2,
    "dirichlet-alpha": 0.5,
    "examples-per-node": 0,
    "seed": 0,
    "client-threads": 1,
    "eval-max-examples": 1000,
    "attack": "none",
    "attackers": 0,
}

DEFAULT_TRAIN_CONFIG: dict[str, object] = {
    "mode": "weights",
    "batch-size": 32,
    "local-batches": 1,
    "local-steps": 1,
    "local-epochs": 0,
    "local-lr": 0.05,
    "local-momentum": 0.0,
}

app = ClientApp()


# ----------------------------------------------------------------- config parsing
def _get_int(source: dict, key: str, default: object, *, minimum: int | None = None) -> int:
    value = source.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"Invalid {key}={value!r}: expected an integer")
    if minimum is not None and value < minimum:
        raise ValueError(f"Invalid {key}={value!r}: expected an integer >= {minimum}")
    return int(value)


def _get_float(source: dict, key: str, default: object, *, positive: bool = False) -> float:
    value = source.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"Invalid {key}={value!r}: expected a number")
    value = float(value)
    if not math.isfinite(value) or (positive and value <= 0):
        raise ValueError(
            f"Invalid {key}={value!r}: expected a finite number{' > 0' if positive else ''}"
        )
    return value


def _get_str(source: dict, key: str, default: str) -> str:
    value = source.get(key, default)
    if not isinstance(value, str):
        raise ValueError(f"Invalid {key}={value!r}: expected a string")
    return value


@dataclass(frozen=True)
class RunSettings:
    """Node-side settings from the run config and node config (validated)."""

    dataset: str
    data_root: str
    partition: PartitionConfig
    partition_id: int
    client_threads: int
    eval_max_examples: int
    data_dir: str | None = None
    cache_dir: str | None = None
    device: str = "auto"
    step_seconds: float = 0.0
    attack: str = "none"  # what this node sends: its honest update unless it lies

    @classmethod
    def from_context(cls, context: Context) -> RunSettings:
        """Read and validate ``context.run_config`` and ``context.node_config``.

        Raises
        ------
        ValueError
            Missing ``partition-id`` / ``num-partitions`` in the node config, or a
            bad value (``device`` included); the message names the key.
        """
        rc = dict(context.run_config)
        nc = dict(context.node_config)
        for key in ("partition-id", "num-partitions"):
            if key not in nc:
                raise ValueError(
                    f"Missing node config key {key!r}: start the SuperNode with "
                    '--node-config "partition-id=<i> num-partitions=<n>"'
                )
        num_partitions = _get_int(nc, "num-partitions", None, minimum=1)
        partition_id = _get_int(nc, "partition-id", None)
        if not 0 <= partition_id < num_partitions:
            raise ValueError(
                f"Invalid partition-id={partition_id}: expected 0 <= partition-id < "
                f"num-partitions={num_partitions}"
            )
        d = DEFAULT_RUN_CONFIG
        dataset = _get_str(rc, "dataset", d["dataset"])
        info = dataset_info(dataset)  # ValueError naming `dataset` if unknown
        partition = PartitionConfig(
            partitioner=_get_str(rc, "partitioner", d["partitioner"]),
            num_partitions=num_partitions,
            classes_per_node=_get_int(rc, "classes-per-node", d["classes-per-node"]),
            dirichlet_alpha=_get_float(rc, "dirichlet-alpha", d["dirichlet-alpha"]),
            seed=_get_int(rc, "seed", d["seed"]),
            examples_per_node=_get_int(rc, "examples-per-node", d["examples-per-node"]),
        )
        partition.validate(info.num_classes)
        device = _get_str(nc, "device", "auto")
        choose_device(device)  # ValueError naming `device` if unusable on this node
        attack = _get_str(rc, "attack", d["attack"])
        if attack not in ATTACKS:
            raise ValueError(f"Invalid attack={attack!r}: expected one of {ATTACKS}")
        attackers = _get_int(rc, "attackers", d["attackers"], minimum=0)
        step_seconds = _get_float(nc, "step-seconds", 0.0)
        if step_seconds < 0:
            raise ValueError(
                f"Invalid step-seconds={step_seconds!r}: expected seconds >= 0 (0 = off)"
            )
        return cls(
            dataset=dataset,
            data_root=_get_str(rc, "data-root", d["data-root"]),
            partition=partition,
            partition_id=partition_id,
            client_threads=_get_int(rc, "client-threads", d["client-threads"], minimum=1),
            eval_max_examples=_get_int(rc, "eval-max-examples", d["eval-max-examples"], minimum=1),
            data_dir=_get_str(nc, "data-dir", "") or None,
            cache_dir=_get_str(nc, "cache-dir", "") or None,
            device=device,
            step_seconds=step_seconds,
            attack=attack if is_attacker(partition_id, attack, attackers) else "none",
        )

    def apply_threads(self) -> None:
        """Set torch's intra-op thread count (process-wide) to ``client_threads``."""
        if torch.get_num_threads() != self.client_threads:
            torch.set_num_threads(self.client_threads)


# -------------------------------------------------------------------- node data
def _source_key(
    dataset: str, root: str, data_dir: str | None, cache_dir: str | None
) -> dict[str, str]:
    """What a node's data are read from, for the on-disk cache key ({} without a
    cache: the source folder is then not walked)."""
    if not cache_dir:
        return {}
    if data_dir:
        folder = os.path.realpath(os.path.expanduser(data_dir))
        return {"dataset": dataset, "data-dir": folder, "files": folder_fingerprint(folder)}
    folder = os.path.realpath(os.path.expanduser(root))
    return {"dataset": dataset, "data-root": folder, "files": folder_fingerprint(folder)}


@lru_cache(maxsize=256)
def _train_data(
    dataset: str,
    root: str,
    config: PartitionConfig,
    partition_id: int,
    data_dir: str | None = None,
    cache_dir: str | None = None,
) -> ImageData:
    """The node's training set: its partition of ``dataset``, or its ``data_dir``."""
    if data_dir:

        def build() -> ImageData:
            return load_image_folder(image_folder_split(data_dir, "train"), dataset_info(dataset))

        key = _source_key(dataset, root, data_dir, cache_dir)
    else:

        def build() -> ImageData:
            train, _ = load_dataset(dataset, root)
            return train.subset(load_partition(dataset, root, config, partition_id))

        key = {
            **_source_key(dataset, root, None, cache_dir),
            "partition": repr(config),
            "partition-id": partition_id,
        }
    return disk_cached(cache_dir, "train", key, build)


@lru_cache(maxsize=256)
def _eval_data(
    dataset: str,
    root: str,
    config: PartitionConfig,
    partition_id: int,
    max_examples: int,
    data_dir: str | None = None,
    cache_dir: str | None = None,
) -> ImageData:
    """The node's evaluation set (see the module docstring), at most ``max_examples``."""

    def subsample(data: ImageData, rows: torch.Tensor) -> ImageData:
        if len(rows) > max_examples:
            gen = torch.Generator().manual_seed(
                _derive_seed(config.seed, partition_id, 0x5EED_E7A1)
            )
            rows = rows[torch.randperm(len(rows), generator=gen)[:max_examples]].sort().values
        return data.subset(rows)

    if data_dir:

        def build() -> ImageData:
            test = load_image_folder(image_folder_split(data_dir, "test"), dataset_info(dataset))
            return subsample(test, torch.arange(len(test)))
    else:

        def build() -> ImageData:
            _, test = load_dataset(dataset, root)
            classes = torch.unique(
                _train_data(dataset, root, config, partition_id, None, cache_dir).labels
            )
            return subsample(test, torch.nonzero(torch.isin(test.labels, classes)).flatten())

    key = {
        **_source_key(dataset, root, data_dir, cache_dir),
        "partition": repr(config),
        "partition-id": partition_id,
        "max-examples": max_examples,
    }
    return disk_cached(cache_dir, "eval", key, build)


def _node_train_data(settings: RunSettings) -> ImageData:
    return _train_data(
        settings.dataset,
        settings.data_root,
        settings.partition,
        settings.partition_id,
        settings.data_dir,
        settings.cache_dir,
    )


def _derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers.

    :func:`flwr_gsgm.simulation.virtual_clock.derive_seed` with ``bits=63``.
    """
    return derive_seed(*parts, bits=63)


# ------------------------------------------------------------- arrays <-> model
def _load_received(model: torch.nn.Module, arrays: ArrayRecord) -> list[str]:
    """Load the received ArrayRecord into ``model``.

    Returns, for each model ``state_dict`` key in order, the received key that
    feeds it. Keys match by name if the key sets are equal, else by position if
    count and shapes agree.

    Raises
    ------
    ValueError
        If the arrays do not fit the model.
    """
    state = model.state_dict()
    model_keys = list(state.keys())
    received_keys = list(arrays.keys())
    if set(received_keys) == set(model_keys):
        source = model_keys
    elif len(received_keys) == len(model_keys):
        source = received_keys
    else:
        raise ValueError(
            f"Received {len(received_keys)} arrays {received_keys[:4]}..., the model "
            f"has {len(model_keys)} state_dict entries {model_keys[:4]}..."
        )
    new_state = {}
    for mkey, rkey in zip(model_keys, source):
        arr = arrays[rkey].numpy()
        if tuple(arr.shape) != tuple(state[mkey].shape):
            raise ValueError(
                f"Received array {rkey!r} has shape {tuple(arr.shape)}, the model's "
                f"{mkey!r} has {tuple(state[mkey].shape)}"
            )
        new_state[mkey] = torch.as_tensor(np.asarray(arr, dtype=np.float32))
    model.load_state_dict(new_state, strict=True)
    return source


_idle_models: dict[str, list[torch.nn.Module]] = {}
_idle_lock = threading.Lock()


@contextmanager
def _borrowed_model(dataset: str) -> Iterator[torch.nn.Module]:
    """A model for ``dataset`` from this process's pool, returned to it afterwards.

    Every message loads a full state_dict into it (strict), and the models hold no
    other state, so reuse changes nothing but the cost of building one (about 1.2 ms
    per message, a tenth of a training step). A pool rather than a per-thread cache:
    the in-process grid runs every call on a new thread, where a per-thread cache
    never hits. It holds at most as many models as calls ever ran at once.
    """
    with _idle_lock:
        idle = _idle_models.setdefault(dataset, [])
        model = idle.pop() if idle else None
    if model is None:
        model = build_model(dataset)
    try:
        yield model
    finally:
        with _idle_lock:
            _idle_models[dataset].append(model)


def _record(msg: Message, key: str, kind: type):
    """``msg.content[key]`` if it is a ``kind`` record, else None.

    Not ``RecordDict.array_records`` / ``config_records``: in Flower 1.42 they leave a
    reference cycle that keeps the whole message (a model copy) alive until the
    garbage collector runs, one per message.
    """
    record = msg.content.get(key)
    return record if isinstance(record, kind) else None


@contextmanager
def _model_from_message(
    msg: Message, settings: RunSettings
) -> Iterator[tuple[torch.nn.Module, list[str]]]:
    """A pooled model holding ``msg``'s arrays, and the received key of each state key."""
    received = _record(msg, "arrays", ArrayRecord)
    if received is None:
        raise ValueError("Message content has no ArrayRecord named 'arrays'")
    with _borrowed_model(settings.dataset) as model:
        yield model, _load_received(model, received)


# ------------------------------------------------------------- device emulation
def emulate_device(
    steps: int,
    step_seconds: float,
    compute_seconds: float,
    sleep: Callable[[float], None] = time.sleep,
) -> float:
    """Sleep so that a message's ``steps`` local steps last ``steps * step_seconds``.

    Parameters
    ----------
    steps : int
        Local steps the message computed (SGD steps, or mini-batch gradients in
        gradient mode).
    step_seconds : float
        Seconds one step takes on the emulated device (0 = no emulation).
    compute_seconds : float
        Wall seconds the real computation took.
    sleep : callable
        ``time.sleep`` (tests pass a fake one).

    Returns
    -------
    float
        Seconds slept: ``steps * step_seconds - compute_seconds`` if positive, else 0
        (a computation slower than the device is not shortened).
    """
    remainder = steps * step_seconds - compute_seconds
    if remainder <= 0:
        return 0.0
    sleep(remainder)
    return remainder


# --------------------------------------------------------------------- handlers
@app.query()
def query(msg: Message, context: Context) -> Message:
    """Reply with this node's identity and partition size (see module docstring)."""
    settings = RunSettings.from_context(context)
    data = _node_train_data(settings)
    metrics = MetricRecord(
        {
            "partition-id": settings.partition_id,
            "num-partitions": settings.partition.num_partitions,
            "num-examples": len(data),
        }
    )
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Compute an update (gradient / delta) or new weights; see module docstring."""
    settings = RunSettings.from_context(context)
    settings.apply_threads()
    config = dict(_record(msg, "config", ConfigRecord) or ConfigRecord())
    d = DEFAULT_TRAIN_CONFIG
    mode = _get_str(config, "mode", d["mode"])
    if mode not in MODES:
        raise ValueError(f"Invalid mode={mode!r}: expected one of {MODES}")
    batch_size = _get_int(config, "batch-size", d["batch-size"], minimum=1)
    local_batches = _get_int(config, "local-batches", d["local-batches"], minimum=1)
    local_steps = _get_int(config, "local-steps", d["local-steps"], minimum=1)
    local_epochs = _get_int(config, "local-epochs", d["local-epochs"], minimum=0)
    local_lr = _get_float(config, "local-lr", d["local-lr"], positive=True)
    local_momentum = _get_float(config, "local-momentum", d["local-momentum"])
    if not 0.0 <= local_momentum < 1.0:
        raise ValueError(f"Invalid local-momentum={local_momentum!r}: expected a number in [0, 1)")
    model_version = _get_int(config, "model-version", -1)
    if "seed" in config:
        seed = _get_int(config, "seed", None)
    else:
        server_round = _get_int(config, "server-round", 0)
        seed = _derive_seed(settings.partition.seed, settings.partition_id, server_round)

    data = _node_train_data(settings)
    labels = data.labels
    if settings.attack == "label-flip":
        labels = flip_labels(labels, dataset_info(settings.dataset).num_classes)
    device = choose_device(settings.device)
    with _model_from_message(msg, settings) as (model, source):
        start = time.perf_counter()
        update, train_loss = compute_update(  # copies: the update outlives the model's loan
            model,
            data.images,
            labels,
            mode=mode,
            batch_size=batch_size,
            local_batches=local_batches,
            local_steps=local_steps,
            local_lr=local_lr,
            seed=seed,
            device=device,
            local_epochs=local_epochs,
            local_momentum=local_momentum,
        )
        compute_time = time.perf_counter() - start
    steps = steps_per_message(
        mode, local_batches, local_steps, local_epochs, batch_size, max(1, len(data))
    )
    sleep_time = 0.0
    if settings.step_seconds > 0:  # after the model's loan: a sleeping node holds none
        sleep_time = emulate_device(steps, settings.step_seconds, compute_time, time.sleep)

    received = _record(msg, "arrays", ArrayRecord)
    if settings.attack in ("sign-flip", "noise"):
        sent = [received[key].numpy() for key in source] if mode == "weights" else None
        update = lie(settings.attack, update, sent, seed)
    by_received_key = dict(zip(source, update))
    out = ArrayRecord()
    for key in received.keys():  # same keys, same order as received
        out[key] = Array.from_numpy_ndarray(by_received_key[key])

    metrics = {
        "num-examples": num_examples_used(
            len(data),
            mode=mode,
            batch_size=batch_size,
            local_batches=local_batches,
            local_steps=local_steps,
            local_epochs=local_epochs,
        ),
        "model-version": model_version,
        "partition-id": settings.partition_id,
        "num-partitions": settings.partition.num_partitions,
        "train-loss": float(train_loss),
        "compute-time": float(compute_time),
        # What work scheduling reads (docs/PORTING.md): the steps done and their
        # seconds; a simulated device reports the seconds its time model drew.
        "train-steps": int(steps),
        "train-seconds": (
            _get_float(config, "virtual-train-seconds", None)
            if "virtual-train-seconds" in config
            else float(compute_time + sleep_time)
        ),
    }
    if "virtual-duration" in config:
        metrics["virtual-duration"] = _get_float(config, "virtual-duration", None)
    if settings.step_seconds > 0:
        metrics["sleep-time"] = float(sleep_time)
    return Message(RecordDict({"arrays": out, "metrics": MetricRecord(metrics)}), reply_to=msg)


@app.evaluate()
def evaluate_handler(msg: Message, context: Context) -> Message:
    """Evaluate the received weights on this node's evaluation set."""
    settings = RunSettings.from_context(context)
    settings.apply_threads()
    data = _eval_data(
        settings.dataset,
        settings.data_root,
        settings.partition,
        settings.partition_id,
        settings.eval_max_examples,
        settings.data_dir,
        settings.cache_dir,
    )
    with _model_from_message(msg, settings) as (model, _):
        loss, accuracy = evaluate(
            model, data.images, data.labels, device=choose_device(settings.device)
        )
    metrics = MetricRecord(
        {"num-examples": len(data), "eval-loss": float(loss), "eval-accuracy": float(accuracy)}
    )
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)
