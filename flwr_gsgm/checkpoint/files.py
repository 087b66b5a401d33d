"""Checkpoint files of a run (plain numpy/python state, no pickle) and SIGTERM.

A checkpoint is an ``.npz``-style zip archive, stored uncompressed: ``state.json``, the
state's tree of python values with every numpy array (or numpy scalar) replaced by a
reference ``{"__ndarray__": i}``, and the arrays as ``<i>.npy`` members (numpy's own
format, read with ``allow_pickle=False``). What JSON cannot say by itself is tagged: a
tuple ``{"__tuple__": [...]}``, a set ``{"__set__": [...]}``, a dict whose keys are not
all strings (a partition-id) ``{"__dict__": [[key, value], ...]}``, a NaN or infinite
float ``{"__float__": "nan"}`` (``"inf"``, ``"-inf"``), so ``state.json`` is strict JSON
(older checkpoints with JSON's ``NaN`` / ``Infinity`` still load); floats are written in
shortest round-trip form, so a state loads back equal, bit for bit, with its types.
Reading one runs no code from the file (unlike the ``torch.save`` checkpoints of earlier
versions, which :func:`load` still reads when torch is installed).

A checkpoint is written atomically (:func:`flwr_gsgm.checkpoint.atomic.atomic_write`), so a
crash at any moment leaves either the old or the new checkpoint, never a torn one.
It ends with a checksum line, ``\\nflwr-gsgm-checkpoint sha256=<64 hex> bytes=<n>\\n``,
over the ``n`` bytes of the archive before it, so that a file damaged afterwards
(truncated, emptied, overwritten, one byte changed on disk or in a copy) is refused
with its name and the cause instead of resuming a different run.

A checkpoint that cannot be written (no space left, no permission) raises
:class:`CheckpointWriteError`, naming the file and the OS error; the previous
checkpoint, if any, is left as it was.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import signal
import threading
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import numpy as np

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
_STATE = "state.json"
# Every member is dated 1980-01-01 (zip's epoch): the same state gives the same bytes.
_EPOCH = (1980, 1, 1, 0, 0, 0)
_CONTAINERS: dict[type, str] = {tuple: "__tuple__", set: "__set__", frozenset: "__frozenset__"}
#: A non-finite python float, tagged: strict JSON has no NaN or infinity, and a resume
#: must get the value back (an evaluation row's NaN train loss), not null.
_FLOAT = "__float__"
_TAGS = frozenset({"__ndarray__", "__npscalar__", "__dict__", _FLOAT, *_CONTAINERS.values()})


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

    ``state`` is a tree of dicts, lists, tuples, sets, ``str``, ``int``, ``float``,
    ``bool``, ``None``, numpy arrays (any dtype but ``object``) and numpy scalars. The
    archive streams into the temporary file through a hash (no copy of the arrays in
    memory); the checksum line follows.

    Raises
    ------
    TypeError
        If ``state`` holds another type (named with its place in the state); nothing
        is written.
    CheckpointWriteError
        If the folder or the file cannot be written (an ``OSError``: no space left,
        no permission, ...); the previous checkpoint at ``path`` is left as it was.
    """
    path = Path(path)
    arrays: list[np.ndarray] = []
    encoded = _encode(state, arrays, "state")
    tree = json.dumps(encoded, separators=(",", ":"), allow_nan=False).encode()
    previous = path.stat().st_size if path.is_file() else None
    out: _Hashing | None = None

    def write(fh: IO[bytes]) -> None:
        nonlocal out
        out = _Hashing(fh)
        # Not seekable: zipfile streams each member with a data descriptor after it.
        with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
            archive.writestr(zipfile.ZipInfo(_STATE, _EPOCH), tree)
            for i, array in enumerate(arrays):
                member = archive.open(zipfile.ZipInfo(f"{i}.npy", _EPOCH), "w", force_zip64=True)
                with member:
                    np.lib.format.write_array(member, array, allow_pickle=False)
        fh.write(f"\nflwr-gsgm-checkpoint sha256={out.hexdigest()} bytes={out.size}\n".encode())

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, write, binary=True)
    except Exception as err:
        # zipfile may fail again while closing the archive after the file's error:
        # name the file's first OSError.
        cause = (out.error if out is not None else None) or _os_error(err)
        if cause is None:
            raise  # not a failed write: a bug to see as it is
        raise CheckpointWriteError(path, cause, previous) from err


def _encode(value: Any, arrays: list[np.ndarray], where: str) -> Any:
    """``value`` as JSON values; each array (or numpy scalar: a 0-d array) appended to
    ``arrays`` and referenced by its index. ``where`` names the place for errors."""
    if isinstance(value, (np.ndarray, np.generic)):  # before float: np.float64 is one
        array = np.asarray(value)
        if array.dtype.hasobject:
            raise TypeError(f"checkpoint state {where}: an object array cannot be saved")
        arrays.append(array)
        return {"__npscalar__" if isinstance(value, np.generic) else "__ndarray__": len(arrays) - 1}
    if isinstance(value, float) and not math.isfinite(value):
        return {_FLOAT: repr(value)}  # "nan", "inf", "-inf": float() reads each back
    if value is None or isinstance(value, (str, int, float)):  # bool is an int
        return value  # json writes a str or int enum as its value, a float round-trip
    if isinstance(value, dict):
        if all(type(k) is str and k not in _TAGS for k in value):
            return {k: _encode(v, arrays, f"{where}[{k!r}]") for k, v in value.items()}
        pairs = [
            [_encode(k, arrays, f"{where} key {k!r}"), _encode(v, arrays, f"{where}[{k!r}]")]
            for k, v in value.items()
        ]
        return {"__dict__": pairs}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_encode(v, arrays, f"{where}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, list):
            return items
        for kind, tag in _CONTAINERS.items():
            if isinstance(value, kind):
                return {tag: items}
    raise TypeError(
        f"checkpoint state {where}: a {type(value).__name__} cannot be saved (numpy arrays "
        "and python values only)"
    )


def _decode(value: Any, array: Callable[[int], np.ndarray]) -> Any:
    """The inverse of :func:`_encode`; ``array(i)`` reads the ``i``-th array.

    A JSON object with a tag key is always a tagged value: :func:`_encode` writes a
    dict that has such a key in the ``__dict__`` form.
    """
    if isinstance(value, list):
        return [_decode(v, array) for v in value]
    if not isinstance(value, dict):
        return value
    if "__ndarray__" in value:
        return array(value["__ndarray__"])
    if "__npscalar__" in value:
        return array(value["__npscalar__"])[()]
    if _FLOAT in value:
        return float(value[_FLOAT])
    if "__dict__" in value:
        return {_decode(k, array): _decode(v, array) for k, v in value["__dict__"]}
    for kind, tag in _CONTAINERS.items():
        if tag in value:
            return kind(_decode(v, array) for v in value[tag])
    return {k: _decode(v, array) for k, v in value.items()}


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
    """A write-only file that hashes what is written through it (the archive).

    Only ``write`` and ``flush``: no ``tell`` or ``seek``, so zipfile writes the archive
    sequentially, as the hash needs.
    """

    def __init__(self, fh: IO[bytes]) -> None:
        self._fh = fh
        self._digest = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None  # the file's first error

    def write(self, data: bytes) -> int:
        self._digest.update(data)
        self.size += len(data)
        try:
            return self._fh.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def flush(self) -> None:
        self._fh.flush()

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


def load(path: Path) -> dict[str, Any]:
    """Read and verify a checkpoint written by :func:`save`.

    Nothing in the file is executed (arrays are read with ``allow_pickle=False``),
    except for a checkpoint of an earlier version (``torch.save``, a pickle): it is
    read with ``torch.load(weights_only=False)`` if torch is installed, so load only
    such checkpoints your own server wrote.

    Raises
    ------
    CheckpointError
        Naming ``path`` and the cause: missing, empty, no checksum line (truncated,
        not a checkpoint, or written before checkpoints had checksums), a size or
        SHA-256 other than the recorded one (damaged), unreadable, or an earlier
        version's without torch installed.
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
        state = _read(path)
    except CheckpointError:
        raise
    except Exception as err:  # the checksum held: written by another program, say
        raise CheckpointError(
            f"checkpoint {path} cannot be read: {type(err).__name__}: {err}"
        ) from err
    if not isinstance(state, dict):
        raise CheckpointError(
            f"checkpoint {path} holds a {type(state).__name__}, not a flwr-gsgm engine state"
        )
    return state


def _read(path: Path) -> Any:
    """The state in the archive at ``path`` (its checksum verified)."""
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        if _STATE not in names:
            if any(n.endswith("/data.pkl") for n in names):
                return _read_torch(path)
            raise CheckpointError(f"checkpoint {path} has no {_STATE}: {names[:5]}")

        def array(i: int) -> np.ndarray:
            with archive.open(f"{int(i)}.npy") as member:
                return np.lib.format.read_array(member, allow_pickle=False)

        return _decode(json.loads(archive.read(_STATE)), array)


def _read_torch(path: Path) -> Any:
    """A checkpoint of an earlier version (``torch.save``), if torch is installed."""
    try:
        import torch
    except ImportError:
        raise CheckpointError(
            f"checkpoint {path} was written by an earlier flwr-gsgm with torch.save: "
            "install torch to resume it, or start afresh (resume=false)"
        ) from None
    return torch.load(path, weights_only=False)


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
