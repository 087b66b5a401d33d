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

An activation the SuperLink refuses with HTTP 401 (a clock off by more than a few
seconds, a key that is not the registered one) ends the SuperNode with Flower's exit
code 305 and a reason naming those causes (:func:`report_refused_activation`; stock
Flower 1.42 logs only "SuperNode terminated gracefully." and exits 0).

Example::

    flwr-gsgm-supernode --warm-executor --superlink 10.0.0.5:9092 \\
        --root-certificates ca.crt --auth-supernode-private-key node-0 \\
        --node-config "partition-id=0 num-partitions=2"
"""

from __future__ import annotations

import argparse
import email.utils
import functools
import os
import subprocess
import sys
import threading
from datetime import datetime
from logging import INFO, WARNING
from typing import Any

from flwr_gsgm.deploy.poll import PollSchedule

__all__ = ["ActivationRefused", "ExecutorSupervisor", "main", "report_refused_activation"]


class ActivationRefused(RuntimeError):
    """The SuperLink answered the SuperNode's activate-node call with HTTP 401."""


def refused_activation_reason(
    call: str, detail: str, server_date: str | None, now: datetime
) -> str:
    """Why the SuperLink refused ``call`` (``activate-node``, ``register-node``) with
    a 401 whose body says ``detail``.

    ``server_date`` is the response's HTTP ``Date`` header (the SuperLink's clock,
    truncated to the second; None if absent) and ``now`` this machine's time
    (timezone-aware) when the SuperLink answered, best taken halfway between sending the
    request and reading its answer: their difference, in seconds, is named when it
    exceeds the 5 s Flower tolerates ahead. It is exact to within 0.5 s plus half the
    request's round trip.
    """
    offset = ""
    parsed = email.utils.parsedate_to_datetime(server_date) if server_date else None
    if parsed is not None:
        # The header's truncated second stands for its middle.
        seconds = (now - parsed).total_seconds() - 0.5
        # Flower's SuperLink accepts a signed timestamp from 5 s ahead to 305 s behind.
        if abs(seconds) > 5:
            side = "ahead of" if seconds > 0 else "behind"
            offset = f" This machine's clock is {abs(seconds):.0f} s {side} the SuperLink's."
    return (
        f"The SuperLink refused this SuperNode (HTTP 401 on {call}: "
        f"{detail or 'no detail'}).{offset} Likely causes: a clock that differs from the "
        "SuperLink's (Flower accepts at most 5 s ahead and 305 s behind; check NTP, e.g. "
        "`timedatectl` on a board without a real-time clock before its first sync), or "
        "an unregistered key (--auth-supernode-private-key is not the key registered "
        "with `flwr supernode register` on this SuperLink)."
    )


#: The Fleet calls of a starting SuperNode whose 401 is reported (method, URL path).
_START_CALLS = (("RegisterNode", "register-node"), ("ActivateNode", "activate-node"))


def report_refused_activation() -> None:
    """Make a start the SuperLink refuses with HTTP 401 end the SuperNode with an error.

    Flower 1.42's retry invoker answers any 401 by sending SIGINT to its own process,
    so a refused SuperNode ends as if stopped by hand ("SuperNode terminated
    gracefully.", exit code 0). Here ``FleetHttpClient.ActivateNode`` (and
    ``RegisterNode``, called first by a SuperNode without a key) raise
    :class:`ActivationRefused` instead, which the retry invoker does not retry and
    Flower's connection code reports: ``Exit Code: 305`` and the reason
    (:func:`refused_activation_reason`), exit status 1. Idempotent.
    """
    from flwr.supernode.fleet_http_client import FleetHttpClient

    for method, call in _START_CALLS:
        original = getattr(FleetHttpClient, method)
        if not getattr(original, "__wrapped_by_flwr_gsgm__", False):
            setattr(FleetHttpClient, method, _refusal_reported(original, call))


def _refusal_reported(original: Any, call: str) -> Any:
    import httpx
    from flwr.supercore import date as flower_date

    @functools.wraps(original)
    def start_call(self: Any, request: Any) -> Any:
        # The clock Flower signs the request's timestamp with, read around the call:
        # the SuperLink stamped its Date header in between (a loaded machine's round
        # trip is seconds, so the answer's arrival alone would overstate the offset).
        sent = flower_date.now()
        try:
            return original(self, request)
        except httpx.HTTPStatusError as err:
            if err.response.status_code != httpx.codes.UNAUTHORIZED:
                raise
            answered = sent + (flower_date.now() - sent) / 2
            try:
                detail = str(err.response.json().get("detail", ""))
            except (ValueError, AttributeError):  # not a JSON object
                detail = err.response.text[:200]
            reason = refused_activation_reason(
                call, detail, err.response.headers.get("date"), answered
            )
            raise ActivationRefused(reason) from None

    start_call.__wrapped_by_flwr_gsgm__ = True
    return start_call


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
    parser.add_argument(
        "--executor-stall-timeout",
        type=float,
        default=None,
        metavar="S",
        help="the executor's --stall-timeout: fail a task whose message makes no "
        "progress for S seconds (default 120)",
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


def executor_command(
    flower_args: list[str],
    parent_pid: int,
    preload: str = "",
    stall_timeout: float | None = None,
) -> list[str]:
    """The ``flwr-gsgm-executor`` command line for a SuperNode started with
    ``flower_args`` (``stall_timeout``: its ``--stall-timeout``, seconds; None: the
    executor's default).

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
    if stall_timeout is not None:
        command += ["--stall-timeout", str(stall_timeout)]
    return command + ["--parent-pid", str(parent_pid)]


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``flwr-gsgm-supernode``."""
    argv = sys.argv[1:] if argv is None else argv
    own, flower_args = _own_parser().parse_known_args(argv)
    try:
        idle = PollSchedule(own.fast_poll_interval, own.fast_poll_window, own.idle_poll_interval)
        if own.executor_stall_timeout is not None and not own.executor_stall_timeout > 0:
            raise ValueError(
                f"--executor-stall-timeout must be > 0 seconds, got {own.executor_stall_timeout}"
            )
        if own.executor_restart_delay < 0:
            raise ValueError(
                f"--executor-restart-delay must be >= 0, got {own.executor_restart_delay}"
            )
        from flwr_gsgm.deploy.flower_waits import shorten_supernode_waits

        shorten_supernode_waits(
            idle, own.reply_poll_interval, own.object_backoff, own.object_backoff_cap
        )
        report_refused_activation()
    except (ValueError, RuntimeError) as err:
        raise SystemExit(f"flwr-gsgm-supernode: {err}") from None

    from flwr.supercore.exit import add_exit_handler
    from flwr.supernode.cli.flower_supernode import flower_supernode

    if own.warm_executor:
        command = executor_command(
            flower_args, os.getpid(), own.preload, own.executor_stall_timeout
        )
        if _runtime_parser().parse_known_args(flower_args)[0].isolation is None:
            flower_args = [*flower_args, "--isolation", "process"]
        supervisor = ExecutorSupervisor(command, own.executor_restart_delay)
        add_exit_handler(supervisor.stop)
        supervisor.start()
    sys.argv = ["flower-supernode", *flower_args]
    flower_supernode()


if __name__ == "__main__":
    main()
