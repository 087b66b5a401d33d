"""Parameter declarations (core/params.py) and self-registration of the rules."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import pytest
from core_testutil import f32

from flwr_gsgm.core import (
    OPTIMIZERS,
    Outcome,
    Param,
    ServerOptimizer,
    declared_params,
    make_optimizer,
    optimizer_params,
)
from flwr_gsgm.core.params import resolve


@pytest.fixture
def scratch_registry():
    """Rules a test defines are registered only for that test."""
    saved = dict(OPTIMIZERS)
    yield OPTIMIZERS
    OPTIMIZERS.clear()
    OPTIMIZERS.update(saved)


# ------------------------------------------------------------------------- Param
@pytest.mark.parametrize(
    "param, value, message",
    [
        (
            Param("beta", 0.5, "", low=0.0, high=1.0, high_open=True),
            1.0,
            "beta must be < 1.0, got 1.0",
        ),
        (Param("lr", 0.1, "", low=0.0, low_open=True), 0, "lr must be > 0.0, got 0.0"),
        (Param("lr", 0.1, ""), float("nan"), "lr must be finite, got nan"),
        (Param("lr", 0.1, ""), "0.1", "lr must be a real number, got '0.1'"),
        (Param("k", 5, "", kind=int, low=1), 2.0, "k must be an integer, got 2.0"),
        (Param("k", 5, "", kind=int, low=1), 0, "k must be >= 1, got 0"),
        (Param("k", 5, "", kind=int, low=1), None, "k must be an integer, got None"),
        (Param("on", True, "", kind=bool), 1, "on must be a bool, got 1"),
        (
            Param("form", "a", "", kind=str, choices=("a", "b")),
            "c",
            "form must be one of ['a', 'b'], got 'c'",
        ),
    ],
)
def test_check_names_the_parameter_the_value_and_the_expectation(param, value, message):
    with pytest.raises(ValueError) as info:
        param.check(value)
    assert str(info.value) == message


def test_check_converts_and_accepts_none_when_optional():
    assert Param("k", None, "", kind=int, low=1, optional=True).check(None) is None
    assert Param("k", 5, "", kind=int, low=1).check(np.int64(3)) == 3
    assert Param("on", True, "", kind=bool).check(np.bool_(False)) is False
    form = Param(
        "form", "a-b", "", kind=str, choices=("a-b",), normalize=lambda v: v.replace("_", "-")
    )
    assert form.check("a_b") == "a-b"


@pytest.mark.parametrize(
    "param, expected",
    [
        (Param("x", 0.5, "", low=0.0, high=1.0, high_open=True), "in [0, 1)"),
        (Param("x", 0.5, "", low=0.0, low_open=True, high=1.0), "in (0, 1]"),
        (Param("x", 0.5, "", low=0.0, low_open=True), "> 0"),
        (Param("x", 5, "", kind=int, low=1), "an integer >= 1"),
        (Param("x", True, "", kind=bool), "true or false"),
        (Param("x", "ema", "", kind=str, choices=("heavy-ball", "ema")), "heavy-ball or ema"),
        (Param("x", None, "", optional=True), "a real number"),
    ],
)
def test_expected_in_words(param, expected):
    assert param.expected() == expected


def test_bad_declarations_fail_at_once():
    with pytest.raises(ValueError, match="beta must be < 1.0"):
        Param("beta", 1.0, "", low=0.0, high=1.0, high_open=True)
    with pytest.raises(ValueError, match="choices need kind=str"):
        Param("x", 1.0, "", choices=("a",))
    with pytest.raises(ValueError, match="kind"):
        Param("x", [1], "", kind=list)


def test_resolve_fills_defaults_and_names_unknown_parameters():
    declared = (Param("a", 1.0, ""), Param("b", 2, "", kind=int))
    assert resolve("r", declared, {"b": 3}) == {"a": 1.0, "b": 3}
    with pytest.raises(ValueError) as info:
        resolve("r", declared, {"c": 1, "a": 1.0})
    assert str(info.value) == "optimizer 'r' does not take parameter(s) 'c'; it takes: a, b"


# ---------------------------------------------------------- every registered rule
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_rule_builds_from_its_declared_defaults(name):
    cls = OPTIMIZERS[name]
    declared = declared_params(name)
    assert optimizer_params(name) == tuple(p.name for p in declared)
    assert [p.name for p in declared[:3]] == ["lr", "max_staleness", "max_norm"]
    defaults = {p.name: p.default for p in declared}
    assert cls.defaults() == defaults
    opt = make_optimizer(name, [f32(0, 0)], [1], **defaults)
    assert opt.params == defaults
    # The constructor alone (no parameter but lr) takes the same defaults.
    assert cls([f32(0, 0)], [1], lr=defaults["lr"]).params == defaults


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_rule_declares_its_own_server_learning_rate(name):
    # The base class's lr defaults serve only a rule that declares none (a test's).
    cls = OPTIMIZERS[name]
    own = {
        p.name: p
        for klass in cls.__mro__[:-1]
        if klass is not ServerOptimizer
        for p in klass.__dict__.get("PARAMS", ())
    }
    assert "lr" in own, f"{cls.__qualname__} takes the base class's lr defaults"


def test_shipped_defaults_are_the_tuned_run_config_ones():
    assert {
        k: v
        for k, v in OPTIMIZERS["gsgm"].defaults().items()
        if k in ("lr", "beta", "momentum_form", "cycle_quorum", "averaging", "lr_scaling")
    } == {
        "lr": 0.1,
        "lr_scaling": "cycle",
        "beta": 0.5,
        "momentum_form": "ema",
        "cycle_quorum": 0.5,
        "averaging": "auto",
    }
    assert OPTIMIZERS["masgd"].defaults()["beta"] == 0.5
    assert OPTIMIZERS["fedbuff"].defaults()["buffer_size"] == 5
    assert (
        OPTIMIZERS["fedasync"].defaults()["alpha"],
        OPTIMIZERS["fedasync"].defaults()["poly_a"],
    ) == (0.6, 0.5)
    assert OPTIMIZERS["dcasgd"].defaults()["dc_lambda"] == 0.04


# -------------------------------------------------------------- a new rule, here
class _Halved(ServerOptimizer):
    """Not registered: no ``name``. Steps by ``gamma * lr * g``."""

    PARAMS: ClassVar[tuple[Param, ...]] = (
        Param("gamma", 0.5, "step fraction", low=0.0, low_open=True, high=1.0),
    )

    def _on_valid(self, node, parts, base_version, staleness, now):
        self._sgd_step(parts, self._gamma * self._lr)
        self._version += 1
        return Outcome.APPLIED


def test_a_rule_registers_itself_with_its_name(scratch_registry):
    class Halved(_Halved):
        name = "test-halved"

    assert OPTIMIZERS["test-halved"] is Halved
    assert _Halved not in OPTIMIZERS.values()  # no name, no registration
    assert optimizer_params("test-halved") == ("lr", "max_staleness", "max_norm", "gamma")
    opt = make_optimizer("test-halved", [f32(0, 0)], [1], lr=1.0)
    assert opt.params["gamma"] == 0.5
    opt.on_update(1, [f32(2, 4)], 0)
    np.testing.assert_array_equal(opt.weights[0], f32(-1, -2))
    with pytest.raises(ValueError, match="gamma must be <= 1.0, got 2.0"):
        make_optimizer("test-halved", [f32(0, 0)], [1], lr=1.0, gamma=2.0)
    opt.load_state_dict(opt.state_dict())  # params round trip


def test_a_subclass_may_redeclare_an_inherited_parameter(scratch_registry):
    class Fast(_Halved):
        name = "test-fast"
        PARAMS = (Param("lr", 0.5, "larger server step", low=0.0, low_open=True),)

    assert [p.name for p in Fast.declared_params()] == ["lr", "max_staleness", "max_norm", "gamma"]
    assert Fast.defaults()["lr"] == 0.5 and OPTIMIZERS["asgd"].defaults()["lr"] == 0.02


def test_a_taken_name_is_refused(scratch_registry):
    with pytest.raises(ValueError, match="'asgd' .* already taken by flwr_gsgm.core.asgd.ASGD"):

        class Other(_Halved):
            name = "asgd"

    assert OPTIMIZERS["asgd"].__module__ == "flwr_gsgm.core.asgd"


# ------------------------------------------------------- per-mode learning rate
def test_the_server_learning_rate_has_a_default_per_kind_of_update():
    from flwr_gsgm.core.params import server_learning_rate

    lr = server_learning_rate(0.02, displacement=0.1)
    assert (lr.default, lr.displacement_default) == (0.02, 0.1)
    assert lr.default_for("gradient") == 0.02
    assert lr.default_for("delta") == lr.default_for("weights") == 0.1
    with pytest.raises(ValueError, match="lr must be > 0.0, got 0"):
        server_learning_rate(0.02, displacement=0)
    with pytest.raises(ValueError, match="displacement_default needs rule_default"):
        Param("x", 1.0, "x", displacement_default=2.0)
    # every shipped rule declares both, in its own file
    from flwr_gsgm.core import OPTIMIZERS

    declared = {
        name: next(p for p in cls.declared_params() if p.name == "lr")
        for name, cls in OPTIMIZERS.items()
    }
    assert {n: (p.default, p.displacement_default) for n, p in declared.items()} == {
        "gsgm": (0.1, 1.0),  # a step per cycle, at its close (apply_at "auto")
        "asgd": (0.02, 0.05),
        "masgd": (0.02, 0.05),
        "dcasgd": (0.02, 0.1),
        "fedasync": (0.02, 0.3),
        "fedbuff": (0.1, 0.25),
        "ca2fl": (0.1, 0.25),
        "ace": (0.02, 0.1),
        "daasgd": (0.02, 0.1),
        "fedcompass": (0.2, 0.9),
    }
    assert "lr : float = 0.1 (gradient mode); 1.0 (delta and weights modes)" in (
        OPTIMIZERS["gsgm"].__doc__
    )
