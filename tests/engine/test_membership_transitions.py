"""Membership owns each node's state: back-off, loss, exclusion, rejoin, and who hears of it."""

from __future__ import annotations

from flwr_gsgm.engine.clock import VirtualTime
from flwr_gsgm.engine.in_flight import InFlight
from flwr_gsgm.engine.ledger import Ledger
from flwr_gsgm.engine.membership import Membership, Node, NodeListener
from flwr_gsgm.engine.settings import EngineSettings
from flwr_gsgm.nodes.backoff import Backoff
from flwr_gsgm.nodes.stats import NodeStats
from flwr_gsgm.simulation.virtual_clock import VirtualClock


class NodeIdsGrid:
    """Only what membership asks of a grid here: the node ids present."""

    def __init__(self, node_ids: list[int]) -> None:
        self.node_ids = node_ids

    def get_node_ids(self) -> list[int]:
        return list(self.node_ids)


def members_of(num_nodes: int, **settings):
    """Membership over ``num_nodes`` started nodes (partition p on node 10 + p) under a
    virtual clock, and the list of what its listener heard."""
    settings = EngineSettings(
        virtual_clock=VirtualClock(), backoff=Backoff(1.0, 2.0, 60.0), **settings
    )
    grid = NodeIdsGrid([10 + p for p in range(num_nodes)])
    clock = VirtualTime(settings.virtual_clock)
    in_flight = InFlight(grid, ["w"], settings.message_ttl, virtual_order=True)
    members = Membership(grid, in_flight, settings, Ledger(), NodeStats(), clock)
    for pid in range(num_nodes):
        members.nodes[pid] = Node(pid, 10 + pid, 1.0)
    heard: list[tuple] = []
    members.start(
        list(range(num_nodes)),
        NodeListener(
            joined=lambda pid, now: heard.append(("joined", pid, now)),
            left=lambda pid, now: heard.append(("left", pid, now)),
            forget=lambda pid: heard.append(("forget", pid)),
            freed=lambda: heard.append(("freed",)),
        ),
    )
    return members, clock, heard


def test_failures_back_a_node_off_for_longer_each_time_then_exclude_it():
    members, clock, heard = members_of(2, max_node_failures=3)
    clock.jump_to(5.0)
    members.fail(0, "boom")
    node = members.nodes[0]
    assert (node.state, node.failures, node.retry_at) == ("backing-off", 1, 6.0)  # 5 + 1 s
    assert heard == [("left", 0, 5.0), ("freed",)]
    assert members.next_retry() == 6.0
    clock.jump_to(5.5)
    members.end_backoffs()
    assert node.state == "backing-off"  # not over yet: nobody hears anything
    clock.jump_to(6.0)
    members.end_backoffs()
    assert node.state == "active" and node.retry_at is None
    assert heard[2:] == [("joined", 0, 6.0), ("freed",)]
    members.fail(0, "boom")  # the second failure in a row: 2 s, until 8 s
    assert (node.state, node.retry_at) == ("backing-off", 8.0)
    clock.jump_to(8.0)
    members.end_backoffs()
    members.fail(0, "boom again")
    assert node.state == "excluded" and members.next_retry() is None
    assert node.excluded == "3 failures in a row (max-node-failures=3); last: boom again"
    assert heard[-2:] == [("left", 0, 8.0), ("freed",)]
    counters = members.ledger.counters
    assert (counters["node_backoffs"], counters["nodes_excluded"]) == (2, 1)
    assert members.stats.counts[0]["backoffs"] == 2
    members.fail(0, "once more")  # an excluded node stays as it is
    assert node.failures == 3 and counters["nodes_excluded"] == 1
    members.replied(1)
    assert members.active_ids() == [1]


def test_a_node_that_left_the_federation_is_lost_forgotten_and_may_return():
    members, clock, heard = members_of(2)
    clock.jump_to(2.0)
    members.grid.node_ids.remove(11)
    members.fail(1, "no reply")
    node = members.nodes[1]
    assert (node.state, node.may_return) == ("lost", True)
    assert heard == [("left", 1, 2.0), ("forget", 1), ("freed",)]
    assert members.ledger.counters["nodes_lost"] == 1
    assert members.ledger.counters["node_backoffs"] == 0


def test_rejections_in_a_row_exclude_a_node_unless_the_model_diverged():
    members, _, heard = members_of(2, max_consecutive_rejections=2)
    members.rejected(0, "norm-ratio: too large")
    members.accepted(0)  # an accepted update starts the count again
    members.rejected(0, "norm-ratio: too large")
    members.rejected(0, "norm-ratio: too large", blame=False)  # every node's: not its fault
    assert members.nodes[0].state == "active" and members.nodes[0].rejections_in_row == 2
    members.rejected(0, "norm-ratio: too large")
    assert members.nodes[0].excluded == (
        "3 rejected updates in a row (max-consecutive-rejections=2); last: norm-ratio: too large"
    )
    assert heard == [("left", 0, 0.0), ("freed",)]


def test_at_a_resume_the_nodes_that_answered_are_the_runs():
    members, clock, heard = members_of(3)
    clock.jump_to(7.0)
    members.nodes[2].active = False  # did not answer at this start
    # The optimizer had 1 and 2 active at the checkpoint; 0 was lost then.
    members.reconcile({1, 2})
    assert heard == [("joined", 0, 7.0), ("left", 2, 7.0)]
    assert members.nodes[2].may_return
    counters = members.ledger.counters
    assert (counters["nodes_joined"], counters["nodes_lost"]) == (1, 1)
