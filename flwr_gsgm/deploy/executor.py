"""Warm ClientApp executor for ``flower-supernode --isolation process`` (Flower 1.42).

With ``--isolation process`` a SuperNode serves its ClientApp tasks over its Runtime
API and starts no process itself. Flower's own ``flower-superexec`` then starts one
``flwr-clientapp`` process per task (Python, ``import flwr``, FAB install, the app's
torch imports: seconds per message). This executor is one long-lived process doing
what ``flwr-clientapp`` does, task after task, with Flower's own runtime functions:

1. acquire a ClientApp task from the Runtime API (``AcquireTask``, as
   ``flower-superexec`` does; polled fast after a task, slower when idle);
2. send the task's heartbeats while it runs (``HeartbeatSender``);
3. pull the message, context, run and FAB (``pull_task_input`` of ``flwr-clientapp``);
4. run the ClientApp, loaded once per FAB (:class:`~flwr_gsgm.deploy.app_cache.AppCache`);
5. push the reply, or the same error reply as ``flwr-clientapp`` when the app raises
   (``CLIENT_APP_RAISED_EXCEPTION``, or ``LOAD_CLIENT_APP_EXCEPTION`` when it cannot
   be loaded), then the task output (status and context).

A task that fails never stops the executor. A task whose message never arrives in full
fails after ``stall_timeout`` seconds (120) in which no object of it became available,
or at once when the SuperNode gives the task up, and the executor goes on with the
next: Flower 1.42's SuperNode leaves such a task behind when a run stops while it
receives one of its messages ("Run ID ... is not in `RUNNING` status. Ignoring
message"), and its objects never come. Killed mid-task (SIGKILL), the task's
heartbeats stop and the SuperNode answers the message with Flower's error reply
``ClientApp stopped responding.`` once the task token expires (60 s); stopped with
SIGTERM/SIGINT mid-task, it answers with an error reply itself before exiting.

Command: ``flwr-gsgm-executor --runtime-api-address HOST:PORT [--insecure |
--root-certificates CA] [--parent-pid PID] [--preload torch] [--stall-timeout S]``
(``python -m flwr_gsgm.deploy.executor``).
"""

from __future__ import annotations

import argparse
import importlib
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from logging import ERROR, INFO, WARNING
from typing import Any

import httpx
from flwr.app import Error, Message
from flwr.clientapp.client_app import LoadClientAppError
from flwr.common.constant import MAX_RETRY_DELAY, ErrorCode, SubStatus
from flwr.proto.runtime_pb2 import AcquireTaskRequest, SendTaskHeartbeatRequest
from flwr.supercore import log
from flwr.supercore.app_utils import start_parent_process_monitor
from flwr.supercore.auth import load_superexec_auth_secret
from flwr.supercore.constant import TaskType
from flwr.supercore.heartbeat import HeartbeatSender
from flwr.supercore.interceptors import (
    RuntimeTokenHttpInterceptor,
    RuntimeVersionHttpInterceptor,
    SuperExecAuthHttpInterceptor,
)
from flwr.supercore.retry import RetryInvoker, exponential
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.supercore.tls import validate_and_resolve_root_certificates
from flwr.supernode.runtime.run_clientapp import (
    pull_task_input,
    push_message,
    push_task_output,
)

from flwr_gsgm.deploy.app_cache import AppCache
from flwr_gsgm.deploy.poll import PollSchedule

__all__ = ["TaskResult", "TaskStalled", "WarmExecutor", "main"]

# What flower-superexec sends with AcquireTask (its SuperExec auth covers only this call).
_ACQUIRE_METHOD = "/flwr.proto.Runtime/AcquireTask"
# Status codes a restarting SuperNode (its uvicorn) answers with: worth a retry.
_RETRYABLE_STATUS = frozenset({502, 503, 504})


class TaskStalled(Exception):
    """A task's message did not arrive: no object of it became available within the
    stall bound, or the SuperNode gave the task up."""


class _ProgressWatch:
    """Stands in for a Runtime API client's ``PullObject`` while a task's input is
    pulled: raises :class:`TaskStalled` on an object still unavailable
    ``stall_timeout`` seconds after the last one arrived (or the task started), or
    once ``given_up`` is set (the SuperNode no longer accepts the task)."""

    def __init__(
        self, pull: Any, stall_timeout: float, task_id: int, given_up: threading.Event
    ) -> None:
        self._pull = pull
        self.stall_timeout = stall_timeout
        self.task_id = task_id
        self.given_up = given_up
        self.last_progress = time.monotonic()

    def __call__(self, request: Any) -> Any:
        response = self._pull(request)
        now = time.monotonic()
        if response.object_found and response.object_available:
            self.last_progress = now
        elif self.given_up.is_set():
            raise TaskStalled(
                f"task {self.task_id}: the SuperNode gave the task up while its message "
                f"was still arriving (object {request.object_id} unavailable)"
            )
        elif now - self.last_progress > self.stall_timeout:
            raise TaskStalled(
                f"task {self.task_id}: object {request.object_id} of its message still "
                f"unavailable after {now - self.last_progress:.1f} s without progress "
                f"(stall-timeout={self.stall_timeout} s); its run has "
                "most likely stopped while the SuperNode was receiving the message"
            )
        return response


@dataclass(frozen=True)
class TaskResult:
    """What one task did: ``sub_status`` is Flower's (``completed`` / ``failed``);
    ``error_code`` is the error reply's code (None: a normal reply or none sent);
    ``seconds`` is the wall time from acquiring the task to pushing its output."""

    task_id: int
    sub_status: str
    error_code: int | None
    seconds: float


class WarmExecutor:
    """Serves a SuperNode's ClientApp tasks from one process.

    Parameters
    ----------
    runtime_api_address : str
        The SuperNode's Runtime API, ``HOST:PORT`` (its ``--host``/``--port``).
    root_certificates : bytes | None
        CA certificate (PEM) of a Runtime API served over TLS; None with ``insecure``.
    insecure : bool
        Plain HTTP (the SuperNode's Runtime API without ``--ssl-certfile``).
    superexec_auth_secret : bytes | None
        The SuperNode's ``--superexec-auth-secret-file`` content, if it uses one.
    poll : PollSchedule | None
        When to ask for the next task; default :meth:`default_poll`.
    stall_timeout : float
        Seconds (> 0) without any object of a task's message becoming available after
        which the task fails and the executor goes on (default 120: a slow link moves
        one object, an array chunk, well within it).

    Raises
    ------
    ValueError
        If ``stall_timeout`` is not > 0.
    """

    #: Default of ``stall_timeout`` (seconds).
    STALL_TIMEOUT = 120.0

    def __init__(
        self,
        runtime_api_address: str,
        root_certificates: bytes | None = None,
        insecure: bool = True,
        superexec_auth_secret: bytes | None = None,
        poll: PollSchedule | None = None,
        stall_timeout: float = STALL_TIMEOUT,
    ) -> None:
        if not stall_timeout > 0:
            raise ValueError(f"stall_timeout must be > 0 seconds, got {stall_timeout!r}")
        self.stall_timeout = stall_timeout
        self.address = runtime_api_address
        self.root_certificates = root_certificates
        self.insecure = insecure
        self.poll = poll or self.default_poll()
        self.apps = AppCache()
        self.tasks_done = 0
        self._deferring = False  # in a Runtime API exchange that must not be cut
        self._interrupted = False
        interceptors: list = [RuntimeVersionHttpInterceptor(component_name="SuperExec")]
        if superexec_auth_secret:
            interceptors.append(
                SuperExecAuthHttpInterceptor(
                    master_secret=superexec_auth_secret, protected_methods={_ACQUIRE_METHOD}
                )
            )
        # Waits for a SuperNode that is (re)starting, however long that takes.
        self._acquirer = self._client(interceptors, max_time=None)

    @staticmethod
    def default_poll() -> PollSchedule:
        """20 ms polls for 10 s after a task, then doubling to one per second."""
        return PollSchedule(fast=0.02, window=10.0, idle=1.0)

    def _client(
        self, interceptors: list, max_time: float | None, invoker: RetryInvoker | None = None
    ) -> RuntimeHttpClient:
        return RuntimeHttpClient.from_server_address(
            server_address=self.address,
            insecure=self.insecure,
            root_certificates=self.root_certificates,
            interceptors=interceptors,
            retry_invoker=invoker or _retry_invoker(max_time),
        )

    # ------------------------------------------------------------------ the loop
    def serve(self, stop: threading.Event | None = None, max_tasks: int | None = None) -> None:
        """Acquire and run tasks until ``stop`` is set or ``max_tasks`` tasks ran."""
        stop = stop or threading.Event()
        while not stop.is_set() and (max_tasks is None or self.tasks_done < max_tasks):
            if self.run_next() is None:
                stop.wait(self.poll.next_wait())

    def run_next(self) -> TaskResult | None:
        """Acquire one pending ClientApp task and run it; None if there was none."""
        res = self._acquirer.AcquireTask(
            AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP])
        )
        if not (res.HasField("task") and res.token):
            return None
        result = self.run_task(res.task.task_id, res.token)
        self.tasks_done += 1
        self.poll.activity()
        return result

    # ------------------------------------------------------------------ one task
    def run_task(self, task_id: int, token: str) -> TaskResult:
        """Run the claimed task ``task_id`` (``token``: its Runtime API token)."""
        started = time.monotonic()
        # A SuperNode that does not answer within 10 s has lost the task anyway.
        invoker = _retry_invoker(max_time=10.0)
        client = self._client(
            [
                RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
                RuntimeTokenHttpInterceptor(token),
            ],
            max_time=None,
            invoker=invoker,
        )
        given_up = threading.Event()
        heartbeat = HeartbeatSender(_heartbeat_fn(client, task_id, given_up))
        # Flower's pull_task_input fetches the message's objects with client.PullObject:
        # watched, so a message that never arrives fails its task instead of holding
        # the executor (its heartbeats keep the task alive at the SuperNode forever).
        client.PullObject = _ProgressWatch(client.PullObject, self.stall_timeout, task_id, given_up)
        message = context = reply = None
        sub_status, details = SubStatus.FAILED, "ClientApp task failed due to unknown reason"
        error_code: int | None = None
        try:
            with self._uninterrupted():  # a message taken is a message answered
                heartbeat.start()
                message, context, run, fab = pull_task_input(client)
            app = self.apps.get(run, fab)
            reply = app(message=message, context=context)
            sub_status, details = SubStatus.COMPLETED, ""
        except TaskStalled as ex:  # no message to answer: fail the task, serve the next
            details = str(ex)
            log(ERROR, "[executor] %s: task failed, serving the next", details)
        except Exception as ex:  # noqa: BLE001 - any app failure becomes an error reply
            error_code, details = _error_of(ex)
            log(ERROR, "[executor] task %d: ClientApp raised an exception", task_id, exc_info=ex)
            if message is not None:
                reply = Message(Error(code=error_code, reason=details), reply_to=message)
        except BaseException:  # stopped mid-task: answer the message before exiting
            invoker.max_tries = 1  # and do not linger if the SuperNode is stopping too
            error_code = ErrorCode.CLIENT_APP_CRASHED
            details = "The ClientApp executor was stopped during the task."
            if message is not None:
                reply = Message(Error(code=error_code, reason=details), reply_to=message)
            raise
        finally:
            with self._uninterrupted():
                self._finish(client, heartbeat, task_id, reply, context, sub_status, details)
            del message, reply  # nothing of a task outlives it
        seconds = time.monotonic() - started
        log(INFO, "[executor] task %d %s in %.3f s", task_id, sub_status, seconds)
        return TaskResult(task_id, sub_status, error_code, seconds)

    def interrupt(self, why: str) -> None:
        """Stop what runs now (raise KeyboardInterrupt), or, during a Runtime API
        exchange of a task (taking its input, pushing its reply), right after it."""
        if self._deferring:
            self._interrupted = True
            return
        raise KeyboardInterrupt(why)

    @contextmanager
    def _uninterrupted(self) -> Iterator[None]:
        self._deferring, self._interrupted = True, False
        try:
            yield
        finally:
            self._deferring = False
        if self._interrupted:
            raise KeyboardInterrupt("deferred stop")

    def _finish(self, client, heartbeat, task_id, reply, context, sub_status, details) -> None:
        """Push the reply, then the task output (as flwr-clientapp does), then clean up."""
        try:
            if reply is not None and context is not None:
                try:
                    push_message(client, reply, context)
                except Exception as ex:  # noqa: BLE001 - the output still goes out
                    log(ERROR, "[executor] task %d: pushing the reply failed: %s", task_id, ex)
            push_task_output(client, context, sub_status, details)
        except Exception as ex:  # noqa: BLE001 - e.g. the token expired meanwhile
            log(ERROR, "[executor] task %d: pushing the task output failed: %s", task_id, ex)
        finally:
            if heartbeat.is_running:
                heartbeat.stop()
            client.close()

    def close(self) -> None:
        """Close the Runtime API connection and unload the app."""
        self._acquirer.close()
        self.apps.unload()


def _error_of(ex: Exception) -> tuple[int, str]:
    """The error reply's code and reason for ``ex``, as flwr-clientapp words them."""
    if isinstance(ex, LoadClientAppError):
        return (
            ErrorCode.LOAD_CLIENT_APP_EXCEPTION,
            "An exception was raised when attempting to load `ClientApp`",
        )
    return ErrorCode.CLIENT_APP_RAISED_EXCEPTION, str(type(ex)) + ":<'" + str(ex) + "'>"


def _heartbeat_fn(client: RuntimeHttpClient, task_id: int, given_up: threading.Event):
    """A heartbeat that never signals the process (flwr-clientapp's raises SIGINT when
    the SuperNode has given the task up; here only that task is lost: ``given_up`` is
    set)."""
    request = SendTaskHeartbeatRequest()

    def send() -> bool:
        try:
            ok = client.SendTaskHeartbeat(request).success
        except httpx.TransportError:
            return False  # retried with back-off by the HeartbeatSender
        except httpx.HTTPStatusError as err:
            if err.response.status_code in _RETRYABLE_STATUS:
                return False
            ok = False
        if not ok:
            given_up.set()
            log(WARNING, "[executor] task %d: the SuperNode no longer accepts it", task_id)
        return True

    return send


def _preload(modules: str) -> None:
    """Import ``modules`` (comma-separated) now; one that fails is logged and skipped."""
    for name in filter(None, (m.strip() for m in modules.split(","))):
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - a missing optional module is no reason to stop
            log(WARNING, "[executor] could not preload %s: %s", name, err)


def _retry_invoker(max_time: float | None) -> RetryInvoker:
    """Retry transport errors and 502/503/504 for up to ``max_time`` seconds (None: for
    ever); give up at once on any other HTTP error (Flower's default invoker raises
    SIGINT in the process on a 401, e.g. for one expired task token)."""

    def give_up(exc: Exception) -> bool:
        if isinstance(exc, httpx.HTTPStatusError):
            return exc.response.status_code not in _RETRYABLE_STATUS
        return False

    return RetryInvoker(
        wait_gen_factory=lambda: exponential(base_delay=0.2, max_delay=MAX_RETRY_DELAY),
        recoverable_exceptions=(httpx.TransportError, httpx.HTTPStatusError),
        max_tries=None,
        max_time=max_time,
        should_giveup=give_up,
    )


# ---------------------------------------------------------------------- command
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flwr-gsgm-executor",
        description="Warm ClientApp executor for `flower-supernode --isolation process`: "
        "serves every ClientApp task of one SuperNode from one process, the ClientApp "
        "loaded once per FAB.",
    )
    parser.add_argument(
        "--runtime-api-address",
        required=True,
        help="the SuperNode's Runtime API as HOST:PORT (its --host and --port)",
    )
    tls = parser.add_mutually_exclusive_group()
    tls.add_argument("--insecure", action="store_true", help="Runtime API without TLS")
    tls.add_argument("--root-certificates", help="CA certificate of a TLS Runtime API")
    parser.add_argument("--superexec-auth-secret-file", help="the SuperNode's secret file")
    parser.add_argument(
        "--parent-pid", type=int, help="exit when this process (the SuperNode) exits"
    )
    parser.add_argument(
        "--preload",
        default="",
        metavar="MODULES",
        help="comma-separated modules to import before the first task (e.g. torch): the "
        "first message then pays only for the app's own imports",
    )
    default = WarmExecutor.default_poll()
    parser.add_argument("--poll-interval", type=float, default=default.fast, metavar="S")
    parser.add_argument("--fast-poll-window", type=float, default=default.window, metavar="S")
    parser.add_argument("--idle-poll-interval", type=float, default=default.idle, metavar="S")
    parser.add_argument(
        "--stall-timeout",
        type=float,
        default=WarmExecutor.STALL_TIMEOUT,
        metavar="S",
        help="fail a task whose message makes no progress for S seconds (default "
        f"{WarmExecutor.STALL_TIMEOUT:g}), e.g. one of a run that stopped meanwhile",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``flwr-gsgm-executor``."""
    args = _parser().parse_args(argv)
    try:
        poll = PollSchedule(args.poll_interval, args.fast_poll_window, args.idle_poll_interval)
        secret = load_superexec_auth_secret(secret_file=args.superexec_auth_secret_file)
        executor = WarmExecutor(
            args.runtime_api_address,
            root_certificates=validate_and_resolve_root_certificates(
                args.root_certificates, args.insecure
            ),
            insecure=args.insecure,
            superexec_auth_secret=secret,
            poll=poll,
            stall_timeout=args.stall_timeout,
        )
    except ValueError as err:
        raise SystemExit(f"flwr-gsgm-executor: {err}") from None
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        # Interrupts what runs: a ClientApp's task answers with an error reply
        # (run_task); a wait, or a retry towards a SuperNode that is gone, just ends.
        stop.set()
        executor.interrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)  # also what the parent monitor raises
    if args.parent_pid is not None:
        start_parent_process_monitor(args.parent_pid)
    _preload(args.preload)
    log(INFO, "[executor] serving ClientApp tasks of the SuperNode at %s", args.runtime_api_address)
    try:
        executor.serve(stop)
    except KeyboardInterrupt:
        pass
    finally:
        executor.close()
        log(INFO, "[executor] stopped after %d task(s)", executor.tasks_done)


if __name__ == "__main__":
    main()
