"""Impossible partitions (issue 12 item 3) and the split's warnings in summary.json.

Before, ``dirichlet-alpha=0.01`` with 30 nodes made every node fail while
partitioning; the server idled the full reply-timeout and failed with "only 0
node(s) answered". The ServerApp now computes the split the nodes will compute
(a pure function of the labels and the run config) before any message.
"""

from __future__ import annotations

import json

import pytest

from clients.client_app import app as client_app
from clients.partitioning import ImpossiblePartitioning
from flwr_gsgm.simulation.inprocess_grid import InProcessGrid
from serverapp.app_config import parse_app_config
from serverapp.experiment import run_experiment


class CountingGrid(InProcessGrid):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pushed = 0

    def push_messages(self, messages):
        messages = list(messages)
        self.pushed += len(messages)
        return super().push_messages(messages)


def test_an_infinite_dirichlet_alpha_is_refused_by_name():
    with pytest.raises(ValueError) as info:
        parse_app_config({"partitioner": "dirichlet", "dirichlet-alpha": float("inf")})
    assert str(info.value) == "run config dirichlet-alpha=inf: expected > 0, a finite number"
    with pytest.raises(ValueError, match=r"run config local-lr=inf: expected > 0, a finite"):
        parse_app_config({"local-lr": float("inf")})


def test_an_impossible_split_fails_in_the_serverapp_before_any_message(tmp_path):
    cfg = parse_app_config({"partitioner": "dirichlet", "dirichlet-alpha": 0.01, "max-updates": 30})
    grid = CountingGrid(client_app, 30, run_config=cfg)
    with pytest.raises(ImpossiblePartitioning) as info:
        run_experiment(grid, cfg, tmp_path / "run")
    assert str(info.value) == (
        "dirichlet-alpha=0.01 with num-partitions=30 cannot give every node 5 examples: the "
        "first draw leaves partition 7 with 0 of 60000 (flwr-datasets' DirichletPartitioner "
        "gave up after 10 draws). Raise dirichlet-alpha (dirichlet-alpha=0.1 gives every node "
        "at least 5 at its first draw) or use fewer nodes"
    )
    assert grid.pushed == 0  # not even the start-up query
    assert not (tmp_path / "run").exists()


def test_the_pathological_split_warning_lands_in_summary_json(tmp_path):
    # 5 nodes, 2 classes each: the deterministic assignment uses classes 0..5 only.
    cfg = parse_app_config({"max-updates": 10, "eval-every": 10, "eval-examples": 200})
    with InProcessGrid(client_app, 5, run_config=cfg) as grid:
        summary = run_experiment(grid, cfg, tmp_path / "run")
    expected = [
        "pathological partitioning with num-partitions=5 and classes-per-node=2 uses only "
        "classes 0..5 of 10"
    ]
    assert summary["warnings"] == expected
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["warnings"] == expected
    assert summary["updates_received"] == 10
