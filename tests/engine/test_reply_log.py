"""The reply log (flwr_gsgm/engine/reply_log.py): rows as written, read back as the
final model's history across crashes and resumes, hand-made logs."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from flwr_gsgm.core import Outcome
from flwr_gsgm.engine.reply_log import (
    COLUMNS,
    ReplyLog,
    ReplyLogWriteError,
    read_lineage,
)
from flwr_gsgm.intake.dispatch import Dispatch


def dispatch(seq: int, pid: int) -> Dispatch:
    return Dispatch(0.0, seq, pid, 0, {}, message_id=f"m{seq}", node_id=100 + pid)


def write(path: Path, rows: list[tuple]) -> Path:
    """A log of ``rows``: (event, received[, dispatch, partition, outcome])."""
    with path.open("w", newline="") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(COLUMNS)
        for row in rows:
            event, received, *rest = row
            if event in ("update", "error"):
                seq, pid, outcome = rest
                w.writerow([event, received, seq, f"m{seq}", 100 + pid, pid, outcome, 0, 1, 0.0])
            else:
                w.writerow([event, received, "", "", "", "", "", "", "", 0.0])
    return path


def kept(lineage) -> list[tuple[str, int, str]]:
    return [(r["event"], int(r["received"]), r["dispatch"]) for r in lineage.kept]


def test_the_log_holds_each_reply_checkpoint_and_resume_in_order(tmp_path):
    path = tmp_path / "replies.csv"
    log = ReplyLog(path)
    log.open(resumed_at=None)
    log.update(dispatch(1, 0), 1, Outcome.APPLIED, 0, 1)
    log.update(dispatch(2, 1), 2, None, None, 1)
    log.error(dispatch(3, 0), 2, 5, 1)
    log.checkpoint(2)
    log.close()
    ReplyLog(path).open(resumed_at=2)
    rows = list(csv.DictReader(path.open()))
    assert [(r["event"], r["received"], r["dispatch"], r["outcome"]) for r in rows] == [
        ("update", "1", "1", "applied"),
        ("update", "2", "2", "rejected"),
        ("error", "2", "3", "5"),
        ("checkpoint", "2", "", ""),
        ("resume", "2", "", ""),
    ]
    assert rows[0]["message_id"] == "m1" and rows[0]["node_id"] == "100"
    assert rows[1]["staleness"] == "" and rows[0]["staleness"] == "0"


def test_a_resume_discards_what_came_after_its_checkpoint(tmp_path):
    # Checkpoint at 2; updates 3 and 4 and an error reply at 4 are lost with the server;
    # the resumed run re-sends dispatch 3 (same number) and goes on.
    path = write(
        tmp_path / "replies.csv",
        [
            ("update", 1, 1, 0, "applied"),
            ("update", 2, 2, 1, "deferred"),
            ("checkpoint", 2),
            ("update", 3, 3, 0, "applied"),
            ("update", 4, 4, 1, "stale"),
            ("error", 4, 5, 0, "5"),
            ("resume", 2),
            ("update", 3, 3, 0, "applied"),
            ("error", 3, 6, 1, "5"),
        ],
    )
    lineage = read_lineage(path)
    assert kept(lineage) == [
        ("update", 1, "1"),
        ("update", 2, "2"),
        ("update", 3, "3"),
        ("error", 3, "6"),
    ]
    assert [(r["event"], r["dispatch"]) for r in lineage.lost] == [
        ("update", "3"),
        ("update", "4"),
        ("error", "5"),
    ]
    assert lineage.resumes == [2]
    assert [r["segment"] for r in lineage.kept] == ["0", "0", "1", "1"]


@pytest.mark.parametrize(
    ("rows", "kept", "lost", "resumes"),
    [
        pytest.param(
            # saved at 3, killed before its row: the resume at 3 keeps rows up to 3
            [(1, 1), ("checkpoint", 1), (2, 2), (3, 3), ("resume", 3), (4, 4)],
            ["1", "2", "3", "4"],
            [],
            [3],
            id="checkpoint-row-cut-off",
        ),
        pytest.param(
            # two crashes after the checkpoint at 1: both tails are lost
            [
                (1, 1),
                ("checkpoint", 1),
                (2, 2),
                ("resume", 1),
                (2, 3),
                (3, 4),
                ("resume", 1),
                (2, 5),
            ],
            ["1", "5"],
            ["2", "3", "4"],
            [1, 1],
            id="two-crashes",
        ),
    ],
)
def test_the_history_across_crashes(tmp_path, rows, kept, lost, resumes):
    """``rows``: (received, dispatch) updates of partition dispatch % 2, or events."""
    made = [
        r if isinstance(r[0], str) else ("update", r[0], r[1], r[1] % 2, "applied") for r in rows
    ]
    lineage = read_lineage(write(tmp_path / "replies.csv", made))
    assert [r["dispatch"] for r in lineage.kept] == kept
    assert [r["dispatch"] for r in lineage.lost] == lost
    assert lineage.resumes == resumes


def test_a_resume_cuts_off_a_half_written_row(tmp_path):
    path = write(tmp_path / "replies.csv", [("update", 1, 1, 0, "applied"), ("checkpoint", 1)])
    with path.open("a") as fh:
        fh.write("update,2,2,m2,10")  # the server died mid-row
    ReplyLog(path).open(resumed_at=1)
    lineage = read_lineage(path)
    assert [r["dispatch"] for r in lineage.kept] == ["1"]
    assert lineage.resumes == [1]


def test_a_log_that_is_not_a_reply_log_is_refused(tmp_path):
    path = tmp_path / "replies.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="header"):
        read_lineage(path)
    write(path, [("update", 1, 1, 0, "applied")])
    with path.open("a") as fh:
        fh.write("restart,1,,,,,,,,0.0\n")
    with pytest.raises(ValueError, match="line 3: unknown event 'restart'"):
        read_lineage(path)


def test_a_full_disk_raises_a_reply_log_write_error_naming_the_file():
    # /dev/full: every write fails with ENOSPC (the header is the first).
    with pytest.raises(
        ReplyLogWriteError, match=r"reply log /dev/full could not be written: \[Errno 28\]"
    ):
        ReplyLog(Path("/dev/full")).open(resumed_at=None)


def test_without_a_path_nothing_is_written(tmp_path):
    log = ReplyLog(None)
    log.open(resumed_at=None)
    log.update(dispatch(1, 0), 1, Outcome.APPLIED, 0, 1)
    log.checkpoint(1)
    log.close()
    assert list(tmp_path.iterdir()) == []
