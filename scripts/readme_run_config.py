"""Print the README's generated tables: the run config and the strategy's arguments.

Usage: ``python scripts/readme_run_config.py`` (prints both tables), or
``python scripts/readme_run_config.py --write README.md`` (replaces, in place, the
table under each header line below). The run config rows come from
:data:`serverapp.app_config.RUN_CONFIG` (the library's keys and the app's), whose server
optimizer rows come from the rules' declarations, so after adding a rule or a parameter, run it with
``--write``, and add the new keys to ``pyproject.toml``
(``tests/engine/test_run_config.py`` checks both). The strategy rows come from the
signature and docstring of :class:`flwr_gsgm.strategy.async_strategy.AsyncStrategy`, the
bounds every rule declares on the base class, and the fields of
:class:`flwr_gsgm.engine.settings.EngineSettings` (its ``engine`` argument).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flwr_gsgm.core import declared_params  # noqa: E402
from flwr_gsgm.engine.settings import EngineSettings  # noqa: E402
from flwr_gsgm.strategy.async_strategy import AsyncStrategy  # noqa: E402
from serverapp.app_config import RUN_CONFIG  # noqa: E402

HEADER = ["| key | default | accepted values | meaning |", "|---|---|---|---|"]
STRATEGY_HEADER = [
    "| argument | of | default | run config key | meaning |",
    "|---|---|---|---|---|",
]
#: Set by ``start()`` (budgets, evaluation points) or by the strategy's own arguments.
_SET_BY_START = (
    "max_updates",
    "max_seconds",
    "eval_every",
    "virtual_clock",
    "seed",
    "federated_evaluation",
)
#: The bounds every rule declares on the base class (``lr`` is ``server_learning_rate``).
_BOUNDS = ("max_staleness", "max_norm")


def shown(value: Any) -> str:
    """A default as TOML writes it (``true``, ``"ema"``, ``0.5``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else repr(value)


def table() -> list[str]:
    """The run config table's lines, header included, in RUN_CONFIG order."""
    rows = [
        f"| `{k}` | `{shown(s.default)}` | {s.expected} | {s.help} |" for k, s in RUN_CONFIG.items()
    ]
    return HEADER + rows


def _described(docstring: str, section: str) -> dict[str, str]:
    """``name -> description`` of a numpydoc ``section`` ("Parameters", "Attributes")."""
    lines = inspect.cleandoc(docstring).splitlines()
    start = lines.index(section) + 2
    out: dict[str, str] = {}
    names: list[str] = []
    for line in lines[start:]:
        if line and not line.startswith(" "):
            if " : " not in line and not line.startswith("**"):
                break  # the next section
            names = [n.strip() for n in line.split(" : ")[0].split(",")]
            for name in names:
                out[name] = ""
        elif line.strip():
            for name in names:
                out[name] = (out[name] + " " + line.strip()).strip()
    return out


def _first_sentence(text: str) -> tuple[str, str | None]:
    """The first sentence of ``text`` in Markdown, and the run config key it names in
    brackets (``[``key``]``), if any."""
    key = re.search(r"\[``([a-z-]+)``", text)
    text = re.sub(r"\s*\[``[a-z-]+``[^\]]*\]", "", text)
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text).replace("``", "`")
    match = re.match(r"(.+?\.)(\s+[A-Z(]|$)", text)
    return (match.group(1) if match else text), (key.group(1) if key else None)


def _row(name: str, of: str, default: Any, key: str | None, text: str) -> str:
    key = key or (name.replace("_", "-") if name.replace("_", "-") in RUN_CONFIG else None)
    return f"| `{name}` | {of} | `{shown(default)}` | {f'`{key}`' if key else '-'} | {text} |"


def strategy_table() -> list[str]:
    """The table of the strategy's constructor arguments, header included."""
    rows = []
    params = _described(AsyncStrategy.__doc__ or "", "Parameters")
    for name, p in inspect.signature(AsyncStrategy.__init__).parameters.items():
        keyword = p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        if keyword and name not in ("self", "optimizer"):
            text, key = _first_sentence(params[name])
            rows.append(_row(name, "`GSGM(...)`, `ASGD(...)`, ...", p.default, key, text))
    for param in declared_params("gsgm"):
        if param.name in _BOUNDS:
            doc = f"{param.doc[0].upper()}{param.doc[1:]} (None = no bound)."
            rows.append(_row(param.name, "every strategy", param.default, None, doc))
    fields = _described(EngineSettings.__doc__ or "", "Attributes")
    for f in dataclasses.fields(EngineSettings):
        if f.name not in _SET_BY_START:
            text, key = _first_sentence(fields[f.name])
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            rows.append(_row(f.name, "`EngineSettings(...)`", default, key, text))
    return STRATEGY_HEADER + rows


TABLES: dict[str, Callable[[], list[str]]] = {HEADER[0]: table, STRATEGY_HEADER[0]: strategy_table}


def write(readme: Path) -> None:
    """Replace each table of :data:`TABLES` in ``readme`` (found by its header line).

    Raises:
        ValueError: the README lacks one of the tables.
    """
    lines = readme.read_text().splitlines()
    for header, make in TABLES.items():
        try:
            start = lines.index(header)
        except ValueError:
            raise ValueError(f"{readme}: no line {header!r}") from None
        end = start
        while end < len(lines) and lines[end].startswith("|"):
            end += 1
        lines = lines[:start] + make() + lines[end:]
    readme.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write"]:
        write(Path(sys.argv[2]))
    else:
        print("\n".join(table() + [""] + strategy_table()))
