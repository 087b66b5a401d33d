"""docs/REFERENCE.md is what scripts/write_reference.py writes, and every default the
docstrings state is the declared one (issue 25 item 5).

The declared defaults are read from the code (the rules' ``PARAMS``, the signature of
``AsyncStrategy``, the fields of ``EngineSettings``, ``RUN_CONFIG``), never written here.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
import re
from pathlib import Path

import pytest

from flwr_gsgm import STRATEGIES, AsyncStrategy
from flwr_gsgm.core import Param, declared_params
from flwr_gsgm.engine.settings import EngineSettings
from serverapp.app_config import RUN_CONFIG  # the library's keys and the app's

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "REFERENCE.md"
_spec = importlib.util.spec_from_file_location(
    "write_reference", ROOT / "scripts" / "write_reference.py"
)
write_reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(write_reference)


def test_the_committed_reference_is_the_generated_one():
    diff = write_reference.check(REFERENCE)
    assert not diff, (
        "docs/REFERENCE.md is stale: run python scripts/write_reference.py --write "
        "docs/REFERENCE.md\n" + "\n".join(diff[:40])
    )


def test_check_mode_exits_1_on_a_stale_page_and_0_on_a_fresh_one(tmp_path, capsys):
    page = tmp_path / "REFERENCE.md"
    assert write_reference.main(["--write", str(page)]) == 0
    assert write_reference.main(["--check", str(page)]) == 0
    page.write_text(page.read_text().replace("| `beta` |", "| `beta2` |", 1))
    assert write_reference.main(["--check", str(page)]) == 1
    out = capsys.readouterr().out
    assert "-| `beta2` |" in out and "+| `beta` |" in out and "is stale" in out


def test_a_per_mode_default_and_a_pipe_are_shown_hand_made():
    lr = Param("lr", 0.1, "d", low=0.0, low_open=True, rule_default=True, displacement_default=0.25)
    assert write_reference.rule_default(lr) == (
        "`0.1` (gradient mode), `0.25` (delta and weights modes)"
    )
    assert write_reference.rule_default(Param("k", 5, "d", kind=int)) == "`5`"
    assert write_reference.cell("min(|A|, c)") == "min(\\|A\\|, c)"


def _rows(text: str) -> dict[str, list[str]]:
    """First cell (without backticks) -> the row's cells, for every table row of ``text``."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            rows.setdefault(cells[0].strip("`"), cells)
    return rows


def test_reference_shows_every_declared_rule_default():
    text = REFERENCE.read_text()
    for rule, cls in STRATEGIES.items():
        section = text.split(f"### `{cls.__name__}` (`{rule}`)\n", 1)[1].split("\n#", 1)[0]
        rows = _rows(section)
        for p in declared_params(rule):
            name = "server_learning_rate" if p.name == "lr" else p.name
            shown = rows[name][1]
            assert shown.startswith(f"`{p.default!r}`"), (rule, name, shown)
            if p.displacement_default is not None:
                assert f"`{p.displacement_default!r}` (delta and weights modes)" in shown


def test_reference_shows_every_strategy_and_engine_default():
    rows = _rows(REFERENCE.read_text().split("## Strategy arguments", 1)[1])
    for name, p in inspect.signature(AsyncStrategy.__init__).parameters.items():
        if name not in ("self", "optimizer") and p.kind is p.KEYWORD_ONLY:
            assert rows[name][2] == f"`{p.default!r}`", name
    for f in dataclasses.fields(EngineSettings):
        if f.name in rows and rows[f.name][1] == "`EngineSettings(...)`":
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            assert rows[f.name][2] == f"`{default!r}`", f.name


def _described(doc: str, section: str) -> dict[str, str]:
    return write_reference._described(doc, section)


def _literal(token: str):
    return ast.literal_eval(token.strip("`:,;"))


def _stated_defaults(descriptions: dict[str, str]) -> dict[str, str]:
    """``name -> token`` for every description that says ``<token> (default)`` or
    ``<token> (the default...``."""
    stated = {}
    for name, text in descriptions.items():
        match = re.search(r"(\S+)\s+\((?:the )?default\b", text)
        if match:
            stated[name] = match[1]
    return stated


def test_stated_defaults_hand_made():
    found = _stated_defaults({"a": "passes; 0 (default): steps", "b": 'or "auto" (the default:'})
    assert {k: _literal(v) for k, v in found.items()} == {"a": 0, "b": "auto"}


def test_async_strategy_docstring_states_the_signature_defaults():
    params = inspect.signature(AsyncStrategy.__init__).parameters
    stated = _stated_defaults(_described(AsyncStrategy.__doc__, "Parameters"))
    assert {"local_momentum", "trainable_keys"} <= set(stated)
    for name, token in stated.items():
        if name in params:
            assert _literal(token) == params[name].default, name


def test_async_strategy_docstring_states_each_rules_learning_rates():
    # "(GSGM: 0.1 and 0.25 per cycle, ...; ASGD 0.02 and 0.05": gradient, then displacement.
    text = _described(AsyncStrategy.__doc__, "Parameters")["server_learning_rate"]
    by_class = {cls.__name__: rule for rule, cls in STRATEGIES.items()}
    pairs = re.findall(r"\b([A-Z][\w]*):? (\d[\d.]*) and (\d[\d.]*)", text)
    assert {name for name, _, _ in pairs} >= {"GSGM", "ASGD"}
    for name, gradient, displacement in pairs:
        lr = next(p for p in declared_params(by_class[name]) if p.name == "lr")
        assert (float(gradient), float(displacement)) == (lr.default, lr.displacement_default)


def test_engine_settings_docstring_states_the_field_defaults():
    fields = {f.name: f for f in dataclasses.fields(EngineSettings)}
    described = _described(EngineSettings.__doc__, "Attributes")
    stated = _stated_defaults(described)
    assert {"query_partition_ids", "dispatch"} <= set(stated)
    for name, token in stated.items():
        assert _literal(token) == fields[name].default, name
    # "base 1 s, factor 2, cap 60 s": Backoff's own fields.
    backoff = dict(re.findall(r"\b(base|factor|cap) (\d[\d.]*)", described["backoff"]))
    assert set(backoff) == {"base", "factor", "cap"}
    for name, value in backoff.items():
        assert float(value) == getattr(type(EngineSettings().backoff)(), name), name


@pytest.mark.parametrize("rule", list(STRATEGIES))
def test_strategy_docstrings_list_the_declared_defaults(rule):
    doc = STRATEGIES[rule].__doc__
    for p in declared_params(rule):
        name = "server_learning_rate" if p.name == "lr" else p.name
        match = re.search(rf"^\s*{name} : [\w| ]+ = (.+)$", doc, re.M)
        assert match, (rule, name)
        assert _literal(match[1].split(" (gradient mode)")[0]) == p.default, (rule, name)


def test_gsgm_docstring_prose_states_the_declared_defaults():
    # "beta 0.5, quorum 0.5, averaging="auto" ..., lr_scaling="cycle", and
    # server_learning_rate=0.1 per cycle in gradient mode"
    prose = inspect.cleandoc(STRATEGIES["gsgm"].__doc__).split("Declared parameters")[0]
    prose = " ".join(prose.split())
    declared = {
        ("server_learning_rate" if p.name == "lr" else p.name): p for p in declared_params("gsgm")
    }
    checked = []
    for name, p in declared.items():
        # the name's last word too ("quorum 0.5"), unless it is a short English word
        # ("at" of apply_at: "at 10 nodes")
        words = (name, name.split("_")[-1]) if len(name.split("_")[-1]) > 2 else (name,)
        for word in dict.fromkeys(words):
            for value in re.findall(rf"\b{word}(?:=| )(\"[^\"]*\"|\d[\d.]*)", prose):
                assert _literal(value) == p.default, (name, value)
                checked.append(name)
    assert {"beta", "cycle_quorum", "averaging", "lr_scaling", "server_learning_rate"} <= set(
        checked
    )


DOC_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_run_config_defaults_stated_in_the_docs_are_the_declared_ones():
    # "`dispatch-timeout` (300 s)", "`max-consecutive-rejections` (10)", ...
    checked = set()
    for page in DOC_PAGES:
        text = page.read_text()
        for key, value in re.findall(r"`([a-z][a-z-]+)`\s+\((\d[\d.]*)(?: s)?\)", text):
            if key in RUN_CONFIG:
                default = RUN_CONFIG[key].default
                assert float(value) == default, (
                    f"{page.name}: `{key}` ({value}), declared {default}"
                )
                checked.add(key)
    assert {"dispatch-timeout", "rejoin-timeout", "max-consecutive-rejections"} <= checked
