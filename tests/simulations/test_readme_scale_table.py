"""The results index's "At scale" table is generated from the committed runs.csv."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from simulations.results import read_csv

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "readme_scale_table", ROOT / "scripts" / "readme_scale_table.py"
)
scale_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scale_table)


def _row(method, nodes, limit, seed, status, acc):
    return {
        "method": method,
        "nodes": nodes,
        "max_in_flight": limit,
        "partition": "k2",
        "seed": seed,
        "status": status,
        "final_accuracy": acc,
        "masd": 0.01,
    }


def test_cells_hand_computed():
    rows = [
        _row("gsgm", 10, 10, 1, "ok", 0.80),
        _row("gsgm", 10, 10, 2, "ok", 0.84),  # 82.0 ± 2.8
        _row("asgd", 10, 10, 1, "ok", 0.83),
        _row("asgd", 10, 10, 2, "diverged", 0.10),  # 83.0, 1 of 2 diverged: the best, bold
        _row("fedavg", 10, 10, 1, "ok", 0.90),  # synchronous: never bold
        _row("gsgm", 30, 20, 1, "ok", 0.70),
        _row("asgd", 30, 20, 1, "failed", math.nan),
        _row("asgd", 30, 20, 2, "diverged", 0.10),
    ]
    lines = scale_table.table(rows)
    assert lines[0] == (
        "| nodes (in flight) | GSGM | ASGD | momentum ASGD | FedBuff | CA2FL | ACE | FedAvg |"
    )
    assert (
        lines[2] == "| 10 (all) | 82.0 ± 2.8 | **83.0** (1 of 2 diverged) | – | – | – | – | 90.0 |"
    )
    assert lines[3] == "| 30 (20) | **70.0** | 1 of 2 diverged, 1 of 2 failed | – | – | – | – | – |"


def test_replace_table_keeps_the_text_around_it_and_names_a_missing_header():
    new = [*scale_table.header(), "| 10 (all) | x |"]
    text = "intro\n\n" + "\n".join([*scale_table.header(), "| old | row |"]) + "\n\nafter\n"
    assert scale_table.replace_table(text, new) == ("intro\n\n" + "\n".join(new) + "\n\nafter\n")
    with pytest.raises(ValueError, match="header line '| nodes"):
        scale_table.replace_table("no table here\n", new)


def test_results_index_shows_the_committed_runs():
    rows = read_csv(ROOT / scale_table.RUNS_CSV)
    readme = (ROOT / "docs" / "results" / "README.md").read_text()
    expected = scale_table.table(rows)
    assert "\n".join(expected) in readme, (
        "docs/results/README.md's 'At scale' table differs from "
        "docs/results/fashion_mnist_scale/runs.csv: "
        "run python scripts/readme_scale_table.py --write docs/results/README.md"
    )
