"""Write docs/REFERENCE.md, the arguments reference, from the declarations in the code.

Usage::

    python scripts/write_reference.py                                # print it
    python scripts/write_reference.py --write docs/REFERENCE.md      # write it
    python scripts/write_reference.py --check docs/REFERENCE.md      # exit 1 if it differs

Nothing in the page is written by hand: the strategy arguments come from the signature
and docstring of :class:`flwr_gsgm.AsyncStrategy`, the bounds every rule declares on
the base class and the fields of ``EngineSettings`` (the strategy's ``engine``
argument); the server rules' parameters from their ``PARAMS`` declarations in
:mod:`flwr_gsgm.core` (:func:`flwr_gsgm.core.declared_params`); the run config keys
from ``serverapp.app_config.RUN_CONFIG`` (the library's keys and this app's), whose server
optimizer rows come from the same declarations.
After adding a rule, a parameter or a run config key, run it with ``--write`` (and add
new keys to ``pyproject.toml``); ``tests/packaging/test_reference.py`` fails while the
committed page differs from what this script writes.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flwr_gsgm import STRATEGIES, AsyncStrategy  # noqa: E402
from flwr_gsgm.core import OPTIMIZERS, Param, declared_params  # noqa: E402
from flwr_gsgm.engine.settings import EngineSettings  # noqa: E402
from serverapp.app_config import RUN_CONFIG  # noqa: E402

HEADER = ["| key | default | accepted values | meaning |", "|---|---|---|---|"]
STRATEGY_HEADER = [
    "| argument | of | default | run config key | meaning |",
    "|---|---|---|---|---|",
]
RULE_HEADER = [
    "| keyword | default | accepted values | run config key | meaning |",
    "|---|---|---|---|---|",
]
CLASSES_HEADER = [
    "| strategy | `strategy` run config value | server rule | what |",
    "|---|---|---|---|",
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
#: The core's name of a parameter -> the strategies' keyword (as Flower's FedAvgM).
_RENAME = {"lr": "server_learning_rate"}


def shown(value: Any) -> str:
    """A default as TOML writes it (``true``, ``"ema"``, ``0.5``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else repr(value)


def cell(text: str) -> str:
    """``text`` safe in a Markdown table cell (a ``|`` would end the cell)."""
    return text.replace("|", "\\|")


def table() -> list[str]:
    """The run config table's lines, header included, in RUN_CONFIG order."""
    rows = [
        f"| `{k}` | `{shown(s.default)}` | {cell(s.expected)} | {cell(s.help)} |"
        for k, s in RUN_CONFIG.items()
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
    return f"| `{name}` | {of} | `{default!r}` | {f'`{key}`' if key else '-'} | {cell(text)} |"


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


def _summary(obj: Any) -> str:
    """The first line of ``obj``'s docstring, in Markdown."""
    line = inspect.cleandoc(obj.__doc__ or "").splitlines()[0] if obj.__doc__ else ""
    return re.sub(r":\w+:`~?([^`]+)`", r"`\1`", line).replace("``", "`")


def classes_table() -> list[str]:
    """One row per strategy class of :data:`flwr_gsgm.STRATEGIES`, in registry order."""
    rows = []
    for rule, cls in STRATEGIES.items():
        core = OPTIMIZERS[rule]
        where = f"`{core.__module__}.{core.__name__}`"
        rows.append(f"| `{cls.__name__}` | `{shown(rule)}` | {where} | {cell(_summary(core))} |")
    return CLASSES_HEADER + rows


def rule_default(param: Param) -> str:
    """``param``'s declared default as Python writes it (both, for a per-mode one)."""
    if param.displacement_default is not None:
        return (
            f"`{param.default!r}` (gradient mode), "
            f"`{param.displacement_default!r}` (delta and weights modes)"
        )
    return f"`{param.default!r}`"


def rule_table(rule: str) -> list[str]:
    """The table of rule ``rule``'s declared parameters (base ones included), header first."""
    rows = []
    for p in declared_params(rule):
        accepted = p.expected() + (" or None" if p.optional else "")
        key = f"`{p.run_config_key}`" if p.run_config_key else "-"
        doc = cell(f"{p.doc[:1].upper()}{p.doc[1:]}.")
        name = _RENAME.get(p.name, p.name)
        rows.append(f"| `{name}` | {rule_default(p)} | {cell(accepted)} | {key} | {doc} |")
    return RULE_HEADER + rows


INTRO = """\
# Reference: strategy arguments, server rule parameters, run config keys

<!-- Generated by `python scripts/write_reference.py --write docs/REFERENCE.md`: do not
edit by hand. tests/packaging/test_reference.py fails while this page differs from
what the script writes. -->

Every table below is generated from the declarations in the code
([`scripts/write_reference.py`](../scripts/write_reference.py)), so the defaults shown
are the ones the code uses. The prose (what to choose, and why) is in
[USER_GUIDE.md](USER_GUIDE.md); the rules themselves in [GSGM.md](GSGM.md)."""

STRATEGY_INTRO = """\
## Strategy arguments

Every strategy (`GSGM(...)`, `ASGD(...)`, ...) takes the keywords below, plus its
rule's own parameters (next section); the engine's settings go in
`engine=EngineSettings(...)`. Budgets, evaluation points, the clock and the seed of the
engine are set by `start()` and by the strategy's own arguments."""

CLASSES_INTRO = """\
## Strategies and their server rules

One strategy class per registered rule (`flwr_gsgm.STRATEGIES`); each takes the
keywords of the section above and its rule's parameters below."""

RULES_INTRO = """\
## Server rule parameters

Each rule's `PARAMS` (and the three every rule declares on the base class:
`server_learning_rate`, `max_staleness`, `max_norm`), as keywords of its strategy. A
parameter not given takes its declared default; the server learning rate has one per
kind of update (docs/GSGM.md, "Client modes"). In the run config, `0` of an optional
number stands for None, and `server-learning-rate = 0` for the rule's own default."""

RUN_CONFIG_INTRO = """\
## Run config keys

Set in `pyproject.toml` `[tool.flwr.app.config]`, override with
`flwr run . --run-config 'key=value ...'` (or `make run RUN_CONFIG='...'`). A bad
value stops the run before training with a message naming the key. The server
optimizer rows come from the rules' declarations above."""


def page() -> str:
    """The whole of docs/REFERENCE.md."""
    parts = [INTRO, STRATEGY_INTRO, "\n".join(strategy_table()), CLASSES_INTRO]
    parts.append("\n".join(classes_table()))
    parts.append(RULES_INTRO)
    for rule, cls in STRATEGIES.items():
        parts.append(f"### `{cls.__name__}` (`{rule}`)")
        parts.append("\n".join(rule_table(rule)))
    parts += [RUN_CONFIG_INTRO, "\n".join(table())]
    return "\n\n".join(parts) + "\n"


#: The generated tables, by header line (the tests look rows up in the page).
TABLES: dict[str, Callable[[], list[str]]] = {
    HEADER[0]: table,
    STRATEGY_HEADER[0]: strategy_table,
    CLASSES_HEADER[0]: classes_table,
}


def check(path: Path) -> list[str]:
    """The unified diff from ``path`` to :func:`page` (empty when they agree)."""
    current = path.read_text() if path.is_file() else ""
    return list(
        difflib.unified_diff(
            current.splitlines(),
            page().splitlines(),
            f"{path} (committed)",
            f"{path} (generated)",
            lineterm="",
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", metavar="PATH", help="write the page to PATH")
    group.add_argument("--check", metavar="PATH", help="exit 1 if PATH differs from the page")
    args = parser.parse_args(argv)
    if args.write:
        Path(args.write).write_text(page())
        print(f"[write_reference] wrote {args.write}")
    elif args.check:
        diff = check(Path(args.check))
        if diff:
            print("\n".join(diff))
            print(f"[write_reference] {args.check} is stale: run with --write {args.check}")
            return 1
        print(f"[write_reference] {args.check} is up to date")
    else:
        sys.stdout.write(page())
    return 0


if __name__ == "__main__":
    sys.exit(main())
