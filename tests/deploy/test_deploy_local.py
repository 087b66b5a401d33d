"""A real deployment on 127.0.0.1: SuperLink + three SuperNodes as separate processes,
TLS and SuperNode authentication, started by the deploy/ scripts, each SuperNode
``flwr-gsgm-supernode --warm-executor`` (the deploy default: its ClientApp served by
one warm ``flwr-gsgm-executor``); GSGM runs with ``flwr run``.

- A SuperNode without a registered key (or without any key) is refused.
- A SuperNode killed with SIGKILL mid-run is noted as lost by the engine, the run goes
  on with the others; a SuperNode restarted for the same partition-id (a new key,
  hence a new node id: a re-provisioned board) rejoins and contributes again; the run
  reaches its budget and ends (no hang).
- A ClientApp that raises gets an error reply and its executor goes on (same process);
  a new version of the app (another FAB) is loaded by the same executor.
- The executor killed with SIGKILL mid-task: its SuperNode survives, the message comes
  back as Flower's error reply (once the task's heartbeat expires, 60 s), the engine
  counts it, and the node trains again with the restarted executor.

Every wait has a deadline; every process started here (and all their children) is
stopped at the end, also on failure. Takes a few minutes: deselect with
``pytest -m "not deploy"``.
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from benchmarks.local_deployment import (
    BIN,
    REPO,
    Deployment,
    executor_pids,
    free_port,
    kill_all,
    probe_app,
    process_tree,
    tail,
    text,
)

NUM_NODES = 3
KILLED = 2  # partition-id whose SuperNode is killed and replaced
# Must outlast the loss detection and the replacement's start: with the warm executor
# two SuperNodes reach 60 updates in about 80 s, and CI once ended a 60-update run
# before the replacement had joined.
MAX_UPDATES = 150
# Above the cold first message of three SuperNodes on a loaded 2-core machine.
DISPATCH_TIMEOUT = 90.0
# 40 mini-batches per update (~1 s of compute here): a kill lands while a node computes.
RUN_CONFIG = (
    f"virtual-clock=false max-updates={MAX_UPDATES} eval-every=30 eval-examples=500 "
    f"min-nodes={NUM_NODES} dispatch-timeout={DISPATCH_TIMEOUT} poll-interval=0.05 "
    'local-batches=40 run-name="deploy-test"'
)
# The executor-kill run: a dispatch-timeout above the 60 s after which the SuperNode
# answers for a ClientApp that stopped responding.
EXECUTOR_KILL_TIMEOUT = 150.0
KILL_RUN_UPDATES = 120

# Runs by default (CI included); no skip: without flower-superlink next to this
# python, openssl, setsid or Fashion-MNIST the deployment fails and says why.
pytestmark = pytest.mark.deploy


# ------------------------------------------------------------------ helpers
def wait_for(
    what: str,
    check: Callable[[], object],
    timeout: float,
    on_fail: Callable[[], str],
    interval: float = 1.0,
):
    """Poll ``check`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}\n{on_fail()}")
        time.sleep(interval)


def computing(log: Path) -> bool:
    """The SuperNode's ClientApp is computing a train reply (received, not sending)."""
    events = re.findall(
        r"Receiving: train message|Received successfully|Sending: train message|"
        r"Sent successfully",
        text(log),
    )
    return events[-2:] == ["Receiving: train message", "Received successfully"]


def train_replies(log: Path) -> int:
    return text(log).count("Sending: train message")


@pytest.fixture(scope="module")
def deployment(tmp_path_factory) -> Iterator[Deployment]:
    dep = Deployment(tmp_path_factory.mktemp("deploy"))
    started = time.monotonic()
    try:
        out = dep.script("start_local.sh", str(NUM_NODES), timeout=180)
        assert "SuperLink https://127.0.0.1:" in out
        for i in range(NUM_NODES):  # every SuperNode got in with its registered key
            wait_for(
                f"SuperNode node-{i} to connect",
                lambda i=i: (
                    f"SuperNode ID: {dep.node_id(f'node-{i}')}"
                    in text(dep.log(f"supernode-node-{i}"))
                ),
                60,
                lambda i=i: tail(dep.log(f"supernode-node-{i}")),
            )
            wait_for(  # ... and runs its ClientApp in a warm executor (the deploy default)
                f"the executor of node-{i}",
                lambda i=i: executor_pids(dep.pid(f"supernode-node-{i}")),
                60,
                lambda i=i: tail(dep.log(f"supernode-node-{i}")),
            )
        print(
            f"\n[deploy] SuperLink + {NUM_NODES} SuperNodes up in {time.monotonic() - started:.1f} s"
        )
        yield dep
    finally:
        dep.stop_everything()
        leftovers = dep.leftover_pids()
        assert not leftovers, f"processes left running: {leftovers}"


# -------------------------------------------------------------------- tests
def test_supernode_without_registered_key_is_refused(deployment: Deployment):
    dep = deployment
    started = time.monotonic()
    dep.script("make_node_keys.sh", "-o", dep.env["KEY_DIR"], "intruder")  # not registered
    address = dep.state()["ADDRESS"]
    common = [
        str(BIN / "flower-supernode"),
        "--superlink",
        address,
        "--root-certificates",
        str(Path(dep.env["CERT_DIR"]) / "ca.crt"),
        "--node-config",
        "partition-id=0 num-partitions=3",
        "--max-retries",
        "2",
        "--host",
        "127.0.0.1",
    ]
    unregistered = dep.popen(
        common
        + [
            "--port",
            str(free_port()),
            "--auth-supernode-private-key",
            str(Path(dep.env["KEY_DIR"]) / "intruder"),
        ],
        dep.base / "intruder.log",
    )
    keyless = dep.popen(common + ["--port", str(free_port())], dep.base / "keyless.log")
    for proc, log in ((unregistered, "intruder.log"), (keyless, "keyless.log")):
        try:
            code = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            pytest.fail(f"refused SuperNode still running after 90 s\n{tail(dep.base / log)}")
        assert code != 0, tail(dep.base / log)
        assert "Failed to initialize the connection to the SuperLink" in text(dep.base / log)
    assert "Failed to activate SuperNode" in text(dep.base / "intruder.log")
    assert "All SuperNodes must be registered" in text(dep.base / "keyless.log")

    listed = subprocess.run(
        [str(BIN / "flwr"), "supernode", "ls", "gsgm-local", "--format", "json"],
        env=dep.env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    payload = listed.stdout[listed.stdout.index("{") :]
    nodes = {int(n["node-id"]): n["status"] for n in json.loads(payload)["nodes"]}
    assert nodes == {dep.node_id(f"node-{i}"): "online" for i in range(NUM_NODES)}
    print(
        f"[deploy] unregistered and keyless SuperNodes refused in {time.monotonic() - started:.1f} s"
    )


def test_gsgm_survives_a_killed_supernode_and_its_replacement_rejoins(deployment: Deployment):
    dep = deployment
    t0 = time.monotonic()
    marks: dict[str, float] = {}
    stream = dep.base / "flwr-run.log"
    run = dep.flwr_run(REPO, f'{RUN_CONFIG} output-dir="{dep.outputs}"', stream)
    killed_log = dep.log(f"supernode-node-{KILLED}")

    def logs() -> str:
        names = [f"supernode-node-{i}" for i in range(NUM_NODES)] + [
            "supernode-node-2b",
            "superlink",
        ]
        return tail(stream, 60) + "\n" + "\n".join(tail(dep.log(n), 15) for n in names)

    def run_alive() -> None:
        if run.poll() is not None:
            pytest.fail(f"flwr run ended early (exit {run.returncode})\n{logs()}")

    # 1. Training runs on all three SuperNodes.
    wait_for(
        "two updates from the SuperNode to be killed",
        lambda: run_alive() or train_replies(killed_log) >= 2,
        300,
        logs,
    )
    marks["node 2 trained"] = time.monotonic() - t0

    # 2. SIGKILL that SuperNode (and its SuperExec / ClientApp children) mid-run, while
    # it computes an update. (Killed while uploading a reply, it would also be noted as
    # lost, but only after the SuperLink's object-push session of that reply expires,
    # 180 s, during which Flower's Grid.pull_messages blocks the engine.)
    wait_for(
        "the SuperNode to be killed to compute an update",
        lambda: run_alive() or computing(killed_log),
        120,
        logs,
        interval=0.1,
    )
    old_id = dep.node_id(f"node-{KILLED}")
    kill_all(process_tree(dep.pid(f"supernode-node-{KILLED}")))
    (dep.run_dir / "pids" / f"supernode-node-{KILLED}.pid").unlink()
    killed_at = time.monotonic()
    marks["killed"] = killed_at - t0

    # 3. The engine notes it as lost; the others keep training.
    lost = wait_for(
        "the engine to note the killed SuperNode as lost",
        lambda: (
            run_alive()
            or re.search(rf"\[async\] node {old_id} \(partition {KILLED}\) lost: .*", text(stream))
        ),
        DISPATCH_TIMEOUT + 120,
        logs,
    )
    marks["lost"] = time.monotonic() - t0
    others_before = sum(train_replies(dep.log(f"supernode-node-{i}")) for i in range(KILLED))

    # 4. A replacement for the same partition-id (new key -> new node id) rejoins.
    dep.script("start_supernode.sh", str(KILLED), "node-2b")
    new_id = dep.node_id("node-2b")
    assert new_id != old_id
    wait_for(
        "the replacement to rejoin",
        lambda: run_alive() or f"[async] node {new_id} (partition {KILLED}) joined" in text(stream),
        180,
        logs,
    )
    marks["rejoined"] = time.monotonic() - t0

    # 5. ... and contributes again.
    wait_for(
        "two updates from the replacement",
        lambda: train_replies(dep.log("supernode-node-2b")) >= 2 or run.poll() is not None,
        240,
        logs,
    )
    assert train_replies(dep.log("supernode-node-2b")) >= 2, (
        f"the run ended before the replacement sent two updates\n{logs()}"
    )
    marks["replacement trained"] = time.monotonic() - t0
    others_after = sum(train_replies(dep.log(f"supernode-node-{i}")) for i in range(KILLED))
    assert others_after > others_before  # the other SuperNodes kept training throughout

    # 6. The run reaches its budget and ends.
    try:
        run.wait(timeout=600)
    except subprocess.TimeoutExpired:
        pytest.fail(f"flwr run did not end within 600 s after the rejoin\n{logs()}")
    marks["run ended"] = time.monotonic() - t0
    log = text(stream)
    assert run.returncode == 0, logs()
    assert "Asynchronous run finished" in log, logs()
    assert not re.search(rf"rejected update from node \d+ \(partition {KILLED}\)", log)

    run_dir = dep.outputs / "deploy-test"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["updates_received"] == MAX_UPDATES
    assert summary["nodes_lost"] >= 1
    # Every rejection is counted by its reason and logged, and none is blamed on the
    # replacement (checked above). Zero is not promised: CI once saw 1 of 150, whose
    # reason it did not print (this test now does); with 2 classes per node the swing
    # after the replacement rejoins can put a surviving node's update over the norm
    # bound. More than a few would be a fault.
    by_reason = summary["rejected_by_reason"]
    rejection_lines = [
        line
        for line in log.splitlines()
        if "rejected update from" in line or "ignored a replayed reply" in line
    ]
    assert summary["rejected"] == sum(by_reason.values()), by_reason
    for reason in by_reason:
        assert any(f"({reason})" in line for line in rejection_lines), (reason, rejection_lines)
    assert summary["rejected"] <= MAX_UPDATES // 50, (by_reason, rejection_lines)
    with (run_dir / "metrics.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert int(rows[-1]["updates"]) == MAX_UPDATES
    assert float(rows[-1]["accuracy"]) > 0.0

    print(f"[deploy] {lost.group(0)}")
    print(
        "[deploy] timeline (s since flwr run): "
        + ", ".join(f"{k} {v:.0f}" for k, v in marks.items())
    )
    print(
        f"[deploy] summary: updates {summary['updates_received']}, lost {summary['nodes_lost']}, "
        f"rejected {by_reason}, "
        f"wall {summary['wall_seconds']:.0f} s, final accuracy {summary['final_accuracy']:.3f}"
    )


PROBE_SERVER = '''"""Probe ServerApp: train messages with the given configs to one node, in turn."""

import json
import time

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

from clients.models import build_model

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    node = int(cfg["node-id"])
    arrays = ArrayRecord(build_model("fashion-mnist", seed=0).state_dict())
    rows = []
    for i, batch_size in enumerate(int(b) for b in str(cfg["batch-sizes"]).split(",")):
        config = ConfigRecord({"mode": "gradient", "batch-size": batch_size, "seed": i,
                               "model-version": i})
        message = Message(RecordDict({"arrays": arrays, "config": config}), node, "train")
        (mid,) = list(grid.push_messages([message]))
        deadline = time.monotonic() + 300
        while not (replies := list(grid.pull_messages([mid]))):
            if time.monotonic() > deadline:
                raise RuntimeError("no reply within 300 s")
            time.sleep(0.05)
        reply = replies[0]
        rows.append({"error": reply.error.code if reply.has_error() else None,
                     "reason": reply.error.reason if reply.has_error() else "",
                     "metrics": {} if reply.has_error() else dict(reply.content["metrics"])})
    with open(cfg["out"], "w") as fh:
        json.dump(rows, fh)
'''


def _probe_app(folder: Path, version: str) -> Path:
    """A small Flower App: the project's ClientApp, a probe ServerApp (version differs)."""
    return probe_app(
        folder,
        "gsgm-deploy-probe",
        version,
        {"probe_server.py": PROBE_SERVER},
        "clients.client_app:app",
        {"node-id": "0", "batch-sizes": "32", "out": ""},
    )


def test_a_raising_clientapp_and_a_new_app_version_keep_the_same_executor(
    deployment: Deployment,
):
    dep = deployment
    log = dep.log("supernode-node-0")
    (executor,) = executor_pids(dep.pid("supernode-node-0"))
    node = dep.node_id("node-0")
    results = []
    for version, batch_sizes in (("1.0.0", "32,0,32"), ("2.0.0", "16")):
        app = _probe_app(dep.base / f"probe-{version}", version)
        out = dep.base / f"probe-{version}.json"
        # a node id can exceed the run config's int64: sent as text
        config = f'node-id="{node}" batch-sizes="{batch_sizes}" out="{out}"'
        run = dep.flwr_run(app, config, dep.base / f"probe-{version}.log")
        try:
            run.wait(timeout=600)
        except subprocess.TimeoutExpired:
            pytest.fail(f"probe {version} did not end\n{tail(dep.base / f'probe-{version}.log')}")
        assert out.is_file(), tail(dep.base / f"probe-{version}.log") + tail(log)
        results.append(json.loads(out.read_text()))
    v1, v2 = results
    print(f"[deploy] probe replies: {results}")
    # batch-size 32, 0 (the ClientApp raises: an error reply), 32 again, then v2's 16
    assert [r["error"] for r in v1] == [None, 2, None], results  # 2: CLIENT_APP_RAISED_EXCEPTION
    assert [r["error"] for r in v2] == [None], results
    assert "batch-size" in v1[1]["reason"] and "ValueError" in v1[1]["reason"]
    assert [r["metrics"]["num-examples"] for r in (v1[0], v1[2], v2[0])] == [32, 32, 16]
    # One executor process served all of it; it imported the app once per version.
    assert executor_pids(dep.pid("supernode-node-0")) == [executor]
    loads = re.findall(r"\[executor\] loaded the ClientApp of (\S+) (\S+)", text(log))
    assert loads[-2:] == [
        ("flwr-gsgm/gsgm-deploy-probe", "1.0.0"),
        ("flwr-gsgm/gsgm-deploy-probe", "2.0.0"),
    ]
    print(f"[deploy] executor {executor}: an error reply, then app 1.0.0 -> 2.0.0, same process")


def test_executor_killed_mid_task_comes_back_as_an_error_reply(deployment: Deployment):
    dep = deployment
    t0 = time.monotonic()
    marks: dict[str, float] = {}
    stream = dep.base / "flwr-run-executor-kill.log"
    outputs = dep.base / "outputs-executor-kill"
    config = RUN_CONFIG.replace(
        f"dispatch-timeout={DISPATCH_TIMEOUT}", f"dispatch-timeout={EXECUTOR_KILL_TIMEOUT}"
    )
    config = config.replace('run-name="deploy-test"', 'run-name="executor-kill"')
    # Long enough that node-0 trains again after the 60 s its SuperNode waits.
    config = config.replace(f"max-updates={MAX_UPDATES}", f"max-updates={KILL_RUN_UPDATES}")
    run = dep.flwr_run(REPO, f'{config} output-dir="{outputs}"', stream)
    nodes = ["node-0", "node-1", "node-2b"]  # node-2 was replaced by node-2b above
    log = dep.log("supernode-node-0")
    supernode = dep.pid("supernode-node-0")

    def logs() -> str:
        return (
            tail(stream, 60) + "\n" + "\n".join(tail(dep.log(f"supernode-{n}"), 20) for n in nodes)
        )

    def run_alive() -> None:
        if run.poll() is not None:
            pytest.fail(f"flwr run ended early (exit {run.returncode})\n{logs()}")

    before = train_replies(log)
    wait_for("an update from node-0", lambda: run_alive() or train_replies(log) > before, 300, logs)
    wait_for(
        "node-0 to compute an update",
        lambda: run_alive() or computing(log),
        120,
        logs,
        interval=0.05,
    )
    (executor,) = executor_pids(supernode)
    os.kill(executor, signal.SIGKILL)
    killed_replies = train_replies(log)
    marks["executor killed"] = time.monotonic() - t0

    # The SuperNode survives; the supervisor starts a new executor.
    restarted = wait_for(
        "a new executor", lambda: [p for p in executor_pids(supernode) if p != executor], 60, logs
    )
    marks["executor restarted"] = time.monotonic() - t0
    # The SuperNode answers the message for the dead ClientApp; the engine counts it.
    error = wait_for(
        "the engine to get the error reply",
        lambda: (
            run_alive()
            or re.search(
                r"\[async\] error reply from node \d+ \(partition 0\) \(code 8: [^)]*\): (.*)",
                text(stream),
            )
        ),
        EXECUTOR_KILL_TIMEOUT,
        logs,
    )
    assert error.group(1).strip() == "ClientApp stopped responding."
    marks["error reply"] = time.monotonic() - t0
    # ... and node-0 trains again, served by the new executor.
    wait_for(
        "node-0 to train again",
        lambda: train_replies(log) >= killed_replies + 3 or run.poll() is not None,
        300,
        logs,
    )
    assert train_replies(log) >= killed_replies + 3, logs()
    assert os.path.exists(f"/proc/{supernode}")
    assert executor_pids(supernode) == restarted
    marks["node-0 trained again"] = time.monotonic() - t0
    try:
        run.wait(timeout=900)
    except subprocess.TimeoutExpired:
        pytest.fail(f"flwr run did not end\n{logs()}")
    assert run.returncode == 0, logs()
    summary = json.loads((outputs / "executor-kill" / "summary.json").read_text())
    assert summary["updates_received"] == KILL_RUN_UPDATES
    assert summary["error_replies"] == 1
    assert summary["nodes_lost"] == 0 and summary["rejected"] == 0
    print(
        "[deploy] executor kill timeline (s since flwr run): "
        + ", ".join(f"{k} {v:.0f}" for k, v in marks.items())
    )
