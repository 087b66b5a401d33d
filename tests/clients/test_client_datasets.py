"""Dataset loading: the IDX reader on the real Fashion-MNIST and on broken files."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from clients.datasets import DATASETS, ImageData, dataset_info, load_dataset, read_idx

FMNIST_ROOT = Path("/usr/share/datasets/fashion-mnist")
FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)


def write_idx(path: Path, array: np.ndarray, *, compress: bool = True) -> None:
    """Write a uint8 array in IDX format (the inverse of read_idx)."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(
        int(s).to_bytes(4, "big") for s in array.shape
    )
    raw = header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()
    if compress:
        with gzip.open(path, "wb") as fh:
            fh.write(raw)
    else:
        path.write_bytes(raw)


def make_fake_root(root: Path, n_train: int = 20, n_test: int = 10, **kw) -> Path:
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    suffix = ".gz" if kw.get("compress", True) else ""
    for split, n in (("train", n_train), ("t10k", n_test)):
        write_idx(
            root / f"{split}-images-idx3-ubyte{suffix}", rng.integers(0, 256, (n, 28, 28)), **kw
        )
        write_idx(root / f"{split}-labels-idx1-ubyte{suffix}", np.arange(n) % 10, **kw)
    return root


# ------------------------------------------------------------------ real data
def test_real_fashion_mnist_sizes_dtypes_and_label_histogram():
    train, test = load_dataset("fashion-mnist", FMNIST_ROOT)
    assert train.images.shape == (60000, 1, 28, 28)
    assert test.images.shape == (10000, 1, 28, 28)
    assert train.images.dtype == torch.uint8 and train.labels.dtype == torch.int64
    assert train.num_classes == test.num_classes == 10
    assert torch.bincount(train.labels, minlength=10).tolist() == [6000] * 10
    assert torch.bincount(test.labels, minlength=10).tolist() == [1000] * 10
    # First training labels of Fashion-MNIST (ankle boot, t-shirt, t-shirt, dress).
    assert train.labels[:4].tolist() == [9, 0, 0, 3]
    assert int(train.images.max()) == 255 and int(train.images.min()) == 0


def test_normalisation_constants_match_the_real_training_pixels():
    train, _ = load_dataset("fashion-mnist", FMNIST_ROOT)
    x = train.images.to(torch.float64) / 255.0
    info = dataset_info("fashion-mnist")
    assert info.mean[0] == pytest.approx(x.mean().item(), abs=1e-4)
    assert info.std[0] == pytest.approx(x.std().item(), abs=1e-4)


def test_load_is_cached_per_process():
    a = load_dataset("fashion-mnist", FMNIST_ROOT)
    b = load_dataset("fashion-mnist", str(FMNIST_ROOT))
    assert a[0] is b[0] and a[1] is b[1]


def test_read_idx_agrees_with_torchvision_reader(tmp_path):
    from torchvision.datasets.mnist import read_sn3_pascalvincent_tensor

    plain = tmp_path / "t10k-images-idx3-ubyte"
    with gzip.open(FMNIST_ROOT / "t10k-images-idx3-ubyte.gz") as src, open(plain, "wb") as dst:
        shutil.copyfileobj(src, dst)
    ours = read_idx(FMNIST_ROOT / "t10k-images-idx3-ubyte.gz")
    theirs = read_sn3_pascalvincent_tensor(str(plain)).numpy()
    assert ours.dtype == np.uint8 and ours.shape == (10000, 28, 28)
    np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(read_idx(plain), ours)  # uncompressed too


# ------------------------------------------------------------ synthetic files
def test_read_idx_roundtrip_and_uncompressed_root(tmp_path):
    root = make_fake_root(tmp_path / "plain", compress=False)
    train, test = load_dataset("fashion-mnist", root)
    assert len(train) == 20 and len(test) == 10
    assert train.labels.tolist() == [i % 10 for i in range(20)]
    raw = read_idx(root / "train-images-idx3-ubyte")
    assert torch.equal(train.images[:, 0], torch.from_numpy(raw))


def test_torchvision_download_layout_is_found(tmp_path):
    make_fake_root(tmp_path / "FashionMNIST" / "raw")
    train, test = load_dataset("fashion-mnist", tmp_path)
    assert (len(train), len(test)) == (20, 10)


def test_missing_root_says_how_to_install(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        load_dataset("fashion-mnist", tmp_path / "nowhere")


def test_missing_file_names_it_and_says_how_to_install(tmp_path):
    root = make_fake_root(tmp_path / "d")
    (root / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(FileNotFoundError) as err:
        load_dataset("fashion-mnist", root)
    msg = str(err.value)
    assert "t10k-labels-idx1-ubyte" in msg
    assert "apt-get install dataset-fashion-mnist" in msg
    assert "data-root" in msg and "download=True" in msg


def test_truncated_file_is_reported_as_corrupt(tmp_path):
    root = make_fake_root(tmp_path / "d")
    path = root / "train-images-idx3-ubyte.gz"
    raw = gzip.decompress(path.read_bytes())
    path.write_bytes(gzip.compress(raw[:-100]))
    with pytest.raises(ValueError, match=r"Corrupt IDX file .*train-images.*holds"):
        load_dataset("fashion-mnist", root)


def test_bad_magic_number(tmp_path):
    path = tmp_path / "x-idx1-ubyte"
    path.write_bytes(b"\x12\x34\x08\x01" + (3).to_bytes(4, "big") + b"abc")
    with pytest.raises(ValueError, match="bad magic number 12340801"):
        read_idx(path)


def test_not_gzip_although_named_gz(tmp_path):
    path = tmp_path / "x-idx1-ubyte.gz"
    path.write_bytes(b"this is not gzip data at all")
    with pytest.raises(ValueError, match="cannot decompress"):
        read_idx(path)


def test_image_and_label_counts_must_agree(tmp_path):
    root = make_fake_root(tmp_path / "d")
    write_idx(root / "train-labels-idx1-ubyte.gz", np.zeros(19))
    with pytest.raises(ValueError, match="20 images but .* 19 labels"):
        load_dataset("fashion-mnist", root)


def test_labels_out_of_range(tmp_path):
    root = make_fake_root(tmp_path / "d")
    write_idx(root / "t10k-labels-idx1-ubyte.gz", np.full(10, 10))
    with pytest.raises(ValueError, match=r"label 10 outside \[0, 10\)"):
        load_dataset("fashion-mnist", root)


def test_unknown_dataset_names_the_key():
    with pytest.raises(ValueError, match="dataset='cifar-1000'"):
        load_dataset("cifar-1000", "/tmp")
    assert "fashion-mnist" in DATASETS


def test_imagedata_validates():
    with pytest.raises(ValueError, match="uint8"):
        ImageData(torch.zeros(2, 1, 4, 4), torch.zeros(2, dtype=torch.int64), 10)
    with pytest.raises(ValueError, match="2 images but 3 labels"):
        ImageData(torch.zeros(2, 1, 4, 4, dtype=torch.uint8), torch.zeros(3, dtype=torch.int64), 10)
    with pytest.raises(ValueError, match="labels must lie"):
        ImageData(torch.zeros(1, 1, 4, 4, dtype=torch.uint8), torch.tensor([10]), 10)
