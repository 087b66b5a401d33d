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
  ``status_reason``: :mod:`flwr_gsgm.divergence`; before that status existed,
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
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flwr_gsgm import stability
from flwr_gsgm.atomic import atomic_write

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
]

# Scalar figures of summary.json (flwr_gsgm.run_outputs.summarize), in order.
SUMMARY_FIELDS = (
    "final_accuracy",
    "masd",
    "accuracy_std",
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
    ``"weights, 5 steps"``, ``"weights, 1 epoch"`` (FedAvg and FedAvgM train in weights
    mode whatever ``client-mode`` says; epochs when ``local-epochs`` > 0)."""
    sync = cfg.get("strategy") in ("fedavg", "fedavgm")
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


def run_row(
    run_dir: Path,
    base: Mapping[str, Any],
    *,
    chance: float,
    margin: float,
    target: float,
) -> dict[str, Any]:
    """The ``runs.csv`` row of the run in ``run_dir``.

    ``base`` holds the columns known from the plan (run_id, stage, questions, method,
    seed, nodes, partition, ...); the rest comes from ``summary.json`` and
    ``metrics.csv``. A run without ``summary.json`` is ``failed`` if its folder holds
    a log or an error file, else ``pending``.
    """
    row: dict[str, Any] = {c: "" for c in RUN_COLUMNS}
    row.update(base)
    row["run_dir"] = str(run_dir)
    if (run_dir / "config.json").is_file():  # written when the run starts
        cfg = json.loads((run_dir / "config.json").read_text())
        row["client_work"] = client_work(cfg)
        row["device_profile"] = cfg.get("device-profile", "uniform")  # older runs: uniform
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
    # No node left to train (flwr_gsgm.run_end) is a failure of the run, unless the
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
    "nodes_excluded",
    "staleness_max",
}
_FLOAT_COLUMNS = {
    "server_learning_rate",
    "peak_accuracy",
    "last_accuracy",
    "time_to_target",
    "updates_to_target",
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
#: and tuned.toml written before the rename (issue 10: one name, FedAvgM's, for the
#: server learning rate) still carry the old one; readers map it so that those results
#: can be reported by the current code.
RENAMED = {"server_lr": "server_learning_rate", "server-lr": "server-learning-rate"}


def current_names(record: Mapping[str, Any]) -> dict[str, Any]:
    """``record`` with every old key of :data:`RENAMED` under its current name."""
    return {RENAMED.get(k, k): v for k, v in record.items()}


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
