"""The warm ClientApp executor against Flower's own SuperNode state and Runtime API
(``runtime_harness``: everything of a SuperNode but its SuperLink connection).

- tasks are served by one ClientApp import per FAB, the node's context carries over;
- the replies and error replies are those of Flower's ``flwr-clientapp``;
- a ClientApp that raises gets an error reply and the executor goes on;
- a new FAB version is installed and imported afresh, the old modules dropped;
- the executor's memory stays flat over hundreds of tasks;
- SIGTERM during a task: the message is answered with an error reply, then it exits.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest
from flwr.common.constant import ErrorCode, SubStatus
from flwr.proto.runtime_pb2 import AcquireTaskRequest
from flwr.supercore.constant import TaskType
from flwr.supercore.runtime import RuntimeHttpClient

from flwr_gsgm.deploy.executor import WarmExecutor
from flwr_gsgm.deploy.flower_waits import shorten_supernode_waits
from flwr_gsgm.deploy.poll import PollSchedule

from .runtime_harness import RUN_ID, RuntimeHarness, build_app, train_message

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]
RUN_V2 = RUN_ID + 1


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Iterator[Path]:
    """FLWR_HOME of this module's SuperNode, its executors and ``flwr-clientapp``."""
    path = tmp_path_factory.mktemp("flwr-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLWR_HOME", str(path))
        mp.setenv("FLWR_TELEMETRY_ENABLED", "0")
        yield path


@pytest.fixture(scope="module")
def supernode(home, tmp_path_factory) -> Iterator[RuntimeHarness]:
    # The SuperNode's 0.5 s reply poll would dominate these tests: shorten it.
    shorten_supernode_waits(PollSchedule(0.1, 5.0, 3.0), 0.005, 0.02, 1.0)
    harness = RuntimeHarness().start()
    apps = tmp_path_factory.mktemp("apps")
    harness.add_run(RUN_ID, build_app(apps / "v1", 1))
    harness.add_run(RUN_V2, build_app(apps / "v2", 2))
    yield harness
    harness.stop()


@pytest.fixture
def executor(supernode) -> Iterator[WarmExecutor]:
    """A warm executor serving ``supernode`` from a thread of this process."""
    ex = WarmExecutor(supernode.address, insecure=True, poll=PollSchedule(0.005, 1.0, 0.05))
    stop = threading.Event()
    thread = threading.Thread(target=ex.serve, args=(stop,), daemon=True)
    thread.start()
    yield ex
    stop.set()
    thread.join(10)
    ex.close()


def ask(supernode: RuntimeHarness, run_id: int = RUN_ID, values=(1.0, 2.0), **config):
    """Deliver one train message and return the SuperNode's reply to it."""
    mid = supernode.deliver(train_message(run_id, list(values), **config))
    reply = supernode.collect_reply()
    assert reply.metadata.reply_to_message_id == mid
    return reply


def metrics(reply) -> dict:
    assert not reply.has_error(), reply.error
    return dict(reply.content["metrics"])


# ----------------------------------------------------------------------- tests
def test_one_import_serves_every_task_and_the_context_carries_over(supernode, executor):
    replies = [ask(supernode, values=(1.0, -3.0)) for _ in range(3)]
    # scale = 2.0 from the FAB's run config: [1, -3] -> [2, -6]
    for reply in replies:
        np.testing.assert_array_equal(reply.content["arrays"]["w"].numpy(), [2.0, -6.0])
    seen = [metrics(r) for r in replies]
    assert [m["calls"] for m in seen] == [1, 2, 3]  # one module import served all three
    assert {m["pid"] for m in seen} == {os.getpid()}
    assert [m["seen"] for m in seen] == [seen[0]["seen"] + i for i in range(3)]  # context.state
    assert executor.apps.loads == 1
    _wait(lambda: executor.tasks_done == 3, "the third task's output")  # pushed after the reply


def test_a_raising_clientapp_gets_flowers_error_reply_and_the_executor_goes_on(supernode, executor):
    failed = ask(supernode, **{"raise": True})
    assert failed.has_error()
    assert failed.error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert failed.error.reason == "<class 'ValueError'>:<'asked to fail'>"
    task_id = _last_task_id(supernode)
    _wait(lambda: _task(supernode, task_id).status.status == "finished", "the task output")
    task = _task(supernode, task_id)
    assert task.status.sub_status == SubStatus.FAILED
    assert task.status.details == "<class 'ValueError'>:<'asked to fail'>"
    after = metrics(ask(supernode))
    assert after["version"] == 1 and after["calls"] >= 1
    _wait(lambda: executor.tasks_done == 2, "the second task's output")
    assert executor.apps.loads == 1


def test_a_new_fab_version_is_imported_afresh_and_the_old_one_dropped(supernode, executor):
    first = metrics(ask(supernode, run_id=RUN_ID))
    second = metrics(ask(supernode, run_id=RUN_V2))
    assert (first["version"], second["version"]) == (1, 2)
    assert second["calls"] == 1  # a fresh import of the module, not the old one
    module = sys.modules["warmprobe_app"]
    assert module.VERSION == 2
    old_dir = [p for p in sys.path if "warmprobe.1.0.0" in p]
    assert old_dir == [], "version 1's folder is still on sys.path"
    back = metrics(ask(supernode, run_id=RUN_ID))
    assert (back["version"], back["calls"]) == (1, 1)
    assert executor.apps.loads == 3


def test_same_replies_as_flwr_clientapp(supernode, home):
    """The stock per-task process and the warm executor answer the same messages alike."""
    stock = [
        _stock_clientapp(supernode, values=(0.5, 4.0)),
        _stock_clientapp(supernode, raise_=True),
    ]
    ex = WarmExecutor(supernode.address, insecure=True)
    warm = []
    try:
        for config in ({}, {"raise": True}):
            supernode.deliver(train_message(RUN_ID, [0.5, 4.0] if not config else [1.0], **config))
            assert ex.run_next() is not None
            warm.append(supernode.collect_reply())
    finally:
        ex.close()
    for a, b in zip(stock, warm):
        assert a.has_error() == b.has_error()
        assert a.metadata.message_type == b.metadata.message_type == "train"
    np.testing.assert_array_equal(stock[0].content["arrays"]["w"].numpy(), [1.0, 8.0])
    np.testing.assert_array_equal(warm[0].content["arrays"]["w"].numpy(), [1.0, 8.0])
    assert set(stock[0].content["metrics"]) == set(warm[0].content["metrics"])
    assert stock[0].content["metrics"]["version"] == warm[0].content["metrics"]["version"] == 1
    assert (stock[1].error.code, stock[1].error.reason) == (
        warm[1].error.code,
        warm[1].error.reason,
    )


def test_memory_stays_flat_over_hundreds_of_tasks(supernode, home):
    proc = _executor_process(supernode)
    try:
        for _ in range(60):  # warm-up: imports, allocator pools, caches
            ask(supernode)
        before = _rss_kib(proc.pid)
        for _ in range(400):
            ask(supernode)
        after = _rss_kib(proc.pid)
    finally:
        _stop(proc)
    print(f"\n[executor] RSS after 60 tasks {before} KiB, after 460 tasks {after} KiB")
    assert after - before < 4096, f"RSS grew by {after - before} KiB over 400 tasks"


def test_sigterm_during_a_task_answers_with_an_error_reply(supernode, home):
    proc = _executor_process(supernode)
    try:
        metrics(ask(supernode))  # loaded and serving
        supernode.deliver(train_message(RUN_ID, [1.0], sleep=60.0))
        long_task = _last_task_id(supernode)
        _wait(lambda: _task(supernode, long_task).status.status == "running", "the long task")
        proc.send_signal(signal.SIGTERM)
        reply = supernode.collect_reply()
        assert proc.wait(30) == 0
    finally:
        _stop(proc)
    assert reply.has_error()
    assert reply.error.code == ErrorCode.CLIENT_APP_CRASHED
    assert reply.error.reason == "The ClientApp executor was stopped during the task."


# --------------------------------------------------------------------- helpers
def _last_task_id(supernode: RuntimeHarness) -> int:
    return sorted(supernode.state.get_tasks(), key=lambda t: t.pending_at)[-1].task_id


def _task(supernode: RuntimeHarness, task_id: int):
    (task,) = supernode.state.get_tasks(task_ids=[task_id])
    return task


def _wait(check, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def _executor_process(supernode: RuntimeHarness) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flwr_gsgm.deploy.executor",
            "--runtime-api-address",
            supernode.address,
            "--insecure",
            "--poll-interval",
            "0.005",
            "--idle-poll-interval",
            "0.05",
        ],
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _rss_kib(pid: int) -> int:
    """Resident set size of process ``pid`` in KiB (psutil, as benchmarks/local_deployment.py)."""
    return psutil.Process(pid).memory_info().rss // 1024


def _stock_clientapp(supernode: RuntimeHarness, values=(1.0,), raise_: bool = False):
    """Answer one message with Flower's ``flwr-clientapp`` (one process for the task)."""
    config = {"raise": True} if raise_ else {}
    supernode.deliver(train_message(RUN_ID, list(values), **config))
    acquirer = RuntimeHttpClient.from_server_address(supernode.address, True, None, [])
    try:
        res = acquirer.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP]))
    finally:
        acquirer.close()
    assert res.token, "no task to acquire"
    done = subprocess.run(
        [
            str(BIN / "flwr-clientapp"),
            "--runtime-api-address",
            supernode.address,
            "--insecure",
            "--token",
            res.token,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Start `flwr-clientapp` process" in done.stdout + done.stderr
    return supernode.collect_reply()


def test_unloading_ignores_modules_whose_paths_are_not_paths(tmp_path, monkeypatch):
    """torch registers a namespace in sys.modules whose __path__ is no list."""
    import types

    from flwr_gsgm.deploy.app_cache import AppCache

    odd = types.ModuleType("odd_namespace")
    odd.__path__ = object()
    odd.__file__ = None
    inside = types.ModuleType("inside_app")
    inside.__file__ = str(tmp_path / "app" / "inside_app.py")
    monkeypatch.setitem(sys.modules, "odd_namespace", odd)
    monkeypatch.setitem(sys.modules, "inside_app", inside)
    monkeypatch.syspath_prepend(str(tmp_path / "app"))
    cache = AppCache()
    cache.app_dir = (tmp_path / "app").resolve()
    cache.unload()
    assert "inside_app" not in sys.modules and sys.modules["odd_namespace"] is odd
    assert str(tmp_path / "app") not in sys.path


def test_a_task_of_a_run_stopped_while_received_fails_and_the_next_run_is_served(supernode):
    """Issue 23 item 9: after a ServerApp crash a warm SuperNode pulls a message of the
    dead run, Flower 1.42 ignores it but leaves its task pending with a message that
    never arrives; the executor fails that task after stall-timeout and serves the next
    run (before: it waited for the message's objects for up to two hours)."""
    ex = WarmExecutor(
        supernode.address, insecure=True, poll=PollSchedule(0.005, 1.0, 0.05), stall_timeout=1.0
    )
    stop = threading.Event()
    thread = threading.Thread(target=ex.serve, args=(stop,), daemon=True)
    thread.start()
    try:
        assert metrics(ask(supernode, run_id=RUN_ID))["version"] == 1  # the run is known
        supernode.deliver_for_a_stopped_run(train_message(RUN_ID, [1.0, 2.0]))
        stale = _last_task_id(supernode)
        started = time.monotonic()
        mid = supernode.deliver(train_message(RUN_V2, [1.0, 2.0]))  # the resumed run
        reply = supernode.collect_reply(timeout=60.0)
        assert reply.metadata.reply_to_message_id == mid
        assert metrics(reply)["version"] == 2
        assert time.monotonic() - started < 30  # the 1 s bound, plus a FAB install
        task = _task(supernode, stale)
        assert (task.status.status, task.status.sub_status) == ("finished", SubStatus.FAILED)
        assert task.run_id == RUN_ID
        assert f"task {stale}: object " in task.status.details
        assert "without progress (stall-timeout=1.0 s)" in task.status.details
    finally:
        stop.set()
        thread.join(10)
        ex.close()


def test_the_stall_timeout_must_be_positive(supernode):
    with pytest.raises(ValueError, match="stall_timeout must be > 0 seconds, got 0"):
        WarmExecutor(supernode.address, insecure=True, stall_timeout=0)
