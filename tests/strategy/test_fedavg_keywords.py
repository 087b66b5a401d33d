"""FedAvg's keyword arguments are refused naming their asynchronous counterpart
(issue 24, item 4; docs/PORTING.md has the table)."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest
from flwr.serverapp.strategy import FedAvg

from flwr_gsgm.engine.federated_evaluation import FederatedEvaluation
from flwr_gsgm.engine.settings import EngineSettings
from flwr_gsgm.simulation.inprocess_grid import InProcessGrid
from flwr_gsgm.strategy.async_strategy import AsyncStrategy
from flwr_gsgm.strategy.fedavg_keywords import FEDAVG_COUNTERPARTS, fedavg_refusal
from flwr_gsgm.strategy.strategies import GSGM
from tests.engine.quadratic_app import initial_arrays, make_app

#: Every refusal message, in full: a change to one is a change of the porting guide.
MESSAGES = {
    "num_rounds": "num_rounds is FedAvg's; use max_updates=<rounds x nodes per round> "
    "(client updates received) or max_seconds (seconds of the engine clock) in start() "
    "(docs/PORTING.md)",
    "timeout": "timeout is FedAvg's; use engine=EngineSettings(dispatch_timeout=<seconds>) "
    "(wall seconds a train message may go unanswered; there is no round to wait for) "
    "(docs/PORTING.md)",
    "should_stop": "should_stop is FedAvg's; an asynchronous run stops at max_updates or "
    "max_seconds in start(); stopping on a metric has no counterpart yet (docs/PORTING.md)",
    "fraction_train": "fraction_train is FedAvg's; every active node trains, with no round: "
    "use engine=EngineSettings(max_in_flight=<fraction_train x nodes>) to have at most that "
    "many train at once (docs/PORTING.md)",
    "fraction_evaluate": "fraction_evaluate is FedAvg's; use federated_evaluation="
    "FederatedEvaluation(every=<updates>, fraction_evaluate=...) (nodes evaluate every that "
    "many client updates) (docs/PORTING.md)",
    "min_train_nodes": "min_train_nodes is FedAvg's; there is no round to fill: use "
    "engine=EngineSettings(min_nodes=...) (nodes to wait for before training starts) and "
    "max_in_flight (at most that many at once) (docs/PORTING.md)",
    "min_evaluate_nodes": "min_evaluate_nodes is FedAvg's; use federated_evaluation="
    "FederatedEvaluation(every=<updates>, min_evaluate_nodes=...) (docs/PORTING.md)",
    "min_available_nodes": "min_available_nodes is FedAvg's; use engine=EngineSettings("
    "min_nodes=...) (nodes to wait for, up to startup_timeout, before training starts) "
    "(docs/PORTING.md)",
    "weighted_by_key": "weighted_by_key is FedAvg's; the server rule applies each update on "
    "its own (no average over a round); federated evaluation: FederatedEvaluation("
    "every=<updates>, weighted_by_key=...) (docs/PORTING.md)",
    "arrayrecord_key": "arrayrecord_key is FedAvg's; train messages carry the model under "
    '"arrays" (FedAvg\'s default); not configurable (docs/PORTING.md)',
    "configrecord_key": "configrecord_key is FedAvg's; train messages carry the config under "
    '"config" (FedAvg\'s default); not configurable (docs/PORTING.md)',
    "train_metrics_aggr_fn": "train_metrics_aggr_fn is FedAvg's; the engine reads each "
    "reply's train-loss (or train_loss) itself: the mean per evaluation window is in "
    "result.train_metrics_clientapp and on_evaluate's metrics (docs/PORTING.md)",
    "evaluate_metrics_aggr_fn": "evaluate_metrics_aggr_fn is FedAvg's; use "
    "federated_evaluation=FederatedEvaluation(every=<updates>, evaluate_metrics_aggr_fn=...) "
    "(docs/PORTING.md)",
}
START_KEYWORDS = ("num_rounds", "timeout", "should_stop")
#: FedAvg's keywords that carry over unchanged (same name, same meaning).
CARRIED_OVER = {"self", "grid", "initial_arrays", "train_config", "evaluate_config", "evaluate_fn"}


def test_every_fedavg_keyword_the_strategies_lack_has_a_counterpart():
    # Flower's own signatures: a keyword added in a later Flower shows up here.
    fedavg = set(inspect.signature(FedAvg.__init__).parameters)
    fedavg |= set(inspect.signature(FedAvg.start).parameters)
    # should_stop is Flower 1.43's (FedAvg.start); refused under 1.42 too.
    newer = {"should_stop"} - fedavg
    assert fedavg - CARRIED_OVER == set(FEDAVG_COUNTERPARTS) - newer
    assert set(FEDAVG_COUNTERPARTS) == set(MESSAGES)
    start = set(inspect.signature(AsyncStrategy.start).parameters)
    assert {"train_config", "evaluate_config", "evaluate_fn"} <= start


def test_the_counterparts_named_exist():
    # Every name a message sends the user to is a real keyword or attribute.
    text = " ".join(FEDAVG_COUNTERPARTS.values())
    settings = {f.name for f in dataclasses.fields(EngineSettings)}
    for name in re.findall(r"EngineSettings\((\w+)=", text) + ["max_in_flight", "min_nodes"]:
        assert name in settings, name
    evaluation = {f.name for f in dataclasses.fields(FederatedEvaluation)}
    for name in re.findall(r"FederatedEvaluation\(every=<updates>, (\w+)=", text):
        assert name in evaluation, name
    start = inspect.signature(AsyncStrategy.start).parameters
    assert "max_updates" in start and "max_seconds" in start
    strategy = inspect.signature(AsyncStrategy.__init__).parameters
    assert {"engine", "federated_evaluation", "on_evaluate"} <= set(strategy)


@pytest.mark.parametrize("keyword", sorted(MESSAGES))
def test_the_constructor_refuses_fedavg_keywords_naming_the_counterpart(keyword):
    with pytest.raises(ValueError) as info:
        GSGM(**{keyword: 1})
    assert str(info.value) == MESSAGES[keyword]


@pytest.mark.parametrize("keyword", START_KEYWORDS)
def test_start_refuses_fedavg_keywords_naming_the_counterpart(keyword):
    grid = InProcessGrid(make_app(), 2, run_config={})
    with pytest.raises(TypeError) as info:
        GSGM().start(grid, initial_arrays(), max_updates=4, **{keyword: 3})
    assert str(info.value) == MESSAGES[keyword]
    assert grid.pending == {}  # refused before any message was sent


def test_start_refuses_an_unknown_keyword_as_python_does():
    grid = InProcessGrid(make_app(), 2, run_config={})
    with pytest.raises(TypeError, match=r"^start\(\) got an unexpected keyword argument 'rounds'$"):
        GSGM().start(grid, initial_arrays(), rounds=3)


def test_several_fedavg_keywords_are_named_in_the_order_given():
    message = fedavg_refusal({"fraction_train": 0.5, "min_available_nodes": 2, "beta": 0.5})
    assert message == MESSAGES["fraction_train"] + ". " + MESSAGES["min_available_nodes"]
    assert fedavg_refusal({"beta": 0.5}) is None


def test_a_keyword_neither_fedavg_nor_ours_keeps_the_generic_message():
    with pytest.raises(ValueError, match="unknown keyword argument.*'rounds'.*the strategy takes"):
        GSGM(rounds=3)


def test_the_porting_guide_names_every_fedavg_keyword_and_only_real_counterparts():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "PORTING.md").read_text()
    for keyword in FEDAVG_COUNTERPARTS:
        assert f"`{keyword}" in doc, keyword
    settings = {f.name for f in dataclasses.fields(EngineSettings)}
    for name in re.findall(r"EngineSettings\((\w+)=", doc):
        assert name in settings, name
    evaluation = {f.name for f in dataclasses.fields(FederatedEvaluation)}
    for name in re.findall(r"FederatedEvaluation\(every=\w+, (\w+)=", doc):
        assert name in evaluation, name
    for hook in ("train_config_fn", "on_evaluate"):
        assert hook in inspect.signature(AsyncStrategy.__init__).parameters
    # The messages quoted in the guide are the code's.
    assert MESSAGES["fraction_train"] in doc and MESSAGES["num_rounds"] in doc
