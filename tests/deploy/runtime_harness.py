"""A SuperNode without its SuperLink, for testing ClientApp executors in seconds.

Flower's own SuperNode pieces run here unchanged: its NodeState and ObjectStore, its
Runtime API (the FastAPI app of ``flower-supernode``, served by uvicorn on a free
loopback port), and the two halves of its main loop, ``_pull_and_store_message``
(message in -> task) and ``_push_messages`` (reply out). Only the Fleet API is
replaced: the message comes from :meth:`RuntimeHarness.deliver` instead of the
SuperLink, the reply is captured instead of uploaded.

Also builds tiny Flower Apps (FABs) whose ClientApp reports what it saw.
"""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path

import numpy as np
import uvicorn
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, Metadata, RecordDict
from flwr.app.message import make_message, remove_content_from_message
from flwr.cli.build import build_fab_from_disk
from flwr.supercore.fab import Fab
from flwr.supercore.inflatable.inflatable_object import (
    get_all_nested_objects,
    get_object_tree,
    no_object_id_recompute,
)
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.run import Run
from flwr.supernode import start_client_internal as sci
from flwr.supernode.main import create_app
from flwr.supernode.nodestate import NodeStateFactory

from benchmarks.local_deployment import app_pyproject, free_port

NODE_ID = 7
RUN_ID = 42

APP_MODULE = '''"""Test ClientApp: scales the arrays; reports its version, calls and process."""

import os
import time

from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp

VERSION = {version}
CALLS = 0  # tasks served by this import of the module

app = ClientApp()
server = ServerApp()


@app.train()
def train(msg, context):
    global CALLS
    config = msg.content["config"]
    if config.get("raise", False):
        raise ValueError("asked to fail")
    time.sleep(float(config.get("sleep", 0.0)))
    CALLS += 1
    seen = int(context.state["seen"]["n"]) + 1 if "seen" in context.state else 1
    context.state["seen"] = MetricRecord({{"n": seen}})
    scale = float(context.run_config["scale"])
    arrays = ArrayRecord(
        {{k: Array(v.numpy() * scale) for k, v in msg.content["arrays"].items()}}
    )
    metrics = MetricRecord(
        {{"version": VERSION, "calls": CALLS, "seen": seen, "pid": os.getpid()}}
    )
    return Message(RecordDict({{"arrays": arrays, "metrics": metrics}}), reply_to=msg)
'''


def build_app(folder: Path, version: int) -> Fab:
    """A FAB of the test ClientApp at ``version`` (1, 2, ...), built in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    pyproject = app_pyproject(
        "warmprobe",
        f"{version}.0.0",
        "warmprobe_app:server",
        "warmprobe_app:app",
        {"scale": 2.0},
        package=".",
        publisher="flwr-gsgm-tests",
    )
    (folder / "pyproject.toml").write_text(pyproject)
    (folder / "warmprobe_app.py").write_text(APP_MODULE.format(version=version))
    content = build_fab_from_disk(folder)
    return Fab(hashlib.sha256(content).hexdigest(), content, {})


def train_message(run_id: int, values: list[float], **config) -> Message:
    """A train message as the SuperLink hands it to the SuperNode."""
    content = RecordDict(
        {
            "arrays": ArrayRecord({"w": Array(np.asarray(values, dtype=np.float32))}),
            "config": ConfigRecord(config),
        }
    )
    metadata = Metadata(
        run_id=run_id,
        message_id="",
        src_node_id=1,
        dst_node_id=NODE_ID,
        reply_to_message_id="",
        group_id="",
        created_at=time.time(),
        ttl=600.0,
        message_type="train",
    )
    return make_message(metadata=metadata, content=content)


class RuntimeHarness:
    """Flower's SuperNode state and Runtime API on ``127.0.0.1:port``, no SuperLink."""

    def __init__(self) -> None:
        self.state_factory = NodeStateFactory(objectstore_factory=ObjectStoreFactory())
        self.state = self.state_factory.state()
        self.store = self.state_factory.objectstore_factory.store()
        self.state.set_node_id(NODE_ID)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(
                app=create_app(state_factory=self.state_factory),
                host="127.0.0.1",
                port=self.port,
                log_level="warning",
            )
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.fabs: dict[str, Fab] = {}
        self.runs: dict[int, Run] = {}

    def start(self) -> RuntimeHarness:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the Runtime API did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def add_run(self, run_id: int, fab: Fab) -> None:
        """A run of ``fab`` (it reaches the SuperNode with the run's first message)."""
        run = Run.create_empty(run_id)
        run.fab_id, run.fab_version = _id_and_version_of(fab)
        run.fab_hash = fab.hash_str
        self.fabs[fab.hash_str] = fab
        self.runs[run_id] = run

    def deliver(self, message: Message) -> str:
        """Hand ``message`` to the SuperNode as its Fleet API would; return its id.

        Runs the SuperNode's own ``_pull_and_store_message``: the run, its FAB and
        context are stored on first sight, a ClientApp task is created.
        """
        objects: dict[str, bytes] = {}
        run_id = self._pull_and_store(message, lambda _rid, oid: objects[oid], objects)
        assert run_id == message.metadata.run_id, "the SuperNode did not take the message"
        return message.metadata.message_id

    def deliver_for_a_stopped_run(self, message: Message) -> None:
        """Hand ``message`` to the SuperNode as if its run stopped while the SuperNode
        received it: the SuperLink refuses its objects (HTTP 403, Flower's
        ``RunNotRunningException``). Flower 1.42's ``_pull_and_store_message`` then logs
        "Run ID ... is not in `RUNNING` status. Ignoring message" and returns None, its
        task left pending, its message never complete. The run must be known already
        (a message of it delivered): for an unknown run no task is created."""
        from flwr.supercore.run import RunNotRunningException

        def refused(_run_id, _object_id):
            raise RunNotRunningException

        run_id = self._pull_and_store(message, refused)
        assert run_id is None, "the SuperNode took the message of a stopped run"

    def _pull_and_store(self, message: Message, pull_object, objects=None):
        """The SuperNode's ``_pull_and_store_message`` on ``message``, its objects served
        by ``pull_object(run_id, object_id)``; ``objects``, if given, is filled with the
        message's deflated objects first. Returns what Flower returns (the run id or None)."""
        with no_object_id_recompute():
            message.metadata.__dict__["_message_id"] = message.object_id
            tree = get_object_tree(message)
            if objects is not None:
                objects.update(
                    {oid: obj.deflate() for oid, obj in get_all_nested_objects(message).items()}
                )
        header = remove_content_from_message(message)
        sent = iter([(header, tree)])
        return sci._pull_and_store_message(
            state=self.state,
            object_store=self.store,
            node_config={"partition-id": 0, "num-partitions": 2},
            receive=lambda: next(sent, None),
            get_run=lambda rid: self.runs[rid],
            get_fab=lambda fab_hash, _rid: self.fabs[fab_hash],
            pull_object=pull_object,
            confirm_message_received=lambda _rid, _mid: None,
            trusted_entities=None,
        )

    def collect_reply(self, timeout: float = 120.0) -> Message:
        """Wait for the next reply as the SuperNode's ``_push_messages`` does; return it.

        Raises TimeoutError after ``timeout`` seconds without one.
        """
        captured: dict[str, object] = {}

        def send(message, tree, _runtime):
            captured["message"], captured["contents"] = message, {}
            ids = {t.object_id for t in _walk(tree)}
            return ids, "session"

        def push_object(_run_id, _session, oid, content):
            captured["contents"][oid] = content

        pusher = threading.Thread(
            target=sci._push_messages,
            kwargs={
                "state": self.state,
                "object_store": self.store,
                "send": send,
                "push_object": push_object,
            },
            daemon=True,
        )
        pusher.start()
        pusher.join(timeout)
        if pusher.is_alive():
            raise TimeoutError(f"no reply from the ClientApp within {timeout} s")
        header: Message = captured["message"]
        reply = inflate_object_from_contents(header.metadata.message_id, captured["contents"])
        reply.metadata.__dict__["_message_id"] = header.metadata.message_id
        return reply


def _walk(tree):
    yield tree
    for child in tree.children:
        yield from _walk(child)


def _id_and_version_of(fab: Fab) -> tuple[str, str]:
    """``publisher/name`` and version from the FAB's pyproject.toml."""
    import io
    import zipfile

    import tomli

    with zipfile.ZipFile(io.BytesIO(fab.content)) as zf:
        config = tomli.loads(zf.read("pyproject.toml").decode())
    name = f"{config['tool']['flwr']['app']['publisher']}/{config['project']['name']}"
    return name, config["project"]["version"]
