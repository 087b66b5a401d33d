"""flwr-gsgm-supernode without a deployment (seconds): its poll schedule, the waits it
replaces in Flower's SuperNode, the executor command it derives from flower-supernode's
flags, and the supervisor that restarts the executor."""

from __future__ import annotations

import functools
import re
import sys
import time

import pytest
from flwr.supercore.inflatable import inflatable_utils
from flwr.supernode import start_client_internal as sci

from flwr_gsgm.deploy import flower_waits
from flwr_gsgm.deploy.poll import PollSchedule
from flwr_gsgm.deploy.supernode import ExecutorSupervisor, executor_command


def test_poll_schedule_is_fast_after_activity_then_doubles_to_idle():
    poll = PollSchedule(fast=0.1, window=5.0, idle=3.0)
    poll.activity(now=100.0)
    assert [poll.next_wait(now=t) for t in (100.0, 102.0, 105.0)] == [0.1, 0.1, 0.1]
    later = [poll.next_wait(now=106.0) for _ in range(7)]
    assert later == pytest.approx([0.2, 0.4, 0.8, 1.6, 3.0, 3.0, 3.0])
    poll.activity(now=200.0)  # a message: fast again
    assert poll.next_wait(now=200.5) == 0.1
    assert poll.next_wait(now=206.0) == pytest.approx(0.2)


def test_poll_schedule_before_any_activity_backs_off_from_fast():
    poll = PollSchedule(fast=0.5, window=10.0, idle=1.0)
    assert [poll.next_wait(now=0.0) for _ in range(3)] == [1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    "args, message",
    [
        ((0.0, 1.0, 1.0), "poll fast must be > 0 seconds, got 0.0"),
        ((0.1, -1.0, 1.0), "poll window must be >= 0 seconds, got -1.0"),
        ((0.5, 1.0, 0.2), "poll idle must be >= fast (0.5) seconds, got 0.2"),
    ],
)
def test_poll_schedule_refuses_bad_values(args, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        PollSchedule(*args)


def test_supernode_waits_are_replaced_in_flowers_module(monkeypatch):
    for name in ("time", "_pull_and_store_message", "_push_messages", "pull_objects"):
        monkeypatch.setattr(sci, name, getattr(sci, name))  # restored after the test
    idle = PollSchedule(0.1, 5.0, 3.0)
    flower_waits.shorten_supernode_waits(idle, 0.02, 0.05, 0.8)
    assert sci.time.reply_poll == 0.02 and sci.time.idle is idle
    assert sci.time.monotonic is time.monotonic  # the rest of `time` is untouched
    assert isinstance(sci.pull_objects, functools.partial)
    assert sci.pull_objects.func is inflatable_utils.pull_objects
    assert sci.pull_objects.keywords == {"initial_backoff": 0.05, "backoff_cap": 0.8}
    flower_waits.shorten_supernode_waits(idle, 0.02, 0.05, 0.8)  # twice: wrapped once
    assert not hasattr(sci._pull_and_store_message.__wrapped__, "__wrapped__")


def test_a_message_received_or_a_reply_sent_restarts_the_fast_polls(monkeypatch):
    for name in ("time", "_push_messages", "pull_objects"):
        monkeypatch.setattr(sci, name, getattr(sci, name))
    results = iter([None, 42])  # an empty poll, then a message of run 42
    monkeypatch.setattr(sci, "_pull_and_store_message", lambda **_: next(results))
    idle = PollSchedule(0.1, 5.0, 3.0)
    flower_waits.shorten_supernode_waits(idle, 0.02, 0.05, 0.8)
    assert sci._pull_and_store_message() is None
    assert idle.last_activity == float("-inf")
    assert sci._pull_and_store_message() == 42
    assert time.monotonic() - idle.last_activity < 60


def test_the_idle_sleep_follows_the_schedule(monkeypatch):
    slept = []
    monkeypatch.setattr(flower_waits.time, "sleep", slept.append)
    clock = flower_waits._SuperNodeClock(PollSchedule(0.1, 5.0, 3.0), 0.02)
    clock.idle.activity()
    clock.sleep(3)  # the SuperNode's idle sleep
    clock.sleep(0.5)  # its reply poll
    clock.sleep(1.25)  # anything else: unchanged
    assert slept == [0.1, 0.02, 1.25]


def test_shorter_waits_refuse_bad_values():
    with pytest.raises(ValueError, match="reply_poll must be > 0 seconds, got 0"):
        flower_waits.shorten_supernode_waits(PollSchedule(0.1, 1, 1), 0, 0.1, 1.0)
    with pytest.raises(ValueError, match=r"object_backoff_cap must be >= object_backoff \(0.5\)"):
        flower_waits.shorten_supernode_waits(PollSchedule(0.1, 1, 1), 0.1, 0.5, 0.1)


@pytest.mark.parametrize(
    "flags, expected",
    [
        ([], ["--runtime-api-address", "127.0.0.1:9094", "--insecure"]),
        (
            ["--superlink", "10.0.0.5:9092", "--host", "0.0.0.0", "--port", "9100"],
            ["--runtime-api-address", "127.0.0.1:9100", "--insecure"],
        ),
        (
            ["--host", "::1", "--port=9200", "--isolation", "process"],
            ["--runtime-api-address", "[::1]:9200", "--insecure"],
        ),
        (
            ["--ssl-certfile", "s.pem", "--ssl-keyfile", "s.key", "--ssl-ca-certfile", "ca.crt"],
            ["--runtime-api-address", "127.0.0.1:9094", "--root-certificates", "ca.crt"],
        ),
        (
            ["--superexec-auth-secret-file", "/etc/flwr/secret"],
            [
                "--runtime-api-address",
                "127.0.0.1:9094",
                "--insecure",
                "--superexec-auth-secret-file",
                "/etc/flwr/secret",
            ],
        ),
    ],
)
def test_executor_command_follows_the_supernodes_flags(flags, expected):
    command = executor_command(flags, parent_pid=4321)
    assert command[:3] == [sys.executable, "-m", "flwr_gsgm.deploy.executor"]
    assert command[3:] == [*expected, "--parent-pid", "4321"]


def test_warm_executor_refuses_subprocess_isolation():
    with pytest.raises(SystemExit, match="--warm-executor needs --isolation process"):
        executor_command(["--isolation", "subprocess"], parent_pid=1)


def test_supervisor_restarts_an_executor_that_exits_until_stopped():
    supervisor = ExecutorSupervisor([sys.executable, "-c", "import sys; sys.exit(3)"], 0.05)
    supervisor.start()
    deadline = time.monotonic() + 60
    while supervisor.starts < 3:
        assert time.monotonic() < deadline, "the executor was not restarted"
        time.sleep(0.05)
    supervisor.stop()
    supervisor.join(30)
    assert not supervisor.is_alive()
    starts = supervisor.starts
    time.sleep(0.3)
    assert supervisor.starts == starts


def test_supervisor_stop_ends_a_running_executor():
    supervisor = ExecutorSupervisor([sys.executable, "-c", "import time; time.sleep(600)"], 0.05)
    supervisor.start()
    deadline = time.monotonic() + 60
    while supervisor.process is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    supervisor.stop(timeout=20)
    supervisor.join(30)
    assert supervisor.process.returncode is not None
    assert supervisor.starts == 1


def test_the_deploy_commands_import_neither_clients_nor_simulations():
    """What a SuperNode runs comes from the library alone (the app comes in its FAB)."""
    import ast
    from pathlib import Path

    package = Path(flower_waits.__file__).parent
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in ("clients", "simulations"), f"{path.name}: {name}"


def test_executor_command_forwards_preload():
    command = executor_command(["--port", "9100"], parent_pid=7, preload="torch,numpy")
    assert command[-4:] == ["--preload", "torch,numpy", "--parent-pid", "7"]


def test_the_engine_pulls_replies_with_a_short_backoff_on_flowers_http_grid(monkeypatch):
    from flwr.superlink.grid import http_grid

    from flwr_gsgm.engine.in_flight import InFlight
    from flwr_gsgm.simulation.inprocess_grid import InProcessGrid

    monkeypatch.setattr(http_grid, "pull_objects", http_grid.pull_objects)
    InFlight(InProcessGrid.__new__(InProcessGrid), ["w"], 60.0, virtual_order=True)
    assert not isinstance(http_grid.pull_objects, functools.partial)  # simulation: untouched
    deployment_grid = type("HttpGrid", (), {"__module__": "flwr.superlink.grid.http_grid"})()
    InFlight(deployment_grid, ["w"], 60.0, virtual_order=False)
    assert http_grid.pull_objects.func is inflatable_utils.pull_objects
    assert http_grid.pull_objects.keywords == {"initial_backoff": 0.02, "backoff_cap": 1.0}


def test_executor_command_forwards_the_stall_timeout():
    command = executor_command(["--port", "9100"], parent_pid=7, stall_timeout=30.0)
    assert command[-4:] == ["--stall-timeout", "30.0", "--parent-pid", "7"]


def test_a_401_on_activate_node_names_the_clock_and_the_key(monkeypatch):
    """Issue 23 item 8, without a SuperLink: Flower's retry invoker would SIGINT the
    process on this 401 (a graceful exit, code 0); the wrapped call raises instead."""
    import httpx
    from flwr.supernode.fleet_http_client import FleetHttpClient

    from flwr_gsgm.deploy.supernode import ActivationRefused, report_refused_activation

    now = time.time()
    date = __import__("email.utils").utils.formatdate(now - 30, usegmt=True)

    def refuse(self, request):
        request_ = httpx.Request("POST", "https://link/v1/fleet/activate-node")
        response = httpx.Response(
            401,
            json={"detail": "Invalid SuperNode authentication"},
            headers={"date": date},
            request=request_,
        )
        raise httpx.HTTPStatusError("401", request=request_, response=response)

    monkeypatch.setattr(FleetHttpClient, "ActivateNode", refuse)
    monkeypatch.setattr(FleetHttpClient, "RegisterNode", FleetHttpClient.RegisterNode)
    report_refused_activation()
    report_refused_activation()  # twice: wrapped once
    assert FleetHttpClient.ActivateNode.__wrapped__ is refuse
    with pytest.raises(ActivationRefused) as err:
        FleetHttpClient.ActivateNode(None, None)
    reason = str(err.value)
    assert "HTTP 401 on activate-node: Invalid SuperNode authentication" in reason
    # The Date header truncates to the second, read as its middle: 29.5 s to 30.5 s plus
    # the microseconds this call takes, printed 30 (31 only past 30.5).
    assert re.search(r"clock is 3[01] s ahead of the SuperLink's", reason), reason
    assert "check NTP" in reason and "an unregistered key" in reason
