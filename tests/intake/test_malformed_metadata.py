"""Malformed reply metadata (issue 12 A): a bad train reply is rejected with reason
"metadata" naming the key and the value, a bad query reply registers no node; the
run goes on and the model ends as if the bad replies had never been sent."""

from __future__ import annotations

import numpy as np
import pytest

from flwr_gsgm.intake.reply import metadata_int
from flwr_gsgm.simulation.inprocess_grid import InProcessGrid
from tests.engine.quadratic_app import make_app
from tests.intake.test_hostile_replies import HOSTILE, run

# (key, bad value, text the rejection message must carry)
BAD_METADATA = [
    ("model-version", float("nan"), "'model-version' is nan"),
    ("model-version", float("inf"), "'model-version' is inf"),
    ("model-version", 1.7, "'model-version' is 1.7"),
    ("model-version", [0], "'model-version' is [0] (list)"),
    ("partition-id", float("-inf"), "'partition-id' is -inf"),
    ("partition-id", [3], "'partition-id' is [3] (list)"),
    ("partition-id", -3, "'partition-id' is -3"),
    ("num-examples", float("nan"), "'num-examples' is nan"),
    ("num-examples", [1, 2], "'num-examples' is [1, 2] (list)"),
    ("train-loss", [0.5], "'train-loss' is [0.5] (list)"),
]


def cycling(kinds):
    """Each reply of the hostile node sets the next key of ``kinds`` to its bad value."""
    calls = {"n": 0}

    def misbehave(pid, grad, metrics):
        key, value, _ = kinds[calls["n"] % len(kinds)]
        calls["n"] += 1
        metrics[key] = value
        return grad, metrics

    return misbehave


def without_hostile():
    grid = InProcessGrid(make_app(), 4, run_config={})
    grid.remove_node(HOSTILE + 1)
    return run(grid)


def test_metadata_int_accepts_integers_and_integral_floats_only():
    assert metadata_int("model-version", 3) == 3
    assert metadata_int("model-version", 3.0) == 3
    assert metadata_int("model-version", np.int64(2)) == 2
    for value in (float("nan"), float("inf"), -float("inf"), 1.7, [1], True, "1", -1):
        with pytest.raises(ValueError, match="'model-version'") as info:
            metadata_int("model-version", value)
        assert "expected an integer >= 0" in str(info.value)
        assert "1.0 is taken as 1" in str(info.value)


def test_bad_train_metadata_is_rejected_named_and_the_run_goes_on(caplog):
    result = run(InProcessGrid(make_app(misbehave={HOSTILE: cycling(BAD_METADATA)}), 4, {}))
    without = without_hostile()
    received = result.report.counters["updates_received"]
    hostile_replies = received - without.report.counters["updates_received"]
    assert hostile_replies > 2 * len(BAD_METADATA)
    assert result.report.rejections == {"metadata": hostile_replies}
    for key in ("w", "b"):
        assert np.array_equal(result.arrays[key].numpy(), without.arrays[key].numpy())
    logged = [
        r.getMessage()
        for r in caplog.records
        if "rejected update from node 4 (partition 3)" in r.getMessage()
    ]
    assert len(logged) == hostile_replies
    assert all("(metadata): metadata '" in line for line in logged)
    for _, _, text in BAD_METADATA:
        assert any(text in line for line in logged), text
    assert any("expected an integer >= 0 (an integral float such as 1.0" in x for x in logged)


def test_integral_floats_and_a_non_finite_train_loss_are_accepted():
    def floats(pid, grad, metrics):
        for key in ("partition-id", "model-version", "num-examples"):
            metrics[key] = float(metrics[key])
        metrics["train-loss"] = float("nan")  # left out of the loss mean, not a crash
        return grad, metrics

    result = run(InProcessGrid(make_app(misbehave={HOSTILE: floats}), 4, {}))
    honest = run(InProcessGrid(make_app(), 4, {}))
    assert result.report.rejections == {}
    assert result.report.counters == honest.report.counters
    for key in ("w", "b"):
        assert np.array_equal(result.arrays[key].numpy(), honest.arrays[key].numpy())
    losses = [row["train_loss"] for row in result.rows[1:]]
    assert losses and all(np.isfinite(x) for x in losses)


@pytest.mark.parametrize(
    "config,why",
    [
        ({"partition-id": float("nan"), "num-partitions": 3}, "'partition-id' is nan"),
        ({"partition-id": 1.7, "num-partitions": 3}, "'partition-id' is 1.7"),
        ({"partition-id": 2, "num-partitions": float("inf")}, "'num-partitions' is inf"),
        ({"partition-id": 2, "num-partitions": -3.0}, "'num-partitions' is -3.0"),
    ],
)
def test_a_query_reply_with_bad_metadata_registers_no_node(caplog, config, why):
    grid = InProcessGrid(make_app(), 3, run_config={})
    grid.add_node(config)
    result = run(grid)
    assert result.report.counters["nodes_refused"] == 1
    assert result.report.counters["updates_received"] > 0
    assert result.report.rejections == {}
    refused = [
        r.getMessage() for r in caplog.records if "refused: its query reply" in r.getMessage()
    ]
    assert len(refused) == 1 and why in refused[0]


def test_integral_floats_in_a_query_reply_are_taken_as_integers():
    grid = InProcessGrid(make_app(), 3, run_config={})
    grid.remove_node(3)  # partition 2's node
    grid.add_node({"partition-id": 2.0, "num-partitions": 3.0})
    result = run(grid)
    assert result.report.counters["nodes_refused"] == 0
    honest = run(InProcessGrid(make_app(), 3, run_config={}))
    for key in ("w", "b"):
        assert np.array_equal(result.arrays[key].numpy(), honest.arrays[key].numpy())
