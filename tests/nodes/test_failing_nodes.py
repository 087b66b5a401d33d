"""Issue 12, item 1: nodes that hang or keep failing, on the in-process grid.

A failure (a train message unanswered past dispatch-timeout, or an error reply of
any Flower error code) backs the node off for min(cap, base * factor^(k-1)) seconds
of the engine clock, and max-node-failures of them in a row exclude it; the start-up
deadline is a setting of its own; closing never waits on a hung ClientApp.
"""

from __future__ import annotations

import threading
from collections import Counter

import pytest
from flwr.app import Error, Message
from flwr.common.constant import ErrorCode

from flwr_gsgm.config.run_config import parse_run_config
from flwr_gsgm.engine.async_engine import EngineSettings
from flwr_gsgm.engine.run_end import RunFailed
from flwr_gsgm.nodes.backoff import Backoff
from flwr_gsgm.simulation.inprocess_grid import InProcessGrid
from flwr_gsgm.simulation.virtual_clock import VirtualClock
from flwr_gsgm.strategy.strategies import ASGD
from tests.engine.quadratic_app import initial_arrays, make_app

# Every computation takes exactly 1 virtual second: the timeline is hand-computable.
EVEN = VirtualClock(seed=0, base_duration=1.0, slow_fraction=0.0, jitter=0.0)
BOUND = 120.0  # wall seconds; a run that takes this long has hung


def test_the_backoff_schedule():
    assert [Backoff().delay(k) for k in range(1, 9)] == [1, 2, 4, 8, 16, 32, 60, 60]
    assert Backoff(base=0.5, factor=3.0, cap=10.0).delay(3) == 4.5
    assert Backoff(factor=1e300).delay(1000) == 60.0  # no overflow on the way to the cap
    with pytest.raises(ValueError, match="back-off cap must be >= base"):
        Backoff(base=2.0, cap=1.0)


def test_a_failing_node_backs_off_exponentially_then_is_excluded(caplog):
    # Partition 0 always answers, partition 1 always raises. Each step is 1 virtual s:
    # partition 1 is sent work at t=0 and fails at t=1, is back at 1+1=2, fails at 3,
    # back at 3+2=5, fails at 6, back at 6+4=10, fails at 11, back at 11+8=19 and
    # fails at 20: its 5th failure in a row excludes it. ASGD's version at time t is t.
    calls: list[tuple[int, int]] = []
    grid = InProcessGrid(make_app(raise_for={1}, calls=calls), 2, run_config={})
    result = ASGD(server_learning_rate=0.1, virtual_clock=EVEN).start(
        grid, initial_arrays(), max_updates=30
    )
    assert [v for p, v in calls if p == 1] == [0, 2, 5, 10, 19]
    c = result.report.counters
    assert (c["error_replies"], c["node_backoffs"], c["nodes_excluded"]) == (5, 4, 1)
    assert c["updates_received"] == 30 and result.report.status == "completed"
    reason = (
        "5 failures in a row (max-node-failures=5); last: error reply (code 2: the ClientApp "
        "raised an exception: RuntimeError: partition 1 fails on purpose)"
    )
    node = result.report.per_node["node 2 (partition 1)"]
    assert (node["state"], node["excluded"], node["backoffs"]) == ("excluded", reason, 4)
    messages = [r.getMessage() for r in caplog.records]
    backoffs = [m for m in messages if "node 2 (partition 1) backs off" in m]
    assert [m.split(" backs off ")[1].split(" (")[0] for m in backoffs] == [
        "1 s",
        "2 s",
        "4 s",
        "8 s",
    ]
    assert f"[async] node 2 (partition 1) excluded for the rest of the run: {reason}" in messages


class ErrorCodeGrid(InProcessGrid):
    """Every train reply of node 2 (partition 1) is Flower error ``code`` (its query works)."""

    def __init__(self, *args, code: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.code = code
        self.to_node_2: list[str] = []

    def push_messages(self, messages):
        messages = list(messages)
        ids = list(super().push_messages(messages))
        self.to_node_2 += [m.metadata.message_type for m in messages if m.metadata.dst_node_id == 2]
        return ids

    def pull_messages(self, message_ids):
        out = []
        for reply in super().pull_messages(message_ids):
            if reply.metadata.src_node_id == 2 and reply.metadata.message_type == "train":
                reply = Message(
                    Error(self.code, "the ClientApp failed to load"), reply_to=_sent(reply)
                )
            out.append(reply)
        return out


def _sent(reply: Message) -> Message:
    """A stand-in for the message ``reply`` answers (same id, same sender and type)."""
    msg = Message(reply.content, reply.metadata.src_node_id, reply.metadata.message_type)
    msg.metadata.__dict__["_message_id"] = reply.metadata.reply_to_message_id
    return msg


def test_another_error_code_is_backed_off_too_and_never_readmitted():
    # Code 1 (the ClientApp failed to load), in deployment mode with a node refresh at
    # every loop: the node is backed off, excluded at its 5th failure, and never sent
    # another message, not even a query.
    grid = ErrorCodeGrid(make_app(), 3, run_config={}, code=ErrorCode.LOAD_CLIENT_APP_EXCEPTION)
    settings = EngineSettings(
        backoff=Backoff(base=0.01, factor=2.0, cap=0.05),
        node_refresh_interval=0.0,
        query_partition_ids=True,
    )
    result = ASGD(server_learning_rate=0.1, virtual_clock=None, engine=settings).start(
        grid, initial_arrays(), max_updates=300
    )
    c = result.report.counters
    assert (c["error_replies"], c["node_backoffs"], c["nodes_excluded"], c["nodes_lost"]) == (
        5,
        4,
        1,
        0,
    )
    assert grid.to_node_2 == ["query"] + ["train"] * 5
    assert result.report.per_node["node 2 (partition 1)"]["excluded"] == (
        "5 failures in a row (max-node-failures=5); last: error reply (code 1: the ClientApp "
        "failed to load: the ClientApp failed to load)"
    )
    assert c["updates_received"] == 300


def hanging_app(hung: int, release: threading.Event, calls: list):
    """The quadratic ClientApp, except that partition ``hung`` never returns from train."""
    inner = make_app(calls=calls)

    def app(msg: Message, context) -> Message:
        if msg.metadata.message_type == "train" and context.node_config["partition-id"] == hung:
            release.wait()  # "never" (until the test ends)
        return inner(msg, context)

    return app


@pytest.mark.parametrize("workers", [2, 0])
def test_a_hung_client_app_is_timed_out_excluded_and_the_run_completes(workers, caplog):
    # Partition 0 hangs. Its dispatch times out after 2 s (workers=0: the pull that
    # computes it gives up at the TTL, 4 s, with Flower's TTL-expiry error); the node
    # backs off, is sent work again, fails again and is excluded (max-node-failures=2).
    # The other two nodes finish the run, and closing the grid does not wait.
    release, calls = threading.Event(), []
    grid = InProcessGrid(hanging_app(0, release, calls), 3, run_config={}, workers=workers)
    settings = EngineSettings(dispatch_timeout=2.0, message_ttl=4.0, max_node_failures=2)
    try:
        done: dict = {}
        strategy = ASGD(server_learning_rate=0.1, virtual_clock=EVEN, engine=settings)
        thread = threading.Thread(
            target=lambda: done.update(
                result=strategy.start(grid, initial_arrays(), max_updates=60), closed=grid.close()
            ),
            daemon=True,
        )
        thread.start()
        thread.join(BOUND)
        assert "result" in done and "closed" in done, f"the run or close() hung ({BOUND} s)"
        rep = done["result"].report
        assert rep.status == "completed" and rep.counters["updates_received"] == 60
        assert rep.counters["nodes_excluded"] == 1 and rep.counters["node_backoffs"] == 1
        assert rep.per_node["node 1 (partition 0)"]["state"] == "excluded"
        assert rep.per_node["node 1 (partition 0)"]["excluded"].startswith(
            "2 failures in a row (max-node-failures=2); last: "
        )
        assert not release.is_set()  # partition 0's first call was still running
        messages = " ".join(r.getMessage() for r in caplog.records)
        if workers:
            assert rep.counters["dispatch_timeouts"] == 2
            assert rep.per_node["node 1 (partition 0)"]["excluded"].endswith(
                "no reply within dispatch-timeout=2.0 s"
            )
        else:
            # The first failure is the TTL expiry the pull returned, named as such.
            assert (
                "error reply from node 1 (partition 0) (code 3: TTL expiry: the message was not "
                "answered within message-ttl=4.0 s (or was removed from the SuperLink)"
            ) in messages
    finally:
        release.set()


def test_every_node_failing_ends_the_run_failed_with_the_reason():
    grid = InProcessGrid(make_app(raise_for={0, 1}), 2, run_config={})
    with pytest.raises(RunFailed) as err:
        ASGD(server_learning_rate=0.1, virtual_clock=EVEN).start(
            grid, initial_arrays(), max_updates=30
        )
    why = (
        "5 failures in a row (max-node-failures=5); last: error reply (code 2: the ClientApp "
        "raised an exception: RuntimeError: partition {} fails on purpose)"
    )
    assert err.value.reason == (
        "no node left to train after 0 of 30 updates: "
        f"node 1 (partition 0) excluded ({why.format(0)}); node 2 (partition 1) excluded "
        f"({why.format(1)})"
    )
    assert str(err.value) == f"the run failed: {err.value.reason}"
    report = err.value.result.report
    assert report.status == "failed" and report.counters["nodes_excluded"] == 2


def slow_query_app(release: threading.Event):
    """The quadratic ClientApp whose query (its first message: start-up) waits for ``release``."""
    inner = make_app()

    def app(msg: Message, context) -> Message:
        if msg.metadata.message_type == "query":
            release.wait()
        return inner(msg, context)

    return app


def test_the_startup_deadline_is_its_own_setting():
    # A start-up slower than the dispatch deadline: the nodes answer their queries once
    # released (after the run has waited longer than dispatch-timeout), and train.
    release = threading.Event()
    grid = InProcessGrid(slow_query_app(release), 2, run_config={}, workers=2)
    timer = threading.Timer(2.0, release.set)
    timer.start()
    settings = EngineSettings(startup_timeout=BOUND, dispatch_timeout=1.0, min_nodes=2)
    result = ASGD(server_learning_rate=0.1, virtual_clock=EVEN, engine=settings).start(
        grid, initial_arrays(), max_updates=20
    )
    assert result.report.counters["updates_received"] == 20
    grid.close()
    # Nodes that never answer: start-up fails after startup-timeout, naming it.
    never = threading.Event()
    grid = InProcessGrid(slow_query_app(never), 2, run_config={}, workers=2)
    settings = EngineSettings(startup_timeout=0.2, min_nodes=2, query_partition_ids=True)
    with pytest.raises(RuntimeError) as err:
        ASGD(server_learning_rate=0.1, engine=settings).start(grid, initial_arrays())
    assert str(err.value) == (
        "only 0 node(s) answered within startup-timeout=0.2 s, min-nodes=2 required"
    )
    grid.close()
    never.set()


@pytest.mark.parametrize(
    "config, expected",
    [
        (
            {"message-ttl": 10.0, "dispatch-timeout": 100.0},
            "run config message-ttl=10.0 must be greater than dispatch-timeout=100.0: a "
            "message expires after message-ttl, so the per-dispatch deadline must come first; "
            "raise message-ttl or lower dispatch-timeout",
        ),
        (
            {"message-ttl": 60.0, "dispatch-timeout": 60.0},
            "run config message-ttl=60.0 must be greater than dispatch-timeout=60.0",
        ),
        (
            {"reply-timeout": 100.0},
            "run config key 'reply-timeout' was removed: use startup-timeout (the start-up "
            "deadline) and dispatch-timeout (the per-dispatch deadline, below message-ttl)",
        ),
    ],
)
def test_contradictory_time_settings_fail_at_start(config, expected):
    with pytest.raises(ValueError) as err:
        parse_run_config(config)
    assert str(err.value).startswith(expected)
    if "reply-timeout" not in config:
        with pytest.raises(ValueError) as err:
            EngineSettings(
                message_ttl=config["message-ttl"], dispatch_timeout=config["dispatch-timeout"]
            )
        assert str(err.value).startswith(expected)


def flaky_query_app(fails: dict[int, int]):
    """The quadratic ClientApp whose query expires (TTL, code 3) the first
    ``fails[partition]`` times. (A query that raises is another case: the node is
    registered without a partition-id, tests/intake/test_fedavg_style_clients.py.)"""
    inner, seen = make_app(), Counter()

    def app(msg: Message, context) -> Message:
        pid = int(context.node_config["partition-id"])
        if msg.metadata.message_type == "query":
            seen[pid] += 1
            if seen[pid] <= fails.get(pid, 0):
                expired = Error(ErrorCode.MESSAGE_UNAVAILABLE, f"query {seen[pid]} expired")
                return Message(expired, reply_to=msg)
        return inner(msg, context)

    return app, seen


def test_a_failed_start_up_query_is_retried_then_the_node_refused(caplog):
    # Under Ray a ClientApp's first message may expire (TTL) while it starts: a failed
    # query is sent again. Partition 0 answers its 3rd query; partition 1 never does
    # and is refused after max-node-failures (5) failed queries; the run goes on.
    app, queries = flaky_query_app({0: 2, 1: 99})
    grid = InProcessGrid(app, 3, run_config={})
    result = ASGD(server_learning_rate=0.1, virtual_clock=EVEN).start(
        grid, initial_arrays(), max_updates=30
    )
    assert (queries[0], queries[1], queries[2]) == (3, 5, 1)
    assert result.report.counters["nodes_refused"] == 1
    assert sorted(result.report.per_node) == ["node 1 (partition 0)", "node 3 (partition 2)"]
    assert result.report.counters["updates_received"] == 30
    messages = [r.getMessage() for r in caplog.records]
    assert any(
        m.startswith("[async] node 2 refused: 5 failed queries in a row; last: its query failed ")
        for m in messages
    )
