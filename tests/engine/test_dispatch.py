"""Concurrency limit (max-in-flight) and dispatch policies on the in-process grid.

The quadratic ClientApp (node p returns w - target_p) and the virtual clock make
every run reproducible, so counts and orders are compared exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, MetricRecord

from flwr_gsgm.engine.async_engine import AsyncEngine, EngineSettings
from flwr_gsgm.engine.dispatch_policy import RandomDispatch, ScheduledDispatch, make_dispatch_policy
from flwr_gsgm.engine.in_flight import InFlight
from flwr_gsgm.model.layout import ModelLayout
from flwr_gsgm.model.optimizer import ModelOptimizer
from flwr_gsgm.simulation.inprocess_grid import InProcessGrid
from flwr_gsgm.simulation.virtual_clock import VirtualClock
from flwr_gsgm.strategy.strategies import ASGD, GSGM
from tests.engine.quadratic_app import initial_arrays, make_app

# 8 nodes, a quarter of them (partitions 4 and 7) 4x slower.
CLOCK = VirtualClock(seed=3, base_duration=1.0, slow_fraction=0.25, slow_factor=4.0, jitter=0.1)


class RecordingGrid(InProcessGrid):
    """In-process grid noting the partition-id of every train message pushed, in order."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trained: list[int] = []

    def push_messages(self, messages):
        messages = list(messages)
        for msg in messages:
            if msg.metadata.message_type == "train":
                self.trained.append(
                    int(self.contexts[msg.metadata.dst_node_id].node_config["partition-id"])
                )
        return super().push_messages(messages)


@pytest.fixture
def engine_log(monkeypatch):
    """Record, at every push, the engine's in-flight count and the partitions in flight,
    and every update received (partition-id, in the order the engine applies them)."""
    log = {"in_flight": [], "busy": [], "received": []}
    push, apply = InFlight.push_train, AsyncEngine._on_update

    def recording_push(self, dispatch, node_id, weights):
        push(self, dispatch, node_id, weights)
        log["in_flight"].append(len(self))
        log["busy"].append(sorted(d.partition_id for d in self.dispatches.values()))

    def recording_apply(self, node, dispatch, reply):
        log["received"].append(dispatch.partition_id)
        return apply(self, node, dispatch, reply)

    monkeypatch.setattr(InFlight, "push_train", recording_push)
    monkeypatch.setattr(AsyncEngine, "_on_update", recording_apply)
    return log


def run(strategy_cls=ASGD, num_nodes=8, max_updates=200, app=None, seed=3, clock=CLOCK, **engine):
    grid = RecordingGrid(app or make_app(), num_nodes, run_config={})
    strategy = strategy_cls(
        server_learning_rate=0.1, virtual_clock=clock, seed=seed, engine=EngineSettings(**engine)
    )
    result = strategy.start(
        grid,
        initial_arrays(),
        max_updates=max_updates,
        eval_every=20,
        evaluate_fn=lambda step, arr: MetricRecord(
            {"accuracy": float(arr["w"].numpy()[0]), "loss": float(arr["b"].numpy()[0])}
        ),
    )
    return result, grid


def spreads(sequence: list[int], num_nodes: int) -> list[int]:
    """max - min of the per-partition counts after each element of ``sequence``."""
    counts = np.zeros(num_nodes, int)
    out = []
    for pid in sequence:
        counts[pid] += 1
        out.append(int(counts.max() - counts.min()))
    return out


def strip(rows):
    """Rows without wall time, NaN written as "nan" (NaN != NaN once a checkpoint reloads it)."""
    return [{k: ("nan" if v != v else v) for k, v in r.items() if k != "wall_time"} for r in rows]


def test_scheduled_dispatch_keeps_per_node_contributions_even_with_4x_slower_nodes(engine_log):
    assert [p for p, f in CLOCK.speed_factors(list(range(8))).items() if f > 1] == [4, 7]
    result, grid = run(max_in_flight=2, dispatch="scheduled")
    assert result.report.counters["updates_received"] == 200
    # Contributions counted when dispatched (received + in flight): spread <= 1 at every dispatch.
    assert max(spreads(grid.trained, 8)) == 1
    # Counted when received, a slow node's update lands 4 s after dispatch: spread <= 2.
    received = engine_log["received"]
    assert max(spreads(received, 8)) == 2
    assert np.bincount(received, minlength=8).tolist() == [25] * 8  # 200 updates, 8 nodes
    # No slot wasted: after the start both slots are busy at every dispatch.
    assert set(engine_log["in_flight"][1:]) == {2}


def test_random_dispatch_lets_per_node_contributions_drift_apart(engine_log):
    result, grid = run(max_in_flight=2, dispatch="random")
    assert result.report.counters["updates_received"] == 200
    assert max(spreads(grid.trained, 8)) == 18
    counts = np.bincount(engine_log["received"], minlength=8)
    assert counts.sum() == 200 and counts.max() - counts.min() == 15


def test_scheduled_still_beats_random_when_a_slow_node_is_the_bottleneck():
    # 4 nodes, 2 slots, one node 4x slower: even counts would need the fast slot to idle,
    # so neither policy keeps them even, but scheduled keeps them 3x closer.
    spread = {}
    for dispatch in ("scheduled", "random"):
        _, grid = run(num_nodes=4, max_in_flight=2, dispatch=dispatch)
        spread[dispatch] = max(spreads(grid.trained, 4))
    assert spread == {"scheduled": 15, "random": 40}


@pytest.mark.parametrize("dispatch", ["random", "scheduled"])
def test_never_more_than_max_in_flight_nodes_train_at_once(engine_log, dispatch):
    result, _ = run(max_in_flight=3, dispatch=dispatch, max_updates=120)
    assert result.report.counters["updates_received"] == 120
    assert max(engine_log["in_flight"]) == 3
    # One dispatch per node at most: the partitions in flight are distinct.
    assert all(len(set(busy)) == len(busy) for busy in engine_log["busy"])


def test_random_dispatch_is_seeded_and_reproducible():
    orders = {}
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        _, grid = run(max_in_flight=2, dispatch="random", seed=seed, max_updates=60)
        orders[name] = grid.trained
    assert len(orders["a"]) >= 60
    assert orders["a"] == orders["b"]
    assert orders["a"] != orders["c"]


@pytest.mark.parametrize("strategy_cls", [ASGD, GSGM])
def test_max_in_flight_at_or_above_the_nodes_equals_no_limit(strategy_cls):
    plain, plain_grid = run(strategy_cls, num_nodes=4, max_updates=90)
    for limit, dispatch in (
        (0, "random"),
        (None, "scheduled"),
        (4, "random"),
        (4, "scheduled"),
        (10, "random"),
    ):
        limited, grid = run(
            strategy_cls, num_nodes=4, max_updates=90, max_in_flight=limit, dispatch=dispatch
        )
        assert strip(limited.rows) == strip(plain.rows), (limit, dispatch)
        assert grid.trained == plain_grid.trained
        for k, v in plain.arrays.items():
            np.testing.assert_array_equal(limited.arrays[k].numpy(), v.numpy())


def test_gsgm_auto_averaging_runs_as_slot_under_a_limit_and_as_table_without(caplog):
    # The whole engine: GSGM's default ("auto") gives the same rows and weights as the
    # variant it resolves to, and the run log says which.
    def gsgm(averaging):
        return lambda **kw: GSGM(averaging=averaging, **kw)

    for limit, variant in ((3, "slot"), (None, "table")):
        caplog.clear()
        auto, auto_grid = run(gsgm("auto"), max_updates=90, max_in_flight=limit)
        explicit, explicit_grid = run(gsgm(variant), max_updates=90, max_in_flight=limit)
        other, _ = run(
            gsgm({"slot": "table", "table": "slot"}[variant]), max_updates=90, max_in_flight=limit
        )
        assert strip(auto.rows) == strip(explicit.rows), limit
        assert strip(other.rows) != strip(explicit.rows), limit  # the variants differ here
        assert auto_grid.trained == explicit_grid.trained
        for k, v in explicit.arrays.items():
            np.testing.assert_array_equal(auto.arrays[k].numpy(), v.numpy())
        logged = [r.getMessage() for r in caplog.records if "averaging = auto ->" in r.getMessage()]
        assert logged == [f"[async] gsgm: averaging = auto -> {variant!r}"], limit


def test_a_node_that_keeps_failing_is_excluded_and_its_slot_goes_to_another(engine_log):
    result, grid = run(
        num_nodes=4,
        max_updates=60,
        app=make_app(raise_for={1}),
        max_in_flight=2,
        dispatch="scheduled",
    )
    c = result.report.counters
    # Backed off after each of its first 4 failures, excluded at the 5th (max-node-failures).
    assert c["error_replies"] == 5 and c["node_backoffs"] == 4 and c["nodes_excluded"] == 1
    assert c["nodes_lost"] == 0
    assert c["updates_received"] == 60
    assert grid.trained.count(1) == 5  # five failures, then never again
    assert max(engine_log["in_flight"]) == 2
    assert 1 not in engine_log["received"]


def test_a_vanished_node_is_lost_under_the_limit_and_frees_its_slot(engine_log):
    # One slot, scheduled: round robin 0, 1, 2, 3, 0, ... The 10th update (partition 1)
    # sends partition 2 its work, then partition 2's node vanishes: the run stalls on
    # it until dispatch-timeout, loses it and goes on with the other three.
    grid = RecordingGrid(make_app(), 4, run_config={})
    strategy = ASGD(
        server_learning_rate=0.1,
        virtual_clock=None,
        engine=EngineSettings(
            dispatch_timeout=0.3, poll_interval=0.001, max_in_flight=1, dispatch="scheduled"
        ),
    )

    def evaluate_fn(step, arrays):
        if step == 10:
            grid.remove_node(3)  # partition 2 goes silent
        return MetricRecord({"accuracy": 0.0, "loss": 0.0})

    result = strategy.start(
        grid, initial_arrays(), max_updates=40, evaluate_fn=evaluate_fn, eval_every=10
    )
    c = result.report.counters
    assert c["updates_received"] == 40
    assert c["nodes_lost"] == 1 and c["lost_in_flight"] == 1
    assert set(engine_log["in_flight"]) == {1}
    assert engine_log["received"][:10] == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    assert grid.trained[10] == 2 and 2 not in grid.trained[11:]
    assert sorted(set(engine_log["received"][10:])) == [0, 1, 3]


@pytest.mark.parametrize("apply_at", ["arrival", "close"])
@pytest.mark.parametrize("dispatch", ["random", "scheduled"])
def test_resume_under_the_limit_equals_the_uninterrupted_run(tmp_path, dispatch, apply_at):
    # apply_at = "close": the hold (nodes that contributed to the open cycle get no work)
    # is rebuilt from the checkpoint's cycle state, so the resumed run dispatches alike.
    settings = dict(max_in_flight=3, dispatch=dispatch, checkpoint_every=20)

    def gsgm(**kw):
        return GSGM(apply_at=apply_at, **kw)

    whole, whole_grid = run(
        gsgm, num_nodes=6, max_updates=100, checkpoint_path=tmp_path / "whole.pt", **settings
    )

    def dies_at_60(step, arrays):  # evaluation at 60 comes before the checkpoint at 60
        if step == 60:
            raise KeyboardInterrupt("killed")
        return MetricRecord(
            {"accuracy": float(arrays["w"].numpy()[0]), "loss": float(arrays["b"].numpy()[0])}
        )

    path = tmp_path / "run.pt"
    strategy = gsgm(
        server_learning_rate=0.1,
        virtual_clock=CLOCK,
        seed=3,
        engine=EngineSettings(checkpoint_path=path, **settings),
    )
    with pytest.raises(KeyboardInterrupt):
        strategy.start(
            RecordingGrid(make_app(), 6, run_config={}),
            initial_arrays(),
            max_updates=100,
            eval_every=20,
            evaluate_fn=dies_at_60,
        )
    resumed, resumed_grid = run(
        gsgm, num_nodes=6, max_updates=100, checkpoint_path=path, resume=True, **settings
    )
    # It resumed at 40 updates: the 3 dispatches in flight re-sent plus 57 new, 60 of the whole run's 100.
    assert len(resumed_grid.trained) == len(whole_grid.trained) - 40
    assert resumed.rows[0]["updates"] == 0 and len(resumed.rows) == 6  # 0, 20, ..., 100
    assert strip(resumed.rows) == strip(whole.rows)
    assert resumed.report.counters == whole.report.counters
    for k, v in whole.arrays.items():
        np.testing.assert_array_equal(resumed.arrays[k].numpy(), v.numpy())


def test_policy_state_round_trips():
    a = RandomDispatch(seed=7)
    a.pick([0, 1, 2])
    b = RandomDispatch(seed=0)
    b.load_state_dict(a.state_dict())
    assert [a.pick([0, 1, 2, 3]) for _ in range(20)] == [b.pick([0, 1, 2, 3]) for _ in range(20)]
    s = ScheduledDispatch()
    for pid, t in ((0, 1.0), (1, 0.5), (0, 2.0)):
        s.on_reply(pid, t, counted=True)
    s.on_reply(2, 3.0, counted=False)  # an error reply: not an update, but a reply
    assert s.pick([0, 1, 2, 3]) == 3  # never replied: first
    assert s.pick([0, 1, 2]) == 2  # 0 updates
    assert s.pick([0, 1]) == 1  # 1 update vs 2
    t = ScheduledDispatch()
    t.load_state_dict(s.state_dict())
    assert t.updates == {0: 2, 1: 1} and t.last_reply == {0: 2.0, 1: 0.5, 2: 3.0}
    with pytest.raises(ValueError, match="dispatch='random'"):
        t.load_state_dict(a.state_dict())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"max_in_flight": -1},
            "max-in-flight must be an integer >= 0 (0 = all nodes) or None, got -1",
        ),
        (
            {"max_in_flight": 1.5},
            "max-in-flight must be an integer >= 0 (0 = all nodes) or None, got 1.5",
        ),
        ({"dispatch": "fifo"}, "dispatch must be auto, random or scheduled, got 'fifo'"),
    ],
)
def test_bad_engine_settings_name_the_key_and_value(kwargs, message):
    with pytest.raises(ValueError) as err:
        EngineSettings(**kwargs)
    assert str(err.value) == message
    if "dispatch" in kwargs:
        with pytest.raises(
            ValueError, match="dispatch must be one of random, scheduled, got 'fifo'"
        ):
            make_dispatch_policy("fifo")


def test_gsgm_learns_the_concurrency_limit_from_the_engine():
    # The engine hands its max-in-flight to the rule factory (ModelOptimizer ->
    # RuleSpec): no call back into the strategy.
    weights = [np.zeros(2, np.float32)]
    layout, arrays = ModelLayout.from_record(initial_arrays())
    for settings, given, expected in (
        (EngineSettings(max_in_flight=3), {}, 3),
        (EngineSettings(), {}, None),
        (EngineSettings(max_in_flight=0), {}, None),  # 0 = every node
        (EngineSettings(max_in_flight=3), {"concurrency": 5}, 5),  # a value given wins
    ):
        strategy = GSGM(engine=settings, lr_scaling="cycle", **given)
        built = ModelOptimizer(
            layout, arrays, strategy.rule_spec, list(range(8)), settings.max_in_flight
        )
        assert built.rule.params["concurrency"] == expected
        assert strategy.rule_spec(weights, list(range(8)), None).params["concurrency"] == (
            given.get("concurrency")
        )


def test_the_engine_hands_its_limit_to_the_rule_factory():
    seen = []
    spec = GSGM(lr_scaling="cycle").rule_spec

    def factory(weights, pids, concurrency):
        seen.append(concurrency)
        return spec(weights, pids, concurrency)

    for limit in (2, 0):
        settings = EngineSettings(max_in_flight=limit, max_updates=4, virtual_clock=CLOCK)
        grid = InProcessGrid(make_app(), 3, run_config={})
        AsyncEngine(
            grid, initial_arrays(), factory, ConfigRecord({"mode": "gradient"}), settings
        ).run()
    assert seen == [2, None]


def test_gsgm_default_averaging_is_slot_only_under_a_limit_that_leaves_nodes_idle():
    # averaging = "auto" (the default): 3 in flight of 8 nodes -> slot; every node in
    # flight (no limit, or a limit of 8 or more) -> table.
    weights = [np.zeros(2, np.float32)]
    cases = [(3, "slot"), (None, "table"), (8, "table"), (20, "table")]
    for limit, variant in cases:
        strategy = GSGM(engine=EngineSettings(max_in_flight=limit))
        optimizer = strategy.rule_spec(weights, list(range(8)), strategy.engine.max_in_flight)
        assert optimizer.params["averaging"] == "auto"
        assert optimizer.averaging_in_use == variant, limit


def test_auto_dispatch_schedules_gsgm_and_draws_at_random_for_the_others():
    assert EngineSettings().dispatch == "auto"  # the run config default
    assert GSGM().dispatch_policy == "scheduled"
    assert GSGM(scheduling=False).dispatch_policy == "random"
    assert ASGD().dispatch_policy == "random"
    assert GSGM(engine=EngineSettings(dispatch="random")).dispatch_policy == "random"


def test_prefetch_keeps_two_messages_per_node_in_flight(engine_log):
    """Deployment option: every node has a second train message queued (real arrival
    order), so each update it sends finds the next one waiting."""
    grid = RecordingGrid(make_app(), 3, run_config={})
    strategy = ASGD(
        server_learning_rate=0.1,
        virtual_clock=None,
        engine=EngineSettings(poll_interval=0.001, prefetch=True),
    )
    result = strategy.start(
        grid,
        initial_arrays(),
        max_updates=30,
        evaluate_fn=lambda step, arr: MetricRecord({"accuracy": 0.0, "loss": 0.0}),
        eval_every=10,
    )
    assert result.report.counters["updates_received"] == 30
    # At the start: one message per node, then the second of each.
    assert grid.trained[:6] == [0, 1, 2, 0, 1, 2]
    assert engine_log["in_flight"][:6] == [1, 2, 3, 4, 5, 6]
    # Never more than two per node; the budget counts messages in flight: 30 in all.
    assert all(max(busy.count(p) for p in set(busy)) <= 2 for busy in engine_log["busy"])
    assert len(grid.trained) == 30
    # Until the budget leaves fewer than 6 messages to send, 6 are in flight at each push.
    assert set(engine_log["in_flight"][5:25]) == {6}
    # The six first messages carry version 0: the last of them to be applied is 5
    # versions stale (one message per node in flight would bound that at 2).
    assert result.report.staleness_max >= 5


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"prefetch": True, "virtual_clock": CLOCK},
            "prefetch needs virtual-clock = false and max-in-flight = 0, got "
            "virtual-clock = True, max-in-flight = 0",
        ),
        (
            {"prefetch": True, "max_in_flight": 2},
            "prefetch needs virtual-clock = false and max-in-flight = 0, got "
            "virtual-clock = False, max-in-flight = 2",
        ),
    ],
)
def test_prefetch_needs_real_arrival_order_and_no_limit(kwargs, message):
    with pytest.raises(ValueError) as err:
        EngineSettings(**kwargs)
    assert str(err.value) == message
    with pytest.raises(ValueError, match="prefetch needs virtual-clock = false"):
        ASGD(virtual_clock=CLOCK, engine=EngineSettings(prefetch=True))


def test_prefetch_is_refused_for_the_rules_that_keep_the_weights_sent():
    from flwr_gsgm.strategy.strategies import DCASGD, FedAsync

    for cls, name in ((DCASGD, "dcasgd"), (FedAsync, "fedasync")):
        with pytest.raises(ValueError) as err:
            cls(virtual_clock=None, engine=EngineSettings(prefetch=True))
        assert str(err.value) == (
            f"prefetch: strategy {name!r} keeps the weights sent to each node for one "
            "message in flight per node; expected prefetch = false"
        )
