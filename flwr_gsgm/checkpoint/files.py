"""Checkpoint files of a run (``torch.save`` of plain numpy/python state) and SIGTERM.

A checkpoint is written atomically (:func:`flwr_gsgm.checkpoint.atomic.atomic_write`), so a
crash at any moment leaves either the old or the new checkpoint, never a torn one.
It ends with a checksum line, ``\\nflwr-gsgm-checkpoint sha256=<64 hex> bytes=<n>\\n``,
over the ``n`` bytes of ``torch.save`` output before it, so that a file damaged
afterwards (truncated, emptied, overwritten, one byte changed on disk or in a copy)
is refused with its name and the cause instead of resuming a different run.

A checkpoint that cannot be written (no space left, no permission) raises
:class:`CheckpointWriteError`, naming the file and the OS error; the previous
checkpoint, if any, is left as it was.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import torch

from flwr_gsgm.checkpoint.atomic import atomic_write

__all__ = [
    "CheckpointError",
    "CheckpointWriteError",
    "save",
    "load",
    "load_for_resume",
    "on_sigterm",
]

_TRAILER = re.compile(rb"\nflwr-gsgm-checkpoint sha256=([0-9a-f]{64}) bytes=(\d+)\n\Z")
_TRAILER_MAX = 128  # bytes: the trailer line is about 100
_BLOCK = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and the cause."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (no space left, no permission, ...).

    Its message names the file, the OS error and what became of the previous
    checkpoint (left as it was: the write is atomic).

    Attributes
    ----------
    path : Path
        The checkpoint file.
    os_error : BaseException
        The error the write failed with: the ``OSError`` (an ``errno`` such as
        ``ENOSPC``), or torch's ``RuntimeError`` when torch hid it.
    """

    def __init__(self, path: Path, os_error: BaseException, previous: int | None) -> None:
        kept = (
            f"the previous checkpoint there ({previous} bytes) is unchanged and resumes"
            if previous is not None
            else "no checkpoint was written there before"
        )
        super().__init__(f"checkpoint {path} could not be written: {_describe(os_error)}; {kept}")
        self.errno = getattr(os_error, "errno", None)
        self.path = path
        self.os_error = os_error


def save(path: Path, state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically with its checksum; make the folder.

    ``torch.save`` streams into the temporary file through a hash (no copy of the
    serialized state in memory); the checksum line follows.

    Raises
    ------
    CheckpointWriteError
        If the folder or the file cannot be written (an ``OSError``: no space left,
        no permission, ...); the previous checkpoint at ``path`` is left as it was.
    """
    path = Path(path)
    previous = path.stat().st_size if path.is_file() else None
    out: _Hashing | None = None

    def write(fh: IO[bytes]) -> None:
        nonlocal out
        out = _Hashing(fh)
        torch.save(state, out)
        fh.write(f"\nflwr-gsgm-checkpoint sha256={out.hexdigest()} bytes={out.size}\n".encode())

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, write, binary=True)
    except (OSError, RuntimeError) as err:
        # torch turns an error of the file under it into its own RuntimeError ("[enforce
        # fail at inline_container.cc] unexpected pos ..."): name the OS error instead.
        cause = _os_error(err) or (out.error if out is not None else None)
        if cause is None and not (isinstance(err, RuntimeError) and "inline_container" in str(err)):
            raise  # not a failed write: a bug to see as it is
        raise CheckpointWriteError(path, cause or err, previous) from err


def _os_error(err: BaseException) -> OSError | None:
    """The first ``OSError`` in ``err``'s chain (itself, its cause or context), or None."""
    seen: set[int] = set()
    cur: BaseException | None = err
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, OSError):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


def _describe(err: BaseException) -> str:
    """``[Errno 28] No space left on device (ENOSPC)`` for an OSError, else type: text."""
    if isinstance(err, OSError) and err.errno is not None:
        name = errno.errorcode.get(err.errno, str(err.errno))
        return f"[Errno {err.errno}] {err.strerror or os.strerror(err.errno)} ({name})"
    return f"{type(err).__name__}: {err}"


class _Hashing:
    """A write-only file that hashes what ``torch.save`` streams through it.

    Only ``write`` and ``flush``: torch 2.x writes its zip archive sequentially; a
    version that seeks would fail here loudly instead of writing a wrong checksum.
    """

    def __init__(self, fh: IO[bytes]) -> None:
        self._fh = fh
        self._digest = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None  # the file's error, which torch may hide

    def write(self, data: bytes) -> int:
        self._digest.update(data)
        self.size += len(data)
        try:
            return self._fh.write(data)
        except OSError as err:
            self.error = err
            raise

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
