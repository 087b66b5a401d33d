"""Print the README's run config table from :data:`flwr_gsgm.run_config.RUN_CONFIG`.

Usage: ``python scripts/readme_run_config.py`` (prints the table), or
``python scripts/readme_run_config.py --write README.md`` (replaces the table under
``## Run config`` in place). The server optimizer rows come from the rules'
declarations, so after adding a rule or a parameter, run it with ``--write``, and
add the new keys to ``pyproject.toml`` (``tests/engine/test_run_config.py`` checks
both).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flwr_gsgm.run_config import RUN_CONFIG  # noqa: E402

HEADER = ["| key | default | accepted values | meaning |", "|---|---|---|---|"]


def shown(value: Any) -> str:
    """A default as TOML writes it (``true``, ``"ema"``, ``0.5``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else repr(value)


def table() -> list[str]:
    """The table's lines, header included, in RUN_CONFIG order."""
    rows = [
        f"| `{k}` | `{shown(s.default)}` | {s.expected} | {s.help} |" for k, s in RUN_CONFIG.items()
    ]
    return HEADER + rows


def write(readme: Path) -> None:
    """Replace the table that follows ``HEADER[0]`` in ``readme``.

    Raises:
        ValueError: the README has no such table.
    """
    lines = readme.read_text().splitlines()
    try:
        start = lines.index(HEADER[0])
    except ValueError:
        raise ValueError(f"{readme}: no line {HEADER[0]!r}") from None
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    readme.write_text("\n".join(lines[:start] + table() + lines[end:]) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write"]:
        write(Path(sys.argv[2]))
    else:
        print("\n".join(table()))
