"""Checkpoint files of a run (plain numpy/python state, no pickle) and SIGTERM.

A checkpoint is an ``.npz``-style zip archive, stored uncompressed: ``state.json``, the
state's tree of python values with every numpy array (or numpy scalar) replaced by a
reference ``{"__ndarray__": i}``, and the arrays as ``<i>.npy`` members (numpy's own
format, read with ``allow_pickle=False``). What JSON cannot say by itself is tagged: a
tuple ``{"__tuple__": [...]}``, a set ``{"__set__": [...]}``, a dict whose keys are not
all strings (a partition-id) ``{"__dict__": [[key, value], ...]}``, a NaN or infinite
float ``{"__float__": "nan"}`` (``"inf"``, ``"-inf"``), so ``state.json`` is strict JSON;
floats are written in shortest round-trip form, so a state loads back equal, bit for
bit, with its types. Reading one runs no code from the file.

``state.json`` also holds the checkpoint's format, ``{"checkpoint_format": 1, ...}``
(:data:`CHECKPOINT_FORMAT`, beside the state's own top-level keys). :func:`load` reads
only checkpoints of this format, written by flwr-gsgm 0.1.0 on; one without it (written
by a development version before 0.1.0's format) or of another format is refused, naming
the file, the format found and what to do: start a new run, or resume it with the
flwr-gsgm version that wrote it.

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
    "CHECKPOINT_FORMAT",
    "FORMAT_KEY",
    "CheckpointError",
    "CheckpointWriteError",
    "describe_error",
    "save",
    "load",
    "load_for_resume",
    "on_sigterm",
]

#: The format of the checkpoints this flwr-gsgm writes and reads, recorded in each
#: checkpoint's ``state.json`` under :data:`FORMAT_KEY`. A change of the state's layout
#: that the previous reader could not load takes the next number; a flwr-gsgm reads
#: its own format only. Format 2: GSGM's and FedBuff's states gained ``trim_fraction``
#: and their kept updates (the trimmed mean's); format 1 (from 3b8d1b2) had neither.
CHECKPOINT_FORMAT = 2
#: The top-level key of ``state.json`` that holds :data:`CHECKPOINT_FORMAT`.
FORMAT_KEY = "checkpoint_format"
_NO_FORMAT = "none: written by a development version before 0.1.0's format"

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
#: Keys a dict of the state writes in the ``__dict__`` form: a tag, or the format's key.
_RESERVED = _TAGS | {FORMAT_KEY}


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
        cause = describe_error(os_error)
        super().__init__(f"checkpoint {path} could not be written: {cause}; {kept}")
        self.errno = getattr(os_error, "errno", None)
        self.path = path
        self.os_error = os_error


def save(path: Path, state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically with its checksum; make the folder.

    ``state.json`` holds ``state`` and, at its top level, :data:`CHECKPOINT_FORMAT`.
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
    if not isinstance(encoded, dict):
        raise TypeError(f"checkpoint state: a {type(state).__name__}, not a dict")
    encoded = {FORMAT_KEY: CHECKPOINT_FORMAT, **encoded}
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
        if all(type(k) is str and k not in _RESERVED for k in value):
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


def describe_error(err: BaseException) -> str:
    """How a failed write names its cause in a message: ``[Errno 28] No space left on
    device (ENOSPC)`` for an ``OSError`` with an errno, else ``TypeName: text``. Used by
    :class:`CheckpointWriteError` and the engine's reply log, so both name a full disk
    the same way."""
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

    Nothing in the file is executed (arrays are read with ``allow_pickle=False``).
    The state is returned without the format's key.

    Raises
    ------
    CheckpointError
        Naming ``path`` and the cause: missing, empty, no checksum line (truncated,
        or not a checkpoint of this format), a size or SHA-256 other than the
        recorded one (damaged), unreadable, or of a format other than
        :data:`CHECKPOINT_FORMAT` (the format found, or none, and what to do).
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
                "truncated, or is not a flwr-gsgm checkpoint of format "
                f"{CHECKPOINT_FORMAT} (it starts with {head!r})"
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
        # Its checksum line says flwr-gsgm wrote it: without state.json, or without
        # the format's key in it, a development version before 0.1.0's format did.
        tree = json.loads(archive.read(_STATE)) if _STATE in archive.namelist() else None
        found = tree.pop(FORMAT_KEY, None) if isinstance(tree, dict) else None
        if type(found) is not int or found != CHECKPOINT_FORMAT:
            raise _format_refused(path, found)

        def array(i: int) -> np.ndarray:
            with archive.open(f"{int(i)}.npy") as member:
                return np.lib.format.read_array(member, allow_pickle=False)

        return _decode(tree, array)


def _format_refused(path: Path, found: Any) -> CheckpointError:
    """The error for a checkpoint at ``path`` whose format is ``found`` (None: it has
    none), not :data:`CHECKPOINT_FORMAT`."""
    return CheckpointError(
        f"checkpoint {path} has checkpoint format "
        f"{_NO_FORMAT if found is None else repr(found)}; this flwr-gsgm reads format "
        f"{CHECKPOINT_FORMAT} only. Start a new run (resume=false, or another run-name), "
        "or resume this one with the flwr-gsgm version that wrote it"
    )


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
