"""ClientApps that misbehave under ``flwr run`` (test_faults_under_flwr_run.py).

Each wraps the project's ClientApp (``clients.client_app:app``): queries are answered
as usual, train messages first misbehave. A copy of the project names one of them as
its ``clientapp`` component, so the project's own app stays as it is.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from clients.client_app import app as project_app

NEVER = 300  # seconds: "never" within a test (its Ray worker is gone after that)


def _before_train(misbehave: Callable[[int], None]) -> ClientApp:
    app = ClientApp()

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        return project_app(msg, context)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        misbehave(int(context.node_config["partition-id"]))
        return project_app(msg, context)

    return app


def _hang_partition_0(pid: int) -> None:
    if pid == 0:
        time.sleep(NEVER)


#: Partition 0's train never returns; the other partitions train as usual.
hung_partition_0 = _before_train(_hang_partition_0)
#: Every train takes 30 s (longer than the message TTL the test sets).
slow_training = _before_train(lambda pid: time.sleep(30))
#: The project's ClientApp as it is: a run config that makes the model diverge is the fault.
unchanged = _before_train(lambda pid: None)
