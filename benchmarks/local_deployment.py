"""One local deployment on 127.0.0.1 (deploy/start_local.sh: SuperLink + SuperNodes
with TLS and SuperNode authentication) and the small Flower Apps that probe it.

Shared by the deployment tests (tests/deploy/), the deployment benchmark
(benchmarks/bench_deployment.py) and the deployment race (benchmarks/race_deployment.py):
import it as ``benchmarks.local_deployment`` with the repository on ``sys.path``.
Processes are found with psutil, never by parsing /proc by hand.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
BIN = Path(sys.executable).parent

_PYPROJECT = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "{name}"
version = "{version}"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["{package}"]

[tool.flwr.app]
publisher = "{publisher}"

[tool.flwr.app.components]
serverapp = "{serverapp}"
clientapp = "{clientapp}"

[tool.flwr.app.config]
{config}
"""


def toml_value(value: object) -> str:
    """A run config value as ``flwr run --run-config`` and pyproject.toml read it (TOML)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string
    return repr(value)


def run_config_pairs(config: dict[str, object]) -> str:
    """``k=v k2=v2`` for ``flwr run --run-config``."""
    return " ".join(f"{key}={toml_value(value)}" for key, value in config.items())


def app_pyproject(
    name: str,
    version: str,
    serverapp: str,
    clientapp: str,
    config: dict[str, object],
    package: str = "clients",
    publisher: str = "flwr-gsgm",
) -> str:
    """The pyproject.toml of a small Flower App (``flwr run`` / ``flwr build`` input).

    ``serverapp`` and ``clientapp`` are ``module:attribute`` references; ``config``
    becomes ``[tool.flwr.app.config]`` (str, int, float and bool values).
    """
    lines = "\n".join(f"{key} = {toml_value(value)}" for key, value in config.items())
    return _PYPROJECT.format(
        name=name,
        version=version,
        package=package,
        publisher=publisher,
        serverapp=serverapp,
        clientapp=clientapp,
        config=lines,
    )


#: The run config every probe App built by :func:`probe_app` starts from.
PROBE_DATA_CONFIG: dict[str, object] = {
    "dataset": "fashion-mnist",
    "data-root": "/usr/share/datasets/fashion-mnist",
    "partitioner": "pathological",
    "classes-per-node": 2,
    "seed": 0,
    "client-threads": 1,
}


def probe_app(
    folder: Path,
    name: str,
    version: str,
    modules: dict[str, str],
    clientapp: str,
    config: dict[str, object],
) -> Path:
    """A Flower App in ``folder``: a copy of the project's ``clients/`` (the real
    ClientApp and data), the given probe modules (file name -> source), ServerApp
    ``probe_server:app`` and the given ClientApp reference; ``config`` is added to
    :data:`PROBE_DATA_CONFIG`. ``folder`` is replaced if it exists."""
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "clients").mkdir(parents=True)
    for source in (REPO / "clients").glob("*.py"):
        shutil.copy2(source, folder / "clients" / source.name)
    for file_name, source in modules.items():
        (folder / file_name).write_text(source)
    pyproject = app_pyproject(
        name, version, "probe_server:app", clientapp, {**config, **PROBE_DATA_CONFIG}
    )
    (folder / "pyproject.toml").write_text(pyproject)
    return folder


# ------------------------------------------------------------------ processes
def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants, parents first ([] if ``pid`` is gone)."""
    try:
        root = psutil.Process(pid)
        return [pid] + [child.pid for child in root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def command_line(pid: int) -> str:
    """The command line of ``pid`` joined by spaces ("" if it is gone or not ours)."""
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return ""


def executor_pids(supernode_pid: int) -> list[int]:
    """The warm executor process(es) under a SuperNode launcher."""
    tree = process_tree(supernode_pid)[1:]
    return [pid for pid in tree if "flwr_gsgm.deploy.executor" in command_line(pid)]


def kill_all(pids: list[int], sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to each pid; pids already gone are skipped."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def text(path: Path) -> str:
    """The file's text ("" if it does not exist yet)."""
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log, headed by its name (for failure messages)."""
    return f"--- {path.name} ---\n" + "\n".join(text(path).splitlines()[-lines:])


# ------------------------------------------------------------------ deployment
class Deployment:
    """The folders and processes of one local deployment (see deploy/start_local.sh).

    ``base`` holds certificates, keys and ``run_name`` (logs, pids, node ids, the
    SuperLink's FLWR_HOME); ``env`` adds to the scripts' environment (for example
    ``CLIENTAPP_MODE``). Every process started through it, and every process whose
    command line names ``base`` or one of its loopback ports, is stopped by
    :meth:`stop_everything`.
    """

    def __init__(self, base: Path, run_name: str = "run", **env: str) -> None:
        self.base = base
        self.run_dir = base / run_name
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
            **env,
        }
        self.popens: list[subprocess.Popen] = []

    def script(self, name: str, *args: str, timeout: float = 120) -> str:
        """Run ``deploy/<name>``; its stdout. Raises RuntimeError naming its output."""
        done = subprocess.run(
            ["bash", str(DEPLOY / name), *args],
            env=self.env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{name} {args} failed:\n{done.stdout}\n{done.stderr}")
        return done.stdout

    def wait_connected(self, names: list[str], timeout: float) -> None:
        """Wait until each SuperNode (``node-0``, ...) logged its SuperNode ID.

        Raises TimeoutError naming the SuperNode and showing its log."""
        deadline = time.monotonic() + timeout
        for name in names:
            while "SuperNode ID:" not in text(self.log(f"supernode-{name}")):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"SuperNode {name} did not connect within {timeout:.0f} s\n"
                        + tail(self.log(f"supernode-{name}"))
                    )
                time.sleep(0.5)

    def popen(self, args: list[str], log: Path, cwd: Path = REPO) -> subprocess.Popen:
        """Start ``args`` in its own session, output to ``log``; stopped at the end."""
        with log.open("w") as out:
            proc = subprocess.Popen(
                args,
                env=self.env,
                cwd=cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.popens.append(proc)
        return proc

    def flwr_run(
        self, app: Path, run_config: str, log: Path, cwd: Path | None = None
    ) -> subprocess.Popen:
        """``flwr run APP gsgm-local --stream --run-config RUN_CONFIG`` against this
        deployment (:meth:`popen`: stopped at the end), its output to ``log``; run in
        ``cwd`` (default: the repository folder)."""
        command = [str(BIN / "flwr"), "run", str(app), "gsgm-local", "--stream"]
        return self.popen([*command, "--run-config", run_config], log, cwd=cwd or REPO)

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
        """The SuperLink's loopback ports, from state.env and the logs."""
        ports = {int(self.state()["PORT"])} if "PORT" in self.state() else set()
        for log in (self.run_dir / "logs").glob("*.log"):
            ports.update(
                int(p) for p in re.findall(r"running on https?://127\.0\.0\.1:(\d+)", text(log))
            )
        return ports

    def leftover_pids(self) -> list[int]:
        """Processes whose command line names our folders or our loopback ports."""
        ports, found = self.our_ports(), []
        for proc in psutil.process_iter():
            if proc.pid == os.getpid():
                continue
            cmdline = command_line(proc.pid)
            used = {int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)\b", cmdline)}
            if str(self.base) in cmdline or used & ports:
                found.append(proc.pid)
        return found

    def stop_everything(self) -> None:
        """Kill what :meth:`popen` started, run stop_local.sh, then any leftover."""
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


def start_deployment(base: Path, run_name: str, nodes: int, **env: str) -> Deployment:
    """SuperLink + ``nodes`` SuperNodes (deploy/start_local.sh) in ``base/run_name``, with
    ``env`` added to the scripts' environment (``NODE_CONFIG_EXTRA_<i>``, ``DATABASE``,
    ...); returns once every SuperNode is connected. The caller stops it
    (:meth:`Deployment.stop_everything`), also when this raises."""
    dep = Deployment(base, run_name, PYTHONPATH=str(REPO), **env)
    try:
        dep.script("start_local.sh", str(nodes), timeout=120 + 30 * nodes)
        dep.wait_connected([f"node-{i}" for i in range(nodes)], timeout=300)
    except BaseException:
        dep.stop_everything()
        raise
    return dep
