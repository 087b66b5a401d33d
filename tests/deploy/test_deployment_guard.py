"""A guarded deployment dies with its script (benchmarks/local_deployment.py:
Deployment.guard, start_deployment, running_deployment), without Flower: a fake
deployment (a process tree started as the SuperLink is, in a session of its own, found
only by the RUN_DIR of its environment) is stopped when the script gets SIGTERM, SIGHUP
or SIGINT (by the script, in its ``finally``) and when it is killed with SIGKILL (by
the watchdog). Every fault fires once the script said it is ready (a file it writes),
never after a sleep; the deadlines below only bound a failure."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from benchmarks import local_deployment as ld

#: Seconds a step may take before the test fails (a loaded 2-core machine).
DEADLINE = 120.0

#: The fake deployment: a process and its child, sleeping; their pids written to the
#: file argv[1] (outside the work folder: neither command line names it).
FAKE_TREE = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
with open(sys.argv[1] + ".tmp", "w") as fh:
    fh.write(f"{os.getpid()} {child.pid}")
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(3600)
"""

#: The script: guards a deployment in argv[1], starts the fake tree (pids to argv[2]),
#: writes "ready" to argv[3], then waits for the test's signal; stops the deployment
#: in a ``finally`` as the benchmarks do.
SCRIPT = """
import sys, time
from pathlib import Path
sys.path.insert(0, {repo!r})
from benchmarks.local_deployment import Deployment

FAKE_TREE = {fake_tree!r}
base, pids, ready = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])


def run():
    dep = Deployment(base, "run")
    dep.guard()
    try:
        dep.popen([sys.executable, "-c", FAKE_TREE, str(pids)], base / "fake.log")
        while not pids.is_file():
            time.sleep(0.05)
        ready.write_text("ready")
        time.sleep(3600)
    finally:
        dep.stop_everything()
        print(f"stopped; left: {{dep.leftover_pids()}}", flush=True)


try:
    run()
except KeyboardInterrupt as err:
    print(f"interrupted ({{err}})", flush=True)
    sys.exit(3)
"""


def wait_for(condition, what: str, deadline: float = DEADLINE):
    """Poll ``condition`` until it is true (its value), failing after ``deadline``."""
    end = time.monotonic() + deadline
    while not (value := condition()):
        if time.monotonic() > end:
            pytest.fail(f"{what}: not within {deadline:.0f} s")
        time.sleep(0.1)
    return value


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def tree_pids(path: Path) -> list[int]:
    return [int(p) for p in path.read_text().split()] if path.is_file() else []


@pytest.fixture
def script(tmp_path):
    """Start the script; (its Popen, the fake tree's pid file, the work folder) once it
    is ready. Whatever is left is killed at the end."""
    work, pids, ready = tmp_path / "work", tmp_path / "tree.pids", tmp_path / "ready"
    source = tmp_path / "script.py"
    source.write_text(SCRIPT.format(repo=str(ld.REPO), fake_tree=FAKE_TREE))
    proc = subprocess.Popen(
        [sys.executable, str(source), str(work), str(pids), str(ready)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for(lambda: ready.is_file() or proc.poll() is not None, "the script's start")
        if proc.poll() is not None:
            pytest.fail(f"the script ended early:\n{proc.communicate()[0]}")
        yield proc, pids, work
    finally:
        ld.kill_all([*tree_pids(pids), *ld.Deployment(work, "run").leftover_pids()])
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_stop_signal_stops_the_deployment_in_the_scripts_finally(script, signum):
    proc, pids, work = script
    tree = tree_pids(pids)
    assert len(tree) == 2 and all(running(pid) for pid in tree)
    proc.send_signal(signum)
    out, _ = proc.communicate(timeout=DEADLINE)
    name = signal.Signals(signum).name
    print(f"{name}: exit {proc.returncode}; {out.strip()!r}; fake tree {tree} gone")
    assert proc.returncode == 3, out
    assert f"interrupted (signal {name})" in out
    assert "stopped; left: []" in out
    assert not any(running(pid) for pid in tree)
    # the script stopped it: its watchdog was dismissed and has ended
    log = (work / "run" / "watchdog.log").read_text()
    assert f"process {proc.pid} stopped the deployment itself" in log
    assert ld.Deployment(work, "run").leftover_pids() == []


def test_the_watchdog_stops_the_deployment_of_a_script_killed_outright(script):
    proc, pids, work = script
    tree = tree_pids(pids)
    assert len(tree) == 2 and all(running(pid) for pid in tree)
    proc.kill()  # SIGKILL: no finally
    proc.wait(timeout=DEADLINE)
    log = work / "run" / "watchdog.log"
    wait_for(lambda: "stopped the deployment in" in ld.text(log), "the watchdog's stop")
    assert not any(running(pid) for pid in tree)
    dep = ld.Deployment(work, "run")
    wait_for(lambda: not dep.leftover_pids(), "the end of every process (watchdog too)")
    print(f"SIGKILL: {ld.text(log).strip()!r}; fake tree {tree} gone")
    assert f"process {proc.pid} ended: stopped the deployment in {work / 'run'}" in ld.text(log)


def test_running_deployment_guards_and_stops_whatever_ends_the_block(tmp_path, monkeypatch):
    pids = tmp_path / "tree.pids"

    def fake_start(dep, nodes, timeout=None):
        dep.popen([sys.executable, "-c", FAKE_TREE, str(pids)], dep.base / "fake.log")

    monkeypatch.setattr(ld.Deployment, "start", fake_start)
    handlers = {s: signal.getsignal(s) for s in ld.STOP_SIGNALS}
    with pytest.raises(RuntimeError, match="the block failed"):
        with ld.running_deployment(tmp_path / "work", "run", 2) as dep:
            assert dep.watchdog is not None and running(dep.watchdog.pid)
            assert all(signal.getsignal(s) != handlers[s] for s in ld.STOP_SIGNALS)
            tree = wait_for(lambda: tree_pids(pids), "the fake tree")
            raise RuntimeError("the block failed")
    assert dep.watchdog is None
    assert {s: signal.getsignal(s) for s in ld.STOP_SIGNALS} == handlers  # put back
    assert not any(running(pid) for pid in tree)
    log = (tmp_path / "work" / "run" / "watchdog.log").read_text()
    assert f"process {os.getpid()} stopped the deployment itself" in log


def test_a_stop_signal_during_the_stop_waits_for_its_end():
    signals = ld._StopSignals()
    original = signal.getsignal(signal.SIGTERM)
    assert signals.acquire()
    try:
        reached = False
        with pytest.raises(ld.Interrupted, match="signal SIGTERM") as err:
            with signals.deferred():
                signal.raise_signal(signal.SIGTERM)  # its handler runs before this returns
                reached = True
        assert reached and err.value.signum == signal.SIGTERM
        signal.raise_signal(signal.SIGHUP)  # once interrupted: only reported
    finally:
        signals.release()
    assert signal.getsignal(signal.SIGTERM) is original
