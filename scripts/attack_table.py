"""The accuracy each lying-node attack costs each method, against its clean runs.

The table of docs/results/lying_nodes, from the lying-nodes sweep
(simulations/presets/lying_nodes.toml, whose client works are the attacks: ``clean``,
``sign-flip-1``, ``noise-3``, ...):

    python scripts/attack_table.py docs/results/lying_nodes/runs.csv

prints one Markdown table: a row per method, the median final accuracy of its clean
runs (%), then per attack the median over seeds of (clean - attacked) final accuracy
on the same seed, in percentage points (positive: the attack cost that much), with the
number of seeds. Only runs with status ``ok`` count towards the median; a seed without
both runs is left out ("–" when none has them). An attacked run that diverged (status
``diverged``, the worst an attack can do) is not dropped silently: its cell says how many
seeds diverged, e.g. ``4.2 (2), 1 diverged``.
"""

from __future__ import annotations

import argparse
import sys

import pandas as pd

CLEAN = "clean"


def loss_table(runs: pd.DataFrame) -> str:
    """The Markdown table of ``runs`` (a lying-nodes runs.csv)."""
    diverged = runs[runs["status"].eq("diverged")].groupby(["method", "client_work"]).size()
    works = sorted(runs["client_work"].unique())  # an attack whose every run diverged too
    ok = runs[runs["status"].eq("ok")]
    acc = ok.pivot_table(
        index=["method", "seed"], columns="client_work", values="final_accuracy", aggfunc="first"
    ).reindex(columns=works)
    if CLEAN not in acc.columns:
        raise ValueError(f"no {CLEAN!r} runs in the table: expected the client work {CLEAN!r}")
    attacks = [c for c in acc.columns if c != CLEAN]
    head = "| method | clean (%) | " + " | ".join(f"{a} (pp)" for a in attacks) + " |"
    lines = [head, "|---" * (2 + len(attacks)) + "|"]
    for method, rows in acc.groupby(level="method", sort=True):
        clean = rows[CLEAN]
        cells = [_cell(100 * clean.median(), clean.notna().sum())]
        for attack in attacks:
            loss = 100 * (clean - rows[attack])
            lost = int(diverged.get((method, attack), 0))
            cells.append(_cell(loss.median(), loss.notna().sum(), lost))
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value: float, seeds: int, diverged: int = 0) -> str:
    text = "–" if seeds == 0 else f"{value:.1f} ({seeds})"
    if diverged:
        return f"{text}, {diverged} diverged" if seeds else f"{diverged} diverged"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs_csv", help="a lying-nodes sweep's runs.csv")
    args = parser.parse_args(argv)
    try:
        print(loss_table(pd.read_csv(args.runs_csv)))
    except (OSError, ValueError, KeyError) as err:
        print(f"attack_table: {args.runs_csv}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
