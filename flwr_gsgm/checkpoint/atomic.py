"""Atomic file writes: a crash leaves the old file or the new one, never a torn one.

The one helper every writer of run files uses (run outputs, checkpoints, the
sweep's tables, cached data): write to a uniquely named ``.<name>.*.tmp`` file in
the same folder (so concurrent writers of one path never share a temporary file),
flush and fsync, then ``os.replace`` it over the target.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

__all__ = ["atomic_write", "atomic_write_text"]


def atomic_write(
    path: str | os.PathLike[str],
    write: Callable[[IO[Any]], object],
    binary: bool = False,
    newline: str | None = None,
) -> Path:
    """Write ``path`` atomically with ``write(fh)``; return the path.

    Parameters
    ----------
    path : path-like
        The target; its folder must exist.
    write : callable
        Called with the open temporary file (text, or bytes if ``binary``).
    binary : bool
        Open the temporary file in binary mode.
    newline : str | None
        Passed to ``open`` in text mode (``""`` for the csv module).

    Raises
    ------
    OSError
        If the file cannot be written; the temporary file is removed and the target
        left as it was.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(
            fd, "wb" if binary else "w", **({} if binary else {"newline": newline})
        ) as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` atomically; return the path."""
    return atomic_write(path, lambda fh: fh.write(text))
