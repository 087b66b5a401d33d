"""Issue 23 items 3 and 4: a server short of memory or disk says so and ends "failed".

Item 3: at start the engine logs its expected peak memory (the rule's model copies,
the messages in flight) and warns, naming averaging="slot" and max-in-flight, when
it exceeds the memory available; a MemoryError becomes a failed run whose reason
quotes that estimate, with summary.json and metrics.csv written (before: an empty
``MemoryError:`` from ``start()``). Item 4: a checkpoint that cannot be written (no
space, no permission) ends the run failed, naming the file and the OS error; the
previous checkpoint stays valid (before: two chained tracebacks, no summary.json).
"""

from __future__ import annotations

import csv
import errno
import json
import os
import tempfile

import numpy as np
import pytest

from clients.client_app import app as client_app
from flwr_gsgm.checkpoint import atomic
from flwr_gsgm.checkpoint import files as checkpoint
from flwr_gsgm.engine import memory
from flwr_gsgm.engine.memory import MemoryEstimate, size_text
from flwr_gsgm.engine.run_end import RunFailed
from flwr_gsgm.engine.settings import EngineSettings
from flwr_gsgm.model.optimizer import ModelOptimizer
from flwr_gsgm.simulation.inprocess_grid import InProcessGrid
from flwr_gsgm.simulation.virtual_clock import VirtualClock
from flwr_gsgm.strategy.strategies import ASGD, GSGM
from serverapp.app_config import parse_app_config
from serverapp.experiment import run_experiment
from tests.engine.quadratic_app import initial_arrays, make_app

EVEN = VirtualClock(seed=0, base_duration=1.0, slow_fraction=0.0, jitter=0.0)
# The quadratic model: w (2 float32) and b (1 float32): 12 bytes, all trainable.
TABLE = (
    "180 B (gsgm, averaging='table', 3 nodes: 9 model copies of 12 B in the rule + 3 "
    "messages in flight x 2 copies of 12 B)"
)
ADVICE = (
    'lower it with averaging="slot" (GSGM: at most 2 + nodes model copies, table averaging '
    "3 + 2 x nodes) or max-in-flight (fewer messages in flight: each costs 2 model copies), "
    "or use fewer nodes or a smaller model"
)


def small_run(**overrides):
    return parse_app_config(
        {
            "strategy": "asgd",
            "partitioner": "iid",
            "max-updates": 6,
            "eval-every": 2,
            "eval-examples": 100,
            **overrides,
        }
    )


# ------------------------------------------------------------------ item 3: memory
def test_the_estimate_is_the_rules_copies_and_the_messages_in_flight():
    assert size_text(180) == "180 B" and size_text(4 << 20) == "4.0 MiB"
    # The case: 300 nodes, a 4 MiB model, GSGM's table averaging, weights mode
    # (each message in flight keeps the weights sent: 3 copies).
    est = MemoryEstimate("gsgm", "table", 300, 3 + 2 * 300, 4 << 20, 4 << 20, 300, 3)
    assert est.total_bytes == (603 + 900) * (4 << 20)
    assert est.describe().startswith("5.9 GiB (gsgm, averaging='table', 300 nodes: 603 model")


def test_a_warning_when_the_expected_peak_exceeds_the_memory_available(monkeypatch, caplog):
    monkeypatch.setattr(memory, "available_memory", lambda: (100, "a test limit"))
    grid = InProcessGrid(make_app(), 3, run_config={})
    report = GSGM(virtual_clock=EVEN).start(grid, initial_arrays(), max_updates=6).report
    expected = f"the expected peak server memory {TABLE} exceeds the memory available 100 B (a test limit): {ADVICE}"
    assert report.warnings == [expected]
    assert expected in caplog.text
    assert f"[async] expected peak server memory {TABLE}; memory available 100 B" in caplog.text
    # Slot averaging under max-in-flight=1: 2 + 3 copies, 1 message in flight.
    grid = InProcessGrid(make_app(), 3, run_config={})
    settings = EngineSettings(max_in_flight=1)
    GSGM(virtual_clock=EVEN, engine=settings).start(grid, initial_arrays(), max_updates=6)
    assert (
        "expected peak server memory 84 B (gsgm, averaging='slot', 3 nodes: 5 model copies "
        "of 12 B in the rule + 1 messages in flight x 2 copies of 12 B)" in caplog.text
    )


def test_enough_memory_gives_no_warning(caplog):
    grid = InProcessGrid(make_app(), 3, run_config={})
    report = GSGM(virtual_clock=EVEN).start(grid, initial_arrays(), max_updates=6).report
    assert report.warnings == [] and report.status == "completed"
    assert f"[async] expected peak server memory {TABLE}" in caplog.text


def out_of_memory_at(call: int, monkeypatch) -> None:
    """The server's ``call``-th update (1-based) raises MemoryError() (empty, as numpy's)."""
    real, calls = ModelOptimizer.on_update, []

    def on_update(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise MemoryError()
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ModelOptimizer, "on_update", on_update)


def test_a_memory_error_ends_the_run_failed_with_the_estimate(monkeypatch):
    monkeypatch.setattr(memory, "available_memory", lambda: (100, "a test limit"))
    out_of_memory_at(4, monkeypatch)
    grid = InProcessGrid(make_app(), 3, run_config={})
    with pytest.raises(RunFailed) as err:
        GSGM(virtual_clock=EVEN).start(grid, initial_arrays(), max_updates=30)
    assert err.value.status == "failed"
    assert err.value.reason == (
        f"out of memory (MemoryError) after 4 of 30 updates; the expected peak server memory "
        f"is {TABLE}, the memory available at start 100 B (a test limit): {ADVICE}"
    )
    report = err.value.result.report
    assert (report.status, report.status_reason) == ("failed", err.value.reason)
    assert report.counters["updates_received"] == 4


def test_a_memory_error_writes_summary_and_metrics(tmp_path, monkeypatch):
    out_of_memory_at(3, monkeypatch)
    cfg = small_run()
    with InProcessGrid(client_app, 2, run_config=cfg) as grid, pytest.raises(RunFailed) as err:
        run_experiment(grid, cfg, tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert summary["status_reason"] == err.value.reason
    assert err.value.reason.startswith(
        "out of memory (MemoryError) after 3 of 6 updates; the expected peak server memory is "
    )
    assert "asgd, 2 nodes: 1 model copies of" in err.value.reason
    assert 'averaging="slot"' in err.value.reason and "max-in-flight" in err.value.reason
    metrics = (tmp_path / "run" / "metrics.csv").read_text().splitlines()
    assert [line.split(",")[0] for line in metrics[1:]] == ["0", "2"]  # rows before it


def test_a_memory_error_while_the_rule_is_built_still_writes_summary(tmp_path, monkeypatch):
    def no_memory(self, *args, **kwargs):
        raise MemoryError("Unable to allocate 4.00 MiB")

    monkeypatch.setattr(ModelOptimizer, "__init__", no_memory)
    cfg = small_run()
    with InProcessGrid(client_app, 2, run_config=cfg) as grid, pytest.raises(RunFailed) as err:
        run_experiment(grid, cfg, tmp_path / "run")
    assert err.value.result is None
    assert err.value.reason == (
        "out of memory (MemoryError: Unable to allocate 4.00 MiB) after 0 of 6 updates, "
        "while the server rule was built (before the peak memory was estimated: the model "
        "alone is too large)"
    )
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["status"], summary["status_reason"]) == ("failed", err.value.reason)
    assert (tmp_path / "run" / "metrics.csv").read_text().startswith("updates,")


# ------------------------------------------------------------------ item 4: disk
class DiskFull:
    """A file whose writes fail with ENOSPC, as on a full disk."""

    def __init__(self, fh) -> None:
        self._fh = fh

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self._fh, name)


def disk_full_from(call: int, monkeypatch) -> None:
    """Checkpoint writes from the ``call``-th on (1-based) hit a full disk."""
    real, calls = checkpoint.atomic_write, []

    def atomic_write(path, write, **kwargs):
        calls.append(1)
        if len(calls) < call:
            return real(path, write, **kwargs)
        return real(path, lambda fh: write(DiskFull(fh)), **kwargs)

    monkeypatch.setattr(checkpoint, "atomic_write", atomic_write)


def test_a_full_disk_ends_the_run_failed_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    disk_full_from(2, monkeypatch)
    cfg = small_run(**{"checkpoint-every": 2})
    run = tmp_path / "run"
    with InProcessGrid(client_app, 2, run_config=cfg) as grid, pytest.raises(RunFailed) as err:
        run_experiment(grid, cfg, run)
    path = run / "checkpoint.pt"
    size = path.stat().st_size
    assert err.value.reason == (
        f"checkpoint {path} could not be written: [Errno 28] No space left on device (ENOSPC); "
        f"the previous checkpoint there ({size} bytes) is unchanged and resumes (at 4 updates)"
    )
    assert checkpoint.load(path)["received"] == 2  # the previous checkpoint, still valid
    assert not [p.name for p in run.iterdir() if p.name.endswith(".tmp")]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["status"], summary["status_reason"]) == ("failed", err.value.reason)
    assert summary["updates_received"] == 4
    metrics = (run / "metrics.csv").read_text().splitlines()
    assert [line.split(",")[0] for line in metrics[1:]] == ["0", "2", "4"]


def test_a_checkpoint_folder_without_write_permission_ends_the_run_failed(tmp_path, monkeypatch):
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    real = tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):
        # Root ignores the mode bits: refuse as the kernel does for anyone else.
        if dir is not None and os.path.samefile(dir, folder):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(dir))
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(atomic.tempfile, "mkstemp", mkstemp)
    path = folder / "checkpoint.pt"
    settings = EngineSettings(checkpoint_every=3, checkpoint_path=path)
    grid = InProcessGrid(make_app(), 2, run_config={})
    try:
        with pytest.raises(RunFailed) as err:
            ASGD(virtual_clock=EVEN, engine=settings).start(grid, initial_arrays(), max_updates=9)
    finally:
        folder.chmod(0o755)
    assert err.value.reason == (
        f"checkpoint {path} could not be written: [Errno 13] Permission denied (EACCES); no "
        "checkpoint was written there before (at 3 updates)"
    )
    report = err.value.result.report
    assert (report.status, report.counters["updates_received"]) == ("failed", 3)
    # No checkpoint and no temporary file. The reply log is there: root ignores the
    # mode bits (only mkstemp refuses here); it holds the 3 updates and no checkpoint
    # row, which is written only once a save succeeded.
    assert sorted(p.name for p in folder.iterdir()) == ["replies.csv"]
    rows = list(csv.DictReader((folder / "replies.csv").open()))
    assert [(r["event"], r["received"]) for r in rows] == [
        ("update", "1"),
        ("update", "2"),
        ("update", "3"),
    ]


def test_an_os_error_under_the_archive_is_named_and_other_errors_pass_through(
    tmp_path, monkeypatch
):
    """zipfile fails again while closing the archive after the file's error (a
    ValueError of a closed file, say): the file's first OSError is named."""
    real = checkpoint.atomic_write

    def fails_then_closes(path, write, **kwargs):
        def wrapped(fh):
            try:
                write(DiskFull(fh))
            except OSError as err:
                raise ValueError("I/O operation on closed file.") from err

        return real(path, wrapped, **kwargs)

    monkeypatch.setattr(checkpoint, "atomic_write", fails_then_closes)
    path = tmp_path / "checkpoint.pt"
    with pytest.raises(checkpoint.CheckpointWriteError) as err:
        checkpoint.save(path, {"received": 1})
    assert str(err.value) == (
        f"checkpoint {path} could not be written: [Errno 28] No space left on device (ENOSPC); "
        "no checkpoint was written there before"
    )
    assert err.value.errno == errno.ENOSPC
    assert not path.exists() and list(tmp_path.iterdir()) == []

    def buggy_write(path, write, **kwargs):
        raise RuntimeError("a bug, not a failed write")

    monkeypatch.setattr(checkpoint, "atomic_write", buggy_write)
    with pytest.raises(RuntimeError, match="a bug, not a failed write"):
        checkpoint.save(path, {"received": 1})


def test_a_state_the_file_cannot_hold_is_refused_before_any_file(tmp_path):
    path = tmp_path / "checkpoint.pt"
    with pytest.raises(TypeError) as err:
        checkpoint.save(path, {"nodes": {3: {"since": object()}}})
    assert str(err.value) == (
        "checkpoint state state['nodes'][3]['since']: a object cannot be saved (numpy "
        "arrays and python values only)"
    )
    with pytest.raises(TypeError, match=r"state\['rows'\]: an object array cannot be saved"):
        checkpoint.save(path, {"rows": np.array([{}], dtype=object)})
    assert list(tmp_path.iterdir()) == []
