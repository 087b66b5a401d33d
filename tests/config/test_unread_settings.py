"""Settings that do nothing are reported (issue 23 item 5).

Before, ``strategy="asgd" beta=0.9`` ran plain ASGD without a word (and config.json
recorded beta=0.9 as if it applied). A server optimizer key the strategy does not
read (:func:`flwr_gsgm.config.run_config.strategy_keys`), set to a non-default value, now
gives a warning in the log and in summary.json ``warnings``.
"""

from __future__ import annotations

import json

import pytest

from clients.client_app import app as client_app
from flwr_gsgm.config.run_config import parse_run_config, unread_settings
from flwr_gsgm.simulation.inprocess_grid import InProcessGrid
from serverapp.experiment import run_experiment


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            {"strategy": "asgd", "beta": 0.9},
            [
                "run config beta=0.9 does nothing: strategy 'asgd' does not read 'beta' (it "
                "reads max-norm, max-staleness, server-learning-rate)"
            ],
        ),
        (
            {"strategy": "fedbuff", "cycle-quorum": 0.3},
            [
                "run config cycle-quorum=0.3 does nothing: strategy 'fedbuff' does not read "
                "'cycle-quorum' (it reads fedbuff-k, max-norm, max-staleness, "
                "server-learning-rate, trim-fraction)"
            ],
        ),
        (
            {"strategy": "gsgm", "fedbuff-k": 3, "dc-lambda": 0.1},
            [
                "run config dc-lambda=0.1 does nothing: strategy 'gsgm' does not read "
                "'dc-lambda' (it reads apply-at, averaging, beta, cycle-quorum, lr-scaling, max-norm, "
                "max-staleness, momentum-form, scheduling, server-learning-rate, trim-fraction)",
                "run config fedbuff-k=3 does nothing: strategy 'gsgm' does not read "
                "'fedbuff-k' (it reads apply-at, averaging, beta, cycle-quorum, lr-scaling, max-norm, "
                "max-staleness, momentum-form, scheduling, server-learning-rate, trim-fraction)",
            ],
        ),
        (
            {"strategy": "gsgm", "client-mode": "weights", "beta": 0.9},
            [
                "run config beta=0.9 does nothing: GSGM steps at each cycle's close "
                "(apply-at='auto', client-mode='weights'), where 'beta' does not enter; set "
                'apply-at = "arrival" to use it'
            ],
        ),
        ({"strategy": "gsgm", "client-mode": "weights", "apply-at": "arrival", "beta": 0.9}, []),
        ({"strategy": "gsgm", "client-mode": "gradient", "beta": 0.9}, []),
        (
            {"strategy": "fedavg", "server-learning-rate": 0.5},
            [
                "run config server-learning-rate=0.5 does nothing: strategy 'fedavg' does not "
                "read 'server-learning-rate' (it reads none of the optimizer keys)"
            ],
        ),
        (
            {"strategy": "fedavgm", "max-norm": 10.0},
            [
                "run config max-norm=10.0 does nothing: strategy 'fedavgm' does not read "
                "'max-norm' (it reads beta, server-learning-rate)"
            ],
        ),
        # a key the strategy reads, at any value: nothing
        ({"strategy": "masgd", "beta": 0.9}, []),
        ({"strategy": "fedavgm", "beta": 0.9, "server-learning-rate": 0.5}, []),
        # a key it does not read, at its default: nothing
        ({"strategy": "asgd", "beta": 0.5, "fedbuff-k": 5, "cycle-quorum": 0.5}, []),
        ({"strategy": "fedavg", "server-learning-rate": 0.0, "max-norm": 0.0}, []),
        ({}, []),
    ],
)
def test_unread_settings(overrides, expected):
    assert unread_settings(parse_run_config(overrides)) == expected


def test_the_warning_lands_in_summary_json(tmp_path, caplog):
    cfg = parse_run_config(
        {
            "strategy": "asgd",
            "beta": 0.9,
            "partitioner": "iid",
            "max-updates": 6,
            "eval-every": 6,
            "eval-examples": 100,
        }
    )
    with InProcessGrid(client_app, 2, run_config=cfg) as grid:
        summary = run_experiment(grid, cfg, tmp_path / "run")
    expected = [
        "run config beta=0.9 does nothing: strategy 'asgd' does not read 'beta' (it reads "
        "max-norm, max-staleness, server-learning-rate)"
    ]
    assert summary["warnings"] == expected
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["warnings"] == expected
    assert expected[0] in caplog.text
