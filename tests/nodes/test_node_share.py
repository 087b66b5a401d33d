"""Issue 23 item 7: a node whose data barely reach the model is named.

One node 1000x slower than two others gets 2 of 3000 updates into the model; before,
only dropped stale updates were warned about. Now the log and summary.json
``warnings`` name the node (partition-id and node id) and its count.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

from flwr_gsgm.config import outputs as run_outputs
from flwr_gsgm.nodes.stats import LOW_SHARE, MIN_FAIR_SHARE, NodeStats
from flwr_gsgm.simulation.inprocess_grid import InProcessGrid
from flwr_gsgm.simulation.virtual_clock import VirtualClock
from flwr_gsgm.strategy.strategies import ASGD
from tests.engine.quadratic_app import initial_arrays, make_app


def run(slow_factor: float, max_updates: int):
    clock = VirtualClock(
        seed=0, base_duration=1.0, slow_fraction=1 / 3, slow_factor=slow_factor, jitter=0.0
    )
    grid = InProcessGrid(make_app(), 3, run_config={})
    return ASGD(server_learning_rate=0.1, virtual_clock=clock).start(
        grid, initial_arrays(), max_updates=max_updates, eval_every=max_updates
    )


def test_a_node_1000x_slower_is_named_with_its_count(tmp_path, caplog):
    report = run(1000.0, 3000).report
    applied = {pid: node["updates_applied"] for pid, node in report.per_node.items()}
    # The seeded slow set is partition 1 (node 2); the budget of 3000 updates (two fast
    # nodes, 1 s each) ends at about t = 1500 s, the slow node takes 1000 s per update.
    assert applied == {
        "node 1 (partition 0)": 1499,
        "node 2 (partition 1)": 2,
        "node 3 (partition 2)": 1499,
    }
    expected = (
        "node 2 (partition 1): only 2 of the 3000 updates taken into the model (applied or "
        "deferred) came from it, below 10% of its fair share 1000.0 (3000 / 3 nodes): its "
        "data barely reach the model (a slow or failing node; see per_node in summary.json)"
    )
    assert report.warnings == [expected]
    assert expected in caplog.text
    summary = run_outputs.summarize([], report.counters, {}, 0.0, 0, 0.0, 0.0, report=report)
    run_outputs.write_summary(tmp_path, summary)
    assert json.loads((tmp_path / "summary.json").read_text())["warnings"] == [expected]


def test_a_node_4x_slower_keeps_its_share():
    assert (LOW_SHARE, MIN_FAIR_SHARE) == (0.1, 10)
    # 4x slower: 1/9 of the updates, above 10% of the fair share 1/3.
    report = run(4.0, 300).report
    assert report.per_node["node 2 (partition 1)"]["updates_applied"] == 34
    assert report.warnings == []


def stats_with(applied: dict[int, int], excluded: frozenset[int] = frozenset()):
    """NodeStats with ``applied`` updates per partition, finished over those nodes."""
    stats = NodeStats()
    for pid, n in applied.items():
        stats.count(pid, "updates_applied", n)
    nodes = {
        pid: SimpleNamespace(
            node_id=pid + 1,
            name=f"node {pid + 1} (partition {pid})",
            excluded="x" if pid in excluded else "",
        )
        for pid in applied
    }
    stats.finish(None, SimpleNamespace(nodes=nodes))
    return stats.warnings


def test_the_share_is_judged_from_a_fair_share_of_ten_updates_over_the_unexcluded_nodes():
    # 29 updates over 3 nodes: a fair share of 9.67 < MIN_FAIR_SHARE, not judged
    # although partition 1 has none of them; 30: judged.
    assert stats_with({0: 15, 1: 0, 2: 14}) == []
    assert [w[:48] for w in stats_with({0: 15, 1: 0, 2: 15})] == [
        "node 2 (partition 1): only 0 of the 30 updates t"
    ]
    # 2 of 60 is 10% of the fair share 20: at the fraction, not below it.
    assert stats_with({0: 29, 1: 2, 2: 29}) == []
    # An excluded node was named with its reason: not again, nor counted in the share.
    assert stats_with({0: 30, 1: 0, 2: 30}, excluded=frozenset({1})) == []
