"""Checkpoint files of a run (``torch.save`` of plain numpy/python state) and SIGTERM.

A checkpoint is written atomically (:func:`flwr_gsgm.atomic.atomic_write`), so a
crash at any moment leaves either the old or the new checkpoint, never a torn one.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from logging import WARNING
from pathlib import Path
from typing import Any

import torch
from flwr.common.logger import log

from flwr_gsgm.atomic import atomic_write

__all__ = ["save", "load", "load_for_resume", "on_sigterm"]


def save(path: Path, state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically (temporary file, fsync, rename); make the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda fh: torch.save(state, fh), binary=True)


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


def load_for_resume(path: Path | None, resume: bool) -> dict[str, Any] | None:
    """The checkpoint to resume from, or None (no resume, or no file: logged)."""
    if not resume or path is None or not path.exists():
        if resume:
            log(WARNING, "[async] resume: no checkpoint at %s, starting afresh", path)
        return None
    return load(path)


@contextmanager
def on_sigterm(enabled: int | bool, handler: Callable[[], None]) -> Iterator[None]:
    """While in the block, SIGTERM calls ``handler()`` (if ``enabled``, main thread only).

    The engine's handler asks its loop to save a checkpoint and stop; the previous
    SIGTERM handler is restored on exit.
    """
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(signum: int, frame: Any) -> None:
        handler()

    previous = signal.signal(signal.SIGTERM, on_signal)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
