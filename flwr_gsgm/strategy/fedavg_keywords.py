"""Flower FedAvg's keyword arguments, refused by the asynchronous strategies with
their counterpart named (docs/PORTING.md has the full table).

FedAvg's constructor keywords and those of its ``start()`` (Flower 1.42) that an
asynchronous strategy does not take: a FedAvg ServerApp ported by renaming the class
fails at once, and the message says what to write instead. ``train_config``,
``evaluate_config`` and ``evaluate_fn`` carry over unchanged and are not listed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["FEDAVG_COUNTERPARTS", "fedavg_refusal"]

_GUIDE = "(docs/PORTING.md)"

#: FedAvg keyword -> what to use instead; each refusal message is
#: ``"<keyword> is FedAvg's; <counterpart> (docs/PORTING.md)"``.
FEDAVG_COUNTERPARTS: dict[str, str] = {
    # start()
    "num_rounds": (
        "use max_updates=<rounds x nodes per round> (client updates received) "
        "or max_seconds (seconds of the engine clock) in start()"
    ),
    "timeout": (
        "use engine=EngineSettings(dispatch_timeout=<seconds>) (wall seconds a train "
        "message may go unanswered; there is no round to wait for)"
    ),
    # start() of Flower 1.43 (FedAvg stops when it returns True after a round)
    "should_stop": (
        "an asynchronous run stops at max_updates or max_seconds in start(); stopping "
        "on a metric has no counterpart yet"
    ),
    # the constructor
    "fraction_train": (
        "every active node trains, with no round: use "
        "engine=EngineSettings(max_in_flight=<fraction_train x nodes>) to have at most "
        "that many train at once"
    ),
    "fraction_evaluate": (
        "use federated_evaluation=FederatedEvaluation(every=<updates>, "
        "fraction_evaluate=...) (nodes evaluate every that many client updates)"
    ),
    "min_train_nodes": (
        "there is no round to fill: use engine=EngineSettings(min_nodes=...) (nodes "
        "to wait for before training starts) and max_in_flight (at most that many at once)"
    ),
    "min_evaluate_nodes": (
        "use federated_evaluation=FederatedEvaluation(every=<updates>, min_evaluate_nodes=...)"
    ),
    "min_available_nodes": (
        "use engine=EngineSettings(min_nodes=...) (nodes to wait for, up to "
        "startup_timeout, before training starts)"
    ),
    "weighted_by_key": (
        "the server rule applies each update on its own (no average over a round); "
        "federated evaluation: FederatedEvaluation(every=<updates>, weighted_by_key=...)"
    ),
    "arrayrecord_key": (
        'train messages carry the model under "arrays" (FedAvg\'s default); not configurable'
    ),
    "configrecord_key": (
        'train messages carry the config under "config" (FedAvg\'s default); not configurable'
    ),
    "train_metrics_aggr_fn": (
        "the engine reads each reply's train-loss (or train_loss) itself: the mean per "
        "evaluation window is in result.train_metrics_clientapp and on_evaluate's metrics"
    ),
    "evaluate_metrics_aggr_fn": (
        "use federated_evaluation=FederatedEvaluation(every=<updates>, "
        "evaluate_metrics_aggr_fn=...)"
    ),
}


def fedavg_refusal(given: Mapping[str, Any]) -> str | None:
    """The refusal message for the FedAvg keywords among ``given``, or None if none.

    One sentence per keyword (joined by ". "), in the order given, each naming its
    counterpart.
    """
    found = [k for k in given if k in FEDAVG_COUNTERPARTS]
    if not found:
        return None
    return ". ".join(f"{k} is FedAvg's; {FEDAVG_COUNTERPARTS[k]} {_GUIDE}" for k in found)
