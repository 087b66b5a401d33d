"""Checkpoint files of a run (``torch.save`` of plain numpy/python state) and SIGTERM.

A checkpoint is written atomically (:func:`flwr_gsgm.atomic.atomic_write`), so a
crash at any moment leaves either the old or the new checkpoint, never a torn one.
It ends with a checksum line, ``\\nflwr-gsgm-checkpoint sha256=<64 hex> bytes=<n>\\n``,
over the ``n`` bytes of ``torch.save`` output before it, so that a file damaged
afterwards (truncated, emptied, overwritten, one byte changed on disk or in a copy)
is refused with its name and the cause instead of resuming a different run.
"""

from __future__ import annotations

import hashlib
import re
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import torch

from flwr_gsgm.atomic import atomic_write

__all__ = ["CheckpointError", "save", "load", "load_for_resume", "on_sigterm"]

_TRAILER = re.compile(rb"\nflwr-gsgm-checkpoint sha256=([0-9a-f]{64}) bytes=(\d+)\n\Z")
_TRAILER_MAX = 128  # bytes: the trailer line is about 100
_BLOCK = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and the cause."""


def save(path: Path, state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically with its checksum; make the folder.

    ``torch.save`` streams into the temporary file through a hash (no copy of the
    serialized state in memory); the checksum line follows.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(fh: IO[bytes]) -> None:
        out = _Hashing(fh)
        torch.save(state, out)
        fh.write(f"\nflwr-gsgm-checkpoint sha256={out.hexdigest()} bytes={out.size}\n".encode())

    atomic_write(path, write, binary=True)


class _Hashing:
    """A write-only file that hashes what ``torch.save`` streams through it.

    Only ``write`` and ``flush``: torch 2.x writes its zip archive sequentially; a
    version that seeks would fail here loudly instead of writing a wrong checksum.
    """

    def __init__(self, fh: IO[bytes]) -> None:
        self._fh = fh
        self._digest = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self._digest.update(data)
        self.size += len(data)
        return self._fh.write(data)

    def flush(self) -> None:
        self._fh.flush()

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


def load(path: Path) -> dict[str, Any]:
    """Read and verify a checkpoint written by :func:`save`.

    It holds numpy arrays, so it is read with ``weights_only=False``: load only
    checkpoints your own server wrote.

    Raises
    ------
    CheckpointError
        Naming ``path`` and the cause: missing, empty, no checksum line (truncated,
        not a checkpoint, or written before checkpoints had checksums), a size or
        SHA-256 other than the recorded one (damaged), or unreadable by ``torch.load``.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    total = path.stat().st_size
    if total == 0:
        raise CheckpointError(f"checkpoint {path} is empty (0 bytes)")
    with open(path, "rb") as fh:
        fh.seek(max(0, total - _TRAILER_MAX))
        match = _TRAILER.search(fh.read())
        if match is None:
            fh.seek(0)
            head = fh.read(16)
            raise CheckpointError(
                f"checkpoint {path} ({total} bytes) has no checksum line at its end: it is "
                "truncated, was written before checkpoints had checksums, or is not a "
                f"flwr-gsgm checkpoint (it starts with {head!r})"
            )
        recorded, size = match.group(1).decode(), int(match.group(2))
        payload = total - len(match.group(0))
        if size != payload:
            raise CheckpointError(
                f"checkpoint {path} is damaged: {payload} bytes of data, its checksum line "
                f"records {size}"
            )
        fh.seek(0)
        actual = _sha256(fh, size)
    if actual != recorded:
        raise CheckpointError(
            f"checkpoint {path} is damaged: the SHA-256 of its {size} bytes of data is "
            f"{actual}, its checksum line records {recorded}"
        )
    try:
        state = torch.load(path, weights_only=False)
    except Exception as err:  # the checksum held: written by another version, say
        raise CheckpointError(
            f"checkpoint {path} cannot be read by torch.load: {type(err).__name__}: {err}"
        ) from err
    if not isinstance(state, dict):
        raise CheckpointError(
            f"checkpoint {path} holds a {type(state).__name__}, not a flwr-gsgm engine state"
        )
    return state


def load_for_resume(path: Path | None, resume: bool) -> dict[str, Any] | None:
    """The checkpoint to resume from (verified), or None without ``resume``.

    Raises
    ------
    CheckpointError
        ``resume`` is set but there is no checkpoint at ``path`` (a run never
        resumes silently from scratch), or the file is unusable (see :func:`load`).
    """
    if not resume:
        return None
    if path is None or not Path(path).exists():
        raise CheckpointError(
            f"resume=true, but there is no checkpoint at {path}: check run-name and "
            "output-dir (the run folder of the run to continue), and that the run had "
            "checkpoint-every > 0; to start afresh, set resume=false"
        )
    return load(path)


def _sha256(fh: IO[bytes], size: int) -> str:
    """Hex SHA-256 of the next ``size`` bytes of ``fh``, read block by block."""
    digest = hashlib.sha256()
    left = size
    while left > 0:
        block = fh.read(min(_BLOCK, left))
        if not block:
            break
        digest.update(block)
        left -= len(block)
    return digest.hexdigest()


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
