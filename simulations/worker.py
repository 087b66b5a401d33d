"""Sweep runs in a separate process: ``python -m simulations.worker RUN_DIR``, or
``python -m simulations.worker --serve REPLY_FD`` (several runs, one after another).

Reads ``RUN_DIR/spec.json`` (``{"nodes": int, "run_config": {...}}``), validates the
run config, and runs :func:`serverapp.experiment.run_experiment` on an
:class:`~flwr_gsgm.simulation.inprocess_grid.InProcessGrid` of the project's ClientApp, which
writes ``config.json``, ``metrics.csv``, ``summary.json`` and ``accuracy.png`` into
``RUN_DIR``. On an exception it writes ``error.txt`` (the traceback) and exits 1, so
the sweep records the run as failed and goes on. A run whose model diverged
(:class:`~flwr_gsgm.engine.run_end.RunDiverged`, outputs written, ``summary.json`` ``status``
"diverged") exits :data:`DIVERGED_EXIT` (3) without ``error.txt``: a result, not a
crash; the sweep counts it as run, and ``runs.csv`` as diverged.

``--serve``: read run folders from standard input, one per line, and run each as
above, with the process's standard output and error (file descriptors 1 and 2)
sent to ``RUN_DIR/log.txt`` during the run; after each run write its exit code
(0 or 1) and a newline to file descriptor ``REPLY_FD``. Imports, the data set and
the partitions are then loaded once per process instead of once per run (about
5-8 s saved per run). Nothing else carries over: every run reseeds everything it
uses (the model initialisation, the clock, each client dispatch). If the process
dies (a crash, a kill on time-out), the sweep marks that run failed and starts a
new process for the next one.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

__all__ = ["DIVERGED_EXIT", "run_one", "serve", "main"]

#: Exit code of a run whose model diverged (scripts/run_simulation.sh uses it too).
DIVERGED_EXIT = 3


def run_one(run_dir: Path) -> dict:
    """Run the experiment described by ``run_dir/spec.json``; return its summary."""
    from clients.client_app import app
    from flwr_gsgm.simulation.inprocess_grid import InProcessGrid
    from serverapp.app_config import parse_app_config
    from serverapp.experiment import run_experiment

    spec = json.loads((run_dir / "spec.json").read_text())
    cfg = parse_app_config(spec["run_config"])
    grid = InProcessGrid(app, int(spec["nodes"]), cfg)
    return run_experiment(grid, cfg, run_dir)


def _diverged(err: BaseException) -> bool:
    from flwr_gsgm.engine.run_end import RunDiverged

    return isinstance(err, RunDiverged)


def _log_end(err: BaseException) -> None:
    """The last log line of a diverged run (as the ServerApp's END_MARKER line)."""
    print(f"[flwr-gsgm] run ended: diverged: {getattr(err, 'reason', err)}", flush=True)


def _run_logged(run_dir: Path) -> int:
    """Run one experiment with fds 1 and 2 sent to ``run_dir/log.txt``; return 0, 1 or
    :data:`DIVERGED_EXIT`."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with (run_dir / "log.txt").open("w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            run_one(run_dir)
            code = 0
        except Exception as err:  # noqa: BLE001 - recorded, then reported through the reply
            if _diverged(err):
                _log_end(err)
                code = DIVERGED_EXIT
            else:
                (run_dir / "error.txt").write_text(traceback.format_exc())
                traceback.print_exc()
                code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
    return code


def serve(reply_fd: int) -> int:
    """Run the run folders named on standard input; reply each exit code on ``reply_fd``."""
    with os.fdopen(reply_fd, "w", buffering=1) as reply:
        for line in sys.stdin:
            run_dir = line.strip()
            if run_dir:
                reply.write(f"{_run_logged(Path(run_dir))}\n")
    return 0


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--serve":
        return serve(int(argv[1]))
    if len(argv) != 1:
        print("usage: python -m simulations.worker RUN_DIR | --serve REPLY_FD", file=sys.stderr)
        return 2
    run_dir = Path(argv[0])
    try:
        run_one(run_dir)
    except BaseException as err:  # noqa: BLE001 - recorded, then reported through the exit code
        if _diverged(err):
            _log_end(err)
            return DIVERGED_EXIT
        (run_dir / "error.txt").write_text(traceback.format_exc())
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
