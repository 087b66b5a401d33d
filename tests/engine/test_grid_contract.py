"""The Grid's contract across Flower versions (issue 24 item 5): a push the SuperLink
refuses returns None in Flower 1.42 and ``""`` in 1.43. Either way the message is
tracked under its own local id, never pulled, and failed at its deadline like a message
never answered; the node is backed off and trains again, and two refused pushes do not
overwrite each other."""

from __future__ import annotations

import logging
import time

import pytest

from flwr_gsgm.engine.async_engine import EngineSettings
from flwr_gsgm.nodes.backoff import Backoff
from flwr_gsgm.simulation.inprocess_grid import InProcessGrid
from flwr_gsgm.strategy.strategies import ASGD
from tests.engine.quadratic_app import initial_arrays, make_app


class RefusingGrid(InProcessGrid):
    """Refuses the first train message to each node of ``refuse`` (never delivers it) and
    returns ``refused_id`` for it, as Flower's grid returns for a push it could not make."""

    def __init__(self, *args, refused_id, refuse: set[int], **kwargs):
        super().__init__(*args, **kwargs)
        self.refused_id, self.refuse = refused_id, set(refuse)
        self.pulled: list[str] = []

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            if msg.metadata.message_type == "train" and node in self.refuse:
                self.refuse.discard(node)
                ids.append(self.refused_id)
            else:
                ids += list(super().push_messages([msg]))
        return ids

    def pull_messages(self, message_ids):
        message_ids = list(message_ids)
        self.pulled += message_ids
        return super().pull_messages(message_ids)


@pytest.mark.parametrize("refused_id", [None, ""])  # Flower 1.42, Flower 1.43
def test_a_refused_push_fails_at_its_deadline_and_the_node_trains_again(refused_id, caplog):
    caplog.set_level(logging.WARNING)
    inner = make_app()

    def slow_app(msg, context):  # 20 ms per update: the run outlasts the 0.3 s deadline
        time.sleep(0.02)
        return inner(msg, context)

    grid = RefusingGrid(slow_app, 3, run_config={}, workers=2, refused_id=refused_id, refuse={1, 2})
    settings = EngineSettings(
        dispatch_timeout=0.3,
        message_ttl=5.0,
        node_refresh_interval=0.0,
        backoff=Backoff(base=0.01, factor=2.0, cap=0.02),
    )
    with grid:
        result = ASGD(server_learning_rate=0.1, engine=settings).start(
            grid, initial_arrays(), max_updates=60
        )
    c = result.report.counters
    assert c["updates_received"] == 60
    # Both refused pushes are tracked (none overwrote the other), each failed once at
    # its deadline; then both nodes trained.
    assert c["dispatch_timeouts"] == 2
    per_node = result.report.per_node
    timed_out = sorted(p for p, n in per_node.items() if n["dispatch_timeouts"] == 1)
    assert len(timed_out) == 2
    assert all(per_node[p]["updates_received"] > 0 for p in timed_out)
    assert refused_id not in grid.pulled and not any(m.startswith("unsent-") for m in grid.pulled)
    warned = [
        r.getMessage() for r in caplog.records if "not accepted by the SuperLink" in r.getMessage()
    ]
    assert sorted(warned) == [
        f"[async] the train message to node {n} was not accepted by the SuperLink (push "
        f"returned {refused_id!r}); it fails at its deadline"
        for n in (1, 2)
    ]
