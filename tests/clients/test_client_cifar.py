"""CIFAR-10 / CIFAR-100 readers on small files written in the real python format.

The files are what the CIFAR python archives hold: Python 2 pickles (protocol 2,
keys and the pixel buffer as Python 2 ``str``, so they load as ``b"data"`` with
``encoding="bytes"`` and as ``"data"`` with ``encoding="latin1"``) of dicts with
``data`` (uint8 ``[N, 3072]``, channel planes R, G, B of a row-major 32x32 image)
and ``labels`` (CIFAR-10) or ``fine_labels`` / ``coarse_labels`` (CIFAR-100), plus a
meta file with the class names. :class:`Py2Pickler` writes that format from
Python 3. Nothing is downloaded.
"""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from clients import datasets as ds
from clients.datasets import DATASETS, load_dataset, read_cifar_batch
from clients.models import build_model, count_parameters


def _images(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 256, (n, 3072), dtype=np.uint8)


class Py2Pickler(pickle._Pickler):
    """Protocol-2 pickler writing ``bytes`` as Python 2 ``str`` (BINSTRING opcodes),
    as cPickle did when the CIFAR archives were made."""

    dispatch = pickle._Pickler.dispatch.copy()

    def save_py2_str(self, obj: bytes) -> None:
        n = len(obj)
        if n < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([n]) + obj)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", n) + obj)
        self.memoize(obj)

    dispatch[bytes] = save_py2_str


def _dump(path: Path, entry: dict, *, py2: bool = True) -> None:
    with path.open("wb") as fh:
        if py2:
            Py2Pickler(fh, protocol=2).dump(entry)
        else:  # a Python 3 pickle with bytes keys also reads
            pickle.dump(entry, fh, protocol=4)


def make_cifar10(root: Path, per_batch: int = 6, n_test: int = 8) -> Path:
    """``root/cifar-10-batches-py`` with 5 train batches, a test batch and the meta."""
    rng = np.random.default_rng(10)
    base = root / "cifar-10-batches-py"
    base.mkdir(parents=True)
    for i in range(1, 6):
        labels = [(i + j) % 10 for j in range(per_batch)]
        _dump(
            base / f"data_batch_{i}",
            {
                b"batch_label": f"training batch {i} of 5".encode(),
                b"labels": labels,
                b"data": _images(rng, per_batch),
                b"filenames": [b"x.png"] * per_batch,
            },
        )
    _dump(
        base / "test_batch",
        {
            b"batch_label": b"testing batch 1 of 1",
            b"labels": [j % 10 for j in range(n_test)],
            b"data": _images(rng, n_test),
            b"filenames": [b"y.png"] * n_test,
        },
    )
    _dump(
        base / "batches.meta",
        {
            b"label_names": [f"c{k}".encode() for k in range(10)],
            b"num_cases_per_batch": per_batch,
            b"num_vis": 3072,
        },
    )
    return root


def make_cifar100(root: Path, n_train: int = 30, n_test: int = 12) -> Path:
    """``root/cifar-100-python`` with train, test and meta."""
    rng = np.random.default_rng(100)
    base = root / "cifar-100-python"
    base.mkdir(parents=True)
    for split, n in (("train", n_train), ("test", n_test)):
        fine = [(7 * j) % 100 for j in range(n)]
        _dump(
            base / split,
            {
                b"filenames": [b"z.png"] * n,
                b"batch_label": split.encode(),
                b"fine_labels": fine,
                b"coarse_labels": [f // 5 for f in fine],
                b"data": _images(rng, n),
            },
        )
    _dump(
        base / "meta",
        {
            b"fine_label_names": [f"f{k}".encode() for k in range(100)],
            b"coarse_label_names": [f"c{k}".encode() for k in range(20)],
        },
    )
    return root


@pytest.fixture(autouse=True)
def _fresh_cache():
    ds._load_cached.cache_clear()
    yield
    ds._load_cached.cache_clear()


def test_cifar10_shapes_labels_and_pixel_layout(tmp_path):
    root = make_cifar10(tmp_path)
    train, test = load_dataset("cifar10", root)
    assert train.images.shape == (30, 3, 32, 32) and test.images.shape == (8, 3, 32, 32)
    assert train.images.dtype == torch.uint8 and train.labels.dtype == torch.int64
    assert train.num_classes == test.num_classes == 10
    # batches are concatenated in order data_batch_1 .. data_batch_5
    assert train.labels.tolist() == [(i + j) % 10 for i in range(1, 6) for j in range(6)]
    assert test.labels.tolist() == [j % 10 for j in range(8)]
    with (root / "cifar-10-batches-py" / "data_batch_2").open("rb") as fh:
        raw = pickle.load(fh, encoding="bytes")[b"data"]
    # row k: 1024 red, then 1024 green, then 1024 blue values, each plane row-major
    img = train.images[6 + 1]
    assert torch.equal(img[0].flatten(), torch.from_numpy(raw[1, :1024]))
    assert torch.equal(img[2].flatten(), torch.from_numpy(raw[1, 2048:]))
    assert int(img[1, 3, 5]) == int(raw[1, 1024 + 3 * 32 + 5])


def test_generated_files_have_the_python2_layout(tmp_path):
    root = make_cifar10(tmp_path)
    with (root / "cifar-10-batches-py" / "data_batch_1").open("rb") as fh:
        as_bytes = pickle.load(fh, encoding="bytes")
    with (root / "cifar-10-batches-py" / "data_batch_1").open("rb") as fh:
        as_latin1 = pickle.load(fh, encoding="latin1")
    assert as_bytes[b"data"].dtype == np.uint8 and as_bytes[b"data"].shape == (6, 3072)
    assert np.array_equal(as_latin1["data"], as_bytes[b"data"])


def test_python3_pickles_with_bytes_keys_also_read(tmp_path):
    path = tmp_path / "b"
    data = np.arange(2 * 3072, dtype=np.int64).astype(np.uint8).reshape(2, 3072)
    _dump(path, {b"data": data, b"labels": [3, 4]}, py2=False)
    images, labels = read_cifar_batch(path)
    assert images.shape == (2, 3, 32, 32) and labels.tolist() == [3, 4]
    assert np.array_equal(images.reshape(2, -1), data)


def test_cifar10_root_may_be_the_batches_folder_itself(tmp_path):
    root = make_cifar10(tmp_path)
    a, _ = load_dataset("cifar10", root)
    b, _ = load_dataset("cifar10", root / "cifar-10-batches-py")
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)


def test_cifar100_uses_the_fine_labels(tmp_path):
    root = make_cifar100(tmp_path)
    train, test = load_dataset("cifar100", root)
    assert train.images.shape == (30, 3, 32, 32) and test.images.shape == (12, 3, 32, 32)
    assert train.num_classes == 100
    assert train.labels.tolist() == [(7 * j) % 100 for j in range(30)]
    assert int(train.labels.max()) > 19  # fine (100), not coarse (20) labels


def test_reader_agrees_with_torchvision_on_the_same_files(tmp_path, monkeypatch):
    """torchvision reads the generated files as real CIFAR once its md5 check is bypassed."""
    import torchvision.datasets.cifar as tvc

    monkeypatch.setattr(tvc, "check_integrity", lambda *a, **k: True)
    monkeypatch.setattr(tvc.CIFAR10, "_check_integrity", lambda self: True)
    root10 = make_cifar10(tmp_path / "c10")
    root100 = make_cifar100(tmp_path / "c100")
    for name, root, cls in (("cifar10", root10, tvc.CIFAR10), ("cifar100", root100, tvc.CIFAR100)):
        ours_train, ours_test = load_dataset(name, root)
        for train, ours in ((True, ours_train), (False, ours_test)):
            ref = cls(str(root), train=train, download=False)
            assert np.array_equal(ref.data, ours.images.permute(0, 2, 3, 1).numpy())  # HWC there
            assert ref.targets == ours.labels.tolist()
            assert len(ref.classes) == ours.num_classes


def test_missing_folder_says_how_to_download(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        load_dataset("cifar10", tmp_path)
    msg = str(err.value)
    assert "batches.meta" in msg and "cifar-10-batches-py" in msg
    assert "python -m clients.datasets download cifar10 DIR" in msg and "data-root" in msg


def test_missing_batch_file_is_named(tmp_path):
    root = make_cifar10(tmp_path)
    (root / "cifar-10-batches-py" / "data_batch_4").unlink()
    with pytest.raises(FileNotFoundError, match="data_batch_4 not found.*download cifar10"):
        load_dataset("cifar10", root)
    root100 = make_cifar100(tmp_path / "x")
    (root100 / "cifar-100-python" / "test").unlink()
    with pytest.raises(FileNotFoundError, match="test not found.*download cifar100"):
        load_dataset("cifar100", root100)


def test_missing_root_says_how_to_download(tmp_path):
    with pytest.raises(FileNotFoundError, match="download cifar100"):
        load_dataset("cifar100", tmp_path / "nowhere")


def test_corrupt_files_are_reported(tmp_path):
    root = make_cifar10(tmp_path)
    batch = root / "cifar-10-batches-py" / "data_batch_1"
    batch.write_bytes(batch.read_bytes()[:100])  # truncated
    with pytest.raises(ValueError, match="Corrupt CIFAR file .*data_batch_1"):
        read_cifar_batch(batch)
    _dump(batch, {b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]})
    with pytest.raises(ValueError, match=r"expected uint8 data \[N, 3072\]"):
        read_cifar_batch(batch)
    _dump(batch, {b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]})
    with pytest.raises(ValueError, match="must hold 2 integers"):
        read_cifar_batch(batch)
    _dump(batch, {b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 12]})
    with pytest.raises(ValueError, match=r"label range \[0, 12\] outside \[0, 10\)"):
        load_dataset("cifar10", root)


def test_a_pickle_that_would_run_code_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    path = tmp_path / "data_batch_1"
    with path.open("wb") as fh:
        pickle.dump({b"data": Evil(), b"labels": []}, fh)
    with pytest.raises(ValueError, match="builtins.print is not allowed"):
        read_cifar_batch(path)


def test_registry_and_models_for_32x32x3():
    for name, classes, params in (("cifar10", 10, 188_810), ("cifar100", 100, 200_420)):
        info = DATASETS[name]
        assert (info.num_classes, info.image_shape) == (classes, (3, 32, 32))
        model = build_model(name, seed=0)
        assert count_parameters(model) == params
        assert all(v.dtype == torch.float32 for v in model.state_dict().values())
        out = model(torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8))
        assert out.shape == (4, classes)


def test_download_is_behind_a_command_and_never_automatic(tmp_path, monkeypatch):
    """Loading never downloads; `download` calls torchvision with download=True."""
    calls = []

    class FakeCIFAR10:
        def __init__(self, root, train, download):
            calls.append((root, train, download))

    import torchvision.datasets as tv

    monkeypatch.setattr(tv, "CIFAR10", FakeCIFAR10)
    assert ds.download("cifar10", tmp_path / "d") == tmp_path / "d"
    assert calls == [(str(tmp_path / "d"), True, True), (str(tmp_path / "d"), False, True)]
    with pytest.raises(ValueError, match="downloadable"):
        ds.download("imagenet", tmp_path)
