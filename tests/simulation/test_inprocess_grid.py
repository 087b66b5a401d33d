"""The in-process grid with a ClientApp that never returns: TTL expiry, free workers, close.

The hung ClientApp blocks on an event the test sets at the end (so no thread outlives
the test), and every wait here is bounded: a grid that blocked would fail the bound,
not hang the suite.
"""

from __future__ import annotations

import threading

from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flwr_gsgm.simulation.inprocess_grid import TTL_EXPIRED, InProcessGrid

BOUND = 60.0  # seconds: far above any wait here; reaching it means the grid blocked


def hanging_app(hung_partition: int, release: threading.Event) -> ClientApp:
    app = ClientApp()

    @app.train()
    def train(msg: Message, context) -> Message:
        pid = int(context.node_config["partition-id"])
        if pid == hung_partition:
            release.wait()  # "never" returns (until the test ends)
        return Message(RecordDict({"metrics": MetricRecord({"partition-id": pid})}), reply_to=msg)

    return app


def push(grid: InProcessGrid, node_ids: list[int], ttl: float) -> list[str]:
    messages = [
        Message(RecordDict({"config": ConfigRecord()}), n, "train", ttl=ttl) for n in node_ids
    ]
    return list(grid.push_messages(messages))


def collect(grid: InProcessGrid, ids: list[str]) -> dict[str, Message]:
    """Pull until every message of ``ids`` is answered (at most BOUND seconds)."""
    got: dict[str, Message] = {}
    done = threading.Event()

    def loop() -> None:
        while len(got) < len(ids):
            for reply in grid.pull_messages([m for m in ids if m not in got]):
                got[reply.metadata.reply_to_message_id] = reply
            grid.wait_for_replies([m for m in ids if m not in got], 0.01)
        done.set()

    threading.Thread(target=loop, daemon=True).start()
    assert done.wait(BOUND), f"only {len(got)} of {len(ids)} replies within {BOUND} s"
    return got


def test_a_hung_call_is_answered_with_ttl_expiry_and_frees_its_worker():
    release = threading.Event()
    try:
        with InProcessGrid(hanging_app(0, release), 3, run_config={}, workers=1) as grid:
            hung, *_ = ids = push(grid, [1], ttl=0.2)
            replies = collect(grid, ids)
            assert replies[hung].error.code == TTL_EXPIRED == 3
            assert "TTL (0.2 s) expired" in replies[hung].error.reason
            # The one worker is free again: the other nodes answer, and the hung node's
            # next message hangs in turn, until its own TTL.
            ids = push(grid, [2, 3, 1], ttl=5.0)
            replies = collect(grid, ids)
            assert [replies[m].content["metrics"]["partition-id"] for m in ids[:2]] == [1, 2]
            assert replies[ids[2]].error.code == TTL_EXPIRED
    finally:
        release.set()


def test_workers_0_a_pull_waits_at_most_the_ttl_and_the_others_answer():
    release = threading.Event()
    try:
        grid = InProcessGrid(hanging_app(1, release), 3, run_config={}, workers=0)
        ids = push(grid, [1, 2, 3], ttl=0.3)
        replies = collect(grid, ids)
        # Node 2 (partition 1) hung: TTL expiry; the others were computed in full (with
        # workers=0 a message's TTL runs from when its computation starts).
        assert [r.has_error() for r in (replies[m] for m in ids)] == [False, True, False]
        assert replies[ids[1]].error.code == TTL_EXPIRED
        # Pulled again, the hung node's next message holds the pull up to its TTL too.
        (again,) = push(grid, [2], ttl=0.3)
        assert collect(grid, [again])[again].error.code == TTL_EXPIRED
    finally:
        release.set()


def test_close_does_not_wait_for_a_hung_call():
    release = threading.Event()
    grid = InProcessGrid(hanging_app(0, release), 2, run_config={}, workers=2)
    push(grid, [1, 2], ttl=600.0)
    closed = threading.Event()
    threading.Thread(target=lambda: (grid.close(), closed.set()), daemon=True).start()
    try:
        assert closed.wait(BOUND), "close() waited for the hung ClientApp"
        assert not release.is_set()  # the call was still running when close() returned
    finally:
        release.set()
