"""Helpers shared by the tests of flwr_gsgm.core (imported by module name)."""

from __future__ import annotations

from typing import Any

import numpy as np

#: GSGM as docs/GSGM.md steps 1-5 define it: heavy-ball momentum, strictly even cycles
#: (quorum 1.0), slot averaging. The hand-computed tests use it; the shipped defaults
#: (ema, quorum 0.5, table) are the tuned choice, declared in ``GSGM.PARAMS``.
GSGM_STRICT = dict(
    momentum_form="heavy-ball", cycle_quorum=1.0, averaging="slot", lr_scaling="step"
)


def f32(*values: float) -> np.ndarray:
    """A 1-D float32 array of the given values."""
    return np.array(values, dtype=np.float32)


def assert_bits_equal(a: np.ndarray, b: np.ndarray, what: str = "array") -> None:
    """Same dtype, shape and bytes (distinguishes -0.0 from 0.0, NaN payloads)."""
    assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray), what
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{what}: shape {a.shape} != {b.shape}"
    assert a.tobytes() == b.tobytes(), f"{what}: values differ\n{a}\n{b}"


def assert_state_equal(a: Any, b: Any, path: str = "state") -> None:
    """Recursive, exact comparison of two state dicts (arrays bit for bit)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert_bits_equal(a, b, path)
    elif isinstance(a, dict):
        assert isinstance(b, dict), path
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_state_equal(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_state_equal(x, y, f"{path}[{i}]")
    else:
        assert type(a) is type(b), f"{path}: {type(a)} != {type(b)} ({a!r}, {b!r})"
        assert a == b, f"{path}: {a!r} != {b!r}"


def assert_unchanged_but_rejected(before: dict, after: dict) -> None:
    """``after`` equals ``before`` except counters['rejected'], one higher."""
    expected = dict(before)
    counters = dict(before["counters"])
    counters["rejected"] += 1
    expected["counters"] = counters
    assert_state_equal(expected, after)


class Engine:
    """A tiny stand-in for the asynchronous engine: dispatch bookkeeping and clock.

    It records the version each node was last sent, calls ``on_dispatch`` on every
    send (as the real engine does) and keeps a clock for ``now``.
    """

    def __init__(self, opt: Any, nodes: list[int]) -> None:
        self.opt = opt
        self.now = 0.0
        self.sent: dict[int, int] = {}
        for n in nodes:
            self.dispatch(n)

    def dispatch(self, node: int) -> None:
        self.opt.on_dispatch(node)
        self.sent[node] = self.opt.version

    def update(self, node: int, arrays: list[np.ndarray], dt: float = 1.0):
        self.now += dt
        out = self.opt.on_update(node, arrays, self.sent[node], now=self.now)
        self.dispatch(node)
        return out

    def lost(self, node: int, dt: float = 0.0) -> None:
        self.now += dt
        self.opt.on_node_lost(node, now=self.now)
        self.sent.pop(node, None)

    def joined(self, node: int, dt: float = 0.0) -> None:
        self.now += dt
        self.opt.on_node_joined(node, now=self.now)
        self.dispatch(node)

    def snapshot(self) -> tuple[float, dict[int, int]]:
        return self.now, dict(self.sent)

    def restore(self, opt: Any, snap: tuple[float, dict[int, int]]) -> None:
        self.opt = opt
        self.now, sent = snap
        self.sent = dict(sent)
