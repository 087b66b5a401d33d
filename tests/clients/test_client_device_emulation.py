"""Node config ``step-seconds``: the ClientApp sleeps the remainder of steps x step-seconds.

No real waiting: the ClientApp's clock and sleep are a fake clock that only the
(real) computation, advanced by a fixed amount, and the sleep move. The durations
asserted are hand-computed: duration = max(compute, steps x step-seconds).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from flwr.app import ArrayRecord, Context, RecordDict

import clients.client_app as client_app
from clients.client_app import app, emulate_device
from clients.models import build_model
from tests.clients.test_client_app import RUN_CONFIG, train_msg


class FakeClock:
    """``perf_counter`` and ``sleep`` of a clock that stands still unless moved."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@pytest.fixture(scope="module")
def weights() -> ArrayRecord:
    return ArrayRecord(build_model("fashion-mnist", seed=0).state_dict())


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(
        client_app, "time", SimpleNamespace(perf_counter=fake.perf_counter, sleep=fake.sleep)
    )
    return fake


def computing_for(monkeypatch, clock: FakeClock, seconds: float) -> None:
    """Every local computation (the real one) advances the fake clock by ``seconds``."""
    real = client_app.compute_update

    def compute_update(*args, **kwargs):
        out = real(*args, **kwargs)
        clock.now += seconds
        return out

    monkeypatch.setattr(client_app, "compute_update", compute_update)


def node_context(**node_config) -> Context:
    return Context(
        run_id=1,
        node_id=42,
        node_config={"partition-id": 3, "num-partitions": 10, **node_config},
        state=RecordDict(),
        run_config=dict(RUN_CONFIG),
    )


def timed_train(clock: FakeClock, msg, ctx) -> tuple[float, dict]:
    """The message's duration on the fake clock and the reply's metrics."""
    start = clock.now
    reply = app(msg, ctx)
    assert not reply.has_error(), reply.error
    return clock.now - start, dict(reply.content["metrics"])


def test_emulate_device_sleeps_the_remainder():
    slept: list[float] = []
    # 4 steps of 0.5 s = 2.0 s; 1.5 s computed -> 0.5 s slept
    assert emulate_device(4, 0.5, 1.5, slept.append) == 0.5
    assert slept == [0.5]
    # computed longer than the device (2.5 s > 2.0 s): no sleep
    assert emulate_device(4, 0.5, 2.5, slept.append) == 0.0
    # exactly the device's time, and no emulation: no sleep
    assert emulate_device(4, 0.5, 2.0, slept.append) == 0.0
    assert emulate_device(3, 0.0, 0.1, slept.append) == 0.0
    assert slept == [0.5]


def test_weights_mode_lasts_steps_times_step_seconds(weights, clock, monkeypatch):
    computing_for(monkeypatch, clock, 0.2)
    msg = train_msg(weights, mode="weights", **{"local-steps": 5, "seed": 1})
    duration, metrics = timed_train(clock, msg, node_context(**{"step-seconds": 0.1}))
    # 5 steps x 0.1 s = 0.5 s: 0.2 s computed, then 0.3 s slept
    assert clock.slept == [pytest.approx(0.3)]
    assert duration == pytest.approx(0.5)
    assert duration >= 5 * 0.1 - 1e-12
    assert metrics["compute-time"] == pytest.approx(0.2)
    assert metrics["sleep-time"] == pytest.approx(0.3)


def test_gradient_mode_counts_mini_batches_as_steps(weights, clock, monkeypatch):
    computing_for(monkeypatch, clock, 0.05)
    msg = train_msg(weights, mode="gradient", **{"local-batches": 3, "local-steps": 9, "seed": 1})
    duration, metrics = timed_train(clock, msg, node_context(**{"step-seconds": 0.25}))
    # 3 mini-batches x 0.25 s = 0.75 s (local-steps is not gradient mode's work)
    assert clock.slept == [pytest.approx(0.7)]
    assert duration == pytest.approx(0.75)
    assert metrics["sleep-time"] == pytest.approx(0.7)


def test_a_computation_slower_than_the_device_is_not_padded(weights, clock, monkeypatch):
    computing_for(monkeypatch, clock, 0.7)
    msg = train_msg(weights, mode="weights", **{"local-steps": 5, "seed": 1})
    duration, metrics = timed_train(clock, msg, node_context(**{"step-seconds": 0.1}))
    assert clock.slept == []
    assert duration == pytest.approx(0.7)  # >= 5 x 0.1 s, by the computation alone
    assert metrics["sleep-time"] == 0.0
    assert metrics["compute-time"] == pytest.approx(0.7)


def test_without_step_seconds_nothing_sleeps_and_the_reply_is_unchanged(
    weights, clock, monkeypatch
):
    computing_for(monkeypatch, clock, 0.2)
    msg = train_msg(weights, mode="weights", **{"local-steps": 5, "seed": 1})
    duration, metrics = timed_train(clock, msg, node_context())
    assert clock.slept == []
    assert duration == pytest.approx(0.2)
    assert "sleep-time" not in metrics


@pytest.mark.parametrize("value", [-0.1, "fast", True])
def test_bad_step_seconds_raises_naming_the_key(weights, value):
    msg = train_msg(weights, mode="weights", **{"local-steps": 1, "seed": 1})
    with pytest.raises(ValueError, match="step-seconds"):
        app(msg, node_context(**{"step-seconds": value}))
