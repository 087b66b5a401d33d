"""A node's own images (torchvision ``ImageFolder``) and an on-disk cache of node data.

Own images: node config ``data-dir``
====================================
A board that trains on images it holds itself (a camera, a local collection) is
started with ``--node-config "partition-id=3 num-partitions=10 data-dir='/data/images'"``.
The folder has one subfolder per class, torchvision ``ImageFolder`` style::

    /data/images/
        0/  or  t-shirt_top/   img001.png img002.jpg ...
        7/  or  sneaker/       ...

optionally split as ``train/<class>/...`` and ``test/<class>/...`` (``test`` is then
used by ``evaluate`` messages; without it they use the training images).

A class folder's name is the class index in the model's output (``"0"`` ..
``"9"``), or the data set's class name compared without case and without anything
but letters and digits (``T-shirt_top`` = ``tshirttop``; names in
:data:`CLASS_NAMES`). The index therefore does not depend on which classes a board
happens to hold (plain ``ImageFolder`` would number the folders it finds 0, 1, ...).
An unknown folder name is an error naming the folder and the accepted names.

Every image is converted to the model's input (:class:`clients.datasets.DatasetInfo`
``image_shape``): to grayscale for one channel (RGB for three), the shorter side
resized to the model's size, the centre cropped to it, kept as ``uint8`` pixels
``[N, C, H, W]`` (the model normalises). For the Fashion-MNIST model that is 28x28
grayscale; note that Fashion-MNIST shows light objects on a black background.

On-disk cache: node config ``cache-dir``
========================================
In a deployment every message starts a new ClientApp process, so an in-memory cache
lives for one message only and each message would re-read and re-partition the whole
data set (seconds on a Raspberry Pi). With ``cache-dir='/var/cache/flwr-gsgm'`` the
node's decoded data are written once to ``<cache-dir>/<kind>-<key>.pt`` (atomically)
and read back by the next processes. The key hashes everything the data depend on
(data set, folder, partition config, partition-id, and the names, sizes and
modification times of the source files), so a changed folder is re-read.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from clients.datasets import DatasetInfo, ImageData
from flwr_gsgm.checkpoint.atomic import atomic_write

__all__ = [
    "CLASS_NAMES",
    "class_index",
    "disk_cached",
    "folder_fingerprint",
    "image_folder_split",
    "load_image_folder",
]

# Class names of the registered data sets, in label order (used for folder names).
CLASS_NAMES: dict[str, tuple[str, ...]] = {
    "fashion-mnist": (
        "T-shirt/top",
        "Trouser",
        "Pullover",
        "Dress",
        "Coat",
        "Sandal",
        "Shirt",
        "Sneaker",
        "Bag",
        "Ankle boot",
    ),
    "cifar10": (
        "airplane",
        "automobile",
        "bird",
        "cat",
        "deer",
        "dog",
        "frog",
        "horse",
        "ship",
        "truck",
    ),
}

_CACHE_FORMAT = 1  # bump when the cached content or its meaning changes


def _normalise(name: str) -> str:
    return re.sub(r"[^0-9a-z]", "", name.lower())


def class_index(folder_name: str, info: DatasetInfo) -> int:
    """The label a class folder stands for (see the module docstring).

    Raises
    ------
    ValueError
        If the name is neither an index in ``[0, num_classes)`` nor a class name.
    """
    if folder_name.isdigit() and int(folder_name) < info.num_classes:
        return int(folder_name)
    names = CLASS_NAMES.get(info.name, ())
    by_name = {_normalise(n): i for i, n in enumerate(names)}
    key = _normalise(folder_name)
    if key and key in by_name:
        return by_name[key]
    accepted = f"0..{info.num_classes - 1}"
    if names:
        accepted += " or one of " + ", ".join(names)
    raise ValueError(
        f"data-dir class folder {folder_name!r} names no class of {info.name}: expected {accepted}"
    )


def image_folder_split(data_dir: str | os.PathLike[str], split: str) -> Path:
    """The folder holding the ``split`` ("train" or "test") images of ``data_dir``.

    ``<data-dir>/<split>`` if ``<data-dir>/train`` exists; else ``data_dir`` itself
    (both splits: a folder of class folders only).

    Raises
    ------
    FileNotFoundError
        If ``data_dir`` is not a folder.
    """
    root = Path(data_dir).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"data-dir {str(root)!r} is not a folder")
    if (root / "train").is_dir():
        if split == "train" or (root / split).is_dir():
            return root / split
        return root / "train"
    return root


def load_image_folder(folder: str | os.PathLike[str], info: DatasetInfo) -> ImageData:
    """Read a folder of class folders as :class:`ImageData` shaped for ``info``'s model.

    Parameters
    ----------
    folder : str or PathLike
        One subfolder per class; files with an image suffix torchvision knows
        (png, jpg, jpeg, bmp, ...); other files are ignored.
    info : DatasetInfo
        Gives the labels' meaning (class count and names) and the input shape.

    Returns
    -------
    ImageData
        ``uint8 [N, C, H, W]`` images in the order of ``ImageFolder`` (class folder
        name, then file name), ``int64 [N]`` labels.

    Raises
    ------
    FileNotFoundError
        Not a folder.
    ValueError
        A class folder with an unknown name, or no image at all.
    """
    # torchvision is imported here: only nodes with a data-dir pay for it.
    from torchvision import transforms
    from torchvision.datasets import ImageFolder

    root = Path(folder).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"data-dir {str(root)!r} is not a folder")
    channels, height, width = info.image_shape
    if channels not in (1, 3):
        raise ValueError(f"{info.name}: cannot convert images to {channels} channels")
    steps: list[Any] = []
    if channels == 1:
        steps.append(transforms.Grayscale(num_output_channels=1))
    steps += [
        transforms.Resize(min(height, width), antialias=True),
        transforms.CenterCrop((height, width)),
        transforms.PILToTensor(),
    ]

    class _GlobalLabels(ImageFolder):
        """ImageFolder whose class indices are the data set's labels."""

        def find_classes(self, directory: str) -> tuple[list[str], dict[str, int]]:
            names = sorted(e.name for e in os.scandir(directory) if e.is_dir())
            if not names:
                raise ValueError(f"data-dir {directory!r} has no class folders")
            return names, {n: class_index(n, info) for n in names}

    folder_set = _GlobalLabels(str(root), transform=transforms.Compose(steps), allow_empty=True)
    if len(folder_set) == 0:
        raise ValueError(f"data-dir {str(root)!r} holds no image files in its class folders")
    images = torch.empty((len(folder_set), channels, height, width), dtype=torch.uint8)
    labels = torch.empty(len(folder_set), dtype=torch.int64)
    for row in range(len(folder_set)):
        image, label = folder_set[row]
        images[row] = image
        labels[row] = label
    return ImageData(images=images, labels=labels, num_classes=info.num_classes)


def folder_fingerprint(folder: str | os.PathLike[str]) -> str:
    """SHA-256 over the relative names, sizes and modification times of the files
    under ``folder`` (recursively; "" for a missing folder)."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        return ""
    digest = hashlib.sha256()
    entries = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in filenames:
            path = Path(dirpath) / name
            try:
                stat = path.stat()
            except OSError:
                continue
            if path.is_file():
                entries.append((str(path.relative_to(root)), stat.st_size, stat.st_mtime_ns))
    for rel, size, mtime in sorted(entries):
        digest.update(f"{rel}\0{size}\0{mtime}\n".encode())
    return digest.hexdigest()


def disk_cached(
    cache_dir: str | os.PathLike[str] | None,
    kind: str,
    key: Mapping[str, Any],
    build: Callable[[], ImageData],
) -> ImageData:
    """``build()``, stored in and then read from ``cache_dir`` (None: no cache).

    Parameters
    ----------
    cache_dir : str, PathLike or None
        Folder of the cache (created if missing); None or "" calls ``build``.
    kind : str
        File name prefix, e.g. ``"train"``.
    key : Mapping
        JSON-serialisable description of everything the data depend on.
    build : callable
        Produces the data when the cache has no valid entry.

    A cache file that cannot be read (truncated, another format) is rebuilt; a
    cache folder that cannot be written only costs the saving.
    """
    if not cache_dir:
        return build()
    folder = Path(cache_dir).expanduser()
    text = json.dumps({"format": _CACHE_FORMAT, "kind": kind, **key}, sort_keys=True, default=str)
    path = folder / f"{kind}-{hashlib.sha256(text.encode()).hexdigest()[:24]}.pt"
    if path.is_file():
        try:
            stored = torch.load(path, map_location="cpu", weights_only=True)
            return ImageData(
                images=stored["images"],
                labels=stored["labels"],
                num_classes=int(stored["num_classes"]),
            )
        except Exception:  # noqa: BLE001 - a bad cache entry is rebuilt, never fatal
            pass
    data = build()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        stored = {
            "images": data.images.contiguous(),
            "labels": data.labels.contiguous(),
            "num_classes": data.num_classes,
            "key": text,
        }
        atomic_write(path, lambda fh: torch.save(stored, fh), binary=True)
    except OSError:
        pass
    return data
