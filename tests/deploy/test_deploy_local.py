"""A real deployment on 127.0.0.1: SuperLink + three SuperNodes as separate processes,
TLS and SuperNode authentication, started by the deploy/ scripts; GSGM runs with
``flwr run``.

- A SuperNode without a registered key (or without any key) is refused.
- A SuperNode killed with SIGKILL mid-run is noted as lost by the engine, the run goes
  on with the others; a SuperNode restarted for the same partition-id (a new key,
  hence a new node id: a re-provisioned board) rejoins and contributes again; the run
  reaches its budget and ends (no hang).

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
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
BIN = Path(sys.executable).parent
NUM_NODES = 3
KILLED = 2  # partition-id whose SuperNode is killed and replaced
MAX_UPDATES = 60
REPLY_TIMEOUT = 45.0
RUN_CONFIG = (
    f"virtual-clock=false max-updates={MAX_UPDATES} eval-every=30 eval-examples=500 "
    f"min-nodes={NUM_NODES} reply-timeout={REPLY_TIMEOUT} poll-interval=0.1 "
    'run-name="deploy-test"'
)

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


def text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def tail(path: Path, lines: int = 40) -> str:
    return f"--- {path.name} ---\n" + "\n".join(text(path).splitlines()[-lines:])


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (from /proc), parents first."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(children.get(current, []))
    return tree


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def kill_all(pids: list[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class Deployment:
    """The folders and processes of one local deployment (see deploy/start_local.sh)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.run_dir = base / "run"
        self.outputs = base / "outputs"
        self.env = {
            **os.environ,
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "VENV": str(BIN.parent),
            "RUN_DIR": str(self.run_dir),
            "CERT_DIR": str(base / "certs"),
            "KEY_DIR": str(base / "keys"),
            "FLWR_HOME": str(self.run_dir / "flwr-home"),
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "STOP_TIMEOUT": "10",
        }
        self.popens: list[subprocess.Popen] = []

    def script(self, name: str, *args: str, timeout: float = 120) -> str:
        done = subprocess.run(
            ["bash", str(DEPLOY / name), *args],
            env=self.env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert done.returncode == 0, f"{name} {args} failed:\n{done.stdout}\n{done.stderr}"
        return done.stdout

    def popen(self, args: list[str], log: Path) -> subprocess.Popen:
        with log.open("w") as out:
            proc = subprocess.Popen(
                args,
                env=self.env,
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.popens.append(proc)
        return proc

    def log(self, name: str) -> Path:
        return self.run_dir / "logs" / f"{name}.log"

    def pid(self, name: str) -> int:
        return int((self.run_dir / "pids" / f"{name}.pid").read_text())

    def node_id(self, key: str) -> int:
        return int((self.run_dir / "nodes" / f"{key}.node-id").read_text())

    def state(self) -> dict[str, str]:
        lines = text(self.run_dir / "state.env").splitlines()
        return dict(line.split("=", 1) for line in lines if "=" in line)

    def our_ports(self) -> set[int]:
        ports = set()
        if "PORT" in self.state():
            ports.add(int(self.state()["PORT"]))
        for log in (self.run_dir / "logs").glob("*.log"):
            ports.update(
                int(p) for p in re.findall(r"running on https?://127\.0\.0\.1:(\d+)", text(log))
            )
        return ports

    def leftover_pids(self) -> list[int]:
        """Processes whose command line names our folders or our loopback ports."""
        ports, found = self.our_ports(), []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                cmdline = (
                    (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                )
            except OSError:
                continue
            used = {int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)\b", cmdline)}
            if str(self.base) in cmdline or used & ports:
                found.append(int(entry.name))
        return found

    def stop_everything(self) -> None:
        for proc in self.popens:
            if proc.poll() is None:
                kill_all(process_tree(proc.pid))
        try:
            subprocess.run(
                ["bash", str(DEPLOY / "stop_local.sh")],
                env=self.env,
                cwd=REPO,
                capture_output=True,
                timeout=60,
            )
        except subprocess.TimeoutExpired:
            pass
        for _ in range(10):  # children of killed processes, orphaned ClientApps, ...
            leftovers = self.leftover_pids()
            if not leftovers:
                break
            kill_all(leftovers)
            time.sleep(0.5)
        for proc in self.popens:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


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
    run = dep.popen(
        [
            str(BIN / "flwr"),
            "run",
            str(REPO),
            "gsgm-local",
            "--stream",
            "--run-config",
            f'{RUN_CONFIG} output-dir="{dep.outputs}"',
        ],
        stream,
    )
    killed_log = dep.log(f"supernode-node-{KILLED}")

    def logs() -> str:
        names = [f"supernode-node-{i}" for i in range(NUM_NODES)] + [
            "supernode-node-2b",
            "superlink",
        ]
        return tail(stream, 60) + "\n" + "\n".join(tail(dep.log(n), 15) for n in names)

    def train_replies(log: Path) -> int:
        return text(log).count("Sending: train message")

    def run_alive() -> None:
        if run.poll() is not None:
            pytest.fail(f"flwr run ended early (exit {run.returncode})\n{logs()}")

    def computing(log: Path) -> bool:
        """The SuperNode's ClientApp is computing a train reply (not sending one)."""
        events = re.findall(
            r"Receiving: train message|Start `flwr-clientapp` process|"
            r"Sending: train message|Sent successfully",
            text(log),
        )
        return events[-2:] == ["Receiving: train message", "Start `flwr-clientapp` process"]

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
            or re.search(rf"\[async\] partition {KILLED} \(node {old_id}\) lost: .*", text(stream))
        ),
        REPLY_TIMEOUT + 120,
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
        lambda: run_alive() or f"[async] partition {KILLED} joined (node {new_id})" in text(stream),
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
    assert f"rejected update from partition {KILLED}" not in log

    run_dir = dep.outputs / "deploy-test"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["updates_received"] == MAX_UPDATES
    assert summary["nodes_lost"] >= 1
    assert summary["rejected"] == 0
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
        f"wall {summary['wall_seconds']:.0f} s, final accuracy {summary['final_accuracy']:.3f}"
    )
