"""Run a sweep: tune on seed 0, then every question on the reporting seeds.

Usage::

    python -m simulations.sweep PRESET.toml [--jobs N] [--only QUESTION ...]
                                [--stage all|tune|report] [--out DIR] [--dry-run]
                                [--timeout SECONDS]

Stages (``--stage all``, the default, runs both):

1. ``tune``: for every method with a grid (``[methods.X] grid``), one run per grid
   point on the tuning seed (``[tune] seed``, default 0) in the tuning setting
   (``[tune] nodes``, ``partition``, ``device-profile``, ``config``), into
   ``OUT/tune/<method>/<grid point>/``; with named client works once per work the
   method runs with (:func:`simulations.preset.tune_works`), into
   ``OUT/tune/<method>/<work>/<grid point>/``.
   Methods that inherit from another are tuned after it, starting from its choice
   (for the same client work).
   The choice per (method, work) is the grid point with the best final accuracy
   (with a time budget, ``max-seconds``: the accuracy at the budget) among the
   runs that did not diverge; accuracies within ``tie-tolerance`` of the best
   tie, and ties go to the lower MASD, then to the earlier grid point
   (:func:`pick_best`). If every grid point diverged or failed, the one with the
   best finite accuracy is kept and flagged ``all-diverged``. Writes
   ``OUT/tune.csv`` (every tuning run, ``chosen`` marked) and ``OUT/tuned.toml``
   (per method, or ``method/work``, the full run-config overrides of its choice, and
   how it was picked).
2. ``report``: every question's runs (methods x reporting seeds x nodes x
   partitions x client works x device profiles) with the tuned overrides of its
   (method, work), into ``OUT/runs/<method>/<setting>/s<seed>/`` (setting:
   :func:`simulations.preset.setting_label`); a run shared by several
   questions runs once. Reads ``OUT/tuned.toml``; the reporting seeds never include
   the tuning seed (checked when the preset is read).

Runs execute outside the sweep's process, in worker processes
(``python -m simulations.worker --serve``, one run at a time each, on the in-process
Flower grid), so a crash or divergence of one run does not stop the sweep: an
exception is recorded in the run's ``error.txt``, a worker that dies (or is killed
after ``--timeout`` seconds) is replaced. A worker runs several runs in turn, which
saves the imports and data loading each time (``--fresh-process``: a new worker per
run). ``--jobs`` runs that many at once (default 1; each uses ``client-threads``
torch threads); runs start seed by seed (:func:`run_order`). A run whose
``summary.json`` exists is skipped (resume); one whose
folder holds results of a different config stops the sweep rather than mixing
them. A failed run (no ``summary.json``) is run again on the next invocation.

Outputs besides the run folders: ``OUT/runs.csv`` (one row per reporting run, see
:mod:`simulations.results` for the columns, the status and the divergence rule),
``OUT/plan.json`` (the preset, for the report) and ``OUT/sweep_log.json`` (one
entry per invocation, with its wall time). ``--dry-run`` prints the number of runs
and the estimated time (cost model in ``[estimate]``) and runs nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w
from tqdm import tqdm

from flwr_gsgm.checkpoint.atomic import atomic_write_text
from flwr_gsgm.config.outputs import strict_json
from simulations.preset import (
    Preset,
    RunSpec,
    estimate_seconds,
    grid_label,
    human_seconds,
    load_preset,
    method_base_config,
    partition_label,
    report_runs,
    setting_label,
    stand_in_tuned,
    tune_runs,
    tune_works,
    tuned_key,
)
from simulations.results import (
    RUN_COLUMNS,
    current_names,
    fill_times_to_reference,
    read_csv,
    run_row,
    without_retired,
    write_csv,
)
from simulations.worker import DIVERGED_EXIT

__all__ = [
    "ExecOptions",
    "SweepError",
    "pick_best",
    "run_sweep",
    "run_order",
    "dry_run",
    "read_tuned",
    "write_tuned",
    "main",
]

REPO_ROOT = Path(__file__).resolve().parents[1]
TUNE_COLUMNS = (*RUN_COLUMNS, "chosen")


class SweepError(RuntimeError):
    """A sweep cannot go on (e.g. a run folder holds results of another config)."""


@dataclass(frozen=True)
class ExecOptions:
    """How runs are executed: ``jobs`` at once, optional per-run ``timeout`` (s),
    no progress bar if ``quiet``, a new worker process per run if ``fresh``."""

    jobs: int = 1
    timeout: float | None = None
    quiet: bool = False
    fresh: bool = False


# ----------------------------------------------------------------- tuning rule
def _num(value: Any) -> float:
    """``value`` as a float; NaN for anything that is not a number."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def pick_best(
    rows: Sequence[Mapping[str, Any]],
    tie_tolerance: float = 0.0,
    score: str = "final_accuracy",
) -> tuple[int, bool]:
    """Index of the chosen tuning run in ``rows`` (grid order), and whether all diverged.

    Among rows with ``status == "ok"``: the highest ``score`` (``final_accuracy``, or
    ``accuracy_at_budget`` for time-budgeted runs); rows within ``tie_tolerance`` of it
    tie; among ties the lowest ``masd`` (NaN counts as worst), then the earliest row.
    If no row is ``ok``: the row with the highest finite ``score`` (else the first),
    and ``True``.

    Raises
    ------
    ValueError
        If ``rows`` is empty.
    """
    if not rows:
        raise ValueError("pick_best needs at least one tuning run")

    num = _num
    ok = [
        i
        for i, r in enumerate(rows)
        if r.get("status") == "ok" and math.isfinite(num(r.get(score)))
    ]
    if not ok:
        finite = [i for i, r in enumerate(rows) if math.isfinite(num(r.get(score)))]
        if not finite:
            return 0, True
        return max(finite, key=lambda i: (num(rows[i][score]), -i)), True
    best = max(num(rows[i][score]) for i in ok)
    ties = [i for i in ok if num(rows[i][score]) >= best - tie_tolerance]

    def masd_key(i: int) -> tuple[float, int]:
        m = num(rows[i].get("masd"))
        return (m if math.isfinite(m) else math.inf, i)

    return min(ties, key=masd_key), False


# ------------------------------------------------------------ tuned.toml I/O
def write_tuned(
    path: Path,
    preset: Preset,
    tuned: Mapping[str, Mapping[str, Any]],
    selection: Mapping[str, Mapping[str, Any]],
) -> Path:
    """Write ``tuned.toml``: ``[methods.X]`` overrides and ``[selection.X]`` facts.

    ``X`` is :func:`simulations.preset.tuned_key`: the method, or ``method/work`` for
    a named client work (its selection then names ``method`` and ``client-work``).
    Values are TOML's: numbers, booleans and strings (``nan`` for a NaN figure).
    """
    header = [
        f"# Tuned choices of `python -m simulations.sweep {preset.path}`.",
        f"# Tuning: seed {preset.tune_seed}, {preset.tune_nodes} nodes, partition "
        f"{partition_label(preset.tune_partition)}; rule: best final accuracy among runs that did "
        "not",
        f"# diverge, ties (within {preset.tie_tolerance:g}) to the lower MASD. The reporting seeds "
        f"{preset.seeds} use [methods.*].",
        "",
    ]
    tables = {"methods": {k: dict(v) for k, v in tuned.items()}}
    tables["selection"] = {k: dict(v) for k, v in selection.items()}
    return atomic_write_text(path, "\n".join(header) + "\n" + tomli_w.dumps(tables))


def read_tuned(path: Path) -> dict[str, dict[str, Any]]:
    """``{tuned_key: overrides}`` from ``tuned.toml`` (keys: the method, or
    ``method/work``; old run config key names read as the current ones)."""
    import tomllib

    if not path.is_file():
        raise SweepError(f"{path} not found: run the tune stage first (--stage tune or all)")
    methods = tomllib.loads(path.read_text()).get("methods", {})
    return {k: without_retired(current_names(v)) for k, v in methods.items()}


# ----------------------------------------------------------------- execution
def _spec_json(spec: RunSpec) -> dict[str, Any]:
    return {
        "run_id": spec.run_id,
        "stage": spec.stage,
        "method": spec.method,
        "seed": spec.seed,
        "nodes": spec.nodes,
        "partition": spec.partition,
        "grid_point": spec.grid_point,
        "run_config": spec.run_config,
        # only when named, so that spec.json of runs without client works is as before
        **({"client_work": spec.client_work} if spec.client_work else {}),
    }


def _recorded_config(config: dict[str, Any]) -> dict[str, Any]:
    """A run record's config under today's names; a deleted option's key at today's
    behaviour dropped (a record of a run that used a deleted option: kept as it is,
    so that it differs from every spec)."""
    config = current_names(config)
    try:
        return without_retired(config)
    except ValueError:
        return config


def _needs_run(run_dir: Path, spec: RunSpec) -> bool:
    """False if ``run_dir`` holds this run's results; True (folder cleaned) otherwise."""
    spec_path = run_dir / "spec.json"
    if (run_dir / "summary.json").is_file():
        if spec_path.is_file():
            old = json.loads(spec_path.read_text())
            # A key recorded under its old name (server-lr) is the same setting.
            if (
                _recorded_config(old.get("run_config") or {})
                != json.loads(json.dumps(spec.run_config))
                or old.get("nodes") != spec.nodes
            ):
                raise SweepError(
                    f"{run_dir} holds results of a different config than the preset asks for now "
                    "(preset or tuned choice changed): delete that folder or use another --out"
                )
        return False
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in (
        "error.txt",
        "log.txt",
        "run_seconds.txt",
        "metrics.csv",
        "config.json",
        "accuracy.png",
    ):
        (run_dir / stale).unlink(missing_ok=True)
    spec_path.write_text(strict_json(_spec_json(spec), indent=2, sort_keys=True) + "\n")
    return True


class _Worker:
    """A ``python -m simulations.worker --serve`` process that runs one run at a time."""

    def __init__(self, env: Mapping[str, str], log_path: Path) -> None:
        read_fd, write_fd = os.pipe()
        with log_path.open("a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "simulations.worker", "--serve", str(write_fd)],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(env),
                pass_fds=(write_fd,),
                text=True,
            )
        os.close(write_fd)
        self.reply = os.fdopen(read_fd, "r")

    def run(self, run_dir: Path, timeout: float | None) -> int:
        """Exit code of the run: 0 ok, DIVERGED_EXIT (3) its model diverged (a result,
        outputs written), 1 exception, < 0 the process died or timed out."""
        try:
            self.proc.stdin.write(f"{run_dir}\n")
            self.proc.stdin.flush()
        except OSError:
            return self._dead(run_dir, "the worker process had died")
        ready, _, _ = select.select([self.reply], [], [], timeout)
        if not ready:
            self.kill()
            (run_dir / "error.txt").write_text(f"timed out after {timeout} s (--timeout)\n")
            return -9
        line = self.reply.readline()
        if not line:
            return self._dead(run_dir, "the worker process died during the run")
        return int(line)

    def _dead(self, run_dir: Path, what: str) -> int:
        code = self.proc.wait()
        (run_dir / "error.txt").write_text(f"{what} (exit code {code})\n")
        return code if code < 0 else -1

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.alive:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
        self.reply.close()

    def kill(self) -> None:
        if self.alive:
            self.proc.kill()
            self.proc.wait()


class _Runner:
    """Hands runs to worker processes (one per calling thread at most); replaces dead ones."""

    def __init__(self, out: Path, timeout: float | None, fresh: bool) -> None:
        self.timeout = timeout
        self.fresh = fresh
        self.out = out
        self.idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self.all: list[_Worker] = []
        self.lock = threading.Lock()
        self.stopping = False

    def _env(self, threads: int) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])]
        )
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[var] = str(threads)
        return env

    def run(self, run_dir: Path, threads: int) -> tuple[int, float]:
        with self.lock:
            if self.stopping:
                return -15, 0.0
        try:
            worker = self.idle.get_nowait()
        except queue.Empty:
            worker = _Worker(self._env(threads), self.out / "workers.log")
            with self.lock:
                self.all.append(worker)
        t0 = time.monotonic()
        code = worker.run(run_dir, self.timeout)
        elapsed = time.monotonic() - t0
        (run_dir / "run_seconds.txt").write_text(f"{elapsed:.3f}\n")
        if worker.alive and not self.fresh:
            self.idle.put(worker)
        else:
            worker.close()
        return code, elapsed

    def close(self) -> None:
        for worker in self.all:
            worker.close()

    def stop_all(self) -> None:
        with self.lock:
            self.stopping = True
            for worker in self.all:
                worker.kill()


def run_order(specs: Sequence[RunSpec]) -> list[RunSpec]:
    """``specs`` seed by seed: every method and setting on the first seed, then the next.

    Otherwise in the given order (question, method, setting). A sweep stopped early
    (a session's end, a time-out) then leaves complete comparisons on its first seeds
    rather than every seed of its first methods.
    """
    return sorted(specs, key=lambda spec: spec.seed)


def execute(
    specs: Sequence[RunSpec],
    out: Path,
    desc: str,
    stats: dict[str, int],
    opts: ExecOptions = ExecOptions(),
) -> None:
    """Run the specs that have no results yet, ``opts.jobs`` at a time, with a progress bar.

    They start in :func:`run_order`.
    """
    todo = run_order([s for s in specs if _needs_run(out / s.run_id, s)])
    stats["skipped"] = stats.get("skipped", 0) + len(specs) - len(todo)
    if not todo:
        return
    runner = _Runner(out, opts.timeout, opts.fresh)
    failed = 0
    with (
        ThreadPoolExecutor(max_workers=max(1, opts.jobs)) as pool,
        tqdm(total=len(todo), desc=desc, unit="run", disable=opts.quiet, dynamic_ncols=True) as bar,
    ):
        futures = {
            pool.submit(runner.run, out / s.run_id, int(s.run_config.get("client-threads", 1))): s
            for s in todo
        }
        try:
            for fut in as_completed(futures):
                spec = futures[fut]
                code, _ = fut.result()
                stats["executed"] = stats.get("executed", 0) + 1
                if code == DIVERGED_EXIT:  # a result (runs.csv: diverged), not a crash
                    tqdm.write(f"[sweep] run {spec.run_id} diverged (summary.json: status_reason)")
                elif code != 0:
                    failed += 1
                    stats["failed"] = stats.get("failed", 0) + 1
                    tqdm.write(
                        f"[sweep] run {spec.run_id} failed (exit {code}); see "
                        f"{out / spec.run_id}/log.txt"
                    )
                bar.set_postfix_str(
                    f"last {spec.run_id}" + (f", failed {failed}" if failed else "")
                )
                bar.update(1)
        except KeyboardInterrupt:
            runner.stop_all()
            for f in futures:
                f.cancel()
            raise
        finally:
            runner.close()


# ----------------------------------------------------------------- stages
def _base_columns(spec: RunSpec) -> dict[str, Any]:
    part = spec.partition
    kind = part.get("partitioner", "")
    return {
        "run_id": spec.run_id,
        "stage": spec.stage,
        "questions": ";".join(spec.questions),
        "method": spec.method,
        "strategy": spec.run_config.get("strategy", "gsgm"),
        "seed": spec.seed,
        "nodes": spec.nodes,
        "max_in_flight": spec.in_flight,
        "partitioner": kind,
        "classes_per_node": part.get("classes-per-node", 2) if kind == "pathological" else "",
        "dirichlet_alpha": part.get("dirichlet-alpha", 0.5) if kind == "dirichlet" else "",
        "partition": partition_label(part),
        "client_work": spec.client_work,
        "device_profile": spec.device_profile,
        "fleet": spec.fleet,
        "grid_point": grid_label(spec.grid_point) if spec.stage == "tune" else "",
        # the strategy's own default when the run config does not set it (server-learning-rate = 0)
        "server_learning_rate": spec.run_config.get("server-learning-rate", ""),
    }


def _row(preset: Preset, out: Path, spec: RunSpec) -> dict[str, Any]:
    return run_row(
        out / spec.run_id,
        _base_columns(spec),
        chance=preset.chance_accuracy,
        margin=preset.chance_margin,
        target=preset.target_accuracy,
        max_seconds=_max_seconds(spec),
    )


def _max_seconds(spec: RunSpec) -> float:
    """The run's time budget in seconds (run config ``max-seconds``; 0 = none)."""
    return float(spec.run_config.get("max-seconds", 0.0) or 0.0)


def tune_stage(
    preset: Preset, out: Path, stats: dict[str, int], opts: ExecOptions = ExecOptions()
) -> dict[str, dict[str, Any]]:
    """Run the tuning grid (resuming), pick per (method, client work), write tune.csv
    and tuned.toml; return ``{tuned_key(method, work): overrides}``."""
    tuned: dict[str, dict[str, Any]] = {}
    selection: dict[str, dict[str, Any]] = {}
    tune_rows: list[dict[str, Any]] = []
    for layer in preset.tune_order():
        pairs = [(m, w) for m in layer for w in tune_works(preset, m)]
        specs = {(m, w): tune_runs(preset, m, tuned, w) for m, w in pairs}
        execute([s for p in pairs for s in specs[p]], out, f"tune {'+'.join(layer)}", stats, opts)
        for m, w in pairs:
            key = tuned_key(m, w)
            base = method_base_config(preset, m, tuned, w)
            named = {"method": m, "client-work": w} if w else {}
            if not specs[(m, w)]:
                tuned[key] = base
                selection[key] = {**named, "grid-point": "default", "candidates": 0}
                continue
            rows = [_row(preset, out, s) for s in specs[(m, w)]]
            budget = _max_seconds(specs[(m, w)][0]) > 0
            score = "accuracy_at_budget" if budget else "final_accuracy"
            index, all_diverged = pick_best(rows, preset.tie_tolerance, score)
            for i, row in enumerate(rows):
                row["chosen"] = i == index
            tune_rows += rows
            chosen = rows[index]
            tuned[key] = {**base, **specs[(m, w)][index].grid_point}
            selection[key] = {
                **named,
                "grid-point": chosen["grid_point"],
                "final-accuracy": _num(chosen.get("final_accuracy")),
                **({"accuracy-at-budget": _num(chosen.get(score))} if budget else {}),
                "masd": _num(chosen.get("masd")),
                "candidates": len(rows),
                "diverged": sum(r["status"] == "diverged" for r in rows),
                "failed": sum(r["status"] == "failed" for r in rows),
                "all-diverged": all_diverged,
            }
    write_csv(out / "tune.csv", tune_rows, TUNE_COLUMNS)
    write_tuned(out / "tuned.toml", preset, tuned, selection)
    return tuned


def report_stage(
    preset: Preset,
    out: Path,
    tuned: Mapping[str, Mapping[str, Any]],
    stats: dict[str, int],
    only: Sequence[str] | None = None,
    opts: ExecOptions = ExecOptions(),
) -> Path:
    """Run the questions' runs (resuming) and write ``runs.csv`` for every question.

    ``runs.csv`` is written also when the runs are interrupted (Ctrl-C, a session's
    end): the finished runs are rows, the others ``pending`` (a run cut off midway:
    ``failed``; the next sweep runs it again), so a half-finished sweep can be reported.
    """
    missing = [
        tuned_key(m, w)
        for m in preset.methods
        for w in tune_works(preset, m)
        if tuned_key(m, w) not in tuned
    ]
    if missing:
        raise SweepError(f"tuned.toml has no choice for {missing}: run the tune stage again")
    try:
        execute(report_runs(preset, tuned, only), out, "report runs", stats, opts)
    finally:
        rows = [_row(preset, out, s) for s in report_runs(preset, tuned)]
        fill_times_to_reference(rows, preset.speed_reference, out)
        path = write_csv(out / "runs.csv", rows)
    return path


def dry_run(
    preset: Preset,
    out: Path,
    jobs: int = 1,
    only: Sequence[str] | None = None,
    stage: str = "all",
) -> str:
    """Text listing the runs per stage and question, what is done, and the estimated time.

    The totals count the stages ``stage`` runs (``all``, ``tune`` or ``report``); the
    other stage's runs are listed, not counted.
    """
    est = preset.estimate
    standin = stand_in_tuned(preset)
    done = lambda spec: (out / spec.run_id / "summary.json").is_file()  # noqa: E731
    lines = [f"Preset {preset.name} ({preset.path}) -> {out}", ""]
    total_runs = total_left = 0
    total_s = left_s = 0.0

    def tally(specs, counted: bool):
        """Add ``specs`` to the totals if ``counted``; return their estimated seconds and
        those not done."""
        nonlocal total_runs, total_left, total_s, left_s
        secs = sum(estimate_seconds(s, est) for s in specs)
        left = [s for s in specs if not done(s)]
        if not counted:
            return secs, left
        total_runs += len(specs)
        total_left += len(left)
        total_s += secs
        left_s += sum(estimate_seconds(s, est) for s in left)
        return secs, left

    lines.append(
        f"Tuning on seed {preset.tune_seed}, {preset.tune_nodes} nodes, "
        f"{partition_label(preset.tune_partition)}"
        + (f", {preset.tune_profile} devices" if preset.tune_profile else "")
        + (":" if stage != "report" else " (not counted: --stage report reads OUT/tuned.toml):")
    )
    names = [
        tuned_key(m, w)
        for layer in preset.tune_order()
        for m in layer
        for w in tune_works(preset, m)
    ]
    width = max(16, *(len(n) + 1 for n in names))  # 16 as before, wider for method/work
    lines.append(f"  {'method':<{width}}{'grid points':>12}{'done':>7}{'est. time':>14}")
    for layer in preset.tune_order():
        for m in layer:
            for w in tune_works(preset, m):
                specs = tune_runs(preset, m, standin, w)
                secs, left = tally(specs, stage != "report")
                lines.append(
                    f"  {tuned_key(m, w):<{width}}{len(specs):>12}{len(specs) - len(left):>7}"
                    f"{human_seconds(secs):>14}"
                )
    lines.append("")
    lines.append(
        f"Reporting on seeds {preset.seeds} (shared runs counted once, in the first question)"
        + (":" if stage != "tune" else " (not counted: --stage tune):")
    )
    lines.append(f"  {'question':<16}{'runs':>6}{'new':>6}{'done':>7}{'est. time':>14}   settings")
    seen: set[str] = set()
    for q in preset.questions.values():
        if only and q.name not in only:
            continue
        specs = report_runs(preset, standin, [q.name])
        new = [s for s in specs if s.run_id not in seen]
        seen.update(s.run_id for s in specs)
        secs, left = tally(new, stage != "tune")
        settings = ", ".join(setting_label(n, partition_label(p), f) for n, p, f in q.settings())
        dims = "".join(
            f" x {what} {', '.join(names)}"
            for what, names in (
                ("client works", q.client_works),
                ("device profiles", q.device_profiles),
                ("fleets", q.fleets),
            )
            if names != [""]
        )
        lines.append(
            f"  {q.name:<16}{len(specs):>6}{len(new):>6}{len(new) - len(left):>7}"
            f"{human_seconds(secs):>14}   {len(q.methods)} methods x {settings}{dims}"
        )
    lines.append("")
    lines.append(
        f"Total: {total_runs} runs, estimated {human_seconds(total_s)} on 1 job; "
        f"left to run: {total_left} runs, {human_seconds(left_s)} on 1 job"
        + (f", about {human_seconds(left_s / jobs)} with --jobs {jobs}" if jobs > 1 else "")
        + "."
    )
    cfg = {**preset.base}
    lines.append(
        "Cost model ([estimate]): {o:g} s per run + client updates at {u:g}/s + {e:g} s per "
        "evaluation of "
        "10,000 test images (eval-examples = {n}, eval-every = {v}, max-updates = {m}).".format(
            o=est["overhead-seconds"],
            u=est["updates-per-second"],
            e=est["eval-seconds-per-10k"],
            n=cfg.get("eval-examples", 0) or "all",
            v=cfg.get("eval-every", 100),
            m=cfg.get("max-updates", 3000),
        )
    )
    return "\n".join(lines)


def _append_log(out: Path, entry: Mapping[str, Any]) -> None:
    path = out / "sweep_log.json"
    log = json.loads(path.read_text()) if path.is_file() else []
    log.append(dict(entry))
    atomic_write_text(path, strict_json(log, indent=2) + "\n")


def run_sweep(
    preset: Preset,
    *,
    stage: str = "all",
    only: Sequence[str] | None = None,
    opts: ExecOptions = ExecOptions(),
) -> dict[str, int]:
    """Run the stages of a sweep; return counts ``executed``, ``skipped``, ``failed``."""
    out = preset.out
    out.mkdir(parents=True, exist_ok=True)
    for q in only or ():
        if q not in preset.questions:
            raise SweepError(f"--only {q!r}: no such question; known: {sorted(preset.questions)}")
    (out / "plan.json").write_text(strict_json(preset.to_plan(), indent=2) + "\n")
    stats = {"executed": 0, "skipped": 0, "failed": 0}
    started = time.time()
    t0 = time.monotonic()
    try:
        if stage in ("all", "tune"):
            tuned = tune_stage(preset, out, stats, opts)
        else:
            tuned = read_tuned(out / "tuned.toml")
        if stage in ("all", "report"):
            report_stage(preset, out, tuned, stats, only, opts)
    finally:
        _append_log(
            out,
            {
                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
                "wall_seconds": round(time.monotonic() - t0, 1),
                "stage": stage,
                "only": list(only or []),
                "jobs": opts.jobs,
                **stats,
            },
        )
    return stats


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def stop_on_signals() -> None:
    """SIGTERM, and SIGINT even in a background job, stop the sweep as Ctrl-C does.

    Then the runs in progress are killed, ``runs.csv`` and ``sweep_log.json`` are
    written (:func:`report_stage`, :func:`run_sweep`), and a later sweep resumes. A
    shell without job control starts ``... &`` with SIGINT ignored, and a session's
    end sends SIGTERM: without this, either would leave neither file.
    """
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m simulations.sweep", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("preset", help="preset TOML file (simulations/presets/*.toml)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (default 1)")
    parser.add_argument(
        "--only",
        action="append",
        metavar="QUESTION",
        help="run only this question's reporting runs (repeatable)",
    )
    parser.add_argument("--stage", choices=("all", "tune", "report"), default="all")
    parser.add_argument("--out", help="output folder (default: the preset's [sweep] out)")
    parser.add_argument(
        "--dry-run", action="store_true", help="print runs and estimated time, run nothing"
    )
    parser.add_argument(
        "--timeout", type=float, default=None, help="kill a run after this many seconds"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument(
        "--fresh-process",
        action="store_true",
        help="a new worker process for every run (default: a worker runs many in turn)",
    )
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be >= 1")
    try:
        preset = load_preset(args.preset, out=args.out)
        if args.dry_run:
            print(dry_run(preset, preset.out, args.jobs, args.only, args.stage))
            return 0
        t0 = time.monotonic()
        stop_on_signals()
        opts = ExecOptions(
            jobs=args.jobs, timeout=args.timeout, quiet=args.quiet, fresh=args.fresh_process
        )
        stats = run_sweep(preset, stage=args.stage, only=args.only, opts=opts)
    except (SweepError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    rows = read_csv(preset.out / "runs.csv") if (preset.out / "runs.csv").is_file() else []
    counts = {
        s: sum(r["status"] == s for r in rows) for s in ("ok", "diverged", "failed", "pending")
    }
    print(
        f"[sweep] ran {stats['executed']} runs ({stats['failed']} failed), skipped "
        f"{stats['skipped']} "
        f"finished ones, in {human_seconds(time.monotonic() - t0)}; runs.csv: "
        + ", ".join(f"{v} {k}" for k, v in counts.items())
        + f" -> {preset.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
