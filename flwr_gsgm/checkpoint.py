"""Atomic checkpoint files of a run (``torch.save`` of plain numpy/python state).

A checkpoint is written to a temporary file in the same folder, flushed to disk,
then renamed over the previous one (``os.replace``), so a crash at any moment leaves
either the old or the new checkpoint, never a torn one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["save", "load"]


def save(path: Path, state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically (temporary file, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def load(path: Path) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save`.

    It holds numpy arrays, so it is read with ``weights_only=False``: load only
    checkpoints your own server wrote.

    Raises
    ------
    FileNotFoundError
        If ``path`` does not exist.
    """
    return torch.load(Path(path), weights_only=False)
