"""A Flower ``Grid`` that runs a ClientApp in this process: no SuperLink, no Ray.

The engine talks to it exactly as to Flower's grids (``push_messages`` /
``pull_messages``), and each pushed message is handled by calling the ClientApp
with the node's ``Context``, so the same strategy, engine and client code run as in
a Flower simulation. Under the virtual clock the order of applied replies does not
depend on when replies arrive, so results equal those of Flower's simulation engine.

Every ClientApp call runs in a daemon thread. With ``workers >= 1`` each pushed
message is computed at once, at most ``workers`` calls at a time (torch releases the
GIL, so client computations run in parallel and overlap the server's evaluation),
and a pull returns the replies that are ready, as Flower's grids do. With
``workers=0`` a reply is computed when it is first pulled, and the pull waits for it
(a message's TTL then runs from when its computation starts). Either way every reply
depends only on its message, so results are the same. A ClientApp exception becomes
an error reply, as in Flower.

Each message's TTL is honoured as Flower's SuperLink does: a message not answered
within its TTL (``message-ttl``) is answered with Flower's TTL-expiry error
(:data:`TTL_EXPIRED`, code 3). A ClientApp call still running then is abandoned:
its thread runs on as a daemon, its result is discarded and its worker is free. So
a ClientApp that never returns holds a worker for at most one TTL per message, and
with ``workers=0`` it holds up the pull that computes it for at most one TTL; use
``workers >= 1`` so that the engine's ``dispatch-timeout`` (shorter than the TTL),
not the TTL, is what a hung node costs. :meth:`close` never waits for a running
call.

``remove_node`` makes a node vanish (its messages are never answered); ``add_node``
lets a new node join.

Thread-safety contract. With ``workers >= 1`` the ClientApp is called from up to
``workers`` threads at once: for different nodes, and for two messages to the same
node (a train and an evaluate message). Flower's simulation engine runs ClientApps
in separate worker processes instead, so a ClientApp that works there may race
here. A ClientApp run with worker threads must be thread-safe: a module-level cache
must build each entry under a lock and never hand a half-built entry to another
thread (this repository's ``clients/`` use ``cachetools.func.lru_cache``, which
builds each key once while the other threads wait for it;
``tests/clients/test_client_thread_safety.py``), and process-wide settings such as
``torch.set_num_threads`` are shared by all nodes. With ``workers=0`` the calls run
one at a time (each in its own thread, the caller waiting), unless one is abandoned
at its TTL: use it for a ClientApp that is not thread-safe.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

__all__ = ["InProcessGrid", "CLIENT_APP_EXCEPTION", "TTL_EXPIRED"]

ClientAppCallable = Callable[[Message, Context], Message]
#: Error code of the reply to a message whose ClientApp raised (Flower's own constant).
CLIENT_APP_EXCEPTION = ErrorCode.CLIENT_APP_RAISED_EXCEPTION
#: Error code of the reply to a message whose TTL expired unanswered (Flower's constant:
#: the SuperLink answers an expired message with it).
TTL_EXPIRED = ErrorCode.MESSAGE_UNAVAILABLE


@dataclass
class _Call:
    """One pushed message and its reply; ``deadline`` in ``time.monotonic()`` seconds."""

    msg: Message
    deadline: float
    reply: Message | None = None
    started: bool = False
    # The reply is TTL expiry while the ClientApp still runs (its result is discarded).
    abandoned: bool = False
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def node_id(self) -> int:
        return self.msg.metadata.dst_node_id

    def expire(self) -> bool:
        """Answer with TTL expiry; True if the call was running: it is abandoned (its
        thread runs on, its result discarded)."""
        self.reply = _expired_reply(self.msg)
        self.abandoned = self.started and not self.done.is_set()
        self.done.set()
        return self.abandoned


class InProcessGrid(Grid):
    """Grid whose nodes are ``client_app`` calls in this process.

    Parameters
    ----------
    client_app : callable
        A ``flwr.clientapp.ClientApp`` (or any ``(Message, Context) -> Message``).
    num_nodes : int
        Number of nodes; node ``i`` gets node config
        ``{"partition-id": i, "num-partitions": num_nodes}`` and node id ``i + 1``.
    run_config : dict
        The run config every node's ``Context`` carries.
    run_id : int
        Run id stamped on messages.
    workers : int
        ClientApp calls computed at once, ahead of pulls (0 = compute on pull, the
        pull waiting up to the message's TTL); then the ClientApp must be thread-safe
        (module docstring). :meth:`close` (or the ``with`` block's end) returns at once.

    Raises
    ------
    ValueError
        If ``num_nodes < 1`` or ``workers < 0``.
    """

    def __init__(
        self,
        client_app: ClientAppCallable,
        num_nodes: int,
        run_config: dict[str, Any],
        run_id: int = 1,
        workers: int = 0,
    ) -> None:
        if num_nodes < 1:
            raise ValueError(f"num_nodes must be >= 1, got {num_nodes!r}")
        if workers < 0:
            raise ValueError(f"workers must be >= 0, got {workers!r}")
        self.workers = workers
        self.client_app = client_app
        self.run_config = dict(run_config)
        self._run = Run.create_empty(run_id)
        _claim_task_identity(run_id)
        self.contexts: dict[int, Context] = {}
        self.calls: dict[str, _Call] = {}  # message id -> its call, until the reply is pulled
        self.queue: deque[str] = deque()  # pushed, not started (workers >= 1)
        self.running = 0  # calls holding a worker
        self.closed = False
        self.changed = threading.Condition()
        self._next_node_id = 1
        self._next_message = 0
        for pid in range(num_nodes):
            self.add_node({"partition-id": pid, "num-partitions": num_nodes})

    @property
    def pending(self) -> dict[str, Message]:
        """Messages pushed whose reply has not been pulled, by message id."""
        return {mid: call.msg for mid, call in self.calls.items()}

    # -- node membership (tests and churn experiments)
    def add_node(self, node_config: dict[str, Any], node_id: int | None = None) -> int:
        """Add a node with ``node_config``; return its node id.

        ``node_id`` brings back a node under its old id, as a SuperNode restarted with
        the same authentication key does; by default the node gets a new id.
        """
        if node_id is None:
            node_id = self._next_node_id
            self._next_node_id += 1
        elif node_id in self.contexts:
            raise ValueError(f"node id {node_id} is present already")
        self.contexts[node_id] = Context(
            run_id=self._run.run_id,
            node_id=node_id,
            node_config=dict(node_config),
            state=RecordDict(),
            run_config=self.run_config,
        )
        return node_id

    def remove_node(self, node_id: int) -> None:
        """Make a node vanish: it leaves ``get_node_ids`` and never answers again."""
        del self.contexts[node_id]

    # -- Grid API
    def set_run(self, run: Run) -> None:
        """Set the run this grid operates in."""
        self._run = run

    @property
    def run(self) -> Run:
        """Run information."""
        return self._run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        """Create a message to ``dst_node_id``."""
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        """Ids of the nodes present now."""
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Store messages for their nodes (start them with workers); return their ids.

        Raises
        ------
        RuntimeError
            If the grid was closed.
        """
        if self.closed:
            raise RuntimeError("InProcessGrid.push_messages after close()")
        ids = []
        with self.changed:
            for msg in messages:
                self._next_message += 1
                mid = f"inprocess-{self._next_message}"
                msg.metadata.__dict__["_message_id"] = mid
                self.calls[mid] = _Call(msg, time.monotonic() + msg.metadata.ttl)
                if self.workers:
                    self.queue.append(mid)
                ids.append(mid)
            self._schedule()
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Return the replies ready among ``message_ids`` (with workers=0: compute them).

        Each reply is returned once; messages to vanished nodes stay unanswered; a
        message whose TTL passed is answered with :data:`TTL_EXPIRED`.
        """
        replies = []
        with self.changed:
            self._schedule()  # expire what is past its TTL, fill the freed workers
        for mid in message_ids:
            call = self.calls.get(mid)
            if call is None or call.node_id not in self.contexts:
                continue
            if not self.workers and not call.started and call.reply is None:
                self._run_inline(call)
            with self.changed:
                if call.reply is None and call.started and time.monotonic() >= call.deadline:
                    self._expire_call(call)
                if call.reply is None:
                    continue  # still computing
                replies.append(call.reply)
                del self.calls[mid]
        return replies

    def wait_for_replies(self, message_ids: Iterable[str], timeout: float) -> None:
        """Block until a reply to one of ``message_ids`` is ready, at most ``timeout`` s
        (the engine waits on the workers, not a whole poll interval); without workers
        or with no reply being computed, sleep ``timeout`` seconds."""
        end = time.monotonic() + timeout
        calls = [self.calls[m] for m in message_ids if m in self.calls]
        if not self.workers or not calls:
            time.sleep(timeout)
            return
        with self.changed:
            while not any(c.reply is not None for c in calls):
                now = time.monotonic()
                if now >= end:
                    return
                # Wake at the first TTL deadline too: expiry is a reply.
                self.changed.wait(min([end] + [c.deadline for c in calls]) - now)
                self._schedule()

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Push ``messages`` and return the replies (synchronous strategies)."""
        ids = list(self.push_messages(messages))
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []
        while len(replies) < len(ids) and (deadline is None or time.monotonic() < deadline):
            replies += list(self.pull_messages(ids))
            waiting = [m for m in ids if m in self.calls and self.calls[m].node_id in self.contexts]
            if not waiting:
                break  # nothing left computing: the rest went to vanished nodes
            self.wait_for_replies(waiting, 0.01)
        return replies

    def close(self) -> None:
        """Drop the calls not started; return without waiting for running ones."""
        with self.changed:
            self.closed = True
            self.queue.clear()

    def __enter__(self) -> InProcessGrid:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- calls
    def _schedule(self) -> None:
        """Start queued calls on free workers, in push order (lock held)."""
        self._expire()
        for mid in list(self.queue):
            if self.running >= self.workers or self.closed:
                return
            call = self.calls.get(mid)
            if call is None or call.reply is not None:
                self.queue.remove(mid)
            elif call.node_id in self.contexts:
                self.queue.remove(mid)
                self.running += 1
                self._start(call)

    def _start(self, call: _Call) -> None:
        call.started = True
        args, name = (call, self.contexts[call.node_id]), "inprocess-node"
        threading.Thread(target=self._compute, args=args, name=name, daemon=True).start()

    def _run_inline(self, call: _Call) -> None:
        """workers=0: compute ``call`` now, waiting at most until its TTL deadline."""
        with self.changed:
            call.deadline = time.monotonic() + call.msg.metadata.ttl
            self._start(call)
        call.done.wait(max(0.0, call.deadline - time.monotonic()))

    def _compute(self, call: _Call, context: Context) -> None:
        reply = _call(self.client_app, call.msg, context)
        with self.changed:
            if not call.abandoned:
                call.reply = reply
                if self.workers:
                    self.running -= 1
            call.done.set()
            self._schedule()
            self.changed.notify_all()

    def _expire(self) -> None:
        """Answer every message past its TTL with :data:`TTL_EXPIRED` (lock held)."""
        now = time.monotonic()
        for call in self.calls.values():
            # workers=0: a message's TTL runs from when its computation starts, so the
            # time a pull spends on other messages does not count against it.
            if call.reply is None and now >= call.deadline and (self.workers or call.started):
                self._expire_call(call)

    def _expire_call(self, call: _Call) -> None:
        self.running -= int(call.expire() and self.workers > 0)  # an abandoned call's worker


def _call(client_app: ClientAppCallable, msg: Message, context: Context) -> Message:
    """``client_app``'s reply to ``msg``; an exception becomes an error reply, as in Flower."""
    try:
        reply = client_app(msg, context)
    except Exception:  # mirrors Flower: an exception becomes an error reply
        reply = Message(Error(CLIENT_APP_EXCEPTION, traceback.format_exc()), reply_to=msg)
    reply.metadata.__dict__["_message_id"] = f"reply-{msg.metadata.message_id}"
    return reply


def _expired_reply(msg: Message) -> Message:
    """The reply Flower's SuperLink gives a message whose TTL expired unanswered."""
    reply = Message(
        Error(
            TTL_EXPIRED,
            f"Error: Message Unavailable - the message's TTL ({msg.metadata.ttl} s) expired "
            "before the node answered it (in-process grid)",
        ),
        reply_to=msg,
    )
    reply.metadata.__dict__["_message_id"] = f"reply-{msg.metadata.message_id}"
    return reply


def _claim_task_identity(run_id: int) -> None:
    """Stamp this process as a ServerApp task, as Flower does before ``main`` runs.

    ``Message`` reads the run id from it. A real ServerApp process already has one;
    it is left alone. The fields are private (no public setter in flwr 1.42):
    ``tests/packaging/test_private_apis.py`` pins them, as it pins ``_message_id``.
    """
    for attr, value in (("_run_id", run_id), ("_node_id", 0), ("_task_id", 0)):
        if getattr(TaskIdentity, attr) is None:
            setattr(TaskIdentity, attr, value)
