"""The reply log, ``replies.csv``: one row per reply the engine handles, and a row per
checkpoint and per resume, so that a run's own records show what became of every reply
across crashes and resumes (docs/FAULTS.md, "The soak").

It is written beside the checkpoint (``<run folder>/replies.csv``) whenever checkpoints
are on (``checkpoint-every`` > 0): the log exists to audit a run that can be resumed.
A fresh run starts it anew; a resumed run appends to it. Each row is flushed when it
is written, so a killed server loses at most the row it was writing.

Columns (:data:`COLUMNS`):

- ``event``: ``update`` (a reply with an update), ``error`` (an error reply: a failure
  of its node), ``lost`` (a message lost with its node, which the time model took
  offline: outcome ``offline``), ``checkpoint`` (the server state was saved after this row's
  ``received`` updates) or ``resume`` (the run continued from the checkpoint saved at
  ``received`` updates);
- ``received``: the run's count of client updates received, this reply's included;
- ``dispatch``: the dispatch's number in the run (its send order, checkpointed with
  the dispatches in flight, so a dispatch re-sent after a resume keeps it: two kept
  updates of one dispatch would be one update applied twice);
- ``message_id``, ``node_id``, ``partition_id``: the train message the reply answers
  (a resumed run's messages are new ones; empty for ``checkpoint`` and ``resume``);
- ``outcome``: an update's ``applied``, ``deferred``, ``stale`` (dropped as too
  stale) or ``rejected`` (intake, norm bound or rule: it never touched the model); an
  error reply's Flower error code;
- ``staleness``: the update's staleness in model versions (empty when rejected);
- ``model_version``: the model's version after the reply;
- ``unix_time``: seconds since the epoch when the row was written.

:func:`read_lineage` reads the log back as the history the final model has: a resume
from the checkpoint at ``received`` = C discards the rows written after that checkpoint
(the server state they changed was lost with the process), which it returns as
``lost``.
"""

from __future__ import annotations

import csv
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from flwr_gsgm.checkpoint.files import describe_error
from flwr_gsgm.core import Outcome
from flwr_gsgm.intake.dispatch import Dispatch

__all__ = ["COLUMNS", "FILE_NAME", "Lineage", "ReplyLog", "ReplyLogWriteError", "read_lineage"]

#: The log's file name, in the run folder beside the checkpoint.
FILE_NAME = "replies.csv"
#: The log's columns (see the module docstring).
COLUMNS = (
    "event",
    "received",
    "dispatch",
    "message_id",
    "node_id",
    "partition_id",
    "outcome",
    "staleness",
    "model_version",
    "unix_time",
)
#: An update's outcome as the log names it; None is a rejected update.
OUTCOME_NAMES = {
    Outcome.APPLIED: "applied",
    Outcome.DEFERRED: "deferred",
    Outcome.STALE: "stale",
    None: "rejected",
}


class ReplyLogWriteError(OSError):
    """The reply log could not be written (no space left, ...): the engine ends the run
    "failed" with this message, as it does when a checkpoint cannot be written, since
    the run could no longer account for its replies. A resume appends after the last
    whole row.

    Attributes
    ----------
    path : Path
        The log file.
    """

    def __init__(self, path: Path, err: OSError) -> None:
        super().__init__(f"reply log {path} could not be written: {describe_error(err)}")
        self.errno = err.errno
        self.path = path


class ReplyLog:
    """The engine's reply log (see the module docstring); a no-op without a path.

    Parameters
    ----------
    path : Path | None
        ``<run folder>/replies.csv``; None: log nothing (checkpoints are off).
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._file: IO[str] | None = None
        self._writer = None

    def open(self, resumed_at: int | None) -> None:
        """Start the log: a fresh run (``resumed_at`` None) truncates it, a resumed run
        appends to it a ``resume`` row at the checkpoint's ``received`` (after cutting
        off a row a crash left half written).

        Raises
        ------
        ReplyLogWriteError
            If the file cannot be opened or written.
        """
        if self.path is None:
            return
        fresh = resumed_at is None or not self.path.is_file()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not fresh:
                _cut_partial_row(self.path)
            self._file = self.path.open("w" if fresh else "a", newline="")
        except OSError as err:
            raise ReplyLogWriteError(self.path, err) from err
        self._writer = csv.writer(self._file, lineterminator="\n")
        if fresh:
            self._row(COLUMNS)
        if resumed_at is not None:
            self._event("resume", resumed_at)

    def update(
        self,
        dispatch: Dispatch,
        received: int,
        outcome: Outcome | None,
        staleness: int | None,
        version: int,
    ) -> None:
        """A reply with an update; ``outcome`` None: it was rejected."""
        self._reply("update", dispatch, received, OUTCOME_NAMES[outcome], staleness, version)

    def error(self, dispatch: Dispatch, received: int, code: int, version: int) -> None:
        """An error reply with Flower error ``code``."""
        self._reply("error", dispatch, received, str(code), None, version)

    def lost(self, dispatch: Dispatch, received: int, version: int) -> None:
        """A message lost with its node (the time model's availability)."""
        self._reply("lost", dispatch, received, "offline", None, version)

    def checkpoint(self, received: int) -> None:
        """The server state was saved after ``received`` updates."""
        self._event("checkpoint", received)

    def close(self) -> None:
        """Close the file (every row is flushed already). A buffer that a full disk
        kept is dropped: its row raised :class:`ReplyLogWriteError` when written."""
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = self._writer = None

    def _reply(
        self,
        event: str,
        dispatch: Dispatch,
        received: int,
        outcome: str,
        staleness: int | None,
        version: int,
    ) -> None:
        self._row(
            (
                event,
                received,
                dispatch.seq,
                dispatch.message_id,
                dispatch.node_id,
                dispatch.partition_id,
                outcome,
                "" if staleness is None else staleness,
                version,
                f"{time.time():.3f}",
            )
        )

    def _event(self, event: str, received: int) -> None:
        self._row((event, received, "", "", "", "", "", "", "", f"{time.time():.3f}"))

    def _row(self, values: tuple) -> None:
        if self._writer is None:
            return
        assert self._file is not None and self.path is not None
        try:
            self._writer.writerow(values)
            self._file.flush()
        except OSError as err:
            raise ReplyLogWriteError(self.path, err) from err


def _cut_partial_row(path: Path) -> None:
    """Truncate ``path`` after its last newline (a row a crash left half written)."""
    with path.open("rb+") as fh:
        data = fh.read()
        end = data.rfind(b"\n") + 1
        if end != len(data):
            fh.truncate(end)


@dataclass
class Lineage:
    """A reply log read back (:func:`read_lineage`).

    Attributes
    ----------
    kept : list[dict[str, str]]
        The ``update`` and ``error`` rows of the final model's history, in order, each
        with one more key, ``segment``: the resumes before it ("0" before the first),
        since message ids are unique only within one run of the ServerApp.
    lost : list[dict[str, str]]
        The rows a resume discarded: written after the checkpoint it resumed from.
    resumes : list[int]
        The ``received`` of each resume's checkpoint, in order.
    """

    kept: list[dict[str, str]] = field(default_factory=list)
    lost: list[dict[str, str]] = field(default_factory=list)
    resumes: list[int] = field(default_factory=list)


def read_lineage(path: Path) -> Lineage:
    """The reply log at ``path`` as the final model's history (see the module docstring).

    Each ``checkpoint`` row at C marks how many rows the state saved at C holds. A
    ``resume`` at C keeps those rows and discards the rest as lost; if the crash cut
    off the checkpoint's own row (the state was saved, its row not yet written), it
    keeps the rows whose ``received`` is at most C.

    Raises
    ------
    ValueError
        If the header is not :data:`COLUMNS`, a row has another number of fields or
        an unknown event.
    """
    out = Lineage()
    saved: dict[int, int] = {}  # checkpoint's received -> kept rows it holds
    with path.open(newline="") as fh:
        rows = csv.reader(fh)
        header = next(rows, None)
        if tuple(header or ()) != COLUMNS:
            raise ValueError(f"{path}: header {header!r}, expected {list(COLUMNS)}")
        for number, values in enumerate(rows, start=2):
            if len(values) != len(COLUMNS):
                raise ValueError(
                    f"{path} line {number}: {len(values)} fields, expected {len(COLUMNS)}"
                )
            row = dict(zip(COLUMNS, values, strict=True))
            event, received = row["event"], int(row["received"])
            if event in ("update", "error"):
                row["segment"] = str(len(out.resumes))
                out.kept.append(row)
            elif event == "checkpoint":
                saved[received] = len(out.kept)
            elif event == "resume":
                cut = saved.get(received)
                if cut is None:
                    cut = sum(1 for r in out.kept if int(r["received"]) <= received)
                out.lost += out.kept[cut:]
                del out.kept[cut:]
                # Checkpoints after this one belong to the discarded history.
                saved = {c: n for c, n in saved.items() if n <= cut and c <= received}
                out.resumes.append(received)
            else:
                raise ValueError(f"{path} line {number}: unknown event {event!r}")
    return out
