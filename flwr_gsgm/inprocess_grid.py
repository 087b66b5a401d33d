"""A Flower ``Grid`` that runs a ClientApp in this process: no SuperLink, no Ray.

The engine talks to it exactly as to Flower's grids (``push_messages`` /
``pull_messages``), and each pushed message is handled by calling the ClientApp
with the node's ``Context``, so the same strategy, engine and client code run as in
a Flower simulation. Under the virtual clock the order of applied replies does not
depend on when replies arrive, so results equal those of Flower's simulation engine.

With ``workers=0`` a reply is computed when it is first pulled, in the caller's
thread. With ``workers >= 1`` each pushed message is computed at once in a pool of
that many threads (torch releases the GIL, so client computations run in parallel
and overlap the server's evaluation), and a pull returns the replies that are ready,
as Flower's grids do. Either way every reply depends only on its message, so results
are the same. A ClientApp exception becomes an error reply, as in Flower.
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
``torch.set_num_threads`` are shared by all nodes. With ``workers=0`` every call runs
in the caller's thread, one at a time: use it for a ClientApp that is not thread-safe.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

__all__ = ["InProcessGrid", "CLIENT_APP_EXCEPTION"]

ClientAppCallable = Callable[[Message, Context], Message]
#: Error code of the reply to a message whose ClientApp raised (Flower's own constant).
CLIENT_APP_EXCEPTION = ErrorCode.CLIENT_APP_RAISED_EXCEPTION


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
        Threads computing replies ahead of pulls (0 = compute on pull, in the caller's
        thread). Call :meth:`close` (or use the grid as a context manager) to stop them.
        With threads, the ClientApp must be thread-safe (see the module docstring).
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
        self.pool = (
            ThreadPoolExecutor(workers, thread_name_prefix="inprocess-node") if workers else None
        )
        self.futures: dict[str, Future[Message]] = {}
        self.client_app = client_app
        self.run_config = dict(run_config)
        self._run = Run.create_empty(run_id)
        _claim_task_identity(run_id)
        self.contexts: dict[int, Context] = {}
        self.pending: dict[str, Message] = {}
        self._next_node_id = 1
        self._next_message = 0
        for pid in range(num_nodes):
            self.add_node({"partition-id": pid, "num-partitions": num_nodes})

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
        """Store messages for their nodes; return their new message ids."""
        ids = []
        for msg in messages:
            self._next_message += 1
            mid = f"inprocess-{self._next_message}"
            msg.metadata.__dict__["_message_id"] = mid
            self.pending[mid] = msg
            context = self.contexts.get(msg.metadata.dst_node_id)
            if self.pool is not None and context is not None:
                self.futures[mid] = self.pool.submit(self._call, msg, context)
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Compute and return replies to those of ``message_ids`` whose node is present.

        Each reply is returned once; messages to vanished nodes stay unanswered.
        """
        replies = []
        for mid in message_ids:
            msg = self.pending.get(mid)
            if msg is None or msg.metadata.dst_node_id not in self.contexts:
                continue
            if self.pool is None:
                replies.append(self._call(msg, self.contexts[msg.metadata.dst_node_id]))
            elif mid in self.futures and self.futures[mid].done():
                replies.append(self.futures.pop(mid).result())
            else:
                continue  # still computing
            del self.pending[mid]
        return replies

    def wait_for_replies(self, message_ids: Iterable[str], timeout: float) -> None:
        """Block until a reply to one of ``message_ids`` is ready, at most ``timeout`` s.

        Lets the asynchronous engine wait for the worker threads instead of sleeping
        a whole poll interval. Without worker threads (replies are computed on pull)
        or with no reply being computed, it sleeps ``timeout`` seconds.
        """
        futures = [self.futures[m] for m in message_ids if m in self.futures]
        if futures:
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)
        else:
            time.sleep(timeout)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Push ``messages`` and return the replies (synchronous strategies)."""
        ids = list(self.push_messages(messages))
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []
        while len(replies) < len(ids) and (deadline is None or time.monotonic() < deadline):
            replies += list(self.pull_messages(ids))
            if not any(mid in self.pending and mid in self.futures for mid in ids):
                break  # nothing left computing: the rest went to vanished nodes
            time.sleep(0.001)
        return replies

    def close(self) -> None:
        """Stop the worker threads (replies not yet pulled are dropped)."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.futures.clear()

    def __enter__(self) -> InProcessGrid:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, msg: Message, context: Context) -> Message:
        try:
            reply = self.client_app(msg, context)
        except Exception:  # mirrors Flower: an exception becomes an error reply
            reply = Message(Error(CLIENT_APP_EXCEPTION, traceback.format_exc()), reply_to=msg)
        reply.metadata.__dict__["_message_id"] = f"reply-{msg.metadata.message_id}"
        return reply


def _claim_task_identity(run_id: int) -> None:
    """Stamp this process as a ServerApp task, as Flower does before ``main`` runs.

    ``Message`` reads the run id from it. A real ServerApp process already has one;
    it is left alone. The fields are private (no public setter in flwr 1.42):
    ``tests/engine/test_private_apis.py`` pins them, as it pins ``_message_id``.
    """
    for attr, value in (("_run_id", run_id), ("_node_id", 0), ("_task_id", 0)):
        if getattr(TaskIdentity, attr) is None:
            setattr(TaskIdentity, attr, value)
