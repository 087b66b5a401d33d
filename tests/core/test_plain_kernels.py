"""Each rule's plain kernel and its chunked fast path agree, arrival by arrival.

For every rule of the registry (GSGM in each of its variants, the baselines with and
without their options) the fast rule and the plain kernel its docstring points to
(:class:`~flwr_gsgm.core.base.PlainKernel`) run the same seeded sequence of events:
dispatches, arrivals of six nodes at different speeds (so staleness varies, GSGM's
slots fold, buffers fill), the fast node lost and back later, node 5 joining, and
the whole fleet leaving before two nodes come back. The weights are float32 arrays
laid end to end over 1198 values, and ``CHUNK`` is made 64 here, so every chunked
kernel crosses chunk boundaries (inside an array and between arrays) while the test
stays fast. After every event the weights agree to float32
rounding (the two order their float32 operations differently), the versions are
equal, and every outcome is the same; at the end each case has gone through the
paths it is there for (deferred and applied updates, slots, expired rows, late group
members...), so that agreeing is not vacuous.
"""

from __future__ import annotations

import re
import sys
from typing import Any

import numpy as np
import pytest

import flwr_gsgm.core.base as core_base
import flwr_gsgm.core.robust as core_robust
from flwr_gsgm.core import OPTIMIZERS, make_optimizer
from flwr_gsgm.core.base import PlainKernel
from flwr_gsgm.scheduling.compass import ArrivalGroups

#: Model arrays: 35 + 150 + 12 + 1001 = 1198 float32 values, 21 chunks of at most 64.
SHAPES = [(7, 5), (150,), (3, 2, 2), (1001,)]
SMALL_CHUNK = 64
EVENTS = 64
#: Churn, event -> nodes: the fast node 0 (holding a slot, a row, a cache...) leaves
#: and comes back, node 5 joins, then every node leaves (None) and two come back.
LOST: dict[int, list[int] | None] = {15: [0], 48: None}
JOINED = {25: [5], 38: [0], 51: [1, 4]}
LR = 0.1
#: Relative speed of each node: the chance it is the next to arrive, among those in flight.
SPEED = {0: 4.0, 1: 1.0, 2: 1.5, 3: 1.0, 4: 0.7, 5: 2.0}
#: Parameters of a rule that are not its plain kernel's: the base class's bounds
#: (left unset here) and FedCompass's scheduler's.
NOT_THE_KERNELS = {
    "max_staleness",
    "max_norm",
    "min_local_steps",
    "max_local_steps",
    "latest_factor",
    "speed_momentum",
}
#: GSGM as docs/GSGM.md steps 1-5 define it (tests/core/core_testutil.py's GSGM_STRICT).
STRICT = dict(momentum_form="heavy-ball", cycle_quorum=1.0, averaging="slot", lr_scaling="step")
DISPLACEMENT = dict(displacement=True, lr=1.0)


def case(rule: str, params: dict[str, Any] | None = None, **check: Any) -> dict[str, Any]:
    """A case: ``rule`` built with ``params``. ``check``: ``outcomes`` that must occur,
    ``counters`` that must end above 0, ``kinds`` of FedCompass arrivals that must
    occur; ``book``: FedCompass with arrival groups; ``hold``: the driver obeys
    :meth:`holds` as the engine does."""
    return dict(rule=rule, params=params or {}, **check)


CASES: dict[str, dict[str, Any]] = {
    # GSGM, gradient mode's defaults: a step per arrival, table averaging, ema, lr per cycle.
    "gsgm": case(
        "gsgm",
        outcomes={"applied", "deferred"},
        counters=("cycles", "cycles_quorum", "slots_applied"),
    ),
    "gsgm-slot-heavy-ball": case(
        "gsgm",
        dict(averaging="slot", momentum_form="heavy-ball"),
        outcomes={"applied", "deferred"},
        counters=("cycles", "slots_applied"),
    ),
    "gsgm-slot-ema": case(
        "gsgm",
        dict(averaging="slot", momentum_form="ema"),
        outcomes={"applied", "deferred"},
        counters=("cycles", "slots_applied"),
    ),
    "gsgm-table-heavy-ball": case(
        "gsgm",
        dict(averaging="table", momentum_form="heavy-ball"),
        outcomes={"applied", "deferred"},
        counters=("cycles", "slots_applied"),
    ),
    "gsgm-strict": case(
        "gsgm",
        STRICT,
        outcomes={"applied", "deferred"},
        counters=("cycles", "slots_applied", "slots_dropped"),
    ),
    "gsgm-beta0": case("gsgm", dict(beta=0.0), counters=("cycles", "slots_applied")),
    "gsgm-concurrency": case(
        "gsgm", dict(concurrency=3), counters=("cycles", "slots_applied")
    ),  # "auto" resolves to slot averaging under the limit
    "gsgm-nosched": case(
        "gsgm", dict(scheduling=False), outcomes={"applied"}, counters=("cycles",)
    ),
    # GSGM, displacement modes' defaults: the cycle's staleness-weighted mean at its close.
    "gsgm-displacement": case(
        "gsgm",
        DISPLACEMENT,
        outcomes={"applied", "deferred"},
        counters=("cycles", "cycles_quorum", "slots_applied"),
    ),
    "gsgm-displacement-held": case(
        "gsgm", DISPLACEMENT, hold=True, outcomes={"applied", "deferred"}, counters=("cycles",)
    ),
    "gsgm-displacement-strict": case(
        "gsgm",
        dict(DISPLACEMENT, cycle_quorum=1.0),
        outcomes={"applied", "deferred"},
        counters=("cycles", "slots_applied", "slots_dropped"),
    ),
    "gsgm-displacement-trim": case(
        "gsgm",
        dict(DISPLACEMENT, trim_fraction=0.34),
        outcomes={"applied", "deferred"},
        counters=("cycles", "slots_applied"),
    ),
    "gsgm-displacement-nosched": case(
        "gsgm",
        dict(DISPLACEMENT, scheduling=False),
        outcomes={"applied", "deferred"},
        counters=("cycles",),
    ),
    "asgd": case("asgd", outcomes={"applied"}),
    "masgd": case("masgd", outcomes={"applied"}),
    # A lambda large enough that the compensation moves w visibly.
    "dcasgd": case("dcasgd", dict(dc_lambda=2.0), outcomes={"applied"}),
    "dcasgd-displacement": case(
        "dcasgd", dict(dc_lambda=2.0, update_scale=0.5), outcomes={"applied"}
    ),
    "fedasync": case("fedasync", outcomes={"applied"}),
    "fedbuff": case("fedbuff", outcomes={"applied", "deferred"}),
    "fedbuff-trim": case("fedbuff", dict(trim_fraction=0.2), outcomes={"applied", "deferred"}),
    "ca2fl": case("ca2fl", outcomes={"applied", "deferred"}),
    "ca2fl-m3": case("ca2fl", dict(buffer_size=3), outcomes={"applied", "deferred"}),
    "ace": case("ace", outcomes={"applied"}, counters=("resyncs",)),
    "aced": case(
        "ace", dict(max_row_age=4), outcomes={"applied", "stale"}, counters=("rows_expired",)
    ),
    "daasgd": case("daasgd", outcomes={"applied"}, counters=("steps_shrunk",)),
    "daasgd-threshold": case(
        "daasgd", dict(delay_threshold=2), outcomes={"applied"}, counters=("steps_shrunk",)
    ),
    "fedcompass": case(
        "fedcompass",
        book=True,
        outcomes={"applied", "deferred"},
        kinds={"single", "group", "late"},
    ),
    "fedcompass-concurrency": case(
        "fedcompass",
        dict(concurrency=3),
        book=True,
        outcomes={"applied", "deferred"},
        kinds={"single", "group", "late"},
    ),
    "fedcompass-no-scheduler": case("fedcompass", outcomes={"applied", "deferred"}),
}


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 64 values: the fast paths cross many chunk boundaries on a small model."""
    monkeypatch.setattr(core_base, "CHUNK", SMALL_CHUNK)
    monkeypatch.setattr(core_robust, "CHUNK", SMALL_CHUNK)


def kernel_of(cls: type) -> type[PlainKernel]:
    """The plain kernel ``cls``'s docstring points to, from the rule's own module."""
    found = re.search(r"The update, written plainly: :class:`(\w+)`", cls.__doc__ or "")
    assert found, f"{cls.__name__}'s docstring does not point to its plain kernel"
    kernel = getattr(sys.modules[cls.__module__], found.group(1), None)
    assert isinstance(kernel, type) and issubclass(kernel, PlainKernel), found.group(1)
    return kernel


def flat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([a.reshape(-1) for a in arrays])


class LoggedGroups(ArrivalGroups):
    """Arrival groups that log what each arrival was (single, group, late, off)."""

    def __init__(self) -> None:
        super().__init__()
        self.kinds: list[str] = []

    def arrive(self, partition_id: int, now: float) -> tuple[str, int | None]:
        kind, gid = super().arrive(partition_id, now)
        self.kinds.append(kind)
        return kind, gid


def run(name: str) -> None:
    """Drive the rule and its plain kernel through the same events, comparing them."""
    spec = CASES[name]
    rng = np.random.default_rng(48)
    weights = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    params = dict(spec["params"])
    lr = params.pop("lr", LR)
    opt = make_optimizer(spec["rule"], weights, range(5), lr=lr, **params)
    assert opt.params["max_staleness"] is None and opt.params["max_norm"] is None
    kernel_params = {k: v for k, v in opt.params.items() if k not in NOT_THE_KERNELS}
    books: list[LoggedGroups] = []
    if spec.get("book"):
        books = [LoggedGroups(), LoggedGroups()]  # the rule's, the kernel's
        opt.share_schedule(books[0])
        kernel_params["book"] = books[1]
    plain = kernel_of(type(opt))(flat(weights), range(5), **kernel_params)
    now = 0.0
    in_flight: dict[int, int] = {}  # node -> the version it was sent
    outcomes: set[str] = set()

    def agree(what: str) -> None:
        np.testing.assert_allclose(
            plain.w, opt.flat_weights, rtol=1e-5, atol=1e-6, err_msg=f"{name}: {what}"
        )
        assert plain.version == opt.version, f"{name}: {what}: version"
        if books:
            assert books[0].state_dict() == books[1].state_dict(), f"{name}: {what}: groups"

    def schedule(node: int) -> None:
        """FedCompass: put ``node``'s message in an arrival group, as the scheduler does
        (some messages get none: the node's update then arrives as a single one)."""
        if rng.random() < 0.15:
            return
        later = [gid for gid, g in books[0].open_groups() if g.expected > now]
        if later and rng.random() < 0.7:
            for book in books:
                book.join(later[-1], node)
        else:
            expected = now + rng.uniform(1.0, 4.0)
            latest = now + 1.5 * (expected - now)
            for book in books:
                book.create(expected, latest, node)

    def dispatch_idle() -> None:
        for node in sorted(opt.active_nodes - set(in_flight)):
            if (spec.get("hold") and opt.holds(node)) or (books and books[0].holds(node)):
                continue
            opt.on_dispatch(node)
            plain.dispatch(node)
            in_flight[node] = opt.version
            if books:
                schedule(node)

    agree("start")
    dispatch_idle()
    for i in range(EVENTS):
        now += float(rng.uniform(0.1, 1.0))
        if i in LOST:
            for node in LOST[i] or sorted(opt.active_nodes):
                opt.on_node_lost(node, now=now)
                plain.lost(node, now=now)
                in_flight.pop(node, None)
                agree(f"node {node} lost")
        elif i in JOINED:
            for node in JOINED[i]:
                opt.on_node_joined(node, now=now)
                plain.joined(node, now=now)
                agree(f"node {node} joined")
        elif books and i % 7 == 6:
            opt.on_deadline(now)
            plain.deadline(now)
            agree(f"deadline at {now:.2f}")
        dispatch_idle()
        if not in_flight:
            continue
        nodes = sorted(in_flight)
        p = np.array([SPEED[n] for n in nodes])
        node = int(rng.choice(nodes, p=p / p.sum()))
        update = [(rng.standard_normal(s) * 0.5).astype(np.float32) for s in SHAPES]
        base = in_flight.pop(node)
        got = opt.on_update(node, update, base, now=now).value
        want = plain.arrive(node, flat(update), base, now=now)
        assert got == want, f"{name}: arrival {i} (node {node}, base {base}): {got} != {want}"
        outcomes.add(got)
        agree(f"arrival {i} (node {node}, staleness {opt.last_staleness}, {got})")
        dispatch_idle()

    # The sequence went through the paths the case is there for.
    assert spec.get("outcomes", set()) <= outcomes, (name, outcomes)
    counters = opt.counters
    for key in spec.get("counters", ()):
        assert counters[key] > 0, (name, key, counters)
    assert spec.get("kinds", set()) <= set(books[0].kinds if books else ()), name


@pytest.mark.parametrize("name", sorted(CASES))
def test_plain_kernel_agrees_with_the_fast_path(name: str) -> None:
    run(name)


def test_every_rule_points_to_its_plain_kernel_and_has_a_case() -> None:
    for rule, cls in OPTIMIZERS.items():
        kernel = kernel_of(cls)
        assert kernel.__module__ == cls.__module__, rule
        assert any(spec["rule"] == rule for spec in CASES.values()), rule
