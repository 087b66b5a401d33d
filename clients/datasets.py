"""Image datasets as in-memory tensors, behind a small name -> loader registry.

Every dataset is returned as two :class:`ImageData` (train, test) holding

- ``images``: ``torch.uint8`` tensor of shape ``[N, C, H, W]``, raw pixel values
  0..255 (no scaling, no normalisation; the model normalises, see
  :mod:`clients.models`);
- ``labels``: ``torch.int64`` tensor of shape ``[N]`` with values in
  ``[0, num_classes)``.

Registered datasets (:data:`DATASETS`):

- ``"fashion-mnist"``: the four IDX files of Fashion-MNIST (60,000 train and 10,000
  test images, 1x28x28, 10 classes), gzip-compressed or not, read by
  :func:`read_idx`. Offline source: the Debian/Ubuntu package
  ``dataset-fashion-mnist`` (files in ``/usr/share/datasets/fashion-mnist``).

- ``"cifar10"``: CIFAR-10 in its python format (50,000 train and 10,000 test
  images, 3x32x32, 10 classes): the folder ``cifar-10-batches-py`` with the pickled
  batches ``data_batch_1`` .. ``data_batch_5``, ``test_batch`` and ``batches.meta``,
  read by :func:`read_cifar_batch`.
- ``"cifar100"``: CIFAR-100 in its python format (50,000 / 10,000 images, 3x32x32,
  100 fine classes): the folder ``cifar-100-python`` with ``train``, ``test`` and
  ``meta``; the labels are the ``fine_labels``.

  For both, ``data-root`` may be the folder holding ``cifar-10-batches-py`` /
  ``cifar-100-python`` (torchvision's ``root``) or that folder itself. There is no
  offline package; with internet access, ``python -m clients.datasets download
  cifar10 DIR`` (or ``cifar100``) fetches the archive through torchvision
  (``download=True``) and unpacks it under ``DIR``; then set ``data-root=DIR``.
  Nothing else in this project downloads anything.

Adding a dataset (for example an ImageFolder tree) means writing one
``loader(root) -> (train, test)`` function and one :class:`DatasetInfo` entry in
:data:`DATASETS` (and a model in :mod:`clients.models`); nothing else changes.

Loading is cached per process (``cachetools.func.lru_cache`` keyed on name and root):
a Flower simulation calls the ClientApp many times in the same worker process, and
every call after the first gets the same tensors back. Callers must therefore treat
the returned tensors as read-only. The cache is thread-safe and builds each entry
once: threads that ask for an entry being loaded wait for it (the in-process grid
calls the ClientApp from several threads at once).
"""

from __future__ import annotations

import gzip
import os
import pickle
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from cachetools.func import lru_cache

__all__ = [
    "DATASETS",
    "DatasetInfo",
    "ImageData",
    "dataset_info",
    "download",
    "load_dataset",
    "read_cifar_batch",
    "read_idx",
]


@dataclass(frozen=True)
class ImageData:
    """A labelled image set held in memory.

    Attributes
    ----------
    images : torch.Tensor
        ``torch.uint8``, shape ``[N, C, H, W]``, raw pixel values 0..255.
    labels : torch.Tensor
        ``torch.int64``, shape ``[N]``, class indices in ``[0, num_classes)``.
    num_classes : int
        Number of classes of the dataset (not necessarily all present here).

    Raises
    ------
    ValueError
        If dtypes, ranks, lengths or label values are inconsistent.
    """

    images: torch.Tensor
    labels: torch.Tensor
    num_classes: int

    def __post_init__(self) -> None:
        if self.images.dtype != torch.uint8 or self.images.dim() != 4:
            raise ValueError(
                "ImageData.images must be a uint8 tensor [N, C, H, W], got "
                f"{self.images.dtype} with shape {tuple(self.images.shape)}"
            )
        if self.labels.dtype != torch.int64 or self.labels.dim() != 1:
            raise ValueError(
                "ImageData.labels must be an int64 tensor [N], got "
                f"{self.labels.dtype} with shape {tuple(self.labels.shape)}"
            )
        if len(self.images) != len(self.labels):
            raise ValueError(
                f"ImageData has {len(self.images)} images but {len(self.labels)} labels"
            )
        if self.num_classes < 1:
            raise ValueError(f"ImageData.num_classes must be >= 1, got {self.num_classes}")
        if len(self.labels) and (
            int(self.labels.min()) < 0 or int(self.labels.max()) >= self.num_classes
        ):
            raise ValueError(
                f"ImageData labels must lie in [0, {self.num_classes}), got range "
                f"[{int(self.labels.min())}, {int(self.labels.max())}]"
            )

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, indices: torch.Tensor) -> ImageData:
        """Return the rows ``indices`` (int64 ``[M]``) as a new ImageData (a copy)."""
        return ImageData(self.images[indices], self.labels[indices], self.num_classes)


@dataclass(frozen=True)
class DatasetInfo:
    """Static description of a registered dataset.

    Attributes
    ----------
    name : str
        Registry key, e.g. ``"fashion-mnist"``.
    num_classes : int
        Number of classes.
    image_shape : tuple[int, int, int]
        ``(C, H, W)`` of one image.
    mean, std : tuple[float, ...]
        Per-channel mean and standard deviation of the training pixels scaled to
        [0, 1]; the model normalises inputs with ``(x / 255 - mean) / std``.
    loader : Callable[[Path], tuple[ImageData, ImageData]]
        Reads ``(train, test)`` from a data root directory.
    install_hint : str
        How to obtain the files; part of the error raised when they are missing.
    """

    name: str
    num_classes: int
    image_shape: tuple[int, int, int]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    loader: Callable[[Path], tuple[ImageData, ImageData]]
    install_hint: str


# --------------------------------------------------------------------------- IDX
_IDX_DTYPES = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Read one IDX file (the MNIST / Fashion-MNIST format), gzip-compressed or not.

    Layout: two zero bytes, a type code (0x08 = uint8, ...), the number of
    dimensions d, then d big-endian uint32 sizes, then the data in C order.

    Parameters
    ----------
    path : str or PathLike
        File to read; a name ending in ``.gz`` is decompressed with gzip.

    Returns
    -------
    np.ndarray
        Array of the stored dtype (native byte order) and shape.

    Raises
    ------
    FileNotFoundError
        If ``path`` does not exist.
    ValueError
        If the file is not valid gzip, has a bad magic number, or its data length
        does not match the sizes in its header (truncated or corrupt file).
    """
    path = Path(path)
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as fh:
                raw = fh.read()
        else:
            raw = path.read_bytes()
    except FileNotFoundError:
        raise
    except (OSError, EOFError, zlib.error) as err:  # gzip.BadGzipFile is an OSError
        raise ValueError(f"Corrupt IDX file {path}: cannot decompress ({err})") from err

    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError(
            f"Corrupt IDX file {path}: bad magic number {raw[:4].hex() or '(empty)'}"
            " (expected 0000 followed by a type code and the number of dimensions)"
        )
    dtype = _IDX_DTYPES[raw[2]]
    ndim = raw[3]
    header = 4 + 4 * ndim
    if ndim == 0 or len(raw) < header:
        raise ValueError(f"Corrupt IDX file {path}: truncated header ({len(raw)} bytes)")
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    expected = header + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) != expected:
        raise ValueError(
            f"Corrupt IDX file {path}: header announces shape {shape} "
            f"({expected} bytes in all) but the file holds {len(raw)} bytes"
        )
    data = np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)
    return data.astype(dtype.newbyteorder("="), copy=True)


def _find_file(root: Path, stem: str, hint: str) -> Path:
    """Locate ``stem`` or ``stem.gz`` in ``root`` or torchvision's ``raw`` folder."""
    candidates = []
    for folder in (root, root / "FashionMNIST" / "raw"):
        for name in (f"{stem}.gz", stem):
            candidates.append(folder / name)
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"Dataset file {stem}[.gz] not found in {root}. {hint}")


_FASHION_MNIST_HINT = (
    "Install the offline copy with `sudo apt-get install dataset-fashion-mnist` "
    "(files land in /usr/share/datasets/fashion-mnist), or set the run config key "
    "`data-root` to a directory holding the four files train-images-idx3-ubyte.gz, "
    "train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz; "
    'with internet access, `python -c "from torchvision.datasets import FashionMNIST; '
    "FashionMNIST('DIR', download=True)\"` downloads them and `data-root=DIR` then works."
)


def _load_mnist_like(root: Path, num_classes: int, hint: str) -> tuple[ImageData, ImageData]:
    """Read the four (Fashion-)MNIST IDX files under ``root``."""
    out = []
    for split in ("train", "t10k"):
        img_path = _find_file(root, f"{split}-images-idx3-ubyte", hint)
        lbl_path = _find_file(root, f"{split}-labels-idx1-ubyte", hint)
        images = read_idx(img_path)
        labels = read_idx(lbl_path)
        if images.dtype != np.uint8 or images.ndim != 3 or images.shape[1:] != (28, 28):
            raise ValueError(
                f"Corrupt dataset file {img_path}: expected uint8 images [N, 28, 28], "
                f"got {images.dtype} {images.shape}"
            )
        if labels.dtype != np.uint8 or labels.ndim != 1:
            raise ValueError(
                f"Corrupt dataset file {lbl_path}: expected uint8 labels [N], "
                f"got {labels.dtype} {labels.shape}"
            )
        if len(images) != len(labels):
            raise ValueError(
                f"Dataset files disagree: {img_path} holds {len(images)} images but "
                f"{lbl_path} holds {len(labels)} labels"
            )
        if len(labels) and int(labels.max()) >= num_classes:
            raise ValueError(
                f"Corrupt dataset file {lbl_path}: label {int(labels.max())} outside "
                f"[0, {num_classes})"
            )
        out.append(
            ImageData(
                images=torch.from_numpy(images).unsqueeze(1),  # [N, 1, 28, 28]
                labels=torch.from_numpy(labels.astype(np.int64)),
                num_classes=num_classes,
            )
        )
    return out[0], out[1]


def _load_fashion_mnist(root: Path) -> tuple[ImageData, ImageData]:
    return _load_mnist_like(root, 10, _FASHION_MNIST_HINT)


# ------------------------------------------------------------------------- CIFAR
_CIFAR_FOLDERS = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}


def _cifar_hint(name: str) -> str:
    folder = _CIFAR_FOLDERS[name]
    return (
        f"{name} has no offline package. With internet access, run "
        f"`python -m clients.datasets download {name} DIR` (torchvision, download=True), "
        f"which unpacks {folder}/ under DIR, then set the run config key `data-root=DIR`; "
        f"or point `data-root` at a folder holding {folder}/ (or at {folder}/ itself) "
        "in the CIFAR python format (https://www.cs.toronto.edu/~kriz/cifar.html)."
    )


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickler that only builds numpy arrays besides plain Python containers.

    The CIFAR files are pickles; refusing every other global keeps a tampered file
    from running code when it is read.
    """

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str):  # noqa: D401 - pickle API
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a CIFAR file")


def _str_keys(entry: dict) -> dict:
    return {(k.decode("latin1") if isinstance(k, bytes) else k): v for k, v in entry.items()}


def _unpickle(path: Path) -> dict:
    try:
        with path.open("rb") as fh:
            entry = _NumpyOnlyUnpickler(fh, encoding="latin1").load()
    except FileNotFoundError:
        raise
    except Exception as err:  # truncated, not a pickle, forbidden global, ...
        raise ValueError(f"Corrupt CIFAR file {path}: cannot unpickle ({err})") from err
    if not isinstance(entry, dict):
        raise ValueError(
            f"Corrupt CIFAR file {path}: expected a pickled dict, got {type(entry).__name__}"
        )
    return _str_keys(entry)


def read_cifar_batch(
    path: str | os.PathLike[str], label_key: str = "labels"
) -> tuple[np.ndarray, np.ndarray]:
    """Read one pickled batch of the CIFAR python format.

    The file is a pickled dict (keys ``bytes`` or ``str``) with ``data``: uint8
    ``[N, 3072]`` (each row the 1024 red, then green, then blue values of a 32x32
    image, row-major) and ``label_key`` (``"labels"`` for CIFAR-10,
    ``"fine_labels"`` for CIFAR-100): N integers.

    Returns
    -------
    (np.ndarray, np.ndarray)
        Images uint8 ``[N, 3, 32, 32]`` and labels int64 ``[N]``.

    Raises
    ------
    FileNotFoundError
        If ``path`` does not exist.
    ValueError
        If the file is not such a dict (a missing key, a bad shape or dtype, or
        counts that disagree).
    """
    path = Path(path)
    entry = _unpickle(path)
    for key in ("data", label_key):
        if key not in entry:
            raise ValueError(f"Corrupt CIFAR file {path}: no {key!r} entry (keys: {sorted(entry)})")
    data = np.asarray(entry["data"])
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise ValueError(
            f"Corrupt CIFAR file {path}: expected uint8 data [N, 3072], got {data.dtype} "
            f"{data.shape}"
        )
    labels = np.asarray(entry[label_key])
    if (
        labels.ndim != 1
        or len(labels) != len(data)
        or (len(labels) and labels.dtype.kind not in "iu")
    ):
        raise ValueError(
            f"Corrupt CIFAR file {path}: {label_key!r} must hold {len(data)} integers, "
            f"got {labels.dtype} {labels.shape}"
        )
    return data.reshape(-1, 3, 32, 32).copy(), labels.astype(np.int64)


def _cifar_dir(root: Path, name: str) -> Path:
    """``root/<folder>`` if it exists, else ``root`` itself if it is that folder."""
    folder = _CIFAR_FOLDERS[name]
    meta = "batches.meta" if name == "cifar10" else "meta"
    if (root / folder).is_dir():
        return root / folder
    if root.name == folder or (root / meta).is_file():
        return root
    return root / folder


def _load_cifar(root: Path, name: str, num_classes: int) -> tuple[ImageData, ImageData]:
    hint = _cifar_hint(name)
    base = _cifar_dir(root, name)
    if name == "cifar10":
        splits = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}
        meta_file, names_key, label_key = "batches.meta", "label_names", "labels"
    else:
        splits = {"train": ["train"], "test": ["test"]}
        meta_file, names_key, label_key = "meta", "fine_label_names", "fine_labels"
    for stem in [meta_file, *splits["train"], *splits["test"]]:
        if not (base / stem).is_file():
            raise FileNotFoundError(f"Dataset file {stem} not found in {base}. {hint}")
    meta = _unpickle(base / meta_file)
    if len(meta.get(names_key, ())) != num_classes:
        raise ValueError(
            f"Corrupt CIFAR file {base / meta_file}: expected {num_classes} {names_key!r}, "
            f"got {len(meta.get(names_key, ()))}"
        )
    out = []
    for split in ("train", "test"):
        parts = [read_cifar_batch(base / stem, label_key) for stem in splits[split]]
        images = np.concatenate([p[0] for p in parts])
        labels = np.concatenate([p[1] for p in parts])
        if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
            raise ValueError(
                f"Corrupt CIFAR {split} files in {base}: label range "
                f"[{labels.min()}, {labels.max()}] outside [0, {num_classes})"
            )
        out.append(ImageData(torch.from_numpy(images), torch.from_numpy(labels), num_classes))
    return out[0], out[1]


def _load_cifar10(root: Path) -> tuple[ImageData, ImageData]:
    return _load_cifar(root, "cifar10", 10)


def _load_cifar100(root: Path) -> tuple[ImageData, ImageData]:
    return _load_cifar(root, "cifar100", 100)


def download(name: str, root: str | os.PathLike[str]) -> Path:
    """Download a data set with torchvision (needs internet) and return ``data-root``.

    Only CIFAR-10 / CIFAR-100 (torchvision ``CIFAR10`` / ``CIFAR100`` with
    ``download=True``, checksum-verified) and Fashion-MNIST (``FashionMNIST``) are
    supported. Never called by the tests or by training.
    """
    from torchvision import datasets as tv  # imported here: training does not need it

    root = Path(root).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    cls = {"cifar10": tv.CIFAR10, "cifar100": tv.CIFAR100, "fashion-mnist": tv.FashionMNIST}
    if name not in cls:
        raise ValueError(f"Unknown dataset: dataset={name!r}; downloadable: {sorted(cls)}")
    for train in (True, False):
        cls[name](str(root), train=train, download=True)
    return root


# ---------------------------------------------------------------------- registry
DATASETS: dict[str, DatasetInfo] = {
    "fashion-mnist": DatasetInfo(
        name="fashion-mnist",
        num_classes=10,
        image_shape=(1, 28, 28),
        # Computed from the 60,000 training images scaled to [0, 1].
        mean=(0.2860,),
        std=(0.3530,),
        loader=_load_fashion_mnist,
        install_hint=_FASHION_MNIST_HINT,
    ),
    "cifar10": DatasetInfo(
        name="cifar10",
        num_classes=10,
        image_shape=(3, 32, 32),
        # The usual per-channel statistics of the 50,000 CIFAR-10 training images.
        mean=(0.4914, 0.4822, 0.4465),
        std=(0.2470, 0.2435, 0.2616),
        loader=_load_cifar10,
        install_hint=_cifar_hint("cifar10"),
    ),
    "cifar100": DatasetInfo(
        name="cifar100",
        num_classes=100,
        image_shape=(3, 32, 32),
        # The usual per-channel statistics of the 50,000 CIFAR-100 training images.
        mean=(0.5071, 0.4865, 0.4409),
        std=(0.2673, 0.2564, 0.2762),
        loader=_load_cifar100,
        install_hint=_cifar_hint("cifar100"),
    ),
}


def dataset_info(name: str) -> DatasetInfo:
    """Return the :class:`DatasetInfo` registered under ``name``.

    Raises
    ------
    ValueError
        If ``name`` is not registered (the message names the key ``dataset``).
    """
    try:
        return DATASETS[name]
    except KeyError:
        raise ValueError(f"Unknown dataset: dataset={name!r}; known: {sorted(DATASETS)}") from None


def load_dataset(name: str, root: str | os.PathLike[str]) -> tuple[ImageData, ImageData]:
    """Load the ``(train, test)`` sets of dataset ``name`` from directory ``root``.

    Cached per process on ``(name, str(root))``: repeated calls return the same
    (shared, to be treated as read-only) tensors. Failed loads are not cached.

    Parameters
    ----------
    name : str
        A key of :data:`DATASETS`, e.g. ``"fashion-mnist"``.
    root : str or PathLike
        Directory holding the dataset files (run config key ``data-root``).

    Returns
    -------
    (ImageData, ImageData)
        Train and test sets; images uint8 ``[N, C, H, W]``, labels int64 ``[N]``.

    Raises
    ------
    ValueError
        Unknown ``name``, or a corrupt / inconsistent file.
    FileNotFoundError
        A file is missing; the message says how to install or download it.
    """
    return _load_cached(name, os.fspath(root))


@lru_cache(maxsize=4)
def _load_cached(name: str, root: str) -> tuple[ImageData, ImageData]:
    info = dataset_info(name)
    path = Path(root).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"Data root {root!r} for dataset {name!r} does not exist. {info.install_hint}"
        )
    return info.loader(path)


def _main(argv: list[str]) -> int:
    """``python -m clients.datasets download NAME DIR``: fetch a data set (internet)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m clients.datasets")
    sub = parser.add_subparsers(dest="command", required=True)
    dl = sub.add_parser("download", help="download a data set with torchvision")
    dl.add_argument("name", choices=["cifar10", "cifar100", "fashion-mnist"])
    dl.add_argument("root", help="folder to download into; use it as run config data-root")
    args = parser.parse_args(argv)
    root = download(args.name, args.root)
    train, test = load_dataset(args.name, root)
    print(
        f"{args.name}: {len(train)} train and {len(test)} test images in {root}; "
        f"set data-root={str(root)!r}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
