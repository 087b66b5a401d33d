"""One declaration per rule: registry, strategies, run config, presets and REFERENCE agree.

Acceptance test of issue #9 item 1: every registered rule is built through the
registry, its strategy class, ``AsyncStrategy`` and the run config, and every layer
ends with the defaults of the rule's ``PARAMS``. A rule added as one new file in
``flwr_gsgm/core/`` reaches every layer with no other edit (checked on a copy of
the package).
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from flwr_gsgm.config.build import build_strategy
from flwr_gsgm.config.keys import _declaring_rules
from flwr_gsgm.config.run_config import (
    ASYNC_STRATEGIES,
    OPTIMIZER_KEYS,
    RUN_CONFIG,
    optimizer_params_from,
    parse_run_config,
    strategy_keys,
)
from flwr_gsgm.core import OPTIMIZERS, Param, ServerOptimizer, declared_params, make_optimizer
from flwr_gsgm.engine.async_engine import EngineSettings
from flwr_gsgm.strategy.async_strategy import AsyncStrategy
from flwr_gsgm.strategy.strategies import STRATEGIES

REPO = Path(__file__).resolve().parents[2]
DUMMY = [np.zeros(3, np.float32)]


def declared_defaults(name: str) -> dict:
    return {p.name: p.default for p in declared_params(name)}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_defaults_agree_in_every_layer(name):
    defaults = declared_defaults(name)
    # (a) registry
    assert make_optimizer(name, DUMMY, [0], **defaults).params == defaults
    # (b) strategies: the named (or generated) class and the generic one, no optimizer args
    for strategy in (STRATEGIES[name](), AsyncStrategy(name)):
        assert strategy.optimizer_name == name
        assert strategy.optimizer_params == defaults
        assert strategy.rule_spec(DUMMY, [0], None).params == defaults
        assert strategy.server_learning_rate == defaults["lr"]
    # (c) run config: an empty run config naming the rule builds the same optimizer
    cfg = parse_run_config({"strategy": name})
    assert build_strategy(cfg).optimizer_params == defaults
    for p in declared_params(name):
        if p.run_config_key is not None and not p.rule_default:
            shown = RUN_CONFIG[p.run_config_key].default
            assert (None if p.optional and shown == 0 else shown) == p.default, p.name
    # server-learning-rate: 0 in the run config = the rule's own declared default
    assert RUN_CONFIG["server-learning-rate"].default == 0.0
    assert (
        build_strategy(
            parse_run_config({"strategy": name, "server-learning-rate": 0.3})
        ).server_learning_rate
        == 0.3
    )


def test_registry_strategies_and_run_config_list_the_same_rules():
    assert list(STRATEGIES) == list(OPTIMIZERS) == list(ASYNC_STRATEGIES)
    assert ASYNC_STRATEGIES[0] == "gsgm"  # the run config's default strategy comes first


def test_public_strategy_names_and_readme_call_still_work():
    from flwr_gsgm import ASGD, DCASGD, GSGM, FedAsync, FedBuff, MomentumASGD

    assert [c.rule for c in (GSGM, ASGD, MomentumASGD, DCASGD, FedAsync, FedBuff)] == [
        "gsgm",
        "asgd",
        "masgd",
        "dcasgd",
        "fedasync",
        "fedbuff",
    ]
    strategy = GSGM(server_learning_rate=0.05, beta=0.9, momentum_form="heavy-ball")
    assert strategy.optimizer_params["lr"] == 0.05 and strategy.optimizer_params["beta"] == 0.9
    assert (
        "cycle_quorum : float = 0.5" in GSGM.__doc__
        and "server_learning_rate : float = 0.1" in GSGM.__doc__
    )  # docstring from the declaration


def test_unknown_strategy_keyword_is_named_with_what_is_accepted():
    with pytest.raises(ValueError) as info:
        STRATEGIES["asgd"](beta=0.5)
    msg = str(info.value)
    assert "'beta'" in msg and "max_norm" in msg and "client_mode" in msg
    with pytest.raises(ValueError, match="beta must be < 1.0, got 1.0"):
        STRATEGIES["masgd"](beta=1.0)


def test_run_config_zero_means_none_and_values_reach_the_rule():
    cfg = parse_run_config(
        {
            "strategy": "gsgm",
            "max-staleness": 7,
            "max-norm": 0.0,
            "momentum-form": "heavy-ball",
            "server-learning-rate": 0.1,
        }
    )
    params = optimizer_params_from(cfg, "gsgm")
    assert (params["max_staleness"], params["max_norm"]) == (7, None)
    assert build_strategy(cfg).optimizer_params == {
        **declared_defaults("gsgm"),
        "max_staleness": 7,
        "momentum_form": "heavy-ball",
        "lr": 0.1,
    }


def test_strategy_keys():
    assert strategy_keys("asgd") == {"server-learning-rate", "max-staleness", "max-norm"}
    assert strategy_keys("fedbuff") == {
        "server-learning-rate",
        "max-staleness",
        "max-norm",
        "fedbuff-k",
        "trim-fraction",
    }
    assert (
        strategy_keys("fedavgm") == {"server-learning-rate", "beta"}
        and strategy_keys("fedavg") == set()
    )
    assert {"beta", "fedbuff-k", "cycle-quorum"} <= OPTIMIZER_KEYS


def test_a_shared_key_must_be_declared_alike():
    saved = dict(OPTIMIZERS)
    try:

        class Clash(ServerOptimizer):  # beta, but with another default than GSGM's
            name = "test-clash"
            PARAMS = (
                Param(
                    "beta",
                    0.9,
                    "momentum",
                    low=0.0,
                    high=1.0,
                    high_open=True,
                    run_config_key="beta",
                ),
            )

            def _on_valid(self, *args):
                raise AssertionError

        with pytest.raises(
            ValueError, match="run config key 'beta': test-clash.beta is declared differently"
        ):
            _declaring_rules()
    finally:
        OPTIMIZERS.clear()
        OPTIMIZERS.update(saved)


def test_engine_and_start_defaults_are_the_run_config_ones():
    assert EngineSettings().max_updates == RUN_CONFIG["max-updates"].default == 4000
    assert EngineSettings().eval_every == RUN_CONFIG["eval-every"].default


def test_reference_table_is_the_generated_one():
    spec = importlib.util.spec_from_file_location(
        "write_reference", REPO / "scripts" / "write_reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    reference = (REPO / "docs" / "REFERENCE.md").read_text().splitlines()
    missing = [line for line in module.table() if line not in reference]
    assert not missing, (
        "run `python scripts/write_reference.py --write docs/REFERENCE.md`:\n" + "\n".join(missing)
    )


NEW_RULE = '''
"""A rule added as one file: scaled SGD (test only)."""
from typing import ClassVar

from .base import Outcome, ServerOptimizer
from .params import Param


class ScaledSGD(ServerOptimizer):
    name: ClassVar[str] = "zz-scaled"
    PARAMS: ClassVar[tuple[Param, ...]] = (
        Param("lr", 0.3, "server learning rate eta", low=0.0, low_open=True,
              run_config_key="server-learning-rate", rule_default=True),
        Param("scale", 0.5, "step scale", low=0.0, low_open=True, run_config_key="zz-scale"),
        Param("warm", None, "warm-up updates", kind=int, low=1, optional=True,
              run_config_key="zz-warm"),
    )

    def _step_bound(self, norm):
        w_after = self._bound_w + self._scale * self._lr * norm
        return w_after + (1.0 + self._scale * self._lr) * norm, w_after

    def _on_valid(self, node, parts, base_version, staleness, now):
        self._sgd_step(parts, self._scale * self._lr)
        self._version += 1
        return Outcome.APPLIED
'''

CHECK_NEW_RULE = textwrap.dedent(
    """
    from flwr_gsgm.core import OPTIMIZERS
    from flwr_gsgm.config.build import build_strategy
    from flwr_gsgm.config.run_config import RUN_CONFIG, parse_run_config, strategy_keys
    from flwr_gsgm.strategy.strategies import STRATEGIES
    import flwr_gsgm.strategy.strategies as strategies

    assert list(OPTIMIZERS)[-1] == "zz-scaled", list(OPTIMIZERS)
    assert strategies.ScaledSGD is STRATEGIES["zz-scaled"]
    assert STRATEGIES["zz-scaled"]().optimizer_params["scale"] == 0.5
    assert (RUN_CONFIG["zz-scale"].default, RUN_CONFIG["zz-warm"].default) == (0.5, 0)
    assert RUN_CONFIG["zz-warm"].expected == "an integer >= 0 (0 = none)"
    assert "zz-scaled" in RUN_CONFIG["strategy"].expected
    assert strategy_keys("zz-scaled") >= {"zz-scale", "server-learning-rate"}
    # its own learning rate default, through the shared server-learning-rate key (0 = the rule's)
    assert build_strategy(parse_run_config({"strategy": "zz-scaled"})).server_learning_rate == 0.3
    assert build_strategy(parse_run_config({"strategy": "asgd"})).server_learning_rate == 0.02
    cfg = parse_run_config({"strategy": "zz-scaled", "zz-scale": 0.25, "zz-warm": 3})
    params = build_strategy(cfg).optimizer_params
    assert (params["scale"], params["warm"]) == (0.25, 3), params
    print("ok")
    """
)


def test_a_new_rule_file_and_its_two_lines_reach_every_layer(tmp_path):
    shutil.copytree(
        REPO / "flwr_gsgm", tmp_path / "flwr_gsgm", ignore=shutil.ignore_patterns("__pycache__")
    )
    core = tmp_path / "flwr_gsgm" / "core"
    (core / "zz_scaled.py").write_text(NEW_RULE)
    # The two lines a new rule adds by hand: its import (the registration order) and its
    # strategy class, written out so that go-to-definition finds it.
    init = (core / "__init__.py").read_text()
    anchor = "from .fedcompass import FedCompassRule  # isort: skip\n"
    assert anchor in init
    init = init.replace(anchor, anchor + "from .zz_scaled import ScaledSGD  # isort: skip\n")
    (core / "__init__.py").write_text(init)
    strategies = tmp_path / "flwr_gsgm" / "strategy" / "strategies.py"
    text = strategies.read_text()
    anchor = "        FedCompass,\n    )\n}"
    assert anchor in text
    text = text.replace(anchor, "        FedCompass,\n        ScaledSGD,\n    )\n}")
    text = text.replace(
        "\n\n#: rule name -> strategy class",
        '\n\nclass ScaledSGD(RuleStrategy):\n    """Scaled SGD."""\n\n    rule = "zz-scaled"\n'
        "\n\n#: rule name -> strategy class",
    )
    strategies.write_text(text)
    proc = subprocess.run(
        [sys.executable, "-c", CHECK_NEW_RULE],
        cwd=tmp_path,
        env={"PYTHONPATH": f"{tmp_path}:{REPO}", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


def test_every_rule_module_is_imported_by_name_and_every_strategy_written_out():
    """No rule is left to an automatic import or a generated class: importing every
    module of the core registers no rule the core's imports did not, and each strategy
    is a class statement of strategies.py (go-to-definition finds it)."""
    import ast
    import pkgutil

    import flwr_gsgm
    import flwr_gsgm.core as core
    from flwr_gsgm.strategy import strategies

    before = list(OPTIMIZERS)
    for module in pkgutil.iter_modules(core.__path__):
        importlib.import_module(f"flwr_gsgm.core.{module.name}")
    assert list(OPTIMIZERS) == before, "a rule module is not imported in core/__init__.py"
    tree = ast.parse(Path(strategies.__file__).read_text())
    written = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    for rule, cls in STRATEGIES.items():
        assert cls.__name__ in written and cls.__module__ == strategies.__name__, rule
        assert getattr(flwr_gsgm, cls.__name__) is cls
        assert cls.__name__ + "Rule" == OPTIMIZERS[rule].__name__
