"""``flwr-gsgm-supernode``: ``flower-supernode`` with short polls and a warm executor.

Takes every flag of ``flower-supernode`` (Flower 1.42) plus its own, and runs Flower's
SuperNode in this process after replacing its fixed waits
(:mod:`flwr_gsgm.deploy.flower_waits`):

- after a message, the SuperNode polls the SuperLink every ``--fast-poll-interval``
  (0.1 s) for ``--fast-poll-window`` (5 s), then backs off to ``--idle-poll-interval``
  (3 s, the stock wait), so an idle board does not spin;
- it checks for the ClientApp's reply every ``--reply-poll-interval`` (0.02 s, stock
  0.5 s) and retries a message object not uploaded yet after ``--object-backoff``
  (0.02 s, stock 1 s).

With ``--warm-executor`` it also adds ``--isolation process`` and keeps one
``flwr-gsgm-executor`` (:mod:`flwr_gsgm.deploy.executor`) running against its Runtime
API: restarted ``--executor-restart-delay`` seconds after it exits (a crash, a kill),
stopped with the SuperNode. Without it, the SuperNode starts a ``flwr-clientapp``
process per message as stock Flower does (only the polls are shorter).

Example::

    flwr-gsgm-supernode --warm-executor --superlink 10.0.0.5:9092 \\
        --root-certificates ca.crt --auth-supernode-private-key node-0 \\
        --node-config "partition-id=0 num-partitions=2"
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
from logging import INFO, WARNING

from flwr_gsgm.deploy.poll import PollSchedule

__all__ = ["ExecutorSupervisor", "main"]


class ExecutorSupervisor(threading.Thread):
    """Keeps one executor process running until :meth:`stop`.

    Parameters
    ----------
    command : list[str]
        The executor's command line.
    restart_delay : float
        Seconds between an exit and the restart (>= 0).
    """

    def __init__(self, command: list[str], restart_delay: float) -> None:
        super().__init__(name="flwr-gsgm-executor-supervisor", daemon=True)
        self.command = command
        self.restart_delay = restart_delay
        self.starts = 0
        self.process: subprocess.Popen | None = None
        self._stopping = threading.Event()

    def run(self) -> None:
        from flwr.supercore import log

        while not self._stopping.is_set():
            self.process = subprocess.Popen(self.command)
            self.starts += 1
            log(INFO, "[supernode] executor started (PID %d)", self.process.pid)
            code = self.process.wait()
            if self._stopping.is_set():
                break
            log(
                WARNING,
                "[supernode] executor exited with code %s; restarting in %.1f s",
                code,
                self.restart_delay,
            )
            self._stopping.wait(self.restart_delay)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop restarting; SIGTERM the executor, SIGKILL it after ``timeout`` s."""
        self._stopping.set()
        proc = self.process
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()


def _own_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flwr-gsgm-supernode",
        add_help=False,
        description="flower-supernode with short polls and an optional warm executor "
        "(all flower-supernode flags are accepted).",
    )
    parser.add_argument("--gsgm-help", action="help", help="show these flags and exit")
    parser.add_argument(
        "--warm-executor",
        action="store_true",
        help="--isolation process, served by a supervised flwr-gsgm-executor",
    )
    parser.add_argument("--executor-restart-delay", type=float, default=1.0, metavar="S")
    parser.add_argument(
        "--preload", default="", metavar="MODULES", help="the executor's --preload (e.g. torch)"
    )
    parser.add_argument("--fast-poll-interval", type=float, default=0.1, metavar="S")
    parser.add_argument("--fast-poll-window", type=float, default=5.0, metavar="S")
    parser.add_argument("--idle-poll-interval", type=float, default=3.0, metavar="S")
    parser.add_argument("--reply-poll-interval", type=float, default=0.02, metavar="S")
    parser.add_argument("--object-backoff", type=float, default=0.02, metavar="S")
    parser.add_argument("--object-backoff-cap", type=float, default=1.0, metavar="S")
    return parser


def _runtime_parser() -> argparse.ArgumentParser:
    """The flower-supernode flags the executor needs (same names and defaults)."""
    from flwr.supercore.constant import SUPERNODE_UVICORN_DEFAULT_PORT, UVICORN_DEFAULT_HOST

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--isolation", default=None)
    parser.add_argument("--host", default=UVICORN_DEFAULT_HOST)
    parser.add_argument("--port", type=int, default=SUPERNODE_UVICORN_DEFAULT_PORT)
    parser.add_argument("--ssl-certfile", default=None)
    parser.add_argument("--ssl-ca-certfile", default=None)
    parser.add_argument("--superexec-auth-secret-file", default=None)
    return parser


def executor_command(flower_args: list[str], parent_pid: int, preload: str = "") -> list[str]:
    """The ``flwr-gsgm-executor`` command line for a SuperNode started with
    ``flower_args``.

    Raises
    ------
    SystemExit
        If ``flower_args`` asks for another isolation than ``process``.
    """
    runtime, _ = _runtime_parser().parse_known_args(flower_args)
    if runtime.isolation not in (None, "process"):
        raise SystemExit(
            f"flwr-gsgm-supernode: --warm-executor needs --isolation process, "
            f"got --isolation {runtime.isolation}"
        )
    host = f"[{runtime.host}]" if ":" in runtime.host else runtime.host
    if host in ("0.0.0.0", "[::]"):  # listening everywhere: reach it on loopback
        host = "127.0.0.1" if host == "0.0.0.0" else "[::1]"
    command = [sys.executable, "-m", "flwr_gsgm.deploy.executor"]
    command += ["--runtime-api-address", f"{host}:{runtime.port}"]
    if not runtime.ssl_certfile:
        command += ["--insecure"]
    elif runtime.ssl_ca_certfile:
        command += ["--root-certificates", runtime.ssl_ca_certfile]
    if runtime.superexec_auth_secret_file:
        command += ["--superexec-auth-secret-file", runtime.superexec_auth_secret_file]
    if preload:
        command += ["--preload", preload]
    return command + ["--parent-pid", str(parent_pid)]


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``flwr-gsgm-supernode``."""
    argv = sys.argv[1:] if argv is None else argv
    own, flower_args = _own_parser().parse_known_args(argv)
    try:
        idle = PollSchedule(own.fast_poll_interval, own.fast_poll_window, own.idle_poll_interval)
        if own.executor_restart_delay < 0:
            raise ValueError(
                f"--executor-restart-delay must be >= 0, got {own.executor_restart_delay}"
            )
        from flwr_gsgm.deploy.flower_waits import shorten_supernode_waits

        shorten_supernode_waits(
            idle, own.reply_poll_interval, own.object_backoff, own.object_backoff_cap
        )
    except (ValueError, RuntimeError) as err:
        raise SystemExit(f"flwr-gsgm-supernode: {err}") from None

    from flwr.supercore.exit import add_exit_handler
    from flwr.supernode.cli.flower_supernode import flower_supernode

    if own.warm_executor:
        command = executor_command(flower_args, os.getpid(), own.preload)
        if _runtime_parser().parse_known_args(flower_args)[0].isolation is None:
            flower_args = [*flower_args, "--isolation", "process"]
        supervisor = ExecutorSupervisor(command, own.executor_restart_delay)
        add_exit_handler(supervisor.stop)
        supervisor.start()
    sys.argv = ["flower-supernode", *flower_args]
    flower_supernode()


if __name__ == "__main__":
    main()
