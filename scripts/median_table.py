"""The median over seeds of a results page's runs.csv, per setting and method.

The targets of docs/results/fashion_mnist_fleet are medians of seeds 1-3 (the generated
RESULTS.md gives means):

    python scripts/median_table.py docs/results/fashion_mnist_fleet/runs.csv

prints one Markdown table per (partition, device profile, fleet, nodes, in flight): each
method's median final accuracy, accuracy at 5 and 20 rounds' worth of client trainings
(%), virtual seconds to FedAvg's final accuracy (with how many seeds reached it),
accuracy at FedAvg's budget (%), where runs.csv has it the accuracy at the client
trainings FedAvg's run received (%; FedAvg's rounds that lost replies held fewer than
a round's worth each) and, for runs with a device-power model, the fleet's kilojoules
to FedAvg's final accuracy. Only runs with status ``ok`` count; an empty or NaN
cell is left out of its median ("–" when no seed has it).
"""

from __future__ import annotations

import argparse
import sys

import pandas as pd

SETTING = ["partition", "device_profile", "fleet", "nodes", "max_in_flight"]
PERCENT = ["final_accuracy", "accuracy_at_5_rounds", "accuracy_at_20_rounds"]


def median_tables(runs: pd.DataFrame) -> str:
    """Markdown tables of the medians of ``runs`` (a page's runs.csv), FedAvg first."""
    runs = runs[runs["status"].eq("ok")]
    setting_columns = [c for c in SETTING if c in runs and runs[c].notna().any()]
    energy = "joules_to_fedavg_accuracy" in runs and runs["joules_to_fedavg_accuracy"].notna().any()
    trainings = (
        "accuracy_at_fedavg_trainings" in runs
        and runs["accuracy_at_fedavg_trainings"].notna().any()
    )
    out = []
    for setting, rows in runs.groupby(setting_columns, sort=True):
        out += [f"### {', '.join(str(v) for v in setting)}", ""]
        out += [
            "| method | seeds | final accuracy (%) | at 5 rounds (%) | at 20 rounds (%) "
            "| s to FedAvg's final accuracy | accuracy at FedAvg's budget (%) |"
            + (" at FedAvg's trainings (%) |" if trainings else "")
            + (" kJ to FedAvg's final accuracy |" if energy else ""),
            "|---|---|---|---|---|---|---|"
            + ("---|" if trainings else "")
            + ("---|" if energy else ""),
        ]
        order = sorted(rows["method"].unique(), key=lambda m: (m != "fedavg", m))
        for method in order:
            mine = rows[rows["method"].eq(method)]
            cells = [_cell(100 * mine[c].median()) for c in PERCENT]
            reached = int(mine["time_to_fedavg_accuracy"].notna().sum())
            time = _cell(mine["time_to_fedavg_accuracy"].median())
            budget = _cell(100 * mine["accuracy_at_fedavg_budget"].median())
            per_training = (
                f" {_cell(100 * mine['accuracy_at_fedavg_trainings'].median())} |"
                if trainings
                else ""
            )
            kilojoules = (
                f" {_cell(mine['joules_to_fedavg_accuracy'].median() / 1000)} |" if energy else ""
            )
            out.append(
                f"| {method} | {len(mine)} | {' | '.join(cells)} | {time} ({reached}/{len(mine)})"
                f" | {budget} |{per_training}{kilojoules}"
            )
        out.append("")
    return "\n".join(out)


def _cell(value: float) -> str:
    return "–" if pd.isna(value) else f"{value:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs_csv", help="a results page's runs.csv")
    args = parser.parse_args(argv)
    print(median_tables(pd.read_csv(args.runs_csv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
