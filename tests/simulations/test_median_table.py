"""scripts/median_table.py: medians over seeds by hand."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("median_table", ROOT / "scripts" / "median_table.py")
median_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(median_table)
median_tables = median_table.median_tables


def run(method, seed, final, at5, at20, time, budget, status="ok"):
    return {
        "method": method,
        "seed": seed,
        "status": status,
        "partition": "dir1",
        "device_profile": "loopback",
        "nodes": 10,
        "max_in_flight": 10,
        "final_accuracy": final,
        "accuracy_at_5_rounds": at5,
        "accuracy_at_20_rounds": at20,
        "time_to_fedavg_accuracy": time,
        "accuracy_at_fedavg_budget": budget,
    }


def test_medians_per_method_fedavg_first_nan_left_out_failed_runs_ignored():
    runs = pd.DataFrame(
        [
            run("gsgm", 1, 0.80, 0.70, 0.82, 30.0, 0.81),
            run("gsgm", 2, 0.84, 0.74, 0.80, math.nan, 0.85),
            run("gsgm", 3, 0.82, 0.72, 0.90, 20.0, 0.83),
            run("gsgm", 4, 0.10, 0.10, 0.10, 1.0, 0.10, status="failed"),
            run("fedavg", 1, 0.79, 0.73, math.nan, 61.0, 0.80),
        ]
    )
    lines = median_tables(runs).splitlines()
    assert lines[0] == "### dir1, loopback, 10, 10"
    # gsgm: medians of (80, 84, 82) = 82.0, (70, 74, 72) = 72.0, (82, 80, 90) = 82.0;
    # time: median of 30 and 20 (seed 2 never reached it) = 25.0; budget 83.0
    assert lines[4] == "| fedavg | 1 | 79.0 | 73.0 | – | 61.0 (1/1) | 80.0 |"
    assert lines[5] == "| gsgm | 3 | 82.0 | 72.0 | 82.0 | 25.0 (2/3) | 83.0 |"


def test_accuracy_at_fedavg_trainings_and_kilojoules_get_columns_when_present():
    runs = pd.DataFrame(
        [
            run("gsgm", 1, 0.80, 0.70, 0.82, 30.0, 0.81) | {"accuracy_at_fedavg_trainings": 0.75},
            run("gsgm", 2, 0.84, 0.74, 0.80, 40.0, 0.85) | {"accuracy_at_fedavg_trainings": 0.71},
            run("fedavg", 1, 0.79, 0.73, math.nan, 61.0, 0.80)
            | {"accuracy_at_fedavg_trainings": 0.78},
        ]
    )
    runs["joules_to_fedavg_accuracy"] = [1500.0, 2500.0, 9000.0]
    lines = median_tables(runs).splitlines()
    assert lines[2].endswith("| at FedAvg's trainings (%) | kJ to FedAvg's final accuracy |")
    # gsgm: median of (75, 71) = 73.0; kJ: median of 1.5 and 2.5 = 2.0
    assert lines[4] == "| fedavg | 1 | 79.0 | 73.0 | – | 61.0 (1/1) | 80.0 | 78.0 | 9.0 |"
    assert lines[5] == "| gsgm | 2 | 82.0 | 72.0 | 81.0 | 35.0 (2/2) | 83.0 | 73.0 | 2.0 |"
