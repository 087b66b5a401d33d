"""Models, one per registered dataset, and weight <-> numpy conversion.

Weights travel as the model's ``state_dict`` in its key order (the server optimizer
works on that list of arrays). Every model here keeps only float32 *parameters* in
its ``state_dict``: no BatchNorm (no integer ``num_batches_tracked``), and the input
normalisation constants are non-persistent buffers, so they never travel.

Inputs are raw pixels: a ``uint8`` (or float, same 0..255 scale) tensor
``[N, C, H, W]``. The model itself computes ``(x / 255 - mean) / std`` per channel
with the dataset's constants (:class:`clients.datasets.DatasetInfo`), so training,
the ClientApp and the server's centralized evaluation cannot disagree on
preprocessing. Output: float32 logits ``[N, num_classes]``.

``"fashion-mnist"`` -> :class:`SmallCNN` (the usual CNN of the FL literature for
28x28 images, without padding): conv 5x5 1->32, ReLU, max-pool 2 -> conv 5x5 32->64,
ReLU, max-pool 2 -> fc 1024->128, ReLU -> fc 128->10; 184,586 parameters.
``state_dict`` keys, in order: ``conv1.weight [32,1,5,5]``, ``conv1.bias [32]``,
``conv2.weight [64,32,5,5]``, ``conv2.bias [64]``, ``fc1.weight [128,1024]``,
``fc1.bias [128]``, ``fc2.weight [10,128]``, ``fc2.bias [10]``.

``"cifar10"`` / ``"cifar100"`` -> :class:`CifarCNN` for 3x32x32 images: three blocks
conv 3x3 (padding 1) -> ReLU -> max-pool 2 with 32, 64, 64 channels (32 -> 16 -> 8
-> 4 pixels), then fc 1024->128, ReLU -> fc 128->classes; 188,810 parameters for
10 classes, 200,420 for 100. No BatchNorm (its statistics do not average well
across non-IID nodes, and the state_dict stays float32 parameters only).
``state_dict`` keys, in order: ``conv1.weight [32,3,3,3]``, ``conv1.bias``,
``conv2.weight [64,32,3,3]``, ``conv2.bias``, ``conv3.weight [64,64,3,3]``,
``conv3.bias``, ``fc1.weight [128,1024]``, ``fc1.bias``, ``fc2.weight
[classes,128]``, ``fc2.bias``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from clients.datasets import DatasetInfo, dataset_info

__all__ = [
    "MODELS",
    "CifarCNN",
    "SmallCNN",
    "build_model",
    "count_parameters",
    "get_weights",
    "set_weights",
]


class PixelNormalize(nn.Module):
    """Map pixels 0..255 (uint8 or float) to ``(x / 255 - mean) / std``, float32.

    The constants are non-persistent buffers: not in ``state_dict``, never sent over
    the wire. ``mean`` and ``std`` need one value per channel (ValueError otherwise).
    """

    def __init__(self, in_channels: int, mean: Sequence[float], std: Sequence[float]) -> None:
        super().__init__()
        if len(mean) != in_channels or len(std) != in_channels:
            raise ValueError(f"mean/std need {in_channels} values, got {len(mean)} and {len(std)}")
        self.register_buffer(
            "mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1), persistent=False
        )
        self.register_buffer(
            "scale",
            (255.0 * torch.tensor(std, dtype=torch.float32)).view(1, -1, 1, 1),
            persistent=False,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.to(torch.float32) - 255.0 * self.mean) / self.scale


class SmallCNN(nn.Module):
    """Two 5x5 conv layers with max-pooling, then two fully connected layers.

    Parameters
    ----------
    in_channels : int
        Image channels C.
    num_classes : int
        Number of output logits.
    image_size : int
        Height = width of the input; must leave a positive size after
        conv5 -> pool2 -> conv5 -> pool2 (``image_size >= 16``).
    mean, std : sequence of float
        Per-channel normalisation constants for pixels scaled to [0, 1].

    Shapes
    ------
    input: ``[N, C, image_size, image_size]`` uint8 or float pixels in 0..255;
    output: ``[N, num_classes]`` float32 logits.
    """

    def __init__(
        self,
        in_channels: int = 1,
        num_classes: int = 10,
        image_size: int = 28,
        mean: Sequence[float] = (0.2860,),
        std: Sequence[float] = (0.3530,),
    ) -> None:
        super().__init__()
        self.normalize = PixelNormalize(in_channels, mean, std)
        side = ((image_size - 4) // 2 - 4) // 2
        if side < 1:
            raise ValueError(f"image_size={image_size} is too small for SmallCNN")
        self.conv1 = nn.Conv2d(in_channels, 32, kernel_size=5)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=5)
        self.fc1 = nn.Linear(64 * side * side, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.normalize(x)
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        return self.fc2(x)


class CifarCNN(nn.Module):
    """Three 3x3 conv blocks with max-pooling, then two fully connected layers.

    Parameters
    ----------
    in_channels : int
        Image channels C (3 for CIFAR).
    num_classes : int
        Number of output logits.
    image_size : int
        Height = width of the input, a multiple of 8 (32 for CIFAR).
    mean, std : sequence of float
        Per-channel normalisation constants for pixels scaled to [0, 1].

    Shapes
    ------
    input: ``[N, C, image_size, image_size]`` uint8 or float pixels in 0..255;
    output: ``[N, num_classes]`` float32 logits.
    """

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 10,
        image_size: int = 32,
        mean: Sequence[float] = (0.4914, 0.4822, 0.4465),
        std: Sequence[float] = (0.2470, 0.2435, 0.2616),
    ) -> None:
        super().__init__()
        self.normalize = PixelNormalize(in_channels, mean, std)
        if image_size < 8 or image_size % 8:
            raise ValueError(f"image_size={image_size} must be a multiple of 8 for CifarCNN")
        side = image_size // 8
        self.conv1 = nn.Conv2d(in_channels, 32, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3, padding=1)
        self.conv3 = nn.Conv2d(64, 64, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(64 * side * side, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.normalize(x)
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.max_pool2d(F.relu(self.conv3(x)), 2)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        return self.fc2(x)


def _cifar_cnn(info: DatasetInfo) -> nn.Module:
    channels, height, width = info.image_shape
    if height != width:
        raise ValueError(f"CifarCNN needs square images, {info.name} has {height}x{width}")
    return CifarCNN(channels, info.num_classes, height, info.mean, info.std)


def _small_cnn(info: DatasetInfo) -> nn.Module:
    channels, height, width = info.image_shape
    if height != width:
        raise ValueError(f"SmallCNN needs square images, {info.name} has {height}x{width}")
    return SmallCNN(channels, info.num_classes, height, info.mean, info.std)


# dataset name -> builder(DatasetInfo) -> nn.Module
MODELS: dict[str, Callable[[DatasetInfo], nn.Module]] = {
    "fashion-mnist": _small_cnn,
    "cifar10": _cifar_cnn,
    "cifar100": _cifar_cnn,
}


def build_model(dataset_name: str, *, seed: int | None = None) -> nn.Module:
    """Build the model registered for ``dataset_name``.

    Parameters
    ----------
    dataset_name : str
        A key of :data:`MODELS` (run config key ``dataset``).
    seed : int, optional
        Seed of the weight initialisation. The global torch RNG is left untouched
        when a seed is given (the initialisation runs under ``fork_rng``).

    Returns
    -------
    torch.nn.Module
        A model in train mode whose ``state_dict`` holds only float32 tensors.

    Raises
    ------
    ValueError
        If no model is registered for ``dataset_name``.
    """
    if dataset_name not in MODELS:
        raise ValueError(f"No model for dataset={dataset_name!r}; known: {sorted(MODELS)}")
    info = dataset_info(dataset_name)
    if seed is None:
        model = MODELS[dataset_name](info)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = MODELS[dataset_name](info)
    # channels_last: the CPU convolution and pooling kernels run 1.4x (training
    # step) to 3x (evaluation) faster in this layout (benchmarks/bench_model.py).
    # Only the memory layout changes: shapes, keys and values of the state_dict are
    # the same, and get_weights / ArrayRecord copies are C-contiguous.
    model = model.to(memory_format=torch.channels_last)
    bad = {k: v.dtype for k, v in model.state_dict().items() if v.dtype != torch.float32}
    if bad:  # pragma: no cover - guards future registry entries
        raise TypeError(f"Model state_dict must be float32 only, found {bad}")
    return model


def count_parameters(model: nn.Module) -> int:
    """Total number of scalar parameters of ``model``."""
    return sum(p.numel() for p in model.parameters())


def get_weights(model: nn.Module) -> list[np.ndarray]:
    """Return the ``state_dict`` values as float32 numpy copies, in key order.

    Returns
    -------
    list[np.ndarray]
        One C-contiguous float32 array per ``state_dict`` entry.
    """
    return [
        np.ascontiguousarray(t.detach().cpu().numpy(), dtype=np.float32).copy()
        for t in model.state_dict().values()
    ]


def set_weights(model: nn.Module, arrays: Sequence[np.ndarray]) -> None:
    """Load ``arrays`` (in ``state_dict`` key order) into ``model`` in place.

    Parameters
    ----------
    model : torch.nn.Module
    arrays : sequence of np.ndarray
        One array per ``state_dict`` entry, same shapes; cast to the entry's dtype.

    Raises
    ------
    ValueError
        If the number of arrays or any shape differs from the model's.
    """
    state = model.state_dict()
    if len(arrays) != len(state):
        raise ValueError(f"Expected {len(state)} arrays for the model, got {len(arrays)}")
    new_state = {}
    for (key, ref), arr in zip(state.items(), arrays):
        arr = np.asarray(arr)
        if tuple(arr.shape) != tuple(ref.shape):
            raise ValueError(
                f"Shape mismatch for {key}: model has {tuple(ref.shape)}, "
                f"array has {tuple(arr.shape)}"
            )
        new_state[key] = torch.as_tensor(arr, dtype=ref.dtype).clone()
    model.load_state_dict(new_state, strict=True)
