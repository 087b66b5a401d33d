"""One run's folder -> one row of ``runs.csv``: status, divergence, time to target.

Status of a run (column ``status``):

- ``"ok"``: it finished and did not diverge;
- ``"diverged"``: it finished, but (a) some evaluation has a non-finite loss or
  accuracy (NaN or infinite: the weights blew up), or (b) its final accuracy (mean
  of the last 5 evaluations, GSGM.md) is at most ``chance + margin``, where chance
  is ``1 / number of classes`` and margin the preset's ``chance-margin`` (default
  0.05: 15% on 10 classes, 6% on 100): it collapsed to, or never left, chance level
  (a run that never learned is no usable result either), or (c) the engine stopped
  it because its model diverged (``summary.json`` ``status`` "diverged", reason in
  ``status_reason``: :mod:`flwr_gsgm.engine.divergence`; before that status existed,
  ``diverged`` true with status "completed": non-finite weights).
  ``diverged_reason`` says which (``non-finite loss``, ``non-finite accuracy``,
  ``final accuracy at chance``, or the engine's kind: ``non-finite weights``,
  ``non-finite test loss``, ``exploding test loss``, ``replies rejected``);
- ``"failed"``: the run's process exited with an error or was killed before writing
  ``summary.json`` (``error`` holds the last line of its log), or the engine ended it
  with no node left to train (``summary.json`` ``status`` "failed";
  ``status_reason`` says why) and its model had not diverged (a diverged model makes
  every node's update look out of range, so every node gets excluded: that run is
  ``"diverged"``, with ``status_reason`` kept);
- ``"pending"``: not run yet.

Diverged runs are kept and counted in every table; their accuracy and stability
figures are left out of means (a flat line at chance would look perfectly stable).

Figures over a run's evaluations (``metrics.csv``, virtual seconds in ``virtual_time``):

- ``accuracy_at_budget``: with a time budget (run config ``max-seconds`` > 0), the
  accuracy (fraction) of the last evaluation at or before ``max-seconds`` (the engine
  stops there and evaluates the final model at its last reply's time); NaN without a
  budget or without such an evaluation;
- ``accuracy_at_5_rounds``, ``accuracy_at_20_rounds``: the accuracy of the last
  evaluation at or before 5 (20) FedAvg rounds' worth of client trainings, a round
  being the nodes that train at once (``max_in_flight`` when it binds, else every
  node); NaN if the run did not get that far;
- ``work_scheduling``: "on" when the run's messages had their local steps set by
  measured speed (run config ``work-scheduling`` other than "off", or a strategy
  whose method schedules work: FedCompass, FedNova, time-budget FedAvg), else "off";
- ``accuracy_at_fedavg_budget``: the run's accuracy (as ``accuracy_at_budget``) at
  the virtual seconds the speed reference's run of the same seed and setting ended at;
- ``accuracy_at_fedavg_trainings``: the run's accuracy (as ``accuracy_at_5_rounds``)
  at the client trainings the speed reference's run of the same seed and setting
  received by its last evaluation: per client training where FedAvg's rounds lost
  replies (nodes that left), so that its 20 rounds held fewer than 20 rounds' worth;
- ``time_to_fedavg_accuracy``: virtual seconds at which the run first reaches the
  final accuracy of the preset's ``speed-reference`` method (FedAvg in the presets)
  with the same seed in the same setting (nodes, partition, max-in-flight, device
  profile), that method taken with its best client work there (highest mean final
  accuracy over its ok seeds); NaN if never, if the run or that reference run is not
  ok, or without a speed reference (:func:`times_to_reference`,
  :func:`fill_times_to_reference`).
- ``joules_to_fedavg_accuracy``: the fleet's joules (metrics.csv ``joules``, with a
  device-power model) at that first evaluation; NaN as above, or without ``joules``;
- ``fleet``, ``availability``, ``speed_variance``: the preset's ``[fleets]`` entry of
  the run's setting ("" for none) and the run config's time-model keys;
  ``test_examples``: the run config's ``eval-examples`` (0: the whole test set).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from flwr_gsgm.checkpoint.atomic import atomic_write
from flwr_gsgm.config.run_config import SYNC_STRATEGIES
from flwr_gsgm.evaluation import stability
from simulations.preset import effective_limit

__all__ = [
    "SUMMARY_FIELDS",
    "RUN_COLUMNS",
    "client_work",
    "divergence",
    "read_metrics",
    "run_row",
    "write_csv",
    "read_csv",
    "RENAMED",
    "current_names",
    "RETIRED",
    "without_retired",
    "accuracy_at_budget",
    "accuracy_at_rounds",
    "SCHEDULING_STRATEGIES",
    "series_label",
    "setting_key",
    "frame",
    "numbers",
    "load_curve",
    "best_work",
    "times_to_reference",
    "accuracies_at_reference_budget",
    "accuracies_at_reference_trainings",
    "fill_times_to_reference",
]

# Scalar figures of summary.json (flwr_gsgm.config.outputs.summarize), in order.
SUMMARY_FIELDS = (
    "final_accuracy",
    "masd",
    "accuracy_std",
    "evaluations",
    "updates_received",
    "updates_applied",
    "steps_applied",
    "updates_deferred",
    "updates_stale",
    "rejected",
    "dropped",
    "error_replies",
    "dispatch_timeouts",
    "node_backoffs",
    "nodes_lost",
    "nodes_joined",
    "lost_in_flight",
    "nodes_excluded",
    "staleness_mean",
    "staleness_max",
    "virtual_seconds",
    "wall_seconds",
)

RUN_COLUMNS = (
    "run_id",
    "stage",
    "questions",
    "method",
    "strategy",
    "seed",
    "nodes",
    "max_in_flight",
    "client_work",
    "device_profile",
    "fleet",
    "availability",
    "speed_variance",
    "test_examples",
    "partitioner",
    "classes_per_node",
    "dirichlet_alpha",
    "partition",
    "grid_point",
    "server_learning_rate",
    "status",
    "diverged",
    "diverged_reason",
    "peak_accuracy",
    "last_accuracy",
    "time_to_target",
    "updates_to_target",
    "accuracy_at_budget",
    "work_scheduling",
    "accuracy_at_5_rounds",
    "accuracy_at_20_rounds",
    "time_to_fedavg_accuracy",
    "joules_to_fedavg_accuracy",
    "accuracy_at_fedavg_budget",
    "accuracy_at_fedavg_trainings",
    *SUMMARY_FIELDS,
    "rejected_by_reason",
    "status_reason",
    "warnings",
    "run_seconds",
    "error",
    "run_dir",
)


def read_metrics(path: Path) -> list[dict[str, float]]:
    """Rows of a run's ``metrics.csv`` as floats (``nan`` for empty cells)."""
    rows = []
    with path.open(newline="") as fh:
        for raw in csv.DictReader(fh):
            rows.append(
                {k: (float(v) if v not in ("", None) else math.nan) for k, v in raw.items()}
            )
    return rows


def divergence(
    rows: Sequence[Mapping[str, float]], final_accuracy: float, chance: float, margin: float
) -> str:
    """Why a finished run counts as diverged, or ``""`` if it does not (module docstring)."""
    if any(not math.isfinite(r.get("loss", math.nan)) for r in rows):
        return "non-finite loss"
    if any(not math.isfinite(r.get("accuracy", math.nan)) for r in rows):
        return "non-finite accuracy"
    if not math.isfinite(final_accuracy) or final_accuracy <= chance + margin:
        return "final accuracy at chance"
    return ""


def client_work(cfg: Mapping[str, Any]) -> str:
    """What one client update computes, from a run's config: ``"gradient, 1 batch"``,
    ``"weights, 5 steps"``, ``"weights, 1 epoch"`` (the synchronous strategies train in
    weights mode whatever ``client-mode`` says; epochs when ``local-epochs`` > 0; for
    time-budget FedAvg and FedNova the work of each node's first message)."""
    sync = cfg.get("strategy") in SYNC_STRATEGIES
    mode = "weights" if sync else cfg.get("client-mode", "gradient")
    if mode == "gradient":
        count, unit = int(cfg.get("local-batches", 1)), "batch"
    elif cfg.get("local-epochs", 0) > 0:
        count, unit = int(cfg["local-epochs"]), "epoch"
    else:
        count, unit = int(cfg.get("local-steps", 1)), "step"
    plural = "" if count == 1 else ("es" if unit == "batch" else "s")
    return f"{mode}, {count} {unit}{plural}"


def _last_log_line(run_dir: Path) -> str:
    log = run_dir / "log.txt"
    if not log.is_file():
        return ""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def accuracy_at_budget(rows: Sequence[Mapping[str, float]], max_seconds: float) -> float:
    """Accuracy of the last evaluation at or before ``max_seconds`` virtual seconds.

    ``rows``: a run's ``metrics.csv`` rows (``virtual_time`` in seconds, ``accuracy``
    a fraction), in order. NaN when ``max_seconds`` is not > 0 (no time budget) or no
    evaluation is that early.
    """
    if not max_seconds > 0:
        return math.nan
    within = [r["accuracy"] for r in rows if r.get("virtual_time", math.inf) <= max_seconds]
    return within[-1] if within else math.nan


#: Strategies whose method sizes each node's local work by its measured speed.
SCHEDULING_STRATEGIES = ("fedcompass", "fednova", "time-budget-fedavg")


def accuracy_at_rounds(rows: Sequence[Mapping[str, float]], rounds: int, round_size: int) -> float:
    """Accuracy of the last evaluation at or before ``rounds x round_size`` client
    updates received; NaN if the run's last evaluation is earlier than that (it did
    not get that far) or ``rows`` is empty."""
    budget = rounds * round_size
    if not rows or rows[-1].get("updates", -math.inf) < budget:
        return math.nan
    within = [r["accuracy"] for r in rows if r.get("updates", math.inf) <= budget]
    return within[-1] if within else math.nan


def run_row(
    run_dir: Path,
    base: Mapping[str, Any],
    *,
    chance: float,
    margin: float,
    target: float,
    max_seconds: float = 0.0,
) -> dict[str, Any]:
    """The ``runs.csv`` row of the run in ``run_dir``.

    ``base`` holds the columns known from the plan (run_id, stage, questions, method,
    seed, nodes, partition, ...); the rest comes from ``summary.json`` and
    ``metrics.csv``. ``max_seconds``: the run config's time budget (virtual seconds;
    0 = none), for ``accuracy_at_budget``. ``time_to_fedavg_accuracy`` needs other
    runs: NaN here, filled by :func:`fill_times_to_reference`. A run without
    ``summary.json`` is ``failed`` if its folder holds a log or an error file, else
    ``pending``.
    """
    row: dict[str, Any] = {c: "" for c in RUN_COLUMNS}
    row.update(base)
    row["run_dir"] = str(run_dir)
    if (run_dir / "config.json").is_file():  # written when the run starts
        cfg = json.loads((run_dir / "config.json").read_text())
        # A sweep's plan names the work and the profile (its setting labels group by
        # them, "" where a preset does not use the dimension); other callers get the
        # run's own: a description of its work, and its profile (older runs: uniform).
        if not base.get("client_work"):
            row["client_work"] = row["client_work"] if "client_work" in base else client_work(cfg)
        if "device_profile" not in base:
            row["device_profile"] = cfg.get("device-profile", "uniform")
        # How the fleet behaved over time (older runs: always there, steady).
        row["availability"] = cfg.get("availability", "always")
        row["speed_variance"] = cfg.get("speed-variance", "none")
        row["test_examples"] = cfg.get("eval-examples", "")
        scheduled = cfg.get("work-scheduling", "off") != "off"
        row["work_scheduling"] = (
            "on" if scheduled or cfg.get("strategy") in SCHEDULING_STRATEGIES else "off"
        )
    summary_path = run_dir / "summary.json"
    run_seconds = None
    if (run_dir / "run_seconds.txt").is_file():
        run_seconds = float((run_dir / "run_seconds.txt").read_text().strip() or "nan")
    row["run_seconds"] = "" if run_seconds is None else round(run_seconds, 2)
    if not summary_path.is_file():
        started = (run_dir / "log.txt").is_file() or (run_dir / "error.txt").is_file()
        row["status"] = "failed" if started else "pending"
        if started:
            err = run_dir / "error.txt"
            row["error"] = (
                (err.read_text().strip().splitlines() or [""])[-1][:300]
                if err.is_file()
                else _last_log_line(run_dir)
            )
        return row
    summary = json.loads(summary_path.read_text())
    for key in SUMMARY_FIELDS:
        value = summary.get(key)
        row[key] = math.nan if value is None else value
    if summary.get("server_learning_rate") is not None:
        # what the run applied: the strategy's default for its client mode where the run
        # config left server-learning-rate unset (0)
        row["server_learning_rate"] = summary["server_learning_rate"]
    row["rejected_by_reason"] = json.dumps(summary.get("rejected_by_reason", {}), sort_keys=True)
    row["status_reason"] = summary.get("status_reason", "")
    row["warnings"] = json.dumps(summary.get("warnings", []))
    metrics = read_metrics(run_dir / "metrics.csv") if (run_dir / "metrics.csv").is_file() else []
    acc = [r["accuracy"] for r in metrics]
    finite = [a for a in acc if math.isfinite(a)]
    row["peak_accuracy"] = max(finite) if finite else math.nan
    row["last_accuracy"] = acc[-1] if acc else math.nan
    row["time_to_target"] = stability.time_to_target(
        [r["virtual_time"] for r in metrics], acc, target
    )
    row["updates_to_target"] = stability.time_to_target(
        [r["updates"] for r in metrics], acc, target
    )
    row["accuracy_at_budget"] = accuracy_at_budget(metrics, max_seconds)
    nodes = int(base.get("nodes") or 0)
    if nodes:
        size = effective_limit(nodes, int(base.get("max_in_flight") or 0)) or nodes
        row["accuracy_at_5_rounds"] = accuracy_at_rounds(metrics, 5, size)
        row["accuracy_at_20_rounds"] = accuracy_at_rounds(metrics, 20, size)
    row["time_to_fedavg_accuracy"] = math.nan
    row["joules_to_fedavg_accuracy"] = math.nan
    row["accuracy_at_fedavg_budget"] = math.nan
    row["accuracy_at_fedavg_trainings"] = math.nan
    final = row["final_accuracy"]
    if summary.get("status") == "diverged":  # the engine stopped the run: its kind first
        reason = str(summary.get("status_reason", "")).split(":")[0] or "diverged"
    else:
        reason = divergence(metrics, float(final), chance, margin) if metrics else "no evaluation"
    if not reason and summary.get("diverged"):
        reason = "non-finite weights"  # written before the status "diverged" existed
    row["diverged"] = bool(reason)
    row["diverged_reason"] = reason
    row["status"] = "diverged" if reason else "ok"
    # No node left to train (flwr_gsgm.engine.run_end) is a failure of the run, unless the
    # model diverged first: then every node's next update is far above its usual norm,
    # the norm-ratio check excludes them all, and the cause is the server rule.
    if summary.get("status") == "failed" and not reason:
        row["status"] = "failed"
    return row


def _cell(value: Any) -> Any:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else repr(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return value


def write_csv(
    path: Path, rows: Sequence[Mapping[str, Any]], columns: Sequence[str] = RUN_COLUMNS
) -> Path:
    """Write rows with ``columns`` (atomically: a ``.tmp`` file renamed in place)."""

    def write(fh: Any) -> None:
        writer = csv.DictWriter(
            fh, fieldnames=list(columns), extrasaction="ignore", lineterminator="\n"
        )
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _cell(row.get(k, "")) for k in columns})

    return atomic_write(path, write, newline="")


_INT_COLUMNS = {
    "seed",
    "nodes",
    "max_in_flight",
    "evaluations",
    "updates_received",
    "steps_applied",
    "updates_deferred",
    "rejected",
    "dropped",
    "error_replies",
    "dispatch_timeouts",
    "node_backoffs",
    "nodes_lost",
    "nodes_joined",
    "lost_in_flight",
    "updates_stale",
    "nodes_excluded",
    "staleness_max",
}
_FLOAT_COLUMNS = {
    "server_learning_rate",
    "peak_accuracy",
    "last_accuracy",
    "time_to_target",
    "updates_to_target",
    "accuracy_at_budget",
    "time_to_fedavg_accuracy",
    "joules_to_fedavg_accuracy",
    "final_accuracy",
    "masd",
    "accuracy_std",
    "staleness_mean",
    "virtual_seconds",
    "wall_seconds",
    "run_seconds",
    "dirichlet_alpha",
    "classes_per_node",
}


#: Old name -> current name of a renamed column or run config key. Run folders, runs.csv
#: and tuned.toml written before the rename (one name, FedAvgM's, for the
#: server learning rate) still carry the old one; readers map it so that those results
#: can be reported by the current code.
RENAMED = {"server_lr": "server_learning_rate", "server-lr": "server-learning-rate"}


def current_names(record: Mapping[str, Any]) -> dict[str, Any]:
    """``record`` with every old key of :data:`RENAMED` under its current name."""
    return {RENAMED.get(k, k): v for k, v in record.items()}


#: Run config keys of options deleted since (docs/GSGM.md "Deleted options"),
#: with the value that is the behaviour every run has now. A tuned.toml or a run record
#: of an older sweep that holds that value is the same run without the key.
RETIRED = {
    "apply": "arrival",
    "table-max-age": 0,
    "cycle-max-updates": 0,
    "cycle-max-seconds": 0.0,
}


def without_retired(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` without the keys of :data:`RETIRED` that hold today's behaviour.

    Raises
    ------
    ValueError
        A retired key with another value: that run used a deleted option, which no
        current run can repeat.
    """
    out = dict(config)
    for key, kept in RETIRED.items():
        if key not in out:
            continue
        if out[key] != kept:
            raise ValueError(
                f"{key} = {out[key]!r} is a deleted GSGM option (only {kept!r}, today's "
                "behaviour, can be read; docs/GSGM.md, Deleted options)"
            )
        del out[key]
    return out


def read_csv(path: Path) -> list[dict[str, Any]]:
    """Read ``runs.csv`` back, numbers as numbers (``nan`` for empty or missing).

    Columns under an old name (:data:`RENAMED`) are read under their current name.
    """
    out = []
    with path.open(newline="") as fh:
        for raw in map(current_names, csv.DictReader(fh)):
            row: dict[str, Any] = dict(raw)
            for k in _FLOAT_COLUMNS & raw.keys():
                row[k] = float(raw[k]) if raw[k] not in ("", None) else math.nan
            for k in _INT_COLUMNS & raw.keys():
                v = raw[k]
                row[k] = int(float(v)) if v not in ("", None, "nan") else math.nan
            if "diverged" in raw:
                row["diverged"] = raw["diverged"] == "true"
            out.append(row)
    return out


# ---------------------------------------------------------------- across runs
def series_label(method: str, work: str = "") -> str:
    """A method's name, with ``/<client work>`` for a named work (tables, curves)."""
    return f"{method}/{work}" if work else method


def setting_key(row: Mapping[str, Any]) -> tuple[int, str, int, str]:
    """``(nodes, partition, limit, device profile)`` of a runs.csv row.

    ``limit`` 0: every node in flight; profile ``""``: the run config's default (and
    every runs.csv written before device profiles).
    """
    nodes = int(row["nodes"])
    limit = row.get("max_in_flight", 0)
    limit = int(limit) if isinstance(limit, (int, float)) and math.isfinite(limit) else 0
    profile = row.get("device_profile", "")
    profile = profile if isinstance(profile, str) else ""
    fleet = row.get("fleet", "")
    if isinstance(fleet, str) and fleet:  # a [fleets] entry is part of the setting
        profile = f"{profile}-{fleet}" if profile else fleet
    return nodes, str(row["partition"]), effective_limit(nodes, limit), profile


def frame(rows: Sequence[Mapping[str, Any]] | pd.DataFrame) -> pd.DataFrame:
    """runs.csv rows as a DataFrame for grouping; a DataFrame made by it is returned as is.

    Every column keeps its Python values (``object`` dtype: an integer column with a NaN
    stays integers, so the rows written back are the rows read); ``client_work`` is
    ``""`` where a row has none, and a column ``setting`` holds :func:`setting_key`.
    """
    if isinstance(rows, pd.DataFrame) and "setting" in rows:
        return rows
    records = rows.to_dict("records") if isinstance(rows, pd.DataFrame) else list(rows)
    df = pd.DataFrame(records, dtype=object)
    if not records:
        return pd.DataFrame(columns=["method", "seed", "status", "client_work", "setting"])
    work = df["client_work"] if "client_work" in df else pd.Series("", index=df.index)
    df["client_work"] = [w if isinstance(w, str) else "" for w in work]
    df["setting"] = [setting_key(r) for r in df.to_dict("records")]
    return df


def numbers(df: pd.DataFrame, column: str) -> pd.Series:
    """``df[column]`` as floats, NaN for what is not a number (or for a missing column)."""
    if column not in df:
        return pd.Series(math.nan, index=df.index, dtype=float)
    return pd.to_numeric(df[column], errors="coerce").astype(float)


def load_curve(row: Mapping[str, Any], out: Path) -> list[dict[str, float]] | None:
    """The ``metrics.csv`` rows of a runs.csv row's run (its ``run_dir``, relative to
    ``out`` if not absolute, else ``out/<run_id>``); None if there is none."""
    run_dir = Path(str(row.get("run_dir", "")))
    if not run_dir.is_absolute():
        run_dir = out / run_dir
    path = run_dir / "metrics.csv"
    if not run_dir.name or not path.is_file():
        path = out / str(row.get("run_id", "")) / "metrics.csv"
        if not path.is_file():
            return None
    return read_metrics(path)


def best_work(rows: Sequence[Mapping[str, Any]] | pd.DataFrame, method: str) -> str | None:
    """The client work of ``method`` with the highest mean final accuracy over its ok
    runs in ``rows`` (one setting's); ties to the first listed; None if no ok run."""
    df = frame(rows)
    mine = df[df["method"].eq(method)]
    final = numbers(mine, "final_accuracy")
    counted = mine["status"].eq("ok") & np.isfinite(final)
    # works in order of their first row, ok or not (the tie-break); NaN: no ok run
    means = final.where(counted).groupby(mine["client_work"], sort=False).mean()
    means = means.dropna()
    return str(means.idxmax()) if len(means) else None


def _reference_runs(df: pd.DataFrame, reference: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The ok rows of ``df``, and among them ``reference``'s with its best client work."""
    work = best_work(df, reference)
    ok = df[df["status"].eq("ok")]
    return ok, ok[ok["method"].eq(reference) & ok["client_work"].eq(work)]


def times_to_reference(
    rows: Sequence[Mapping[str, Any]] | pd.DataFrame,
    reference: str,
    out: Path,
    column: str = "virtual_time",
) -> dict[tuple[str, Any], float]:
    """Virtual seconds each ok run takes to reach ``reference``'s final accuracy (with
    ``column = "joules"``: the fleet's joules by then, for runs with a device-power
    model; runs whose metrics.csv lacks the column are left out).

    Paired by seed in one setting's rows: the target of a run is the final accuracy
    (fraction, mean of the last 5 evaluations) of ``reference``'s ok run with the same
    seed and ``reference``'s best client work in these rows (:func:`best_work`), and its
    time the first evaluation's ``virtual_time`` with accuracy at least that (NaN if
    never; the reference's own runs are timed the same way). Runs without
    ``metrics.csv`` or without an ok reference run of their seed are left out.
    Returns ``{(series_label(method, client work), seed): seconds}``; without client
    works the label is the method.
    """
    ok, ref = _reference_runs(frame(rows), reference)
    target = dict(zip(ref["seed"], numbers(ref, "final_accuracy")))  # the last run of a seed
    times = {}
    for r in ok[ok["seed"].isin(list(target))].to_dict("records"):
        curve = load_curve(r, out)
        if curve and column in curve[0]:
            times[(series_label(r["method"], r["client_work"]), r["seed"])] = (
                stability.time_to_target(
                    [c[column] for c in curve],
                    [c["accuracy"] for c in curve],
                    target[r["seed"]],
                )
            )
    return times


def _accuracies_at_reference_end(
    rows: Sequence[Mapping[str, Any]] | pd.DataFrame,
    reference: str,
    out: Path,
    column: str,
    accuracy_at: Callable[[list[dict[str, float]], float], float],
) -> dict[tuple[str, Any], float]:
    """Each ok run's ``accuracy_at(curve, end)``, ``end`` the ``column`` value of the
    last evaluation of ``reference``'s run of the same seed (best client work, as
    :func:`times_to_reference`); keyed as there."""
    ok, ref = _reference_runs(frame(rows), reference)
    end = {}
    for r in ref.to_dict("records"):
        curve = load_curve(r, out)
        if curve:
            end[r["seed"]] = curve[-1][column]
    accuracies = {}
    for r in ok[ok["seed"].isin(list(end))].to_dict("records"):
        curve = load_curve(r, out)
        if curve:
            key = (series_label(r["method"], r["client_work"]), r["seed"])
            accuracies[key] = accuracy_at(curve, end[r["seed"]])
    return accuracies


def accuracies_at_reference_trainings(
    rows: Sequence[Mapping[str, Any]] | pd.DataFrame, reference: str, out: Path
) -> dict[tuple[str, Any], float]:
    """Each ok run's accuracy at the client trainings (``updates``) that
    ``reference``'s run of the same seed (best client work, as
    :func:`times_to_reference`) had received at its last evaluation: the accuracy of
    the run's last evaluation at or before that many (NaN if the run did not get that
    far); keyed as :func:`times_to_reference`."""
    return _accuracies_at_reference_end(
        rows, reference, out, "updates", lambda curve, n: accuracy_at_rounds(curve, 1, int(n))
    )


def accuracies_at_reference_budget(
    rows: Sequence[Mapping[str, Any]] | pd.DataFrame, reference: str, out: Path
) -> dict[tuple[str, Any], float]:
    """Each ok run's accuracy (:func:`accuracy_at_budget`) at the virtual seconds at
    which ``reference``'s run of the same seed (best client work, as
    :func:`times_to_reference`) made its last evaluation; keyed as there."""
    return _accuracies_at_reference_end(rows, reference, out, "virtual_time", accuracy_at_budget)


def fill_times_to_reference(rows: Sequence[dict[str, Any]], reference: str, out: Path) -> None:
    """Set every row's ``time_to_fedavg_accuracy`` (:func:`times_to_reference`),
    ``joules_to_fedavg_accuracy``, ``accuracy_at_fedavg_budget``
    (:func:`accuracies_at_reference_budget`) and ``accuracy_at_fedavg_trainings``
    (:func:`accuracies_at_reference_trainings`), per setting
    (:func:`setting_key`); NaN for a row that is not timed or without ``reference``
    (an empty name)."""
    df = frame(rows)
    times = pd.Series(math.nan, index=df.index, dtype=object)
    joules = pd.Series(math.nan, index=df.index, dtype=object)
    accuracies = pd.Series(math.nan, index=df.index, dtype=object)
    per_training = pd.Series(math.nan, index=df.index, dtype=object)
    if reference and len(df):
        for _, srows in df.groupby("setting", sort=False):
            timed = times_to_reference(srows, reference, out)
            energy = times_to_reference(srows, reference, out, column="joules")
            at_budget = accuracies_at_reference_budget(srows, reference, out)
            at_trainings = accuracies_at_reference_trainings(srows, reference, out)
            labels = map(series_label, srows["method"], srows["client_work"])
            keys = list(zip(labels, srows["seed"]))
            times[srows.index] = [timed.get(key, math.nan) for key in keys]
            joules[srows.index] = [energy.get(key, math.nan) for key in keys]
            accuracies[srows.index] = [at_budget.get(key, math.nan) for key in keys]
            per_training[srows.index] = [at_trainings.get(key, math.nan) for key in keys]
    for r, t, j, a, n in zip(rows, times, joules, accuracies, per_training, strict=True):
        r["time_to_fedavg_accuracy"] = t
        r["joules_to_fedavg_accuracy"] = j
        r["accuracy_at_fedavg_budget"] = a
        r["accuracy_at_fedavg_trainings"] = n
