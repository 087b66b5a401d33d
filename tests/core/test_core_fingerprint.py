"""Bit-for-bit guard of every rule's numerics: sha256 of the weights after a fixed run.

Each rule (and each GSGM variant: slot / table averaging, heavy-ball / ema momentum,
the ablations) runs the same seeded sequence of dispatches, updates (a fast node
among slower ones, so slots fold and cycles close), a node lost and a node joined,
on float32 weights with one array longer than ``CHUNK`` (so the chunked kernels
cross a chunk boundary). The sha256 of the final weights' bytes is compared with
``EXPECTED``.

The hashes in ``EXPECTED`` were computed by the OLD code, before the core step was
optimized (issue 25 item 6: preallocated scratch, ``out=`` kernels, one fused
finite check), on main at 6362796, except two whose rules were meant to change:
``fedbuff`` (the paper's staleness weight 1 / sqrt(1 + tau)) and ``ca2fl`` (a lost
node keeps its cache, as the paper keeps every client's), recorded after 1ba1b20.
An optimization that changes any float32
operation or its order changes a hash: do not update one without saying why the
numerics were meant to change.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest

from flwr_gsgm.core import make_optimizer

#: Shapes of the fingerprint model: small arrays and one over CHUNK elements (2**16 now,
#: 2**18 when the hashes were recorded), so the chunked kernels cross chunk boundaries.
SHAPES = [(7, 5), (13,), (3, 2, 2), (300_001,)]

#: (rule, params): every rule with its declared defaults, GSGM in each variant.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "gsgm-slot-heavy-ball": ("gsgm", dict(averaging="slot", momentum_form="heavy-ball")),
    "gsgm-slot-ema": ("gsgm", dict(averaging="slot", momentum_form="ema")),
    "gsgm-table-heavy-ball": ("gsgm", dict(averaging="table", momentum_form="heavy-ball")),
    "gsgm-table-ema": ("gsgm", dict(averaging="table", momentum_form="ema")),
    "gsgm-slot-strict-step": (
        "gsgm",
        dict(averaging="slot", cycle_quorum=1.0, lr_scaling="step", momentum_form="heavy-ball"),
    ),
    "gsgm-nosched": ("gsgm", dict(scheduling=False)),
    "gsgm-beta0": ("gsgm", dict(beta=0.0)),
    "asgd": ("asgd", {}),
    "masgd": ("masgd", {}),
    "dcasgd": ("dcasgd", {}),
    "fedasync": ("fedasync", {}),
    "fedbuff": ("fedbuff", {}),
    "ca2fl": ("ca2fl", {}),
    "ace": ("ace", {}),
    "daasgd": ("daasgd", {}),
}

#: sha256 of the final weights, computed by the OLD code (see the module docstring).
EXPECTED: dict[str, str] = {
    "ace": "f52a19cc86d9140934ee345c4187907c748aaf396afb272378f8ddb303b91803",
    "asgd": "76c57dcb1440a1edd8fdf47639294095d267cdccea7d20a45dcf5ed118d81726",
    "ca2fl": "80d0381de0b0f9ff43de733eedb493749508e6bbd1d40790c0f4baa50f51bee1",
    "daasgd": "17fc7061eb95f7d94f63a178840abbcbfb1d6d966d2f2ea64fbd90fbfc5843fb",
    "dcasgd": "8210472b32e2d3459884228b0ec59d6ca06d162073d9c947b773d899ceb72e8b",
    "fedasync": "e90ba645f3d08728bd96df338fc0063c2f609b3552f46b3d6ab29ff515c5cdcb",
    "fedbuff": "3efda48b7a7636fc22f826f4179fe1077035888c05b77a1500d5a629d176929f",
    "gsgm-beta0": "82477a10486ff3e0ed878c6ce7406be4e8c3ac969f55505833f375655fe96591",
    "gsgm-nosched": "552d03da36113ef37934bd4afff67b8d4dc2785341773d6e028875dab5d9d353",
    "gsgm-slot-ema": "a1fe773583b6bb10f0af3ecf8597881bc4209875786a4e157982193f336414f6",
    "gsgm-slot-heavy-ball": "f30f27fe1168b8b8e6abe647b98b02041b9a8405bf0d399ba6a00702c928e129",
    "gsgm-slot-strict-step": "822c150e79ee503d72f0cf5472a648f67361f90acecf86aae8e132703a35db3a",
    "gsgm-table-ema": "ad5997374374619b31697686dcd6ab9d50ac063041c1147f6db78526e203ffa8",
    "gsgm-table-heavy-ball": "19693048ef931158a05b0c71bfc6106809a1cc6b7776f713fdc2ce5e71f306a9",
    "masgd": "cb516cd50a4ed9075a05ab8b809476adbf8155cca18626d9b095c8e9a69f29b8",
}


def run_sequence(name: str, params: dict[str, Any]) -> list[np.ndarray]:
    """The fixed seeded sequence; returns copies of the final weights (float32)."""
    rng = np.random.default_rng(2025)
    weights = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    nodes = [0, 1, 2, 3, 4]
    opt = make_optimizer(name, weights, nodes, lr=0.05, **params)
    sent: dict[int, int] = {}
    now = 0.0

    def dispatch(n: int) -> None:
        opt.on_dispatch(n)
        sent[n] = opt.version

    for n in nodes:
        dispatch(n)
    # Node 0 is fast (every other arrival), the rest take turns; node 3 is lost at
    # arrival 17 and rejoins at arrival 25.
    slow = [1, 2, 3, 4]
    for i in range(40):
        now += 0.5
        if i == 17:
            opt.on_node_lost(3, now=now)
            sent.pop(3)
            slow.remove(3)
        if i == 25:
            opt.on_node_joined(3, now=now)
            dispatch(3)
            slow.append(3)
        n = 0 if i % 2 == 0 else slow[(i // 2) % len(slow)]
        g = [(rng.standard_normal(s) * 0.1).astype(np.float32) for s in SHAPES]
        opt.on_update(n, g, sent[n], now=now)
        dispatch(n)
    return [a.copy() for a in opt.weights]


def fingerprint(arrays: list[np.ndarray]) -> str:
    h = hashlib.sha256()
    for a in arrays:
        assert a.dtype == np.float32
        h.update(a.tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("case", sorted(CASES))
def test_weights_bit_for_bit(case: str) -> None:
    name, params = CASES[case]
    assert fingerprint(run_sequence(name, params)) == EXPECTED[case]


if __name__ == "__main__":  # print the hashes (run on the old code to record them)
    for case in sorted(CASES):
        print(f'    "{case}": "{fingerprint(run_sequence(*CASES[case]))}",')
