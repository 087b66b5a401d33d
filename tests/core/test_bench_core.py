"""``benchmarks/bench_core.py --quick`` runs and prints a row per rule and variant.

Timings are not asserted (the machine is shared); the floors are: they are counted,
not measured, and the table's meaning rests on them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from flwr_gsgm.core import OPTIMIZERS

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_core.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_core", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_run_has_a_row_per_rule_and_gsgm_variant(capsys):
    bench = load_bench()
    rows = bench.main(["--quick"])
    printed = capsys.readouterr().out
    cases = {r["case"] for r in rows}
    assert {r["rule"] for r in rows} == set(OPTIMIZERS)
    variants = {"gsgm slot heavy-ball", "gsgm slot ema", "gsgm table heavy-ball", "gsgm table ema"}
    assert variants <= cases
    for case in cases:
        assert case in printed
    by = {(r["case"], r["kind"]): r for r in rows}
    # Floors, counted: ASGD reads g to validate it, then g and w, and writes w: 4 / 3.
    assert by[("asgd", "applied")]["floor"] == 4 / 3
    # GSGM slot averaging, an applied arrival: validation, g, M, w, S; w, S: 7 / 3.
    assert by[("gsgm slot ema", "applied")]["floor"] == 7 / 3
    # ... with table averaging, + the row and the table sum read and written: 11 / 3.
    assert by[("gsgm table ema", "applied")]["floor"] == 11 / 3
    assert by[("fedbuff", "into buffer")]["floor"] == 4 / 3
    assert by[("dcasgd", "dispatch")]["floor"] == 2 / 3
    # Memory, in model copies for the bench's 4 nodes: FedBuff w and its buffer sum (2),
    # + its K = 5 updates when trimming; GSGM's close step w, M, S and up to 4 slots
    # (2 + 4), + the cycle's contributions when trimming (2 x 4).
    copies = {r["case"]: r["copies"] for r in rows}
    assert copies["fedbuff"] == 2 and copies["fedbuff trimmed"] == 7
    assert copies["gsgm close"] == 6 and copies["gsgm close trimmed"] == 14
    # No verdict below 10M parameters: the target is stated at 10M.
    assert {r["verdict"] for r in rows} == {"-"}
