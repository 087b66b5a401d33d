"""scripts/attack_table.py: each attack's accuracy loss against the clean run, by hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("attack_table", ROOT / "scripts" / "attack_table.py")
attack_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(attack_table)


def run(method, work, seed, final, status="ok"):
    return {
        "method": method,
        "client_work": work,
        "seed": seed,
        "final_accuracy": final,
        "status": status,
    }


def test_losses_are_paired_by_seed_and_their_median_taken():
    runs = pd.DataFrame(
        [
            run("gsgm", "clean", 1, 0.80),
            run("gsgm", "clean", 2, 0.84),
            run("gsgm", "clean", 3, 0.82),
            # losses 10, 2, 6 pp: median 6
            run("gsgm", "sign-flip-1", 1, 0.70),
            run("gsgm", "sign-flip-1", 2, 0.82),
            run("gsgm", "sign-flip-1", 3, 0.76),
            run("fedavg", "clean", 1, 0.78),
            run("fedavg", "clean", 2, 0.80),
            # seed 2 failed: one pair only, 78 - 75 = 3 pp
            run("fedavg", "sign-flip-1", 1, 0.75),
            run("fedavg", "sign-flip-1", 2, 0.10, status="failed"),
        ]
    )
    assert attack_table.loss_table(runs).splitlines() == [
        "| method | clean (%) | sign-flip-1 (pp) |",
        "|---|---|---|",
        "| fedavg | 79.0 (2) | 3.0 (1) |",
        "| gsgm | 82.0 (3) | 6.0 (3) |",
    ]


def test_an_attacked_run_that_diverged_is_counted_not_dropped():
    runs = pd.DataFrame(
        [
            run("gsgm", "clean", 1, 0.80),
            run("gsgm", "clean", 2, 0.84),
            run("gsgm", "clean", 3, 0.82),
            # seed 1 diverged; seeds 2 and 3 lost 4 and 2 pp: median 3
            run("gsgm", "sign-flip-3", 1, 0.10, status="diverged"),
            run("gsgm", "sign-flip-3", 2, 0.80),
            run("gsgm", "sign-flip-3", 3, 0.80),
            # every seed diverged: no loss to give, only the count
            run("gsgm", "noise-3", 1, 0.10, status="diverged"),
            run("gsgm", "noise-3", 2, 0.10, status="diverged"),
        ]
    )
    assert attack_table.loss_table(runs).splitlines()[2] == (
        "| gsgm | 82.0 (3) | 2 diverged | 3.0 (2), 1 diverged |"
    )


def test_a_table_without_clean_runs_is_refused():
    runs = pd.DataFrame([run("gsgm", "noise-1", 1, 0.5)])
    with pytest.raises(ValueError, match="no 'clean' runs in the table"):
        attack_table.loss_table(runs)
