"""Run config validation: every bad value fails before training, naming the key.

The library checks its keys and leaves the others to the app
(:func:`flwr_gsgm.config.run_config.parse_run_config`); this project's app declares its
own (serverapp/app_config.py) and refuses a key neither declares.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from clients.client_app import DEFAULT_RUN_CONFIG
from flwr_gsgm.config import run_config as library
from flwr_gsgm.config.keys import RunConfigKey
from flwr_gsgm.config.run_config import parse_run_config
from flwr_gsgm.simulation.inprocess_grid import InProcessGrid
from serverapp.app_config import APP_KEYS, RUN_CONFIG, parse_app_config
from serverapp.server_app import main
from tests.engine.quadratic_app import make_app

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_pyproject_run_config_equals_the_documented_defaults():
    app_config = tomllib.loads(PYPROJECT.read_text())["tool"]["flwr"]["app"]["config"]
    assert app_config == {k: spec.default for k, spec in RUN_CONFIG.items()}
    assert set(RUN_CONFIG) == set(library.RUN_CONFIG) | set(APP_KEYS)


def test_the_app_keys_are_those_only_the_app_reads():
    assert set(APP_KEYS) == {
        *("eval-examples", "eval-threads", "eval-max-examples", "client-threads"),
        *("dataset", "data-root", "partitioner", "classes-per-node", "dirichlet-alpha"),
        "examples-per-node",
        *("attack", "attackers"),
    }
    assert not set(APP_KEYS) & set(library.RUN_CONFIG)
    # The ClientApp's fallbacks (a run config without the key) are the declared defaults.
    for key, default in DEFAULT_RUN_CONFIG.items():
        assert RUN_CONFIG[key].default == default, key


def test_defaults_parse_to_the_main_job():
    cfg = parse_app_config({})
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
        parse_app_config({key: value})
    assert str(err.value).startswith(expected)


def test_unknown_key_is_named():
    # the known keys: the library's and the app's, sorted
    known = r"\['sever-lr'\] unknown; known keys: \[.*'batch-size', .*'classes-per-node', "
    with pytest.raises(ValueError, match=known):
        parse_app_config({"sever-lr": 0.1})


def test_a_misspelt_key_names_the_closest_known_key():
    # Issue 35 item 7: the near match first, then the list of known keys (the app's too).
    known = sorted({**library.RUN_CONFIG, **APP_KEYS})
    with pytest.raises(ValueError) as err:
        parse_app_config({"max-update": 100})
    assert str(err.value) == (
        f"run config key(s) ['max-update'] unknown; did you mean max-updates? known keys: {known}"
    )
    with pytest.raises(ValueError) as err:
        parse_app_config({"max-update": 100, "eval-evry": 10, "zzz": 1})
    assert str(err.value) == (
        "run config key(s) ['eval-evry', 'max-update', 'zzz'] unknown; did you mean "
        f"eval-every for eval-evry, max-updates for max-update? known keys: {known}"
    )
    with pytest.raises(ValueError) as err:  # nothing close: no guess
        parse_app_config({"zzz": 1})
    assert str(err.value) == f"run config key(s) ['zzz'] unknown; known keys: {known}"


def test_the_library_leaves_the_keys_it_does_not_know_to_the_app():
    given = {"strategy": "asgd", "my-model": "resnet", "my-layers": 3, "dataset": "mine"}
    cfg = parse_run_config(given)
    assert cfg["strategy"] == "asgd" and cfg["max-updates"] == 4000  # checked, defaulted
    assert (cfg["my-model"], cfg["my-layers"], cfg["dataset"]) == ("resnet", 3, "mine")
    assert "partitioner" not in cfg  # an app key the run config does not set: not there
    assert list(cfg)[: len(library.RUN_CONFIG)] == list(library.RUN_CONFIG)
    # ... and may list them among the keys a resume may change
    parse_run_config({**given, "resume-allow-changes": "my-layers,dataset"})
    with pytest.raises(ValueError, match=r"\['my-depth'\] are not run config keys"):
        parse_run_config({**given, "resume-allow-changes": "my-depth"})
    with pytest.raises(ValueError, match="run config key 'reply-timeout' was removed"):
        parse_run_config({"reply-timeout": 30.0, "my-model": "resnet"})


def test_an_apps_keys_are_checked_as_the_librarys():
    app_keys = {"my-layers": RunConfigKey(2, lambda v: v >= 1, "an integer >= 1", "layers")}
    assert parse_run_config({"my-layers": 4.0}, app_keys)["my-layers"] == 4  # coerced
    assert parse_run_config({}, app_keys)["my-layers"] == 2
    with pytest.raises(ValueError) as err:
        parse_run_config({"my-layers": 0}, app_keys)
    assert str(err.value) == "run config my-layers=0: expected an integer >= 1"
    with pytest.raises(
        ValueError, match=r"\['my-layer'\] unknown; did you mean my-layers\? known keys: \[.*'my-"
    ):
        parse_run_config({"my-layer": 3}, app_keys)
    with pytest.raises(ValueError, match=r"\['seed'\] are the library's keys already"):
        parse_run_config({}, {"seed": RunConfigKey(1, lambda v: True, "any", "")})


def test_the_app_parses_its_own_output_unchanged():
    cfg = parse_app_config({"partitioner": "dirichlet", "dirichlet-alpha": 1, "seed": 4})
    assert parse_app_config(cfg) == cfg and set(cfg) == set(RUN_CONFIG)
    assert cfg["dirichlet-alpha"] == 1.0 and type(cfg["dirichlet-alpha"]) is float
    # what the library alone parsed, the app completes
    assert parse_app_config(parse_run_config({"seed": 4, "partitioner": "iid"})) == (
        parse_app_config({"seed": 4, "partitioner": "iid"})
    )


@pytest.mark.parametrize(
    "bad",
    [
        {"strategy": "sgd"},
        {"server-learning-rate": -1.0},
        {"classes-per-node": 11},
        {"beta": 1.0},
        {"max-in-flight": -1},
        {"dispatch": "fifo"},
        {"sever-lr": 0.1},  # a typo of a key
        {"dirichlet-alpha": 0.0},
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
