"""benchmarks/soak_deployment.py: its fault schedule, each invariant check against a
hand-made record that breaks it, and the quick soak of a real deployment (the CI form)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from benchmarks import soak_deployment as soak
from flwr_gsgm.engine.reply_log import COLUMNS, read_lineage


# ------------------------------------------------------------------ the schedule
def test_the_full_schedule_is_seeded_and_has_every_kind_of_fault():
    faults = soak.fault_schedule(0, 3600.0, quick=False)
    assert faults == soak.fault_schedule(0, 3600.0, quick=False)
    assert faults != soak.fault_schedule(1, 3600.0, quick=False)
    kinds = [f.kind for f in faults]
    # 3600 // 360 kills, // 900 hangs, // 1200 stops, one restart, one full disk, and the
    # cluster of a kill, a hang and a stop within 5 s.
    assert {k: kinds.count(k) for k in soak.FAULT_KINDS} == {
        "supernode-kill": 11,
        "clientapp-hang": 5,
        "serverapp-stop": 4,
        "superlink-restart": 1,
        "disk-full": 1,
    }
    assert [f.at for f in faults] == sorted(f.at for f in faults)
    assert all(120.0 <= f.at <= 3300.0 + 5.0 for f in faults)
    assert all(10 <= f.hold <= 60 for f in faults if f.kind == "supernode-kill")
    assert all(f.hold == soak.DISPATCH_TIMEOUT + 15 for f in faults if f.kind == "clientapp-hang")


def test_no_two_faults_at_once_hit_the_same_node():
    for seed in range(20):
        faults = [f for f in soak.fault_schedule(seed, 3600.0, quick=False) if f.target is not None]
        for i, f in enumerate(faults):
            for g in faults[:i]:
                if g.at <= f.at <= g.at + g.hold + 20.0:
                    assert f.target != g.target, (seed, f, g)


def test_the_quick_schedule_kills_one_node_while_another_hangs_then_stops_the_server():
    faults = soak.fault_schedule(0, 120.0, quick=True)
    assert [(f.at, f.kind, f.target) for f in faults] == [
        (25.0, "supernode-kill", 1),
        (28.0, "clientapp-hang", 3),
        (60.0, "serverapp-stop", None),
    ]
    kill, hang = faults[0], faults[1]
    assert hang.at < kill.at + kill.hold  # at once


# ------------------------------------------------------------------ the invariants
def write_log(path: Path, rows: list[tuple]) -> Path:
    """(event, received, dispatch, partition, outcome) rows; events without a reply:
    (event, received)."""
    with path.open("w", newline="") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(COLUMNS)
        for row in rows:
            if len(row) == 2:
                w.writerow([row[0], row[1], "", "", "", "", "", "", "", 0.0])
            else:
                event, received, seq, pid, outcome = row
                w.writerow([event, received, seq, f"m{seq}", 100 + pid, pid, outcome, 0, 1, 0.0])
    return path


def node(pid: int, received: int, applied: int, deferred=0, stale=0, rejected=0, errors=0):
    return {
        f"node {100 + pid} (partition {pid})": {
            "node_id": 100 + pid,
            "partition_id": pid,
            "updates_received": received,
            "updates_applied": applied,
            "updates_deferred": deferred,
            "updates_stale": stale,
            "rejected": rejected,
            "error_replies": errors,
        }
    }


GOOD_LOG = [
    ("update", 1, 1, 0, "applied"),
    ("update", 2, 2, 1, "deferred"),
    ("checkpoint", 2),
    ("update", 3, 3, 0, "stale"),  # lost with the server
    ("resume", 2),
    ("update", 3, 3, 0, "applied"),  # the same dispatch, sent again
    ("error", 3, 4, 1, "5"),
    ("update", 4, 5, 1, "rejected"),
]
GOOD_SUMMARY = {
    "updates_received": 4,
    "per_node": {**node(0, 2, 2), **node(1, 2, 0, deferred=1, rejected=1, errors=1)},
}


def test_the_accounting_check_passes_a_consistent_record_and_names_the_lost(tmp_path):
    lineage = read_lineage(write_log(tmp_path / "r.csv", GOOD_LOG))
    check = soak.check_accounted(lineage, GOOD_SUMMARY)
    assert check.passed, check.figure
    assert check.figure == (
        "4 updates over 2 nodes, each counted once (1 received after a checkpoint and "
        "lost with the server, 1 resumes)"
    )
    assert soak.check_applied_once(lineage).passed


def test_the_accounting_check_fails_a_count_that_differs_from_the_log(tmp_path):
    lineage = read_lineage(write_log(tmp_path / "r.csv", GOOD_LOG))
    summary = json.loads(json.dumps(GOOD_SUMMARY))
    summary["per_node"]["node 100 (partition 0)"]["updates_applied"] = 1
    summary["per_node"]["node 100 (partition 0)"]["updates_stale"] = 1
    check = soak.check_accounted(lineage, summary)
    assert not check.passed
    assert "updates_applied 1, replies.csv 2" in check.figure
    assert "updates_stale 1, replies.csv 0" in check.figure


def test_the_accounting_check_fails_received_that_is_not_the_sum_of_outcomes(tmp_path):
    lineage = read_lineage(write_log(tmp_path / "r.csv", GOOD_LOG))
    summary = json.loads(json.dumps(GOOD_SUMMARY))
    summary["per_node"]["node 100 (partition 0)"]["updates_received"] = 3
    summary["updates_received"] = 5
    check = soak.check_accounted(lineage, summary)
    assert not check.passed
    assert "received 3 != applied+deferred+stale+rejected 2" in check.figure


def test_the_accounting_check_fails_a_node_the_summary_lacks(tmp_path):
    lineage = read_lineage(write_log(tmp_path / "r.csv", GOOD_LOG))
    summary = {"updates_received": 2, "per_node": node(0, 2, 2)}
    check = soak.check_accounted(lineage, summary)
    assert not check.passed
    assert "partition 1: in replies.csv, not in summary.json" in check.figure


def test_the_applied_once_check_fails_a_dispatch_applied_twice(tmp_path):
    # Dispatch 1 applied before the checkpoint and again after the resume from it.
    log = [
        ("update", 1, 1, 0, "applied"),
        ("checkpoint", 1),
        ("resume", 1),
        ("update", 2, 1, 0, "applied"),
    ]
    check = soak.check_applied_once(read_lineage(write_log(tmp_path / "r.csv", log)))
    assert not check.passed
    assert check.figure == "dispatches with two updates: ['1']; messages: []"


def test_the_applied_once_check_fails_one_message_counted_twice_in_a_run(tmp_path):
    log = [("update", 1, 1, 0, "applied"), ("update", 2, 2, 0, "applied")]
    path = write_log(tmp_path / "r.csv", log)
    path.write_text(path.read_text().replace(",m2,", ",m1,"))
    check = soak.check_applied_once(read_lineage(path))
    assert not check.passed
    assert check.figure == "dispatches with two updates: []; messages: ['m1']"


def test_the_finite_check_fails_a_non_finite_evaluation_or_a_diverged_run():
    rows = [
        {"updates": "0", "loss": "2.3", "accuracy": "0.1"},
        {"updates": "50", "loss": "nan", "accuracy": "0.1"},
    ]
    assert not soak.check_finite(rows, {"status": "completed"}).passed
    assert "non-finite at ['50']" in soak.check_finite(rows, {"status": "completed"}).figure
    assert not soak.check_finite(rows[:1], {"status": "diverged"}).passed
    assert not soak.check_finite([], {"status": "completed"}).passed
    assert soak.check_finite(rows[:1], {"status": "completed"}).passed


def test_the_status_check_wants_completed_or_a_reason():
    assert soak.check_status({"status": "completed"}, "").passed
    failed = soak.check_status({"status": "failed", "status_reason": "no node left"}, "")
    assert failed.passed and failed.figure == "failed: no node left"
    assert not soak.check_status({"status": "failed", "status_reason": ""}, "").passed
    assert not soak.check_status({}, "").passed
    gave_up = soak.check_status({"status": "completed"}, "gave up after 40 resumes")
    assert not gave_up.passed and gave_up.figure == "completed (gave up after 40 resumes)"


def test_the_accuracy_check_allows_the_tolerance_and_no_more():
    assert soak.check_accuracy(0.82, 0.84, 0.03).passed
    far = soak.check_accuracy(0.80, 0.84, 0.03)
    assert not far.passed
    assert far.figure == "0.8000 against 0.8400 undisturbed (-4.0 pp; within 3 pp)"
    assert not soak.check_accuracy(math.nan, 0.84, 0.03).passed


def test_the_leftover_check_fails_any_process_left():
    assert soak.check_no_leftover([], []).passed
    left = soak.check_no_leftover([4321], ["flwr-serverapp --runtime-api-address 127.0.0.1:1"])
    assert not left.passed and left.figure.startswith("1 left: flwr-serverapp")


# ------------------------------------------------------------------ the quick soak
def test_the_quick_soak_keeps_every_invariant(tmp_path):
    code = soak.main(["--quick", "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")])
    rows = {r["invariant"]: r for r in csv.DictReader((tmp_path / "out" / "invariants.csv").open())}
    summary = (tmp_path / "out" / "summary.txt").read_text()
    for name in ("accounted", "applied-once", "finite", "status", "no-leftover"):
        assert rows[name]["result"] == "PASS", summary
    faults = list(csv.DictReader((tmp_path / "out" / "faults.csv").open()))
    assert [f["kind"] for f in faults if f["injected_at"]] == [
        "supernode-kill",
        "clientapp-hang",
        "serverapp-stop",
    ], summary
    assert all(f["restored_at"] for f in faults), summary
    assert "1 resumes" in rows["accounted"]["figure"], summary
    assert (code == 0) == (rows["accuracy"]["result"] == "PASS")
