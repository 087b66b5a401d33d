"""One local deployment on 127.0.0.1 (deploy/start_local.sh: SuperLink + SuperNodes
with TLS and SuperNode authentication) and the small Flower Apps that probe it.

Shared by the deployment tests (tests/deploy/) and the deployment scripts
(benchmarks/bench_deployment.py, race_deployment.py, soak_deployment.py,
server_cost.py): import it as ``benchmarks.local_deployment`` with the repository on
``sys.path``. Processes are found with psutil, never by parsing /proc by hand.

**A deployment dies with the script that started it.** The SuperLink and the
SuperNodes run in sessions of their own (so that a Ctrl-C reaches only the script), so
nothing stops them when the script ends but the script itself. A *guarded* deployment
(:meth:`Deployment.guard`; :func:`start_deployment` and :func:`running_deployment`
guard theirs) makes sure it is stopped however the script ends:

- SIGTERM, SIGHUP and SIGINT (even in a background job, where the shell ignores it)
  are raised in the main thread as :class:`Interrupted`, a ``KeyboardInterrupt``, as
  Ctrl-C is, so that the script's ``finally`` blocks run
  :meth:`Deployment.stop_everything` (the script must stop it in a ``finally``, or use
  :func:`running_deployment`); while it stops, further signals wait (and once one has
  interrupted the script, the next ones are only reported);
- a watchdog process (:class:`Watchdog`), started before anything else in a session of
  its own (a Ctrl-C or a kill of the script's process group spares it), waits for the
  script to end; if the script ends without stopping the deployment (killed outright
  with SIGKILL, or it forgot), the watchdog stops it (:meth:`Deployment.stop_everything`:
  the PID files, then every process that names the deployment's folders or ports or has
  its ``RUN_DIR`` in its environment, such as a start script left running), writing
  ``<run folder>/watchdog.log``.

:meth:`Deployment.stop_everything` dismisses the watchdog and puts the signal handlers
back (a signal that came while it stopped is then raised). Run as a script, this module
is the watchdog (``--watchdog``, started by :class:`Watchdog`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

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


def run_dir_of(proc: psutil.Process) -> str | None:
    """``RUN_DIR`` in the environment of ``proc`` (None if unset, gone or not ours)."""
    try:
        return proc.environ().get("RUN_DIR")
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
        return None


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


# ------------------------------------------------------------------ signals, watchdog
#: The signals a guarded deployment's script stops on, as on Ctrl-C.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


class Interrupted(KeyboardInterrupt):
    """A stop signal (:data:`STOP_SIGNALS`) while a guarded deployment runs, raised as
    Ctrl-C is; ``str()`` names it (``signal SIGTERM``)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signal.Signals(signum).name}")
        self.signum = signum


class _StopSignals:
    """The handlers of :data:`STOP_SIGNALS` while at least one guarded deployment runs
    (one set for the process: installed by the first :meth:`acquire`, put back by the
    last :meth:`release`).

    A signal raises :class:`Interrupted` in the main thread, once: the next ones only
    say so on stderr (the script is already stopping; SIGKILL still ends it, then the
    watchdog stops the deployment). Within :meth:`deferred` (a deployment stopping) a
    signal waits and is raised when the last deferral ends.
    """

    def __init__(self) -> None:
        self.users = 0
        self.saved: dict[int, Any] = {}
        self.deferring = 0
        self.pending: int | None = None
        self.interrupted = False

    def acquire(self) -> bool:
        """Install the handlers (unless they are already); False outside the main
        thread, where Python cannot set them (the watchdog still guards)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        if self.users == 0:
            self.saved = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
            self.pending, self.interrupted = None, False
            for signum in STOP_SIGNALS:
                signal.signal(signum, self._handle)
        self.users += 1
        return True

    def release(self) -> None:
        """Put the handlers found by the first :meth:`acquire` back (at the last one)."""
        self.users -= 1
        if self.users == 0:
            for signum, handler in self.saved.items():
                signal.signal(signum, signal.SIG_DFL if handler is None else handler)

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """Stop signals wait until the block ends (then the first is raised, unless one
        has interrupted the script already)."""
        self.deferring += 1
        try:
            yield
        finally:
            self.deferring -= 1
        if not self.deferring and self.pending is not None and not self.interrupted:
            signum, self.pending, self.interrupted = self.pending, None, True
            raise Interrupted(signum)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.deferring or self.interrupted:
            if self.pending is None and not self.interrupted:
                self.pending = signum
            if self.interrupted:
                print(
                    f"signal {signal.Signals(signum).name}: already stopping the deployment "
                    "(SIGKILL ends this process; its watchdog then stops the deployment)",
                    file=sys.stderr,
                    flush=True,
                )
            return
        self.interrupted = True
        raise Interrupted(signum)


_STOP_SIGNALS = _StopSignals()


class Watchdog:
    """The watchdog process of one deployment (:meth:`start`), in a session of its own.

    It holds the read end of a pipe whose write end only this process holds: when this
    process ends (however: SIGKILL too) the pipe closes, or its pidfd says so, and the
    watchdog stops the deployment (:func:`watch`). :meth:`dismiss` (called by
    :meth:`Deployment.stop_everything` once it stopped the deployment) tells it to end
    without doing anything."""

    def __init__(self, proc: subprocess.Popen, write_fd: int, log: Path) -> None:
        self.proc, self.write_fd, self.log = proc, write_fd, log

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    def start(cls, dep: Deployment) -> Watchdog:
        """The watchdog of this process over ``dep``, its output to
        ``<run folder>/watchdog.log``; it spares this process's ancestors (a shell whose
        command line names the work folder)."""
        dep.run_dir.mkdir(parents=True, exist_ok=True)
        log = dep.run_dir / "watchdog.log"
        ancestors = [str(proc.pid) for proc in psutil.Process().parents()]
        command = [sys.executable, str(Path(__file__).resolve()), "--watchdog"]
        command += [str(os.getpid()), str(dep.base), dep.run_name]
        command += [f"--spare={pid}" for pid in ancestors]
        read_fd, write_fd = os.pipe()  # neither end is inherited by other children
        try:
            with log.open("w") as out:
                proc = subprocess.Popen(
                    command,
                    stdin=read_fd,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=REPO,
                    start_new_session=True,
                )
        except BaseException:
            os.close(write_fd)
            raise
        finally:
            os.close(read_fd)
        return cls(proc, write_fd, log)

    def dismiss(self) -> None:
        """Tell the watchdog that the deployment is stopped; wait for it to end."""
        try:
            os.write(self.write_fd, b"stopped\n")
        except OSError:  # it is gone already
            pass
        os.close(self.write_fd)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def wait_for_parent(parent: int, pipe: int) -> bool:
    """Wait until process ``parent`` ends or writes to ``pipe`` (the read end of
    :class:`Watchdog`'s pipe): True if it ended without writing (the pipe at its end of
    file, or its pidfd readable), False if it wrote (it stopped the deployment itself)."""
    watched = [pipe]
    try:
        pidfd = os.pidfd_open(parent)
    except ProcessLookupError:
        return not _wrote(pipe, timeout=0)
    except (AttributeError, OSError):  # no pidfd (Linux < 5.3): the pipe alone
        pidfd = -1
    else:
        if os.getppid() != parent:  # ended before the pidfd was opened (its pid reused?)
            os.close(pidfd)
            return not _wrote(pipe, timeout=0)
        watched.append(pidfd)
    select.select(watched, [], [])  # the pipe (written to, or closed) or the pidfd
    return not _wrote(pipe, timeout=0)  # the pidfd: it ended, maybe just after writing


def _wrote(pipe: int, timeout: float) -> bool:
    """Whether the pipe holds data within ``timeout`` seconds (False at its end)."""
    ready, _, _ = select.select([pipe], [], [], timeout)
    return bool(ready) and bool(os.read(pipe, 64))


def watch(parent: int, base: Path, run_name: str, spare: set[int]) -> int:
    """The watchdog's work (``--watchdog``): wait for process ``parent``
    (:func:`wait_for_parent`, the pipe on stdin); if it ended without dismissing the
    watchdog, stop the deployment in ``base/run_name`` (:meth:`Deployment.stop_everything`:
    its PID files, then every process naming ``base`` or its ports or with its run
    folder as ``RUN_DIR``, ``spare`` left alone). Exit code 1 if a process is left."""
    for signum in (signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    if not wait_for_parent(parent, sys.stdin.fileno()):
        print(f"process {parent} stopped the deployment itself: nothing to do", flush=True)
        return 0
    dep = Deployment(base, run_name)
    dep.spared.update(spare)
    dep.stop_everything()
    print(f"process {parent} ended: stopped the deployment in {dep.run_dir}", flush=True)
    if leftovers := dep.leftover_pids():
        print(f"processes still alive after the stop: {leftovers}", flush=True)
        return 1
    return 0


# ------------------------------------------------------------------ deployment
class Deployment:
    """The folders and processes of one local deployment (see deploy/start_local.sh).

    ``base`` holds certificates, keys and ``run_name`` (logs, pids, node ids, the
    SuperLink's FLWR_HOME); ``env`` adds to the scripts' environment (for example
    ``CLIENTAPP_MODE``). Every process started through it, every process whose
    command line names ``base`` or one of its loopback ports and every process with
    its run folder as ``RUN_DIR`` in its environment (what the deploy scripts start
    inherits it) is stopped by :meth:`stop_everything`. :meth:`guard` makes sure that
    happens however this process ends.
    """

    def __init__(self, base: Path, run_name: str = "run", **env: str) -> None:
        self.base = base
        self.run_name = run_name
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
        #: Processes :meth:`leftover_pids` leaves alone (the watchdog; its parent's
        #: ancestors, in the watchdog).
        self.spared: set[int] = set()
        self.watchdog: Watchdog | None = None
        self._signals_held = False

    def guard(self) -> Deployment:
        """Until :meth:`stop_everything`: stop signals raise :class:`Interrupted` (the
        caller stops the deployment in a ``finally``) and a :class:`Watchdog` stops the
        deployment if this process ends without stopping it (see the module's
        docstring). Call it before anything is started; calling it again does nothing.
        """
        if self.watchdog is None:
            self.watchdog = Watchdog.start(self)
            self.spared.add(self.watchdog.pid)
        if not self._signals_held:
            self._signals_held = _STOP_SIGNALS.acquire()
        return self

    def start(self, nodes: int, timeout: float | None = None) -> None:
        """SuperLink + ``nodes`` SuperNodes (deploy/start_local.sh, given ``timeout``
        seconds, default 120 + 30 per node); returns once every SuperNode is connected.
        Raises RuntimeError or TimeoutError naming what failed; the caller stops it."""
        limit = 120 + 30 * nodes if timeout is None else timeout
        self.script("start_local.sh", str(nodes), timeout=limit)
        self.wait_connected([f"node-{i}" for i in range(nodes)], timeout=300)

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
        """Processes whose command line names our folders or our loopback ports, or
        whose environment has our run folder as ``RUN_DIR``; not this process, its
        ancestors (a shell whose command names the work folder) or :attr:`spared`."""
        me = psutil.Process()
        skip = {me.pid, *(proc.pid for proc in me.parents()), *self.spared}
        run_dirs = {str(self.run_dir), os.path.realpath(self.run_dir)}
        ports, found = self.our_ports(), []
        for proc in psutil.process_iter():
            if proc.pid in skip:
                continue
            cmdline = command_line(proc.pid)
            used = {int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)\b", cmdline)}
            if str(self.base) in cmdline or used & ports or run_dir_of(proc) in run_dirs:
                found.append(proc.pid)
        return found

    def stop_everything(self) -> None:
        """Kill what :meth:`popen` started, run stop_local.sh, then any leftover; stop
        signals wait meanwhile. Then the guard (:meth:`guard`) is lifted: the watchdog
        dismissed, the signal handlers put back (a signal that came meanwhile is raised
        then, as :class:`Interrupted`)."""
        with _STOP_SIGNALS.deferred():
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
            if self.watchdog is not None:
                self.watchdog.dismiss()
                self.watchdog = None
            if self._signals_held:
                self._signals_held = False
                _STOP_SIGNALS.release()


def start_deployment(
    base: Path,
    run_name: str,
    nodes: int,
    *,
    guard: bool = True,
    start_timeout: float | None = None,
    **env: str,
) -> Deployment:
    """SuperLink + ``nodes`` SuperNodes (deploy/start_local.sh, ``start_timeout``:
    :meth:`Deployment.start`) in ``base/run_name``, with ``env`` added to the scripts'
    environment (``NODE_CONFIG_EXTRA_<i>``, ``DATABASE``, ``CLIENTAPP_MODE``, ...);
    returns once every SuperNode is connected. With ``guard`` (the default) the
    deployment is guarded first (:meth:`Deployment.guard`: stop signals raised as
    :class:`Interrupted`, a watchdog). The caller stops it
    (:meth:`Deployment.stop_everything`) in a ``finally``; if this raises, it is
    stopped already."""
    dep = Deployment(base, run_name, PYTHONPATH=str(REPO), **env)
    try:
        if guard:
            dep.guard()
        dep.start(nodes, start_timeout)
    except BaseException:
        dep.stop_everything()
        raise
    return dep


@contextmanager
def running_deployment(
    base: Path, run_name: str, nodes: int, *, start_timeout: float | None = None, **env: str
) -> Iterator[Deployment]:
    """:func:`start_deployment` (guarded) as a context manager: the deployment is
    stopped when the block ends, however (an error, a stop signal as
    :class:`Interrupted`; the watchdog if the process is killed outright)."""
    dep = start_deployment(base, run_name, nodes, start_timeout=start_timeout, **env)
    try:
        yield dep
    finally:
        dep.stop_everything()


def main(argv: list[str] | None = None) -> int:
    """The watchdog (:func:`watch`): ``local_deployment.py --watchdog PARENT BASE
    RUN_NAME [--spare=PID ...]``, the pipe of :class:`Watchdog` on stdin."""
    parser = argparse.ArgumentParser(description="The watchdog of a local deployment.")
    parser.add_argument("--watchdog", action="store_true", required=True)
    parser.add_argument("parent", type=int, help="the process whose end stops it")
    parser.add_argument("base", type=Path, help="the deployment's work folder")
    parser.add_argument("run_name", help="its run folder under BASE")
    parser.add_argument("--spare", type=int, action="append", default=[], metavar="PID")
    args = parser.parse_args(argv)
    return watch(args.parent, args.base, args.run_name, set(args.spare))


if __name__ == "__main__":
    sys.exit(main())
