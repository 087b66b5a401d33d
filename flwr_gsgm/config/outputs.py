"""Files a run writes to ``outputs/<run-name>/``.

- ``config.json``: the resolved run config (every key, defaults filled in);
- ``metrics.csv``: one row per evaluation (columns :data:`METRIC_COLUMNS`, then
  ``joules`` with a device-power model and the federated evaluation's ``federated_*``
  columns when it ran);
- ``summary.json``: final accuracy, MASD and std of accuracy over the second half,
  counters, staleness, wall seconds (:func:`summarize`);
- ``model.npz``: the final global model (:func:`write_model`: numpy arrays by name, or
  a torch ``state_dict`` for a name ending ``.pt``; asynchronous strategies); a run
  whose model diverged (``status`` "diverged") writes ``model_last_finite.npz`` instead:
  the model of its last evaluation that showed no divergence
  (:mod:`flwr_gsgm.engine.divergence`), or nothing if there was none;
- ``checkpoint.pt``: the server state, with run config ``checkpoint-every`` > 0
  (:mod:`flwr_gsgm.checkpoint.files`).

Every JSON file is strict JSON (:func:`strict_json`: a non-finite number is written
as null, so ``json.loads`` of any language reads it; ``train_loss`` is NaN at 0
updates). Nothing here needs torch or matplotlib: the project's app writes its model as
``model.pt`` and plots ``accuracy.png`` itself (``serverapp/``).
"""

from __future__ import annotations

import csv
import json
import math
import time
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from flwr_gsgm.checkpoint.atomic import atomic_write, atomic_write_text
from flwr_gsgm.evaluation import stability

__all__ = [
    "LAST_FINITE_MODEL",
    "METRIC_COLUMNS",
    "MODEL",
    "metric_columns",
    "run_dir_for",
    "strict_json",
    "write_config",
    "write_model",
    "write_metrics",
    "summarize",
    "write_summary",
]

#: The final model of a run that did not diverge ...
MODEL = "model.npz"
#: ... and the last finite evaluated model of one that did.
LAST_FINITE_MODEL = "model_last_finite.npz"

METRIC_COLUMNS = (
    "updates",
    "version",
    "virtual_time",
    "wall_time",
    "accuracy",
    "loss",
    "staleness_mean",
    "staleness_max",
    "train_loss",
    "deferred",
    "rejected",
    "dropped",
)


def strict_json(value: Any, **dumps_kwargs: Any) -> str:
    """``value`` as strict JSON text (RFC 8259; ``json.dumps`` with ``dumps_kwargs``).

    A non-finite number (NaN, +-infinity: python or numpy floats) becomes null, where
    ``json.dumps`` would write ``NaN`` or ``Infinity``, which strict parsers refuse;
    numpy scalars and arrays become python numbers and lists, tuples lists. Use it for
    every JSON file a run writes (an app's own results file too).

    Raises
    ------
    TypeError
        For a value JSON cannot hold (as ``json.dumps``).
    """
    return json.dumps(_json_value(value), allow_nan=False, **dumps_kwargs)


def _json_value(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None, numpy values by python's."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    elif isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    return value


def run_dir_for(cfg: Mapping[str, Any]) -> Path:
    """``<output-dir>/<run-name>`` of a run config, absolute; an empty ``run-name``
    becomes ``<strategy>-<UTC time>`` (e.g. ``gsgm-20261130-184527``)."""
    name = cfg["run-name"] or f"{cfg['strategy']}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    return Path(cfg["output-dir"]).expanduser().resolve() / name


def write_config(run_dir: Path, cfg: Mapping[str, Any]) -> Path:
    """Write ``config.json`` (sorted keys, strict JSON) and return its path."""
    path = run_dir / "config.json"
    atomic_write_text(path, strict_json(dict(cfg), indent=2, sort_keys=True) + "\n")
    return path


def write_model(run_dir: Path, arrays: Any, name: str = MODEL) -> Path:
    """Write the model ``arrays`` (an ``ArrayRecord``) as ``run_dir/name``, atomically.

    A name ending ``.npz`` (the default, :data:`MODEL`): a numpy archive of one
    ``<key>.npy`` per array, in the record's order, dtypes and shapes as they are
    (``dict(np.load(path))`` gives them back by key; nothing pickled). A name ending
    ``.pt``: a torch ``state_dict`` (``torch.load(path)``), which needs torch.

    Raises
    ------
    ValueError
        For another suffix.
    ImportError
        For ``.pt`` without torch installed.
    """
    path = run_dir / name
    if path.suffix == ".pt":
        import torch

        return atomic_write(
            path, lambda fh: torch.save(arrays.to_torch_state_dict(), fh), binary=True
        )
    if path.suffix != ".npz":
        raise ValueError(f"model file {name!r}: expected a name ending .npz or .pt")

    def write(fh: Any) -> None:
        with zipfile.ZipFile(fh, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
            for key in arrays.keys():
                # dated 1980-01-01 (zip's epoch): the same model gives the same bytes
                member = zipfile.ZipInfo(f"{key}.npy", (1980, 1, 1, 0, 0, 0))
                with archive.open(member, "w", force_zip64=True) as out:
                    np.lib.format.write_array(out, arrays[key].numpy(), allow_pickle=False)

    return atomic_write(path, write, binary=True)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else repr(value)
    return str(value)


def metric_columns(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """:data:`METRIC_COLUMNS`, then ``joules`` (the fleet's energy, with a device-power
    model) and the federated evaluation's columns the rows hold (``federated_nodes``,
    then ``federated_<metric>`` sorted), if any."""
    extra = sorted({k for r in rows for k in r if k.startswith("federated_")})
    if "federated_nodes" in extra:
        extra.remove("federated_nodes")
        extra.insert(0, "federated_nodes")
    energy = ["joules"] if any("joules" in r for r in rows) else []
    return [*METRIC_COLUMNS, *energy, *extra]


def write_metrics(run_dir: Path, rows: Sequence[Mapping[str, Any]]) -> Path:
    """Write ``metrics.csv`` with :func:`metric_columns`; floats in shortest round-trip
    form; a federated column is empty in a row without a federated evaluation."""
    columns = metric_columns(rows)

    def write(fh: Any) -> None:
        writer = csv.writer(fh, lineterminator="\n")
        writer.writerow(columns)
        for row in rows:
            writer.writerow([_fmt(row.get(col, "")) for col in columns])

    return atomic_write(run_dir / "metrics.csv", write, newline="")


def summarize(
    rows: Sequence[Mapping[str, Any]],
    counters: Mapping[str, Any],
    rejections: Mapping[str, int],
    staleness_mean: float,
    staleness_max: int,
    wall_seconds: float,
    virtual_seconds: float,
    report: Any = None,
    warnings: Sequence[str] = (),
    status: tuple[str, str] | None = None,
) -> dict[str, Any]:
    """Summary figures of one run (GSGM.md, "Measuring stability").

    ``counters`` uses the same names as the summary (the engine's
    :meth:`flwr_gsgm.engine.ledger.Ledger.report_counters`); a missing one counts 0.
    ``rejected_by_reason`` is ``rejections`` (``{reason: count}``, sorted), beside
    ``updates_received`` and ``updates_applied``, as the end-of-run log line has it.
    Accuracy figures are fractions in [0, 1]; MASD and std are over the second half
    of the evaluations; times are seconds. ``report`` (the engine's
    :class:`~flwr_gsgm.engine.async_engine.EngineReport`, absent for Flower's synchronous
    strategies) adds ``status`` ("completed", "diverged" or "failed") and
    ``status_reason``, ``per_node`` (counts and state per partition-id) and its
    ``warnings`` and ``server_learning_rate`` (the rule's ``lr`` used: given, or its
    default for the client mode; None without a report) and ``work_scheduling``:
    ``state``, the policy and why it turned itself off if it did, and ``nodes``, per
    node name its measured ``seconds_per_step`` and the ``local_steps_sent`` in its
    latest message (None: its own work; empty while scheduling is off); ``status``
    ``(status, status_reason)`` gives them without a report (a synchronous run that
    diverged); ``warnings`` adds sentences about the run
    that the log also holds (a pathological split that uses only some classes)
    after the report's.
    """
    acc = [float(r["accuracy"]) for r in rows]
    if status is None:
        status = (getattr(report, "status", "completed"), getattr(report, "status_reason", ""))
    return {
        "status": status[0],
        "status_reason": status[1],
        "diverged": bool(counters.get("diverged", 0)),
        "final_accuracy": stability.final_accuracy(acc),
        "masd": stability.masd(acc),
        "accuracy_std": stability.accuracy_std(acc),
        "evaluations": len(acc),
        "updates_received": int(counters.get("updates_received", 0)),
        "updates_applied": int(counters.get("updates_applied", 0)),
        "steps_applied": int(counters.get("steps_applied", 0)),
        "updates_deferred": int(counters.get("updates_deferred", 0)),
        "updates_stale": int(counters.get("updates_stale", 0)),
        "rejected": int(sum(rejections.values())),
        "rejected_by_reason": dict(sorted(rejections.items())),
        "dropped": int(counters.get("dropped", 0)),
        "error_replies": int(counters.get("error_replies", 0)),
        "dispatch_timeouts": int(counters.get("dispatch_timeouts", 0)),
        "node_backoffs": int(counters.get("node_backoffs", 0)),
        # a dict: runs.csv (simulations/results.py) takes the scalar figures only
        "federated_evaluation": {
            key: int(counters.get(key, 0))
            for key in ("federated_eval_sent", "federated_eval_replies", "federated_eval_failed")
        },
        "nodes_lost": int(counters.get("nodes_lost", 0)),
        "nodes_joined": int(counters.get("nodes_joined", 0)),
        "lost_in_flight": int(counters.get("lost_in_flight", 0)),
        "nodes_excluded": int(counters.get("nodes_excluded", 0)),
        "staleness_mean": float(staleness_mean),
        "staleness_max": int(staleness_max),
        "virtual_seconds": float(virtual_seconds),
        "wall_seconds": float(wall_seconds),
        "server_learning_rate": getattr(report, "server_learning_rate", None),
        "work_scheduling": {
            "state": getattr(report, "work_scheduling", "off"),
            "nodes": dict(getattr(report, "work_nodes", {})),
        },
        "per_node": dict(getattr(report, "per_node", {})),
        "warnings": list(getattr(report, "warnings", [])) + list(warnings),
    }


def write_summary(run_dir: Path, summary: Mapping[str, Any]) -> Path:
    """Write ``summary.json`` (strict JSON: a non-finite number, at any depth, as null)
    and return its path."""
    path = run_dir / "summary.json"
    atomic_write_text(path, strict_json(dict(summary), indent=2) + "\n")
    return path
