"""A local SuperLink for the `flwr run` tests, started and stopped by the test itself.

Why not the one `flwr run` starts: Flower gives its local SuperLink 15 s to answer
/health (``flwr.cli.constant.LOCAL_SUPERLINK_STARTUP_TIMEOUT``, no setting), and on
this shared 2-core machine the start takes 11-14 s at load average 15-16, more while
the previous test's SuperExec, simulation and Ray processes still shut down. Past
15 s `flwr run` kills it ("Failed to start local SuperLink within 15s"), the run never
starts and the test fails at random (test_a_failing_run_makes_the_script_fail, run
after another `flwr run` test). Here the test starts the same command on ports of its
own, waits until it answers (or starts again on new ports if it exited, e.g. because
a port was taken between choosing and binding it), and `flwr run` finds it healthy on
``FLWR_LOCAL_SUPERLINK_HTTP_API_PORT`` and reuses it. At the end it is stopped by its
PID, and the test waits until it and every process it started (SuperExec, simulation,
Ray) have exited, so the next test starts on a machine without them.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil

# A start that hangs fails the test instead of blocking it; not a speed bound.
HANG_GUARD_S = 600.0


def free_port() -> int:
    """A TCP port of 127.0.0.1 that is free now (the kernel's choice)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_flwr_config(home: Path, num_supernodes: int) -> None:
    """FLWR_HOME/config.toml: the "local" SuperLink simulating ``num_supernodes`` nodes,
    one CPU per ClientApp, for the tests that call ``flwr run`` themselves (Flower 1.42
    warns that ``options.`` is deprecated; scripts/run_simulation.sh writes the
    connection alone and passes ``--federation-config``, which overrides these)."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        f"""[superlink]
default = "local"

[superlink.local]
address = ":local-in-memory:"
options.num-supernodes = {num_supernodes}
options.backend.client-resources.num-cpus = 1
options.backend.client-resources.num-gpus = 0.0
options.backend.init-args.logging-level = "ERROR"
"""
    )


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).is_success
    except httpx.HTTPError:
        return False


def _start(home: Path, env: dict[str, str]) -> subprocess.Popen | None:
    """Flower's command for its local SuperLink; None if it exited before answering."""
    http, control = env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"], env["FLWR_LOCAL_CONTROL_API_PORT"]
    # The log lies outside FLWR_HOME/local-superlink: scripts/run_simulation.sh stops
    # the SuperLink whose log is there, without waiting; this one is the test's to stop.
    command = ["flower-superlink", "--insecure", "--simulation", "--isolation", "subprocess"]
    command += ["--control-api-address", f"127.0.0.1:{control}", "--host", "127.0.0.1"]
    command += ["--port", http, "--log-file", str(home / "test-superlink.log")]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + HANG_GUARD_S
    while not _healthy(int(http)):
        if proc.poll() is not None:
            return None
        if time.monotonic() > deadline:
            _stop(proc)
            raise AssertionError(f"flower-superlink did not answer in {HANG_GUARD_S} s")
        time.sleep(0.5)
    return proc


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the SuperLink by PID; wait until it and its descendants have exited."""
    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    # The SuperLink terminates its SuperExec (which ends the simulation and Ray) but
    # waits only 1 s for it; wait for the rest here, killing what does not end.
    _, alive = psutil.wait_procs(descendants, timeout=60)
    for child in alive:
        child.kill()
    psutil.wait_procs(alive, timeout=60)


@contextmanager
def local_superlink(home: Path, attempts: int = 3) -> Iterator[dict[str, str]]:
    """A running local SuperLink with FLWR_HOME ``home``; yields the environment for
    `flwr run` / scripts/run_simulation.sh (its ports, FLWR_HOME, runtime dependency
    installation off, this interpreter's bin folder first on PATH).

    Raises AssertionError if flower-superlink exits before answering ``attempts``
    times (each on new free ports) or does not answer within HANG_GUARD_S.
    """
    home.mkdir(parents=True, exist_ok=True)
    for _ in range(attempts):
        env = {
            **os.environ,
            "FLWR_HOME": str(home),
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
            "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        }
        proc = _start(home, env)
        if proc is not None:
            break
    else:
        log = (home / "test-superlink.log").read_text()[-2000:]
        raise AssertionError(f"flower-superlink exited at start {attempts} times:\n{log}")
    try:
        yield env
    finally:
        _stop(proc)
