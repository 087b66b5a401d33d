"""Run config validation: every bad value fails before training, naming the key."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from flwr_gsgm.config.run_config import RUN_CONFIG, parse_run_config
from flwr_gsgm.simulation.inprocess_grid import InProcessGrid
from serverapp.server_app import main
from tests.engine.quadratic_app import make_app

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_pyproject_run_config_equals_the_documented_defaults():
    app_config = tomllib.loads(PYPROJECT.read_text())["tool"]["flwr"]["app"]["config"]
    assert app_config == {k: spec.default for k, spec in RUN_CONFIG.items()}


def test_defaults_parse_to_the_main_job():
    cfg = parse_run_config({})
    assert (cfg["strategy"], cfg["dataset"], cfg["classes-per-node"]) == (
        "gsgm",
        "fashion-mnist",
        2,
    )


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("strategy", "sgd", "run config strategy='sgd': expected one of gsgm, asgd"),
        (
            "server-learning-rate",
            -0.1,
            "run config server-learning-rate=-0.1: expected 0 (the strategy's default) or > 0",
        ),
        ("local-lr", 0, "run config local-lr=0.0: expected > 0"),
        ("classes-per-node", 11, "run config classes-per-node=11: expected an integer in [1, 10]"),
        ("beta", 1.0, "run config beta=1.0: expected in [0, 1)"),
        ("beta", -0.2, "run config beta=-0.2: expected in [0, 1)"),
        ("cycle-quorum", 0.0, "run config cycle-quorum=0.0: expected in (0, 1]"),
        ("max-updates", 2.5, "run config max-updates=2.5: expected an integer > 0"),
        ("scheduling", "maybe", "run config scheduling='maybe': expected true or false"),
        (
            "max-in-flight",
            -1,
            "run config max-in-flight=-1: expected an integer >= 0 (0 = all nodes)",
        ),
        (
            "max-in-flight",
            1.5,
            "run config max-in-flight=1.5: expected an integer >= 0 (0 = all nodes)",
        ),
        ("dispatch", "fifo", "run config dispatch='fifo': expected auto, random or scheduled"),
        (
            "client-mode",
            "params",
            "run config client-mode='params': expected gradient, delta or weights",
        ),
    ],
)
def test_bad_values_name_the_key(key, value, expected):
    with pytest.raises(ValueError) as err:
        parse_run_config({key: value})
    assert str(err.value).startswith(expected)


def test_unknown_key_is_named():
    with pytest.raises(ValueError, match=r"\['sever-lr'\] unknown"):
        parse_run_config({"sever-lr": 0.1})


@pytest.mark.parametrize(
    "bad",
    [
        {"strategy": "sgd"},
        {"server-learning-rate": -1.0},
        {"classes-per-node": 11},
        {"beta": 1.0},
        {"max-in-flight": -1},
        {"dispatch": "fifo"},
    ],
)
def test_server_app_fails_before_any_message_is_sent(bad, tmp_path):
    grid = InProcessGrid(make_app(), 2, run_config={})

    class Context:
        run_config = {**bad, "output-dir": str(tmp_path)}

    with pytest.raises(ValueError, match=next(iter(bad))):
        main(grid, Context())  # the ServerApp's main function
    assert grid._next_message == 0  # nothing was pushed
    assert list(tmp_path.iterdir()) == []  # no run folder either


def test_reference_documents_every_key_with_its_default():
    readme = (PYPROJECT.parent / "docs" / "REFERENCE.md").read_text()
    for key, spec in RUN_CONFIG.items():
        v = spec.default
        shown = (
            ("true" if v else "false")
            if isinstance(v, bool)
            else (f'"{v}"' if isinstance(v, str) else repr(v))
        )
        assert f"| `{key}` | `{shown}` |" in readme, key


def test_reference_tables_are_the_generated_ones():
    """docs/REFERENCE.md's run config and strategy argument tables equal what the script writes."""
    import importlib.util

    path = PYPROJECT.parent / "scripts" / "write_reference.py"
    spec = importlib.util.spec_from_file_location("write_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    readme = (PYPROJECT.parent / "docs" / "REFERENCE.md").read_text()
    for header, make in module.TABLES.items():
        lines = make()
        assert lines[0] == header and len(lines) > 10
        assert "\n".join(lines) + "\n" in readme, (
            f"run: python scripts/{path.name} --write docs/REFERENCE.md"
        )
    names = [line.split("`")[1] for line in module.strategy_table()[2:]]
    for argument in ("client_mode", "local_steps", "dispatch_timeout", "max_staleness", "max_norm"):
        assert argument in names
