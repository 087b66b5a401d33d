"""Which torch device a node computes on: CUDA when the board has it, else the CPU.

The ClientApp reads the optional node config key ``device``
(``flower-supernode --node-config "... device='cpu'"``):

- ``"auto"`` (default): ``cuda`` if :func:`torch.cuda.is_available` (a Jetson with
  NVIDIA's CUDA wheel of torch, a PC with a GPU), else ``cpu`` (Raspberry Pi, CI);
- ``"cpu"``, ``"cuda"`` or ``"cuda:<index>"``: that device; asking for CUDA on a
  machine without it is an error rather than a silent fall-back.

On the CPU the computation is exactly the one of :mod:`clients.training` without a
device (bit-identical for the same thread count). On CUDA it is not bit-reproducible
(cuDNN picks kernels at run time); the server does not rely on that.
"""

from __future__ import annotations

import torch

__all__ = ["DEVICE_CHOICES", "choose_device"]

DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:<index>")


def choose_device(requested: str = "auto") -> torch.device:
    """Resolve a node config ``device`` value to a :class:`torch.device`.

    Parameters
    ----------
    requested : str
        ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:<index>"`` (case-insensitive).

    Returns
    -------
    torch.device
        ``cuda`` (index 0 unless given) or ``cpu``.

    Raises
    ------
    ValueError
        If the value is none of the above, or CUDA is asked for but
        ``torch.cuda.is_available()`` is false, or the index does not exist.
    """
    if not isinstance(requested, str):
        raise ValueError(f"Invalid device={requested!r}: expected one of {DEVICE_CHOICES}")
    value = requested.strip().lower()
    if value == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if value == "cpu":
        return torch.device("cpu")
    if value == "cuda" or value.startswith("cuda:"):
        index_text = value.partition(":")[2]
        if value.startswith("cuda:") and not index_text.isdigit():
            raise ValueError(f"Invalid device={requested!r}: expected cuda:<index>")
        if not torch.cuda.is_available():
            raise ValueError(
                f"Invalid device={requested!r}: torch.cuda.is_available() is False on this "
                "node (CPU-only torch wheel or no GPU); use device='auto' or 'cpu'"
            )
        index = int(index_text) if index_text else 0
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"Invalid device={requested!r}: this node has "
                f"{torch.cuda.device_count()} CUDA device(s)"
            )
        return torch.device("cuda", index)
    raise ValueError(f"Invalid device={requested!r}: expected one of {DEVICE_CHOICES}")
