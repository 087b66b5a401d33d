"""The run config keys of this project's Flower App, and the check of a whole run config.

The library (:mod:`flwr_gsgm.config.run_config`) declares the keys it reads: the
strategy, its budget and optimizer, the client work, the clock, the engine,
checkpoints and outputs. The keys below are the app's: its data (``dataset`` and
where it lies, how it is split over the nodes), its evaluation and its ClientApp's
threads, read by ``serverapp/`` and ``clients/`` only. They are declared with the
library's :class:`~flwr_gsgm.config.keys.RunConfigKey`, so they are checked, and
their errors worded, as the library's are.

:func:`parse_app_config` is the check every driver of the app runs before training
(the ServerApp, :func:`serverapp.experiment.run_experiment`, the sweep's worker): the
library's keys and the app's, defaults filled in, and a key neither declares refused
(``run config key(s) ['max-update'] unknown; did you mean max-updates? known keys:
[...]``). :data:`RUN_CONFIG`
is every key in the order of ``pyproject.toml`` ``[tool.flwr.app.config]`` and the
README's table (a test keeps the defaults equal). Nothing here imports torch or the
data: the presets (``simulations/``) check their run configs with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from clients.attacks import ATTACKS
from flwr_gsgm.config import run_config as library
from flwr_gsgm.config.keys import RunConfigKey, any_value, non_negative, one_of, positive

__all__ = ["APP_KEYS", "DATASET_CLASSES", "RUN_CONFIG", "parse_app_config"]

#: The data sets of ``clients/datasets.py`` and their number of classes.
DATASET_CLASSES = {"fashion-mnist": 10, "cifar10": 10, "cifar100": 100}


#: The server's evaluation (serverapp/experiment.py), listed after ``eval-every``.
EVALUATION_KEYS: dict[str, RunConfigKey] = {
    "eval-examples": RunConfigKey(
        0,
        non_negative,
        "an integer >= 0 (0 = the whole test set)",
        "server evaluation on a fixed random subset (seed 0) of this many test images",
    ),
    "eval-threads": RunConfigKey(
        2,
        positive,
        "an integer > 0",
        "threads of the server evaluation (same accuracy; loss up to float rounding)",
    ),
}

#: The ClientApp and its data (clients/), listed after the client work's keys.
NODE_KEYS: dict[str, RunConfigKey] = {
    "eval-max-examples": RunConfigKey(
        1000,
        positive,
        "an integer > 0",
        "ClientApp evaluate handler (federated evaluation): test images per node",
    ),
    "client-threads": RunConfigKey(
        1,
        positive,
        "an integer > 0",
        "torch threads per ClientApp (another value changes the bits of a run)",
    ),
    # data
    "dataset": RunConfigKey(
        "fashion-mnist",
        one_of(*DATASET_CLASSES),
        f"one of {', '.join(DATASET_CLASSES)}",
        "data set",
    ),
    "data-root": RunConfigKey(
        "/usr/share/datasets/fashion-mnist", any_value, "a folder", "where the data set lies"
    ),
    "partitioner": RunConfigKey(
        "pathological",
        one_of("pathological", "dirichlet", "iid"),
        "pathological, dirichlet or iid",
        "non-IID partitioning",
    ),
    "classes-per-node": RunConfigKey(
        2, positive, "an integer in [1, number of classes]", "pathological: classes per node"
    ),
    "dirichlet-alpha": RunConfigKey(0.5, positive, "> 0", "dirichlet: concentration alpha"),
    "examples-per-node": RunConfigKey(
        0,
        non_negative,
        "an integer >= 0 (0 = the whole partition)",
        "at most this many training examples per node (a seeded subset: a smaller epoch)",
    ),
    # lying nodes (clients/attacks.py): measuring what the server's defences stop
    "attack": RunConfigKey(
        "none",
        one_of(*ATTACKS),
        ", ".join(ATTACKS),
        "what the lying nodes send instead of their honest update",
    ),
    "attackers": RunConfigKey(
        0,
        non_negative,
        "an integer >= 0",
        "the nodes of partition-id below this lie (attack)",
    ),
}

#: Every key of the app's own (not the library's).
APP_KEYS: dict[str, RunConfigKey] = {**EVALUATION_KEYS, **NODE_KEYS}

# Where each group goes in the table of every key: after this library key.
_AFTER = {"eval-every": EVALUATION_KEYS, "local-momentum": NODE_KEYS}


def _every_key() -> dict[str, RunConfigKey]:
    keys: dict[str, RunConfigKey] = {}
    for key, spec in library.RUN_CONFIG.items():
        keys[key] = spec
        keys.update(_AFTER.get(key, {}))
    return keys


#: Every key of this app's run config, the library's and the app's, in table order.
RUN_CONFIG: dict[str, RunConfigKey] = _every_key()


def parse_app_config(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """Validate this app's run config and fill in the defaults of every key.

    ``run_config`` is ``context.run_config``, or one already parsed (parsing is
    idempotent): :func:`flwr_gsgm.config.run_config.parse_run_config` with
    :data:`APP_KEYS`, then the checks across the app's keys.

    Returns
    -------
    dict[str, Any]
        Every key of :data:`RUN_CONFIG` with a value of the key's type.

    Raises
    ------
    ValueError
        A key neither the library nor the app declares, a bad value (the message names
        the key, the value and what was expected; see ``parse_run_config``), or
        ``classes-per-node`` above the data set's number of classes.
    """
    cfg = library.parse_run_config(run_config, app_keys=APP_KEYS)
    num_classes = DATASET_CLASSES[cfg["dataset"]]
    if cfg["partitioner"] == "pathological" and cfg["classes-per-node"] > num_classes:
        raise ValueError(
            f"run config classes-per-node={cfg['classes-per-node']}: expected an integer in "
            f"[1, {num_classes}] ({cfg['dataset']} has {num_classes} classes)"
        )
    return cfg
