"""The model (a CNN with BatchNorm), Fashion-MNIST from its IDX files, training and testing."""

from __future__ import annotations

import gzip
import threading
from functools import cache
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F


class Net(nn.Module):
    """Two conv layers with BatchNorm, one dense layer; input uint8 [N, 1, 28, 28]."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(1, 8, 3), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 16, 3), nn.BatchNorm2d(16)
        self.fc = nn.Linear(16 * 5 * 5, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = (x.float() / 255.0 - 0.2860) / 0.3530
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(x.flatten(1))


def _read_idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as fh:
        data = fh.read()
    ndim = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(shape)


_lock = threading.Lock()


@cache
def _fashion_mnist(root: str, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    prefix = "train" if split == "train" else "t10k"
    images = _read_idx(Path(root) / f"{prefix}-images-idx3-ubyte.gz")
    labels = _read_idx(Path(root) / f"{prefix}-labels-idx1-ubyte.gz")
    return torch.from_numpy(images.copy()).unsqueeze(1), torch.from_numpy(labels.astype(np.int64))


def load_data(root: str, split: str, partition_id: int = 0, num_partitions: int = 1):
    """Partition ``partition_id`` of ``num_partitions`` (IID, seed 0) of a split."""
    with _lock:  # one read per process, even when ClientApps run in threads
        images, labels = _fashion_mnist(root, split)
    rows = np.array_split(np.random.default_rng(0).permutation(len(labels)), num_partitions)
    index = torch.from_numpy(rows[partition_id])
    return images[index], labels[index]


def train(net: Net, images, labels, steps: int, batch_size: int, lr: float) -> float:
    """``steps`` SGD steps on random mini-batches; the mean training loss."""
    net.train()
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    total = 0.0
    for _ in range(steps):
        batch = torch.randint(len(labels), (batch_size,))
        loss = F.cross_entropy(net(images[batch]), labels[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total += loss.item()
    return total / steps


@torch.no_grad()
def test(net: Net, images, labels) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) on the given images."""
    net.eval()
    logits = torch.cat([net(images[i : i + 1000]) for i in range(0, len(labels), 1000)])
    loss = F.cross_entropy(logits, labels).item()
    return loss, (logits.argmax(1) == labels).float().mean().item()
