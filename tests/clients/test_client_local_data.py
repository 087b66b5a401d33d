"""A node's own images (node config data-dir), the on-disk cache (cache-dir) and the
device choice (device), on small generated folders of PNG files."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, Metadata, RecordDict
from PIL import Image

from clients import client_app as client_app_module
from clients.client_app import app
from clients.datasets import ImageData, dataset_info
from clients.device import choose_device
from clients.local_data import (
    class_index,
    disk_cached,
    folder_fingerprint,
    image_folder_split,
    load_image_folder,
)
from clients.models import build_model
from clients.training import compute_update, evaluate

FMNIST = dataset_info("fashion-mnist")
# folder name -> (label, RGB colour of its images)
CLASSES = {"0": (0, (255, 0, 0)), "sneaker": (7, (0, 255, 0)), "Ankle boot": (9, (0, 0, 255))}


def _gray(rgb: tuple[int, int, int]) -> int:
    """PIL's ITU-R 601-2 luma transform ("L" mode), as torchvision's Grayscale."""
    r, g, b = rgb
    return (r * 299 + g * 587 + b * 114 + 500) // 1000


def make_folder(root: Path, per_class: int = 3, size=(40, 32)) -> Path:
    for name, (_, colour) in CLASSES.items():
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", size, colour).save(root / name / f"img{i}.png")
    (root / "0" / "notes.txt").write_text("not an image")
    return root


@pytest.fixture(autouse=True)
def _fresh_caches():
    client_app_module._train_data.cache_clear()
    client_app_module._eval_data.cache_clear()
    yield
    client_app_module._train_data.cache_clear()
    client_app_module._eval_data.cache_clear()


# ------------------------------------------------------------------ ImageFolder
def test_image_folder_becomes_grayscale_28x28_with_global_labels(tmp_path):
    data = load_image_folder(make_folder(tmp_path / "imgs"), FMNIST)
    assert isinstance(data, ImageData)
    assert data.images.dtype == torch.uint8 and data.images.shape == (9, 1, 28, 28)
    assert data.labels.dtype == torch.int64 and data.num_classes == 10
    # ImageFolder order: class folders sorted by name ("0", "Ankle boot", "sneaker")
    assert data.labels.tolist() == [0] * 3 + [9] * 3 + [7] * 3
    for name, (label, colour) in CLASSES.items():
        rows = data.images[data.labels == label]
        assert torch.all(rows == _gray(colour)), name


def test_resize_keeps_aspect_and_crops_the_centre(tmp_path):
    folder = tmp_path / "imgs" / "3"
    folder.mkdir(parents=True)
    wide = Image.new("L", (112, 56), 0)
    wide.paste(255, (28, 0, 84, 56))  # white centre square, black side bands
    wide.save(folder / "wide.png")
    data = load_image_folder(tmp_path / "imgs", FMNIST)
    assert data.images.shape == (1, 1, 28, 28)
    # The black side bands were cropped away (only the outer columns are blended by
    # the antialiased resize); a plain 28x28 resize would have kept them.
    assert int(data.images[..., 1:-1].min()) == 255
    assert float(data.images.float().mean()) > 250


def test_class_folder_names(tmp_path):
    assert class_index("4", FMNIST) == 4
    assert class_index("T-shirt_top", FMNIST) == 0
    assert class_index("ANKLE_BOOT", FMNIST) == 9
    for bad in ("10", "cat", "", "-1"):
        with pytest.raises(ValueError, match="class folder"):
            class_index(bad, FMNIST)
    (tmp_path / "imgs" / "cat").mkdir(parents=True)
    Image.new("L", (28, 28), 1).save(tmp_path / "imgs" / "cat" / "a.png")
    with pytest.raises(ValueError, match="'cat'.*T-shirt/top"):
        load_image_folder(tmp_path / "imgs", FMNIST)


def test_empty_or_missing_folder_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="data-dir"):
        load_image_folder(tmp_path / "missing", FMNIST)
    (tmp_path / "empty" / "1").mkdir(parents=True)
    with pytest.raises(ValueError, match="no image"):
        load_image_folder(tmp_path / "empty", FMNIST)
    (tmp_path / "flat").mkdir()
    with pytest.raises(ValueError, match="no class folders"):
        load_image_folder(tmp_path / "flat", FMNIST)


def test_train_test_split_layout(tmp_path):
    flat = make_folder(tmp_path / "flat")
    assert image_folder_split(flat, "train") == flat
    assert image_folder_split(flat, "test") == flat
    split = tmp_path / "split"
    make_folder(split / "train")
    assert image_folder_split(split, "train") == split / "train"
    assert image_folder_split(split, "test") == split / "train"  # no test/ folder
    make_folder(split / "test", per_class=1)
    assert image_folder_split(split, "test") == split / "test"


# ---------------------------------------------------------------- on-disk cache
def test_disk_cache_writes_once_and_reads_back(tmp_path):
    data = ImageData(
        torch.arange(2 * 28 * 28, dtype=torch.int64)
        .remainder(256)
        .to(torch.uint8)
        .view(2, 1, 28, 28),
        torch.tensor([1, 2]),
        10,
    )
    calls = []

    def build():
        calls.append(1)
        return data

    first = disk_cached(tmp_path / "cache", "train", {"a": 1}, build)
    again = disk_cached(tmp_path / "cache", "train", {"a": 1}, build)
    assert len(calls) == 1
    assert torch.equal(first.images, again.images) and torch.equal(first.labels, again.labels)
    assert again.num_classes == 10
    assert [p.name.startswith("train-") for p in (tmp_path / "cache").iterdir()] == [True]
    disk_cached(tmp_path / "cache", "train", {"a": 2}, build)  # another key
    assert len(calls) == 2
    disk_cached(None, "train", {"a": 1}, build)  # no cache folder: always built
    assert len(calls) == 3


def test_corrupt_cache_entry_is_rebuilt(tmp_path):
    data = ImageData(torch.zeros((1, 1, 28, 28), dtype=torch.uint8), torch.tensor([0]), 10)
    disk_cached(tmp_path, "train", {"k": 0}, lambda: data)
    (entry,) = tmp_path.glob("train-*.pt")
    entry.write_bytes(b"truncated")
    calls = []
    out = disk_cached(tmp_path, "train", {"k": 0}, lambda: calls.append(1) or data)
    assert calls == [1] and torch.equal(out.images, data.images)
    assert torch.load(entry, weights_only=True)["labels"].tolist() == [0]  # rewritten


def test_fingerprint_follows_the_files(tmp_path):
    folder = make_folder(tmp_path / "imgs")
    before = folder_fingerprint(folder)
    assert before == folder_fingerprint(folder)
    Image.new("RGB", (28, 28), (1, 2, 3)).save(folder / "0" / "new.png")
    assert folder_fingerprint(folder) != before
    assert folder_fingerprint(tmp_path / "missing") == ""


# ---------------------------------------------------------- the ClientApp on it
def _message(content: RecordDict, message_type: str) -> Message:
    metadata = Metadata(
        run_id=1,
        message_id="m",
        src_node_id=1,
        dst_node_id=2,
        reply_to_message_id="",
        group_id="",
        created_at=time.time(),
        ttl=600.0,
        message_type=message_type,
    )
    return Message(content=content, metadata=metadata)


def _context(node_config: dict) -> Context:
    return Context(
        run_id=1,
        node_id=2,
        node_config={"partition-id": 1, "num-partitions": 3, **node_config},
        state=RecordDict(),
        # data-root does not exist: a node with a data-dir never reads the data set
        run_config={"dataset": "fashion-mnist", "data-root": "/nonexistent", "seed": 0},
    )


def _no_decoding(*args, **kwargs):
    raise AssertionError("images decoded although the disk cache holds them")


def test_client_app_trains_on_its_data_dir(tmp_path):
    folder = make_folder(tmp_path / "imgs", per_class=4)
    cache = tmp_path / "cache"
    ctx = _context({"data-dir": str(folder), "cache-dir": str(cache)})
    weights = ArrayRecord(build_model("fashion-mnist", seed=0).state_dict())

    query = app(_message(RecordDict({"config": ConfigRecord()}), "query"), ctx)
    assert not query.has_error()
    assert query.content["metrics"]["num-examples"] == 12
    assert query.content["metrics"]["partition-id"] == 1

    config = ConfigRecord({"mode": "gradient", "batch-size": 5, "seed": 7, "model-version": 3})
    reply = app(_message(RecordDict({"arrays": weights, "config": config}), "train"), ctx)
    assert not reply.has_error(), reply.error if reply.has_error() else None
    metrics = reply.content["metrics"]
    assert metrics["num-examples"] == 5 and metrics["model-version"] == 3

    data = load_image_folder(folder, FMNIST)
    model = build_model("fashion-mnist", seed=0)
    expected, loss = compute_update(
        model, data.images, data.labels, mode="gradient", batch_size=5, seed=7
    )
    got = reply.content["arrays"].to_numpy_ndarrays()
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)
    assert metrics["train-loss"] == pytest.approx(loss)
    assert len(list(cache.glob("train-*.pt"))) == 1

    # A new process starts with empty in-memory caches: it reads the disk cache and
    # decodes no image.
    client_app_module._train_data.cache_clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(client_app_module, "load_image_folder", _no_decoding)
        again = app(_message(RecordDict({"arrays": weights, "config": config}), "train"), ctx)
    assert not again.has_error()
    for a, b in zip(again.content["arrays"].to_numpy_ndarrays(), expected):
        np.testing.assert_array_equal(a, b)

    evaluation = app(_message(RecordDict({"arrays": weights}), "evaluate"), ctx)
    assert not evaluation.has_error()
    assert evaluation.content["metrics"]["num-examples"] == 12  # no test/ folder


def test_client_app_rejects_an_unusable_device(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    folder = make_folder(tmp_path / "imgs")
    msg = _message(RecordDict({"config": ConfigRecord()}), "query")
    with pytest.raises(ValueError, match="device='cuda'"):
        app(msg, _context({"data-dir": str(folder), "device": "cuda"}))
    with pytest.raises(ValueError, match="device='tpu'"):
        app(msg, _context({"data-dir": str(folder), "device": "tpu"}))


# --------------------------------------------------------------------- devices
def test_choose_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert choose_device() == torch.device("cpu")
    assert choose_device("auto") == torch.device("cpu")
    assert choose_device("CPU") == torch.device("cpu")
    for bad in ("cuda", "cuda:0", "cuda:x", "gpu", 3):
        with pytest.raises(ValueError, match="device"):
            choose_device(bad)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert choose_device("auto") == torch.device("cuda")
    assert choose_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="2 CUDA device"):
        choose_device("cuda:2")


@pytest.mark.parametrize("mode", ["gradient", "delta", "weights"])
def test_cpu_device_is_the_plain_computation(mode):
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (40, 1, 28, 28), dtype=torch.uint8, generator=gen)
    labels = torch.randint(0, 10, (40,), generator=gen)
    model = build_model("fashion-mnist", seed=1)
    kwargs = dict(mode=mode, batch_size=8, local_batches=2, local_steps=2, seed=5)
    plain, plain_loss = compute_update(model, images, labels, **kwargs)
    on_cpu, cpu_loss = compute_update(model, images, labels, device=choose_device("cpu"), **kwargs)
    assert plain_loss == cpu_loss
    for a, b in zip(plain, on_cpu):
        np.testing.assert_array_equal(a, b)
    assert evaluate(model, images, labels) == evaluate(model, images, labels, device="cpu")
