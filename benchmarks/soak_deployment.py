"""A chaos soak of the real deployment: GSGM on a SuperLink (with its
database) and 5 SuperNodes with the warm executor, under TLS and SuperNode
authentication on 127.0.0.1, while a seeded schedule of faults hits it, several at
once; then invariants checked from the run's own records (docs/FAULTS.md, "The soak").

**It runs alone** (as the race: benchmarks/race_deployment.py): no helper, test suite
or sweep beside it, since the hang and the kills are timed against the deployment's
deadlines.

Faults (:data:`FAULT_KINDS`), drawn by :func:`fault_schedule` from ``--seed``:

- ``supernode-kill``: a SuperNode's process tree (launcher and warm executor) gets
  SIGKILL; it is started again with its key after its hold (10-60 s), retried while
  the SuperLink still holds the old connection;
- ``clientapp-hang``: a SuperNode's warm executor gets SIGSTOP for the dispatch
  deadline and 15 s more (a ClientApp that hangs past its deadline), then SIGCONT;
- ``serverapp-stop``: the ServerApp gets SIGTERM (it saves a checkpoint and stops);
  the soak runs ``flwr run`` again with ``resume=true``;
- ``superlink-restart``: the SuperLink's process tree (SuperLink, SuperExec,
  ServerApp) gets SIGKILL (a server that lost its power: the ServerApp saves
  nothing), and the SuperLink starts again on its database after its hold; the run
  resumes from its last checkpoint;
- ``disk-full``: the run folder's file system (a tmpfs mounted for the soak) is filled
  for its hold: the checkpoint or the reply log cannot be written, the run ends
  "failed" naming the error; once the space is back the run resumes.

Whenever the ServerApp is gone (stopped, killed, failed) and the faults that stop a
server (SuperLink down, disk full) are over, the soak resumes the run with the time
left (``max-seconds``), until its time is spent and the run ends ``completed``.

Invariants (:func:`check_all`), each PASS or FAIL with its figure:

- ``accounted``: per node, the replies of the final model's history in
  ``replies.csv`` (:func:`flwr_gsgm.engine.reply_log.read_lineage`) equal
  summary.json's counts, and received = applied + deferred + stale + rejected;
- ``applied-once``: no dispatch and no message has two updates in that history (a
  dispatch re-sent after a resume keeps its number);
- ``finite``: every evaluation's loss and accuracy are finite, the run did not diverge;
- ``status``: the run ended ``completed``, or with a status and the reason that
  stopped it;
- ``accuracy``: the final accuracy within ``--tolerance`` (3 pp) of an undisturbed
  run of the same updates (the same run config in-process, on the same nodes'
  partitions, with the virtual clock);
- ``no-leftover``: no process of the deployment runs after it is stopped.

Results go to ``--out`` (default docs/results/soak/, with ``--quick`` a temporary
folder): ``faults.csv`` (the timeline), ``invariants.csv``, ``accuracy.png`` (the soak
against the undisturbed run, by updates received), ``summary.txt`` (what it printed)
and the run's ``summary.json``, ``metrics.csv`` and ``replies.csv``.

``--quick`` (CI, about 3 minutes): 120 s of training, one SuperNode killed while
another hangs, then the ServerApp stopped and resumed; no SuperLink restart, no full
disk.

Usage::

    python benchmarks/soak_deployment.py             # 60 minutes, every kind of fault
    python benchmarks/soak_deployment.py --quick     # CI

Every process it starts is stopped when it ends, also on an error, Ctrl-C, SIGTERM or
SIGHUP (exit code 1, saying so), and by a watchdog when it is killed outright: its
deployment is guarded (:func:`benchmarks.local_deployment.start_deployment`).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.local_deployment import (  # noqa: E402
    REPO,
    Deployment,
    Interrupted,
    command_line,
    executor_pids,
    kill_all,
    process_tree,
    run_config_pairs,
    start_deployment,
    tail,
)
from flwr_gsgm.engine.reply_log import FILE_NAME as REPLY_LOG  # noqa: E402
from flwr_gsgm.engine.reply_log import Lineage, read_lineage  # noqa: E402

#: The kinds of fault, in the order the summary lists them.
FAULT_KINDS = (
    "supernode-kill",
    "clientapp-hang",
    "serverapp-stop",
    "superlink-restart",
    "disk-full",
)
#: Faults that stop the server: the run resumes only once they are over.
SERVER_FAULTS = ("superlink-restart", "disk-full")
NODES = 5
RUN_NAME = "soak"
#: Seconds a train message may go unanswered (the soak's dispatch-timeout): a hang lasts
#: this and 15 s more.
DISPATCH_TIMEOUT = 30.0
#: The run config of the soak on top of the project's defaults (the main job: GSGM, one
#: gradient batch per message, 2 classes per node).
SOAK_CONFIG: dict[str, Any] = {
    "strategy": "gsgm",
    "virtual-clock": False,
    "max-updates": 1_000_000,  # the soak's time ends the run
    "eval-examples": 2000,
    "eval-threads": 1,
    "seed": 0,
    "min-nodes": NODES,
    "startup-timeout": 120.0,
    "dispatch-timeout": DISPATCH_TIMEOUT,
    "message-ttl": DISPATCH_TIMEOUT + 60.0,
    "rejoin-timeout": 180.0,
    "poll-interval": 0.05,
    "run-name": RUN_NAME,
}
#: Per length: (eval-every, checkpoint-every).
CADENCE = {"full": (100, 50), "quick": (20, 10)}
#: Resumes after which the soak gives up (a run that cannot stay up).
MAX_SEGMENTS = 40


# ------------------------------------------------------------------ the schedule
@dataclass
class Fault:
    """One fault: its kind, when (seconds since the soak's training started), which
    partition it hits (None: the server side) and how long it holds (seconds)."""

    at: float
    kind: str
    target: int | None
    hold: float
    injected_at: float = math.nan
    restored_at: float = math.nan
    note: str = ""

    @property
    def due_back(self) -> float:
        return self.injected_at + self.hold


def fault_schedule(seed: int, seconds: float, quick: bool) -> list[Fault]:
    """The seeded faults of a soak of ``seconds`` of training, sorted by time.

    Full: a SuperNode kill every 6 min on average (hold 10-60 s), a ClientApp hang
    every 15 min, a ServerApp stop every 20 min, one SuperLink restart and one full disk
    (held 20 s; a full disk until the ServerApp stops on it, at most 180 s), and once a
    cluster: a kill, a hang and a ServerApp stop within 5 s.
    Quick: a kill at 25 s (hold 15 s) while another node hangs from 28 s, then a
    ServerApp stop at 60 s (the hang still on). No two faults at once hit the same node.
    """
    hang = DISPATCH_TIMEOUT + 15.0
    if quick:
        faults = [
            Fault(25.0, "supernode-kill", 1, 15.0),
            Fault(28.0, "clientapp-hang", 3, hang),
            Fault(60.0, "serverapp-stop", None, 0.0),
        ]
        return faults
    rng = random.Random(seed)
    start, end = 120.0, seconds - 300.0

    def when() -> float:
        return round(rng.uniform(start, end), 1)

    faults = [
        Fault(when(), "supernode-kill", rng.randrange(NODES), round(rng.uniform(10, 60), 1))
        for _ in range(int(seconds // 360))
    ]
    faults += [
        Fault(when(), "clientapp-hang", rng.randrange(NODES), hang)
        for _ in range(int(seconds // 900))
    ]
    faults += [Fault(when(), "serverapp-stop", None, 0.0) for _ in range(int(seconds // 1200))]
    faults += [
        Fault(when(), "superlink-restart", None, 20.0),
        Fault(when(), "disk-full", None, 180.0),
    ]
    t, a, b = when(), rng.randrange(NODES), rng.randrange(NODES - 1)
    b += b >= a  # another node
    faults += [
        Fault(t, "supernode-kill", a, 30.0),
        Fault(t + 2.0, "clientapp-hang", b, hang),
        Fault(t + 5.0, "serverapp-stop", None, 0.0),
    ]
    faults.sort(key=lambda f: f.at)
    _spread_targets(faults)
    return faults


def _spread_targets(faults: list[Fault]) -> None:
    """Move a node fault that overlaps another on the same node to a free node."""
    for i, f in enumerate(faults):
        if f.target is None:
            continue
        busy = {
            g.target
            for g in faults[:i]
            if g.target is not None and g.at <= f.at <= g.at + g.hold + 20.0
        }
        if f.target in busy:
            free = [p for p in range(NODES) if p not in busy]
            if free:
                f.target = free[0]


# ------------------------------------------------------------------ the invariants
@dataclass
class Check:
    """One invariant's verdict and the figure it rests on."""

    name: str
    passed: bool
    figure: str

    @property
    def verdict(self) -> str:
        return "PASS" if self.passed else "FAIL"


def _counts(lineage: Lineage) -> dict[int, dict[str, int]]:
    """Per partition: its kept rows by outcome (``error`` for error replies)."""
    out: dict[int, dict[str, int]] = {}
    for row in lineage.kept:
        what = row["outcome"] if row["event"] == "update" else "error"
        by = out.setdefault(int(row["partition_id"]), {})
        by[what] = by.get(what, 0) + 1
    return out


def check_accounted(lineage: Lineage, summary: dict[str, Any]) -> Check:
    """Per node, the kept rows of ``replies.csv`` against summary.json's ``per_node``
    counts, and received = applied + deferred + stale + rejected."""
    counts, wrong, total = _counts(lineage), [], 0
    names = {
        "updates_applied": "applied",
        "updates_deferred": "deferred",
        "updates_stale": "stale",
        "rejected": "rejected",
        "error_replies": "error",
    }
    seen = set()
    for name, node in summary.get("per_node", {}).items():
        pid = node.get("partition_id")
        seen.add(pid)
        logged = counts.get(pid, {})
        received = node.get("updates_received", 0)
        total += received
        parts = sum(node.get(k, 0) for k in names if k != "error_replies")
        if parts != received:
            wrong.append(f"{name}: received {received} != applied+deferred+stale+rejected {parts}")
        for key, outcome in names.items():
            if node.get(key, 0) != logged.get(outcome, 0):
                wrong.append(
                    f"{name}: {key} {node.get(key, 0)}, replies.csv {logged.get(outcome, 0)}"
                )
        updates_logged = sum(v for k, v in logged.items() if k != "error")
        if received != updates_logged:
            wrong.append(f"{name}: received {received}, replies.csv {updates_logged}")
    for pid in sorted(set(counts) - seen):
        wrong.append(f"partition {pid}: in replies.csv, not in summary.json")
    if summary.get("updates_received") != total:
        wrong.append(f"updates_received {summary.get('updates_received')} != the nodes' {total}")
    if wrong:
        return Check("accounted", False, "; ".join(wrong[:6]))
    lost = sum(1 for r in lineage.lost if r["event"] == "update")
    return Check(
        "accounted",
        True,
        f"{total} updates over {len(seen)} nodes, each counted once "
        f"({lost} received after a checkpoint and lost with the server, "
        f"{len(lineage.resumes)} resumes)",
    )


def check_applied_once(lineage: Lineage) -> Check:
    """No dispatch and no message id has two update rows in the final history."""
    updates = [r for r in lineage.kept if r["event"] == "update"]
    dispatches = [r["dispatch"] for r in updates]
    twice = sorted((d for d, n in Counter(dispatches).items() if n > 1), key=int)
    # Message ids are unique within one run of the ServerApp (a resumed run's messages
    # are new ones; the in-process grid counts them from 1 again).
    mids = [(r["segment"], r["message_id"]) for r in updates]
    twice_mid = sorted(m[1] for m, n in Counter(mids).items() if n > 1)
    if twice or twice_mid:
        return Check(
            "applied-once",
            False,
            f"dispatches with two updates: {twice[:5]}; messages: {twice_mid[:5]}",
        )
    return Check(
        "applied-once", True, f"{len(updates)} updates from {len(set(dispatches))} dispatches"
    )


def check_finite(metrics: list[dict[str, str]], summary: dict[str, Any]) -> Check:
    """Every evaluation's loss and accuracy finite; the run did not diverge."""
    bad = [
        r["updates"]
        for r in metrics
        if not (math.isfinite(float(r["loss"])) and math.isfinite(float(r["accuracy"])))
    ]
    if bad or summary.get("status") == "diverged" or not metrics:
        return Check(
            "finite",
            False,
            f"status {summary.get('status')!r}, {len(metrics)} evaluations, "
            f"non-finite at {bad[:5]}",
        )
    return Check("finite", True, f"{len(metrics)} evaluations, all finite")


def check_status(summary: dict[str, Any], soak_reason: str) -> Check:
    """``completed``, or a status with the reason that stopped it."""
    status, reason = summary.get("status", "no summary.json"), summary.get("status_reason", "")
    if soak_reason:
        return Check("status", False, f"{status} ({soak_reason})")
    if status == "completed":
        return Check("status", True, "completed")
    return Check("status", bool(reason), f"{status}: {reason or 'no reason given'}")


def check_accuracy(soak: float, undisturbed: float, tolerance: float) -> Check:
    """The soak's final accuracy within ``tolerance`` of the undisturbed run's."""
    gap = soak - undisturbed
    figure = (
        f"{soak:.4f} against {undisturbed:.4f} undisturbed ({100 * gap:+.1f} pp; "
        f"within {100 * tolerance:.0f} pp)"
    )
    return Check("accuracy", math.isfinite(gap) and abs(gap) <= tolerance, figure)


def check_no_leftover(pids: list[int], commands: list[str]) -> Check:
    """No process of the deployment left."""
    if pids:
        return Check(
            "no-leftover", False, f"{len(pids)} left: " + "; ".join(c[:80] for c in commands[:3])
        )
    return Check("no-leftover", True, "none")


def check_all(
    run_dir: Path,
    undisturbed: float,
    tolerance: float,
    leftover: list[int],
    commands: list[str],
    soak_reason: str = "",
) -> list[Check]:
    """Every invariant from the run folder's records (summary.json, metrics.csv,
    replies.csv), the undisturbed run's final accuracy and the processes left."""
    summary = _json(run_dir / "summary.json")
    metrics = _csv(run_dir / "metrics.csv")
    log = run_dir / REPLY_LOG
    checks = []
    if log.is_file():
        lineage = read_lineage(log)
        checks += [check_accounted(lineage, summary), check_applied_once(lineage)]
    else:
        checks += [Check(n, False, f"no {log}") for n in ("accounted", "applied-once")]
    checks += [
        check_finite(metrics, summary),
        check_status(summary, soak_reason),
        check_accuracy(summary.get("final_accuracy", math.nan), undisturbed, tolerance),
        check_no_leftover(leftover, commands),
    ]
    return checks


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _csv(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        return []
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


# ------------------------------------------------------------------ the soak
@dataclass
class Soak:
    """One soak: the deployment, the run's segments and the faults' timeline."""

    args: argparse.Namespace
    base: Path
    outputs: Path
    faults: list[Fault]
    dep: Deployment | None = None
    started: float = 0.0
    segments: int = 0
    reason: str = ""  # why the soak itself gave up ("" if it did not)
    mounted: bool = False
    log: list[str] = field(default_factory=list)

    @property
    def run_dir(self) -> Path:
        return self.outputs / RUN_NAME

    def now(self) -> float:
        return time.monotonic() - self.started

    def say(self, text: str) -> None:
        line = f"[{self.now():7.1f} s] {text}" if self.started else text
        self.log.append(line)
        print(line, flush=True)

    # ----------------------------------------------------------- set-up
    def mount_outputs(self) -> None:
        """A tmpfs of ``--disk-mb`` for the run folder, so that it can be filled; without
        root (or mount) the disk-full fault is skipped and says why."""
        self.outputs.mkdir(parents=True, exist_ok=True)
        if not any(f.kind == "disk-full" for f in self.faults):
            return
        done = subprocess.run(
            [
                "mount",
                "-t",
                "tmpfs",
                "-o",
                f"size={self.args.disk_mb}m",
                "tmpfs",
                str(self.outputs),
            ],
            capture_output=True,
            text=True,
        )
        self.mounted = done.returncode == 0
        if not self.mounted:
            why = (done.stderr or done.stdout).strip()
            for f in self.faults:
                if f.kind == "disk-full":
                    f.note = f"not injected: mount of a tmpfs failed ({why})"
            self.say(f"no full disk in this soak: mount failed: {why}")

    def start(self) -> None:
        self.dep = start_deployment(
            self.base, "run", NODES, DATABASE=str(self.base / "run" / "superlink.db")
        )
        self.started = time.monotonic()

    def config(self, resume: bool) -> dict[str, Any]:
        every, ckpt = CADENCE["quick" if self.args.quick else "full"]
        remaining = max(self.args.seconds - self.now(), 5.0)
        return {
            **SOAK_CONFIG,
            "eval-every": every,
            "checkpoint-every": ckpt,
            "max-seconds": round(remaining, 1),
            "output-dir": str(self.outputs),
            "resume": resume,
        }

    # ----------------------------------------------------------- the loop
    def run(self) -> None:
        """Segments of the run until it ends on its own; faults injected on time."""
        assert self.dep is not None
        while True:
            resume = self.segments > 0
            log = self.base / f"flwr-run-{self.segments:02d}.log"
            summary = self.run_dir / "summary.json"
            summary.unlink(missing_ok=True)
            self.say(
                f"flwr run ({'resume' if resume else 'start'}), "
                f"{self.config(resume)['max-seconds']} s left"
            )
            cli = self.dep.flwr_run(REPO, run_config_pairs(self.config(resume)), log)
            began = time.monotonic()
            gone = None  # when the ServerApp process was last seen to end
            while True:
                serving = bool(self.serverapp_pids())  # one process scan per turn
                if cli.poll() is not None and not serving:
                    break
                self.tick(serving)
                time.sleep(0.5)
                if serving:
                    gone = None
                    continue
                if gone is None:
                    gone = time.monotonic()
                    if gone - began > 10.0:
                        self.say("the ServerApp process is gone")
                # The run folder holds what the run did; the CLI lingers after its run
                # (~25 s), and forever on a run whose SuperLink restarted under it.
                if time.monotonic() - max(gone, began + 60.0) > 5.0:
                    kill_all(process_tree(cli.pid))
                    cli.wait()
            got = _json(summary)
            self.say(
                f"the run stopped: {got.get('status', 'no summary.json')} "
                f"{got.get('status_reason', '')}".rstrip()
            )
            if got.get("status") in ("completed", "diverged") or (
                got and self.now() >= self.args.seconds
            ):
                return
            if self.now() >= self.args.seconds + 600:
                self.reason = (
                    f"no completed run 600 s past the soak's time ({self.segments} resumes)"
                )
                return
            self.segments += 1
            if self.segments > MAX_SEGMENTS:
                self.reason = f"gave up after {MAX_SEGMENTS} resumes"
                return
            if not (self.run_dir / "checkpoint.pt").is_file():
                self.reason = "the run stopped before its first checkpoint: nothing to resume"
                return
            while self.server_faults_on():  # resume once the server is back
                self.tick()
                time.sleep(0.5)
            self.tail_of(log)

    def tail_of(self, log: Path) -> None:
        for line in tail(log, 6).splitlines()[1:]:
            self.log.append("    " + line)

    def server_faults_on(self) -> bool:
        return any(
            f.kind in SERVER_FAULTS and not math.isnan(f.injected_at) and math.isnan(f.restored_at)
            for f in self.faults
        )

    def tick(self, serving: bool | None = None) -> None:
        """Inject the faults due, restore those whose hold is over.

        Two faults hit the ServerApp, so they wait for one to run: a ServerApp stop,
        and a full disk, which is held until the ServerApp stops on it (a run folder
        that is full only matters once the run writes a new page: the reply log
        appends rows of ~100 bytes into pages of 4 KiB) or for at most its hold.
        ``serving``: whether a ServerApp runs, if the caller has just looked."""
        now = self.now()
        if serving is None:
            serving = bool(self.serverapp_pids())
        for f in self.faults:
            waits = f.kind in ("serverapp-stop", "disk-full") and not serving
            if math.isnan(f.injected_at) and not f.note and now >= f.at and not waits:
                self.inject(f)
            elif not math.isnan(f.injected_at) and math.isnan(f.restored_at):
                stopped_on_it = f.kind == "disk-full" and not serving
                if now >= f.due_back or stopped_on_it:
                    self.restore(f)

    # ----------------------------------------------------------- faults
    def supernode_pid(self, pid: int) -> int | None:
        assert self.dep is not None
        try:
            return self.dep.pid(f"supernode-node-{pid}")
        except (FileNotFoundError, ValueError):
            return None

    def serverapp_pids(self) -> list[int]:
        """The ServerApp processes of this deployment (their command line names its
        SuperLink's port), wherever they hang in the process tree."""
        assert self.dep is not None
        port = f"127.0.0.1:{self.dep.state().get('PORT', '?')}"
        return [
            proc.pid
            for proc in psutil.process_iter()
            if "flwr-serverapp" in (cmd := command_line(proc.pid)) and port in cmd
        ]

    def superlink_pid(self) -> int | None:
        assert self.dep is not None
        try:
            pid = self.dep.pid("superlink")
        except (FileNotFoundError, ValueError):
            return None
        return pid if "flower-superlink" in command_line(pid) else None

    def inject(self, f: Fault) -> None:
        assert self.dep is not None
        f.injected_at = self.now()
        if f.kind == "supernode-kill":
            pid = self.supernode_pid(f.target)
            kill_all(process_tree(pid) if pid else [])
            f.note = f"SIGKILL to node-{f.target}'s launcher and executor"
        elif f.kind == "clientapp-hang":
            pid = self.supernode_pid(f.target)
            stopped = executor_pids(pid) if pid else []
            kill_all(stopped, signal.SIGSTOP)
            f.note = f"SIGSTOP to node-{f.target}'s executor {stopped}"
        elif f.kind == "serverapp-stop":
            pids = self.serverapp_pids()
            kill_all(pids, signal.SIGTERM)
            f.note = f"SIGTERM to the ServerApp {pids}" if pids else "no ServerApp running"
            f.restored_at = f.injected_at
        elif f.kind == "superlink-restart":
            pid = self.superlink_pid()
            kill_all(process_tree(pid) if pid else [])
            f.note = "SIGKILL to the SuperLink, its SuperExec and the ServerApp"
        elif f.kind == "disk-full":
            f.note = self.fill_disk()
        self.say(f"fault {f.kind}{'' if f.target is None else f' node-{f.target}'}: {f.note}")

    def restore(self, f: Fault) -> None:
        assert self.dep is not None
        if f.kind == "supernode-kill":
            if not self.start_supernode(f):
                return
        elif f.kind == "clientapp-hang":
            pid = self.supernode_pid(f.target)
            kill_all(executor_pids(pid) if pid else [], signal.SIGCONT)
            f.restored_at = self.now()
        elif f.kind == "superlink-restart":
            self.dep.script("start_superlink.sh", timeout=120)
            f.restored_at = self.now()
        elif f.kind == "disk-full":
            (self.outputs / "filler").unlink(missing_ok=True)
            f.restored_at = self.now()
        self.say(f"restored {f.kind}{'' if f.target is None else f' node-{f.target}'}")

    def start_supernode(self, f: Fault) -> bool:
        """Start the killed SuperNode again with its key; True once it is up, or still
        trying to connect on its own. A SuperNode the SuperLink refuses (its old
        connection not yet expired: code 305) is tried again 10 s later, for at most
        5 minutes, then the soak gives up on it and says so."""
        assert self.dep is not None
        self.dep.env["SUPERNODE_START_TIMEOUT"] = "20"
        try:
            self.dep.script("start_supernode.sh", str(f.target), f"node-{f.target}", timeout=60)
            f.note += "; started again"
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            pid = self.supernode_pid(f.target)
            if pid is not None and psutil.pid_exists(pid) and "still trying" in str(err):
                f.note += "; started again (connecting)"
            elif f.hold < 300:
                f.hold += 10.0
                self.say(f"node-{f.target} not started again ({_last_line(err)}): again in 10 s")
                return False
            else:
                f.note += f"; could not start it again: {str(err)[-200:]}"
                self.reason = f"node-{f.target} could not be started again"
        f.restored_at = self.now()
        return True

    def fill_disk(self) -> str:
        """Fill the run folder's file system with one file; what it did."""
        filler = self.outputs / "filler"
        written = 0
        try:
            with filler.open("wb") as fh:
                block = b"\0" * (1 << 20)
                while True:
                    fh.write(block)
                    fh.flush()
                    written += len(block)
        except OSError as err:
            return f"filled the run folder's tmpfs with {written >> 20} MB ({err.strerror})"
        return "filled"

    # ----------------------------------------------------------- teardown
    def stop(self) -> tuple[list[int], list[str]]:
        """Restore every fault still held, stop the deployment; the processes left."""
        if self.dep is None:
            return [], []
        for f in self.faults:
            if f.kind == "clientapp-hang" and not math.isnan(f.injected_at):
                pid = self.supernode_pid(f.target)
                kill_all(executor_pids(pid) if pid else [], signal.SIGCONT)
        (self.outputs / "filler").unlink(missing_ok=True)
        self.dep.stop_everything()
        time.sleep(1.0)
        left = self.dep.leftover_pids()
        return left, [command_line(p) for p in left]

    def unmount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.outputs)], capture_output=True)
            self.mounted = False


# ------------------------------------------------------------------ the undisturbed run
def undisturbed_accuracy(
    config: dict[str, Any], updates: int, folder: Path
) -> tuple[float, list[dict[str, str]]]:
    """The same run config in-process (the project's ClientApp on the same partitions,
    the virtual clock, no fault) for ``updates`` client updates: its final accuracy and
    metrics rows."""
    from clients.client_app import app
    from flwr_gsgm.simulation.inprocess_grid import InProcessGrid
    from serverapp.app_config import parse_app_config
    from serverapp.experiment import run_experiment

    keep = {k: v for k, v in config.items() if k not in ("output-dir", "resume", "max-seconds")}
    cfg = parse_app_config(
        {
            **keep,
            "virtual-clock": True,
            "max-updates": max(updates, 1),
            "checkpoint-every": 0,
            "run-name": "undisturbed",
        }
    )
    run_dir = folder / "undisturbed"
    run_experiment(InProcessGrid(app, NODES, cfg), cfg, run_dir)
    return _json(run_dir / "summary.json").get("final_accuracy", math.nan), _csv(
        run_dir / "metrics.csv"
    )


# ------------------------------------------------------------------ results
def write_results(
    out: Path, soak: Soak, checks: list[Check], undisturbed_rows: list[dict[str, str]]
) -> str:
    """faults.csv, invariants.csv, the run's records, accuracy.png and summary.txt in
    ``out``; the summary's text."""
    out.mkdir(parents=True, exist_ok=True)
    with (out / "faults.csv").open("w", newline="") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(
            ["at_seconds", "kind", "target", "hold_seconds", "injected_at", "restored_at", "note"]
        )
        for f in soak.faults:
            w.writerow(
                [
                    f.at,
                    f.kind,
                    "" if f.target is None else f"node-{f.target}",
                    f.hold,
                    _s(f.injected_at),
                    _s(f.restored_at),
                    f.note,
                ]
            )
    with (out / "invariants.csv").open("w", newline="") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(["invariant", "result", "figure"])
        for c in checks:
            w.writerow([c.name, c.verdict, c.figure])
    for name in ("summary.json", "metrics.csv", REPLY_LOG):
        if (soak.run_dir / name).is_file():
            shutil.copy2(soak.run_dir / name, out / name)
    plot_accuracy(out / "accuracy.png", _csv(soak.run_dir / "metrics.csv"), undisturbed_rows)
    kinds = {
        k: sum(1 for f in soak.faults if f.kind == k and not math.isnan(f.injected_at))
        for k in FAULT_KINDS
    }
    lines = [
        f"soak: {soak.args.seconds:.0f} s of training, {NODES} SuperNodes, seed {soak.args.seed}"
        f"{' (quick)' if soak.args.quick else ''}; {soak.segments} resumes",
        "faults injected: " + ", ".join(f"{k} {n}" for k, n in kinds.items()),
        *[f"  {c.name:13s} {c.verdict}  {c.figure}" for c in checks],
    ]
    text = "\n".join(lines) + "\n"
    (out / "summary.txt").write_text(text + "\ntimeline:\n" + "\n".join(soak.log) + "\n")
    return text


def _last_line(err: BaseException) -> str:
    """The first line that names an exit code in ``err``'s text, else its last line."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err))  # Flower's log colours
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    coded = [line for line in lines if "Exit Code" in line]
    return (coded or lines or [type(err).__name__])[0][:120]


def _s(x: float) -> str:
    return "" if math.isnan(x) else f"{x:.1f}"


def plot_accuracy(
    path: Path, soak_rows: list[dict[str, str]], still_rows: list[dict[str, str]]
) -> None:
    """Accuracy against updates received: the soak and the undisturbed run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for rows, label in ((soak_rows, "soak (faults)"), (still_rows, "undisturbed, in-process")):
        if rows:
            ax.plot(
                [int(r["updates"]) for r in rows], [float(r["accuracy"]) for r in rows], label=label
            )
    ax.set_xlabel("client updates received")
    ax.set_ylabel("test accuracy")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the CI form: 120 s, 3 faults")
    p.add_argument("--minutes", type=float, default=60.0, help="training time (default 60)")
    p.add_argument("--seed", type=int, default=0, help="the fault schedule's seed")
    p.add_argument("--tolerance", type=float, default=0.03, help="accuracy gap allowed")
    p.add_argument("--disk-mb", type=int, default=256, help="size of the run folder's tmpfs")
    p.add_argument("--out", type=Path, default=None, help="results folder")
    p.add_argument("--work", type=Path, default=None, help="work folder (default: a temporary one)")
    args = p.parse_args(argv)
    args.seconds = 120.0 if args.quick else 60.0 * args.minutes
    if args.out is None and not args.quick:
        args.out = REPO / "docs" / "results" / "soak"
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the soak; 0 if every invariant holds, 1 otherwise (the summary says which)."""
    args = parse_args(argv)
    base = args.work or Path(tempfile.mkdtemp(prefix="soak-"))
    base.mkdir(parents=True, exist_ok=True)
    out = args.out or base / "results"
    soak = Soak(args, base, base / "outputs", fault_schedule(args.seed, args.seconds, args.quick))
    try:
        try:
            soak.mount_outputs()
            soak.start()
            soak.run()
        except Exception as err:  # a broken deployment: stop, then report what is known
            soak.reason = f"{type(err).__name__}: {err}"
            soak.say(f"the soak stopped: {soak.reason}")
        finally:
            leftover, commands = soak.stop()
        summary = _json(soak.run_dir / "summary.json")
        soak.say(f"the undisturbed run: {summary.get('updates_received', 0)} updates in-process")
        still, still_rows = undisturbed_accuracy(
            soak.config(False), summary.get("updates_received", 0), base
        )
        checks = check_all(soak.run_dir, still, args.tolerance, leftover, commands, soak.reason)
        text = write_results(out, soak, checks, still_rows)
    except Interrupted as err:  # SIGTERM, SIGHUP, SIGINT while the deployment ran
        print(
            f"soak interrupted ({err}); every process it started was stopped",
            file=sys.stderr,
            flush=True,
        )
        return 1
    finally:
        soak.unmount()
    print(text + f"results in {out}", flush=True)
    return 0 if all(c.passed for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
