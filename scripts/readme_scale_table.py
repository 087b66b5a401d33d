"""Print (or write into docs/results/README.md) the "At scale" table from the scale runs.csv.

Usage::

    python scripts/readme_scale_table.py [RUNS_CSV] [--write docs/results/README.md]

``RUNS_CSV`` defaults to ``docs/results/fashion_mnist_scale/runs.csv`` (the rows
``python -m simulations.report`` writes beside the results page). One row per
(nodes, max-in-flight) setting, one column per method of :data:`COLUMNS`: the mean ±
sample std of the final accuracy (%) over the runs that finished ``ok``, then how many
of the setting's runs diverged or failed; ``–`` where the method did not run. The
highest mean among the asynchronous columns (all but FedAvg) is bold. With
``--write``, the table under the header line in the results index (docs/results/README.md)
is replaced in place, so the index cannot drift from the committed runs
(``tests/simulations/test_readme_scale_table.py``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulations.report import method_summary, setting_of, settings_of  # noqa: E402
from simulations.results import read_csv  # noqa: E402

#: (method in runs.csv, column title); the last is synchronous (never bold).
COLUMNS = (
    ("gsgm", "GSGM"),
    ("asgd", "ASGD"),
    ("masgd", "momentum ASGD"),
    ("fedbuff", "FedBuff"),
    ("ca2fl", "CA2FL"),
    ("ace", "ACE"),
    ("fedavg", "FedAvg"),
)
SYNCHRONOUS = ("fedavg",)
RUNS_CSV = Path("docs/results/fashion_mnist_scale/runs.csv")


def header() -> list[str]:
    """The table's header line and separator."""
    titles = ["nodes (in flight)", *(title for _, title in COLUMNS)]
    return ["| " + " | ".join(titles) + " |", "|" + "---|" * len(titles)]


def _cell(summary: dict, bold: bool) -> str:
    """``83.0 ± 0.8 (1 of 3 diverged)``, ``3 of 3 diverged`` or ``–``."""
    finished = summary["runs"] - summary["pending"]
    if not finished:
        return "–"
    lost = [f"{summary[s]} of {finished} {s}" for s in ("diverged", "failed") if summary[s]]
    fa = summary["final_accuracy"]
    if not fa.n:
        return ", ".join(lost)
    text = f"{100 * fa.mean:.1f}" + (f" ± {100 * fa.std:.1f}" if fa.n > 1 else "")
    text = f"**{text}**" if bold else text
    return text + (f" ({', '.join(lost)})" if lost else "")


def table(rows: list[dict]) -> list[str]:
    """The table's lines, header included: settings by nodes, every node in flight first."""
    lines = header()
    for setting in sorted(settings_of(rows)):
        mine = [r for r in rows if setting_of(r) == setting]
        summaries = [method_summary(mine, m) for m, _ in COLUMNS]
        asynchronous = [s for s in summaries if s["method"] not in SYNCHRONOUS]
        scored = [s for s in asynchronous if s["final_accuracy"].n]
        best = max(scored, key=lambda s: s["final_accuracy"].mean)["method"] if scored else None
        nodes, _, limit = setting
        cells = [f"{nodes} ({limit or 'all'})"]
        cells += [_cell(s, s["method"] == best) for s in summaries]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def replace_table(text: str, new: list[str]) -> str:
    """``text`` with the table that starts at :func:`header`'s first line replaced by ``new``.

    Raises:
        ValueError: the header line is not in ``text``.
    """
    lines = text.splitlines()
    try:
        start = lines.index(new[0])
    except ValueError:
        raise ValueError(f"header line {new[0]!r} not found") from None
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return "\n".join(lines[:start] + new + lines[end:]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs_csv", nargs="?", default=str(RUNS_CSV))
    parser.add_argument("--write", metavar="PAGE", help="replace the table in this file")
    args = parser.parse_args(argv)
    lines = table(read_csv(Path(args.runs_csv)))
    if args.write:
        path = Path(args.write)
        path.write_text(replace_table(path.read_text(), lines))
        print(f"[readme_scale_table] wrote {path}")
    else:
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
