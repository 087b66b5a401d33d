"""Plots and a Markdown results table from a finished (or half-finished) sweep.

Usage::

    python -m simulations.report OUT [--md docs/RESULTS.md] [--figures DIR]

Reads ``OUT/runs.csv`` (and, when present, ``OUT/plan.json``, ``OUT/tuned.toml``,
``OUT/tune.csv``, ``OUT/sweep_log.json``, ``OUT/notes.md`` and each run's
``metrics.csv``), writes the Markdown file (default: the preset's ``results-md``, else
``docs/RESULTS.md``) and its figures (default: ``<folder of the Markdown
file>/figures/<sweep name>/``).

Figures and tables, per question and setting (number of nodes, partition,
max-in-flight, device profile); with client works (``[client-works]``) every method
and work is a row and a curve of its own, ``method/work``:

- accuracy against client updates per method, the mean over seeds as a line and
  the seed range (min to max) shaded; against virtual time (each seed interpolated
  on a common time grid) for ``time-to-target`` questions and for questions with
  client works, device profiles or a time budget (``max-seconds``), where client
  updates are not comparable;
- the stability improvement of the reference method (GSGM) over each other method,
  ``1 - MASD_ref / MASD_b`` computed per seed (both runs of that seed must have
  finished without diverging), as bars of the mean with the sample standard
  deviation and the seeds as dots;
- ``scale`` questions: final accuracy and MASD against the number of nodes;
  ``noniid`` questions: final accuracy and MASD per partition, grouped bars;
- a table per setting: runs that finished / diverged / failed, then mean ± sample
  standard deviation (ddof = 1) over the seeds that did not diverge of the final
  accuracy (%), MASD and std of accuracy over the second half (percentage points),
  time to the target accuracy (virtual seconds, over the seeds that reached it),
  with a preset's ``speed-reference`` the time to that method's final accuracy
  (paired by seed, that method with its best client work:
  :func:`times_to_reference`), with a time budget the accuracy at the budget, and
  mean and max staleness.

The headline tables compare each method with its best client work per setting
(highest mean final accuracy over its ok seeds).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from flwr_gsgm.evaluation.stability import stability_improvement
from simulations.preset import effective_limit, human_seconds, partition_label, setting_label
from simulations.results import (
    best_work,
    current_names,
    fill_times_to_reference,
    frame,
    load_curve,
    numbers,
    read_csv,
    series_label,
    setting_key,
    times_to_reference,
    write_csv,
)

__all__ = [
    "Stat",
    "stat",
    "question_rows",
    "settings_of",
    "summaries",
    "method_summary",
    "markdown_table",
    "improvements",
    "times_to_reference",
    "write_report",
    "main",
]


# ------------------------------------------------------------------ numbers
@dataclass(frozen=True)
class Stat:
    """Mean, sample standard deviation (ddof = 1; NaN if n < 2) and count of values."""

    mean: float
    std: float
    n: int
    values: tuple[float, ...] = ()


#: Columns of the ``runs.csv`` written beside the results page (one row per reporting run).
PAGE_COLUMNS = (
    "method",
    "nodes",
    "max_in_flight",
    "partition",
    "client_work",
    "device_profile",
    "fleet",
    "availability",
    "speed_variance",
    "work_scheduling",
    "seed",
    "status",
    "final_accuracy",
    "masd",
    "accuracy_std",
    "time_to_target",
    "accuracy_at_budget",
    "accuracy_at_5_rounds",
    "accuracy_at_20_rounds",
    "time_to_fedavg_accuracy",
    "accuracy_at_fedavg_budget",
    "accuracy_at_fedavg_trainings",
    "joules_to_fedavg_accuracy",
    "test_examples",
    "virtual_seconds",
    "staleness_mean",
    # every reply counted once: received = applied + deferred + stale + rejected
    "updates_received",
    "updates_applied",
    "updates_deferred",
    "updates_stale",
    "rejected",
    "lost_in_flight",
    "dispatch_timeouts",
    "run_id",
)


def stat(values: Iterable[Any]) -> Stat:
    """:class:`Stat` of the finite values among ``values``."""
    vals = []
    for v in values:
        try:
            f = float(v)
        except (TypeError, ValueError):
            continue
        if math.isfinite(f):
            vals.append(f)
    if not vals:
        return Stat(math.nan, math.nan, 0)
    arr = np.asarray(vals)
    return Stat(
        float(arr.mean()),
        float(arr.std(ddof=1)) if len(arr) > 1 else math.nan,
        len(arr),
        tuple(vals),
    )


def question_rows(
    rows: Sequence[Mapping[str, Any]] | pd.DataFrame, question: str
) -> list[dict[str, Any]]:
    """Rows of the reporting runs that answer ``question``."""
    return _answering(frame(rows), question).to_dict("records")


def _answering(df: pd.DataFrame, question: str) -> pd.DataFrame:
    """:func:`question_rows` of a :func:`~simulations.results.frame`, as a DataFrame."""
    if "questions" not in df:
        return df.iloc[:0]
    return df[df["questions"].map(lambda qs: question in str(qs).split(";"))]


# (nodes, partition label, max-in-flight limit (0 = all nodes), device profile ("" = default))
Setting = tuple[int, str, int, str]


def setting_of(row: Mapping[str, Any]) -> tuple[int, str, int]:
    """``(nodes, partition, limit)`` of a runs.csv row (limit 0: every node in flight).

    Without the device profile (as before profiles existed; scripts/readme_scale_table.py);
    the report's settings are :func:`~simulations.results.setting_key`.
    """
    return setting_key(row)[:3]


def settings_of(rows: Sequence[Mapping[str, Any]]) -> list[tuple[int, str, int]]:
    """Distinct :func:`setting_of` settings, in order of first appearance."""
    return list(dict.fromkeys(setting[:3] for setting in frame(rows)["setting"]))


def _settings(df: pd.DataFrame) -> list[Setting]:
    """Distinct settings with the device profile (:func:`~simulations.results.setting_key`),
    in order of first appearance."""
    return list(dict.fromkeys(df["setting"]))


def _in_setting(df: pd.DataFrame, setting: Setting) -> pd.DataFrame:
    return df[df["setting"].map(setting.__eq__)]


def _label(setting: Setting) -> str:
    """``n10-k2``, ``n100-k2-f20-edge``: the setting's label (headline settings, figures)."""
    nodes, part, limit, profile = setting
    return setting_label(nodes, part, limit, profile=profile)


def series_rows(rows: Sequence[Mapping[str, Any]] | pd.DataFrame) -> pd.DataFrame:
    """``rows`` with ``method`` the row's series, ``method/work`` for a named client work
    (:func:`~simulations.results.series_label`; unchanged without works), so that the
    per-method tables and curves show one row per method and work."""
    df = frame(rows)
    return df.assign(method=list(map(series_label, df["method"], df["client_work"])))


def best_work_rows(rows: Sequence[Mapping[str, Any]] | pd.DataFrame) -> pd.DataFrame:
    """Each method's rows of its best client work in each setting (the headline's
    comparison: :func:`~simulations.results.best_work`), ``client_work`` cleared so
    that they read as the method's; rows without client works are kept as they are."""
    df = frame(rows)
    best = {}
    for (setting, method), mine in df.groupby(["setting", "method"], sort=False):
        chosen = best_work(mine, method)
        best[(setting, method)] = chosen if chosen is not None else min(mine["client_work"])
    keep = [best[key] == w for key, w in zip(zip(df["setting"], df["method"]), df["client_work"])]
    return df[keep].assign(client_work="")


#: Figures of :func:`summaries` over a group's ok runs (``time_to_target``: over those
#: that reached the target).
_STAT_COLUMNS = (
    "final_accuracy",
    "masd",
    "accuracy_std",
    "time_to_target",
    "accuracy_at_budget",
    "virtual_seconds",
    "staleness_mean",
    "staleness_max",
)
_EMPTY_SUMMARY = {
    **dict.fromkeys(("runs", "ok", "diverged", "failed", "pending", "reached"), 0),
    **dict.fromkeys(_STAT_COLUMNS, Stat(math.nan, math.nan, 0)),
}


def summaries(rows: Sequence[Mapping[str, Any]] | pd.DataFrame, by: str = "method") -> pd.DataFrame:
    """Counts and :class:`Stat` figures of the runs per value of ``by`` (one setting's rows).

    One row per value of ``by`` in order of first appearance: ``runs``, ``ok``,
    ``diverged``, ``failed``, ``pending``, ``reached`` (ok runs with a finite
    ``time_to_target``), then a :class:`Stat` per :data:`_STAT_COLUMNS` over the ok runs.
    Columns ``rows`` lack (the page's ``runs.csv`` has no ``staleness_max``) give empty
    :class:`Stat` figures.
    """
    df = frame(rows)
    status = df["status"]
    ok = status.eq("ok")
    reached = ok & np.isfinite(numbers(df, "time_to_target"))
    counts = pd.DataFrame(
        {
            "runs": True,
            "ok": ok,
            **{s: status.eq(s) for s in ("diverged", "failed", "pending")},
            "reached": reached,
        },
        index=df.index,
    )
    table = counts.groupby(df[by], sort=False).sum()
    for column in _STAT_COLUMNS:
        counted = reached if column == "time_to_target" else ok
        values = numbers(df, column).where(counted)
        table[column] = values.groupby(df[by], sort=False).agg(stat)
    return table


def method_summary(rows: Sequence[Mapping[str, Any]] | pd.DataFrame, method: str) -> dict[str, Any]:
    """Counts and :class:`Stat` figures of one method's runs (one setting): a row of
    :func:`summaries` as a dict with ``method``; zero counts for a method without runs."""
    table = summaries(rows)
    row = table.loc[method].to_dict() if method in table.index else _EMPTY_SUMMARY
    return {"method": method, **row}


def improvements(
    rows: Sequence[Mapping[str, Any]] | pd.DataFrame, reference: str, methods: Sequence[str]
) -> list[dict[str, Any]]:
    """Per other method: stability improvement of ``reference`` over it, paired by seed.

    For each seed where both runs are ``ok``: ``1 - MASD_ref / MASD_b`` and the
    difference of final accuracy ``acc_ref - acc_b``; returned as :class:`Stat`
    over those seeds (one setting's rows). Methods without runs are left out.
    """
    df = frame(rows)
    ok = df[df["status"].eq("ok")]
    ref = ok[ok["method"].eq(reference)].drop_duplicates("seed", keep="last")
    ref = ref[["seed", "masd", "final_accuracy"]]
    out = []
    for m in methods:
        if m == reference or not df["method"].eq(m).any():
            continue
        # an inner merge keeps the baseline's order of seeds
        pairs = ok[ok["method"].eq(m)].merge(ref, on="seed", suffixes=("", "_ref"))
        masd, masd_ref = numbers(pairs, "masd"), numbers(pairs, "masd_ref")
        delta = numbers(pairs, "final_accuracy_ref") - numbers(pairs, "final_accuracy")
        out.append(
            {
                "baseline": m,
                "improvement": stat(map(stability_improvement, masd_ref, masd)),
                "delta_accuracy": stat(delta),
                "seeds": pairs["seed"].tolist(),
            }
        )
    return out


# ------------------------------------------------------------------ formatting
def _pm(s: Stat, scale: float = 1.0, digits: int = 1, signed: bool = False) -> str:
    if s.n == 0:
        return "–"
    fmt = f"{{:{'+' if signed else ''}.{digits}f}}"
    text = fmt.format(s.mean * scale)
    if s.n > 1:
        text += f" ± {s.std * scale:.{digits}f}"
    return text


def _setting_name(setting: Setting) -> str:
    nodes, part, limit, profile = setting
    if part.startswith("k"):
        desc = f"{part[1:]} classes per node"
    elif part.startswith("dir"):
        desc = f"Dirichlet alpha = {part[3:]}"
    else:
        desc = part.upper() if part == "iid" else part
    return (
        f"{nodes} nodes, {desc}"
        + (f", {limit} in flight" if limit else "")
        + (f", {profile} devices" if profile else "")
    )


def _methods_in(rows, order: Sequence[str]) -> list[str]:
    present = set(frame(rows)["method"])
    ordered = [m for m in order if m in present]
    return ordered + sorted(present - set(ordered))


def _rel(path: Path, start: Path) -> str:
    return Path(os.path.relpath(path, start)).as_posix()


# ------------------------------------------------------------------ plots
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _colors(methods: Sequence[str]) -> dict[str, Any]:
    plt = _plt()
    cmap = plt.get_cmap("tab10")
    return {m: cmap(i % 10) for i, m in enumerate(methods)}


_LINESTYLES = ("-", "--", ":", "-.")


def _method_of(series: str) -> str:
    """The method of a ``method/work`` series (:func:`series_rows`)."""
    return series.split("/")[0]


def _work_of(series: str) -> str:
    """The client work of a ``method/work`` series; "" for a plain method."""
    return series.split("/", 1)[1] if "/" in series else ""


def _series_styles(series: Sequence[str]) -> dict[str, tuple[Any, str]]:
    """Colour per method, line style per client work, of ``method/work`` series."""
    colors = _colors(list(dict.fromkeys(_method_of(s) for s in series)))
    works = list(dict.fromkeys(_work_of(s) for s in series))
    return {
        s: (colors[_method_of(s)], _LINESTYLES[works.index(_work_of(s)) % len(_LINESTYLES)])
        for s in series
    }


_load_curve = load_curve  # one implementation (simulations.results)


def _save_figure(fig, path: Path) -> Path:
    """Lay out ``fig``, write it to ``path`` (PNG, 110 dpi; folders made) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# More series than this on one axis make a legend that covers the curves (the
# lying-nodes page had 56): past it, one panel per client work.
_SERIES_PER_AXIS = 12


def _draw_curves(ax, rows: pd.DataFrame, methods, out: Path, x: str, styles) -> bool:
    """Draw each of ``methods``' mean curve over seeds on ``ax``, seed range shaded;
    False if none had a curve. ``styles``: :func:`_series_styles`."""
    drawn = False
    for m in methods:
        mine = rows[rows["method"].eq(m)]
        ok = mine[mine["status"].eq("ok")].to_dict("records")
        curves = [c for c in map(_load_curve, ok, [out] * len(ok)) if c]
        if not curves:
            continue
        if x == "updates":
            common = sorted(set.intersection(*(set(row["updates"] for row in c) for c in curves)))
            if not common:
                continue
            grid = np.asarray(common)
            ys = np.asarray(
                [
                    [next(row["accuracy"] for row in c if row["updates"] == u) for u in common]
                    for c in curves
                ]
            )
        else:
            end = min(max(row[x] for row in c) for c in curves)
            grid = np.linspace(0.0, end, 200)
            ys = np.asarray(
                [
                    np.interp(grid, [row[x] for row in c], [row["accuracy"] for row in c])
                    for c in curves
                ]
            )
        ys = 100.0 * ys
        color, ls = styles[m]
        n_bad = int(mine["status"].isin(("diverged", "failed")).sum())
        label = f"{m} ({len(curves)} seed{'s' if len(curves) > 1 else ''}"
        label += (f", {n_bad} diverged/failed" if n_bad else "") + ")"
        ax.plot(grid, ys.mean(axis=0), color=color, ls=ls, label=label, lw=1.6)
        if len(curves) > 1:
            ax.fill_between(grid, ys.min(axis=0), ys.max(axis=0), color=color, alpha=0.18, lw=0)
        drawn = True
    ax.grid(alpha=0.3)
    return drawn


def plot_curves(
    rows, methods, out: Path, path: Path, title: str, x: str = "updates"
) -> Path | None:
    """Accuracy curves per method: mean over seeds, seed range shaded (ok runs only).

    ``x``: ``updates`` (client updates received) or ``virtual_time`` (seconds). A
    method named ``method/work`` (:func:`series_rows`) gets its method's colour and a
    line style per client work. More than ``_SERIES_PER_AXIS`` series of several
    client works are drawn one panel per work (methods in the same colour in every
    panel, one legend per panel). Returns the PNG's path, or None if no run had a curve.
    """
    rows = frame(rows)
    plt = _plt()
    xlabel = "client updates received" if x == "updates" else "virtual time (s)"
    works = list(dict.fromkeys(_work_of(m) for m in methods))
    styles = _series_styles(methods)
    if len(methods) <= _SERIES_PER_AXIS or len(works) < 2:
        fig, ax = plt.subplots(figsize=(8, 4.8))
        if not _draw_curves(ax, rows, methods, out, x, styles):
            plt.close(fig)
            return None
        ax.set(xlabel=xlabel, ylabel="test accuracy (%)", title=title)
        ax.legend(fontsize=8, loc="lower right")
        return _save_figure(fig, path)
    # One panel per work: the colour names the method, so every line is solid.
    styles = {m: (color, "-") for m, (color, _) in styles.items()}
    ncols = min(4, len(works))
    nrows = -(-len(works) // ncols)
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(4.2 * ncols, 3.4 * nrows), sharex=True, sharey=True, squeeze=False
    )
    drawn = False
    for ax, work in zip(axes.flat, works):
        mine = [m for m in methods if _work_of(m) == work]
        if _draw_curves(ax, rows, mine, out, x, styles):
            drawn = True
            for line in ax.get_lines():  # the work is the panel's title
                line.set_label(line.get_label().replace(f"/{work} (", " ("))
            ax.legend(fontsize=6, loc="lower right")
        ax.set_title(work or "base config", fontsize=9)
    for ax in axes.flat[len(works) :]:
        ax.set_visible(False)
    if not drawn:
        plt.close(fig)
        return None
    for ax in axes[-1]:
        ax.set_xlabel(xlabel)
    for ax in axes[:, 0]:
        ax.set_ylabel("test accuracy (%)")
    fig.suptitle(title)
    return _save_figure(fig, path)


def plot_improvement(
    imps: Sequence[Mapping[str, Any]],
    reference: str,
    path: Path,
    title: str,
    target: float | None = None,
) -> Path | None:
    """Bars: stability improvement (%) of ``reference`` over each baseline, seeds as dots.

    ``target`` (a fraction, the preset's ``headline-target``) is drawn as a dashed line.
    """
    imps = [i for i in imps if i["improvement"].n]
    if not imps:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(imps) + 2), 4.2))
    xs = np.arange(len(imps))
    means = [100 * i["improvement"].mean for i in imps]
    errs = [100 * i["improvement"].std if i["improvement"].n > 1 else 0.0 for i in imps]
    colors = ["tab:green" if v >= 0 else "tab:red" for v in means]
    ax.bar(xs, means, yerr=errs, color=colors, alpha=0.75, capsize=4)
    for x, i in zip(xs, imps):
        ax.scatter(
            [x] * i["improvement"].n,
            [100 * v for v in i["improvement"].values],
            color="k",
            s=12,
            zorder=3,
        )
    ax.axhline(0, color="k", lw=0.8)
    if target is not None:
        ax.axhline(100 * target, color="gray", lw=0.8, ls="--", label=f"target {100 * target:.0f}%")
        ax.legend(fontsize=8, loc="best")
    ax.set_xticks(xs, [i["baseline"] for i in imps], rotation=30, ha="right")
    ax.set_ylabel(f"stability improvement of {reference} (%)\n1 - MASD_{reference} / MASD_baseline")
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    return _save_figure(fig, path)


def plot_scale(rows, methods, path: Path, title: str) -> Path | None:
    """Final accuracy and MASD against the number of nodes, mean ± std per method."""
    rows = frame(rows)
    plt = _plt()
    colors = _colors(methods)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    nodes = sorted(set(rows["nodes"].map(int)))
    drawn = False
    for m in methods:
        pts = []
        for n in nodes:
            s = method_summary(rows[rows["nodes"].map(int).eq(n)], m)
            if s["ok"]:
                pts.append((n, s["final_accuracy"], s["masd"]))
        if not pts:
            continue
        drawn = True
        ns = [p[0] for p in pts]
        for ax, k, scale in ((axes[0], 1, 100.0), (axes[1], 2, 100.0)):
            ax.errorbar(
                ns,
                [scale * p[k].mean for p in pts],
                yerr=[scale * (p[k].std if p[k].n > 1 else 0.0) for p in pts],
                color=colors[m],
                marker="o",
                capsize=3,
                label=m,
            )
    if not drawn:
        plt.close(fig)
        return None
    axes[0].set_ylabel("final accuracy (%)")
    axes[1].set_ylabel("MASD of accuracy (percentage points)")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xticks(nodes, [str(n) for n in nodes])
        ax.set_xlabel("number of nodes")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle(title)
    return _save_figure(fig, path)


def plot_time_to_reference(
    times: Mapping[tuple[str, Any], float],
    series: Sequence[str],
    reference: str,
    path: Path,
    title: str,
) -> Path | None:
    """Bars: the median virtual seconds each series takes to reach ``reference``'s
    final accuracy (:func:`times_to_reference`), its seeds as dots; a series that
    never reached it on a seed is counted in its label ("2/3 reached"), and a series
    that never did has no bar.

    ``times``: ``{(series, seed): seconds}`` (NaN: never reached). None if no series
    reached it.
    """
    by_series = {m: _times_by_seed(times, m) for m in series}
    by_series = {m: t for m, t in by_series.items() if len(t)}
    if not any(t.notna().any() for t in by_series.values()):
        return None
    plt = _plt()
    colors = _colors(list(dict.fromkeys(_method_of(m) for m in by_series)))
    fig, ax = plt.subplots(figsize=(max(5, 1.0 * len(by_series) + 2), 4.2))
    xs = np.arange(len(by_series))
    labels = []
    for x, (m, t) in zip(xs, by_series.items()):
        reached = t.dropna()
        if len(reached):
            ax.bar(x, float(reached.median()), color=colors[_method_of(m)], alpha=0.8)
            ax.scatter([x] * len(reached), reached.to_numpy(), color="k", s=12, zorder=3)
        labels.append(m if len(reached) == len(t) else f"{m}\n{len(reached)}/{len(t)} reached")
    ax.set_xticks(xs, labels, rotation=30, ha="right")
    ax.set_ylabel(f"virtual seconds to {reference}'s final accuracy\n(median, seeds as dots)")
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    return _save_figure(fig, path)


def plot_grouped(rows, methods, settings, path: Path, title: str) -> Path | None:
    """Final accuracy and MASD per setting (grouped bars), mean ± std per method."""
    rows = frame(rows)
    plt = _plt()
    colors = _colors(methods)
    fig, axes = plt.subplots(2, 1, figsize=(max(7, 1.3 * len(settings) + 3), 7), sharex=True)
    width = 0.8 / max(1, len(methods))
    xs = np.arange(len(settings))
    drawn = False
    for j, m in enumerate(methods):
        sums = [method_summary(_in_setting(rows, s), m) for s in settings]
        for ax, key in ((axes[0], "final_accuracy"), (axes[1], "masd")):
            vals = [100 * s[key].mean if s[key].n else np.nan for s in sums]
            errs = [100 * s[key].std if s[key].n > 1 else 0.0 for s in sums]
            if not all(np.isnan(vals)):
                drawn = True
            ax.bar(
                xs + (j - (len(methods) - 1) / 2) * width,
                vals,
                width,
                yerr=errs,
                color=colors[m],
                label=m,
                capsize=2,
            )
    if not drawn:
        plt.close(fig)
        return None
    axes[0].set_ylabel("final accuracy (%)")
    axes[1].set_ylabel("MASD (percentage points)")
    axes[1].set_xticks(xs, [s[1] for s in settings])
    axes[1].set_xlabel("partition (k = classes per node, dir = Dirichlet alpha)")
    axes[0].legend(fontsize=7, ncol=min(5, len(methods)))
    for ax in axes:
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(title)
    return _save_figure(fig, path)


# ------------------------------------------------------------------ markdown
def markdown_table(table: pd.DataFrame) -> list[str]:
    """The lines of a Markdown table: ``table``'s columns as the header, a line per row.

    Cells are written as ``str`` of the values, unpadded (``| a | b |``), so that the
    page's text is the same whatever the widths (``DataFrame.to_markdown`` pads).
    """
    lines = ["| " + " | ".join(map(str, table.columns)) + " |", "|" + "---|" * table.shape[1]]
    return lines + ["| " + " | ".join(map(str, row)) + " |" for row in table.itertuples(False)]


def _counts(s: Mapping[str, Any]) -> str:
    """``ok/runs``, with the pending runs when there are some (a summary's row)."""
    return f"{s['ok']}/{s['runs']}" + (f" ({s['pending']} pending)" if s["pending"] else "")


def _method_table(
    rows, methods, show_target: bool, target: float, speed: tuple[str, dict] | None = None
) -> list[str]:
    """One row per method (or ``method/work``) of one setting's rows; a column "accuracy
    at budget" when some run has a time budget."""
    rows = frame(rows)
    s = summaries(rows).loc[list(methods)]
    pm = lambda column, *args: s[column].map(lambda x: _pm(x, *args))  # noqa: E731
    table = pd.DataFrame({"method": s.index, "ok / runs": s.apply(_counts, axis=1)})
    table["diverged"], table["failed"] = s["diverged"], s["failed"]
    table["final accuracy (%)"] = pm("final_accuracy", 100)
    table["MASD (pp)"] = pm("masd", 100, 2)
    table["std of accuracy (pp)"] = pm("accuracy_std", 100, 2)
    if np.isfinite(numbers(rows, "accuracy_at_budget")).any():
        table["accuracy at the time budget (%)"] = pm("accuracy_at_budget", 100)
    if show_target:
        reached = pm("time_to_target", 1, 0) + " (" + s["reached"].astype(str) + "/"
        table[f"time to {100 * target:.0f}% (virtual s; seeds that reached it)"] = (
            reached + s["ok"].astype(str) + ")"
        ).where(s["ok"] > 0, "–")
    if speed:
        times = pd.Series(list(speed[1].values()), [m for m, _ in speed[1]], dtype=float)
        timed = times.groupby(level=0, sort=False).agg(stat).reindex(s.index)
        counts = times.index.value_counts()
        table[f"time to {speed[0]}'s accuracy (virtual s; seeds that reached it)"] = [
            f"{_pm(t, 1, 0)} ({t.n}/{counts[m]})" if m in counts else "–" for m, t in timed.items()
        ]
    table["virtual time of the run (s)"] = pm("virtual_seconds", 1, 0)
    table["staleness mean"] = pm("staleness_mean", 1, 2)
    table["staleness max"] = pm("staleness_max", 1, 1)
    lines = markdown_table(table)
    bad = rows[rows["status"].isin(("diverged", "failed"))]
    if len(bad):
        why = _texts(bad, "diverged_reason")
        why = why.where(why != "", _texts(bad, "error")).where(lambda w: w != "", bad["status"])
        runs = bad["method"] + " seed " + bad["seed"].astype(str) + " (" + why + ")"
        lines += ["", "Not in the means: " + "; ".join(runs) + "."]
    return lines


def _texts(df: pd.DataFrame, column: str) -> pd.Series:
    """``df[column]``'s text, ``""`` where a row has none (None, NaN, a missing column)."""
    values = df[column] if column in df else pd.Series("", index=df.index)
    return values.map(lambda v: v if isinstance(v, str) else "")


def _improvement_table(imps, reference) -> list[str]:
    imps = pd.DataFrame(imps, columns=["baseline", "improvement", "delta_accuracy", "seeds"])
    table = pd.DataFrame({f"{reference} vs": imps["baseline"]})
    table["stability improvement (%)"] = imps["improvement"].map(lambda i: _pm(i, 100, 0, True))
    table["Δ final accuracy (pp)"] = imps["delta_accuracy"].map(lambda d: _pm(d, 100, 1, True))
    table["seeds paired"] = imps["seeds"].map(len)
    return markdown_table(table)


def _headline_section(sweep: _Sweep) -> list[str]:
    """The targets the preset names first (``[sweep] headline-*``), a table each.

    Stability (``headline-baselines`` in ``headline-settings``): a row's verdict needs
    the mean stability improvement at least ``target`` and the mean final accuracy
    difference at least ``-accuracy_tolerance`` (a fraction of accuracy; 0 when the
    preset sets none). With ``accuracy_baselines``: the reference's divergences and its
    final accuracy against the best of them, in every setting. With ``speed_settings``:
    the reference's time to the speed reference's accuracy against the speed
    reference's own, paired by seed.
    """
    headline = sweep.plan.get("headline") or {}
    if not headline:
        return []
    md = ["## Headline", ""]
    rows = best_work_rows(sweep.rows)
    if sweep.rows["client_work"].astype(bool).any():
        md += ["Each method with its best client work in each setting.", ""]
    md += _stability_target(rows, headline, sweep.reference)
    if headline.get("accuracy_baselines"):
        md += _divergence_target(rows, sweep.reference)
        md += _accuracy_target(rows, headline, sweep.reference)
    if headline.get("speed_settings") and sweep.plan.get("speed_reference"):
        md += _speed_target(sweep, rows, headline["speed_settings"])
    return md


def _stability_target(rows, headline: Mapping[str, Any], reference: str) -> list[str]:
    target = float(headline["target"])
    tolerance = float(headline.get("accuracy_tolerance", 0.0))
    accuracy_clause = (
        f"final accuracy at most {100 * tolerance:g} pp lower"
        if tolerance
        else "final accuracy no lower"
    )
    cells = []
    for setting in _named_settings(rows, headline["settings"]):
        for imp in improvements(_in_setting(rows, setting), reference, headline["baselines"]):
            i, d = imp["improvement"], imp["delta_accuracy"]
            met = "–" if not i.n else ("yes" if i.mean >= target and d.mean >= -tolerance else "no")
            cells.append(
                (
                    _setting_name(setting),
                    imp["baseline"],
                    _pm(i, 100, 0, signed=True),
                    _pm(d, 100, 1, signed=True),
                    len(imp["seeds"]),
                    met,
                )
            )
    head = ["setting", f"{reference} vs", "stability improvement (%)", "Δ final accuracy (pp)"]
    table = pd.DataFrame(cells, columns=[*head, "seeds paired", "target met"])
    return [
        f"Stability improvement of {reference} (1 - MASD_{reference} / MASD_B, paired by seed, "
        f"mean ± sample std) and its final accuracy minus B's; the target is at least "
        f"{100 * target:.0f}% with {accuracy_clause}.",
        "",
        *markdown_table(table),
        "",
    ]


def _divergence_target(rows, reference: str) -> list[str]:
    """Per setting: the reference's runs that diverged or failed (target: none)."""
    rows = frame(rows)
    mine = summaries(rows[rows["method"].eq(reference)], by="setting")
    mine = mine.loc[sorted(mine.index)]
    table = pd.DataFrame(
        {
            "setting": mine.index.map(_setting_name),
            "ok / runs": mine.apply(_counts, axis=1),
            "diverged": mine["diverged"],
            "failed": mine["failed"],
            "target met": (mine["diverged"] + mine["failed"]).eq(0).map({True: "yes", False: "no"}),
        }
    )
    return [
        f"Runs of {reference} per setting; the target is that none diverges or fails.",
        "",
        *markdown_table(table),
        "",
    ]


def _accuracy_target(rows, headline: Mapping[str, Any], reference: str) -> list[str]:
    """Per setting: the reference's mean final accuracy minus the best baseline's.

    The best baseline is the one with the highest mean final accuracy over its ok runs
    (its ok / runs shown: a baseline that diverged on some seeds is averaged over the
    others, as in the method tables). Met: the difference is at least ``-tolerance``.
    """
    tolerance = float(headline.get("accuracy_tolerance", 0.0))
    cells = []
    for setting in _sorted_settings(rows):
        srows = _in_setting(rows, setting)
        ref = method_summary(srows, reference)["final_accuracy"]
        ran = [method_summary(srows, m) for m in headline["accuracy_baselines"]]
        ran = [s for s in ran if s["runs"] > s["pending"]]
        scored = [s for s in ran if s["final_accuracy"].n]
        if not ref.n or not ran:
            continue
        if not scored:  # every run of every baseline diverged or failed
            finished = sum(s["runs"] - s["pending"] for s in ran)
            cells.append(
                (_setting_name(setting), _pm(ref, 100), "– (every run diverged)", "–")
                + (f"0/{finished}", "–", "yes")
            )
            continue
        best = max(scored, key=lambda s: s["final_accuracy"].mean)
        delta = ref.mean - best["final_accuracy"].mean
        cells.append(
            (_setting_name(setting), _pm(ref, 100), best["method"])
            + (
                _pm(best["final_accuracy"], 100),
                f"{best['ok']}/{best['runs']}",
                f"{100 * delta:+.2f}",
            )
            + ("yes" if delta >= -tolerance else "no",)
        )
    head = ["setting", f"{reference} (%)", "best baseline", "its final accuracy (%)"]
    head += ["ok / runs", "Δ final accuracy (pp)", "target met"]
    return [
        f"Final accuracy of {reference} against the best of "
        f"{', '.join(headline['accuracy_baselines'])} in each setting (mean over the ok runs); "
        f"the target is at most {100 * tolerance:g} pp lower.",
        "",
        *markdown_table(pd.DataFrame(cells, columns=head)),
        "",
    ]


def _speed_target(sweep: _Sweep, rows, labels: Sequence[str]) -> list[str]:
    """Per named setting: time to the speed reference's accuracy, paired by seed.

    Met when, on every seed where both runs are ok, the reference reaches that
    accuracy (:func:`times_to_reference`) strictly earlier than the speed reference.
    """
    reference, speed = sweep.reference, sweep.plan["speed_reference"]
    cells = []
    for setting in _named_settings(rows, labels):
        srows = _in_setting(rows, setting)
        times = times_to_reference(srows, speed, sweep.out)
        mine, theirs = _times_by_seed(times, reference), _times_by_seed(times, speed)
        seeds = sorted(set(mine.index) & set(theirs.index))
        mine, theirs = mine[seeds], theirs[seeds]
        faster = int((mine < theirs).sum())  # NaN: never reached
        reached = stat(mine)
        paired = improvements(srows, reference, [speed])
        delta = paired[0]["delta_accuracy"] if paired else stat([])
        met = "–" if not seeds else ("yes" if faster == len(seeds) else "no")
        cells.append(
            (_setting_name(setting), f"{_pm(reached, 1, 0)} ({reached.n}/{len(seeds)})")
            + (_pm(stat(theirs), 1, 0), f"{faster}/{len(seeds)}")
            + (_pm(delta, 100, 1, signed=True), met)
        )
    head = ["setting", f"{reference} (virtual s)", f"{speed} (virtual s)"]
    head += [f"seeds {reference} is faster", "Δ final accuracy (pp)", "target met"]
    return [
        f"Virtual time {reference} takes to reach {speed}'s final accuracy (paired by seed) "
        f"against {speed}'s own; the target is less time on every seed.",
        "",
        *markdown_table(pd.DataFrame(cells, columns=head)),
        "",
    ]


def _times_by_seed(times: Mapping[tuple[str, Any], float], label: str) -> pd.Series:
    """The times of one series of :func:`times_to_reference`'s result, by seed."""
    return pd.Series({seed: t for (m, seed), t in times.items() if m == label}, dtype=float)


def _named_settings(rows, labels: Sequence[str]) -> list[Setting]:
    """The settings of ``rows`` whose label (``n30-k2-f20``) is in ``labels``, in that order."""
    by_label = {_label(s): s for s in _settings(frame(rows))}
    return [by_label[label] for label in labels if label in by_label]


def _sorted_settings(rows) -> list[Setting]:
    """Settings by nodes, then partition, then limit (0, every node in flight, first)."""
    return sorted(_settings(frame(rows)))


def _notes_section(out: Path) -> list[str]:
    """``OUT/notes.md`` as a section "Notes on this sweep" (where and on which code the
    runs ran, across sessions); nothing if the file is absent."""
    path = out / "notes.md"
    if not path.is_file():
        return []
    return ["## Notes on this sweep", "", path.read_text().strip(), ""]


def _tuned_section(out: Path) -> list[str]:
    path = out / "tuned.toml"
    if not path.is_file():
        return []
    import tomllib

    data = tomllib.loads(path.read_text())
    if not any(sel.get("candidates") for sel in data.get("selection", {}).values()):
        # no grid anywhere: a row per series of "–" would only repeat the run config
        return [
            "## Tuned choices",
            "",
            "Nothing was tuned: every method ran its declared defaults with the preset's "
            "run config (`tuned.toml` lists each series' config).",
            "",
        ]
    cells = []
    for m, cfg in data.get("methods", {}).items():
        cfg = current_names(cfg)  # a tuned.toml written before a key was renamed
        sel = data.get("selection", {}).get(m, {})
        choice = ", ".join(f"`{k}={json.dumps(v)}`" for k, v in cfg.items())
        fa, ms = sel.get("final-accuracy", math.nan), sel.get("masd", math.nan)
        flag = " (all diverged)" if sel.get("all-diverged") else ""
        cells.append(
            (m, choice, f"{100 * fa:.1f}", f"{100 * ms:.2f}", sel["candidates"])
            + (f"{sel.get('diverged', 0)}{flag}",)
            if sel.get("candidates")
            else (m, choice, "–", "–", 0, "–")
        )
    head = ["method", "choice (run config)", "seed-0 final accuracy (%)", "seed-0 MASD (pp)"]
    head += ["grid points", "grid points diverged"]
    table = pd.DataFrame(cells, columns=head)
    return ["## Tuned choices (seed 0 only)", "", *markdown_table(table), ""]


def _sweep_log(out: Path) -> list[dict[str, Any]] | None:
    """The entries of ``OUT/sweep_log.json`` (one per sweep invocation), None if absent."""
    path = out / "sweep_log.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _wall_time(log: list[dict[str, Any]] | None) -> tuple[float, int, int]:
    if log is None:
        return math.nan, 0, 0
    return (
        sum(float(e.get("wall_seconds", 0.0)) for e in log),
        sum(int(e.get("executed", 0)) for e in log),
        len(log),
    )


def _jobs_used(log: list[dict[str, Any]] | None) -> list[int]:
    """The distinct ``--jobs`` of the sweep invocations that ran something."""
    return sorted({int(e["jobs"]) for e in log or [] if e.get("executed") and "jobs" in e})


@dataclass(frozen=True)
class _Sweep:
    """What a sweep's output folder holds (the files the report reads)."""

    out: Path
    rows: pd.DataFrame  # runs.csv (:func:`~simulations.results.frame`)
    plan: dict[str, Any]  # plan.json, {} if absent
    tune_rows: list[dict[str, Any]]  # tune.csv, [] if absent
    log: list[dict[str, Any]] | None  # sweep_log.json

    @property
    def name(self) -> str:
        return self.plan.get("name", self.out.name)

    @property
    def reference(self) -> str:
        return self.plan.get("reference", "gsgm")

    @property
    def target(self) -> float:
        return float(self.plan.get("target_accuracy", 0.7))

    def questions(self) -> dict[str, Any]:
        """The plan's questions, else one per question name found in runs.csv."""
        return self.plan.get("questions") or {
            q: {"title": q, "kind": "stability"}
            for q in dict.fromkeys(
                x for qs in self.rows["questions"] for x in str(qs).split(";") if x
            )
        }


def read_sweep(out: Path) -> _Sweep:
    """Read ``OUT/runs.csv``, ``plan.json``, ``tune.csv`` and ``sweep_log.json``."""
    plan_path, tune_path = out / "plan.json", out / "tune.csv"
    return _Sweep(
        out=out,
        rows=frame(read_csv(out / "runs.csv")),
        plan=json.loads(plan_path.read_text()) if plan_path.is_file() else {},
        tune_rows=read_csv(tune_path) if tune_path.is_file() else [],
        log=_sweep_log(out),
    )


def _run_seconds(rows: Sequence[Mapping[str, Any]] | pd.DataFrame) -> float:
    """Sum of the finite ``run_seconds`` of ``rows`` (in row order)."""
    return sum(v for v in numbers(frame(rows), "run_seconds") if math.isfinite(v))


def _overview(sweep: _Sweep) -> list[str]:
    """Title and the opening bullets: provenance, wall time, counts, definitions."""
    plan, rows = sweep.plan, sweep.rows
    wall, executed, invocations = _wall_time(sweep.log)
    jobs = _jobs_used(sweep.log)
    counts = rows["status"].value_counts()
    status = {s: int(counts.get(s, 0)) for s in ("ok", "diverged", "failed", "pending")}
    md = [f"# Results: {sweep.name}", ""]
    md.append(
        f"Produced by `python -m simulations.sweep {plan.get('preset', 'PRESET.toml')}` then "
        f"`python -m simulations.report {sweep.out}` on "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}."
    )
    md.append("")
    md.append(
        f"- Sweep wall time: **{human_seconds(wall)}** over {invocations} invocation(s) of the "
        "sweep command "
        f"({executed} runs executed; the runs themselves took "
        f"{human_seconds(_run_seconds(sweep.tune_rows))} of tuning and "
        f"{human_seconds(_run_seconds(rows))} of reporting runs, on {os.cpu_count()} CPU cores "
        f"with --jobs {'/'.join(map(str, jobs)) or '?'})."
    )
    md.append(
        f"- Reporting runs: {len(rows)} ({status['ok']} ok, {status['diverged']} diverged, "
        f"{status['failed']} failed, {status['pending']} pending); seeds {plan.get('seeds', '?')}; "
        f"tuning on seed {plan.get('tune', {}).get('seed', 0)} only."
    )
    base = plan.get("base", {})
    if base:
        md.append(
            "- Common run config: "
            + ", ".join(f"`{k}={base[k]}`" for k in _BASE_KEYS_SHOWN if k in base)
            + "."
        )
    md += _definitions(sweep)
    md.append("")
    return md


#: The common run config keys the overview names.
_BASE_KEYS_SHOWN = (
    "dataset",
    "max-updates",
    "eval-every",
    "eval-examples",
    "batch-size",
    "client-mode",
    "slow-fraction",
    "slow-factor",
    "jitter",
)


def _definitions(sweep: _Sweep) -> list[str]:
    """The bullets defining final accuracy, MASD, staleness and divergence."""
    reference, plan = sweep.reference, sweep.plan
    chance = plan.get("chance_accuracy", 0.1)
    return [
        "- Final accuracy: mean of the last 5 evaluations. MASD: mean |a(j+1) - a(j)| of test "
        "accuracy "
        f"over the second half of the evaluations; std: its standard deviation there (both in "
        f"percentage points, pp). Time to target: first virtual time with accuracy >= "
        f"{100 * sweep.target:.0f}%. Stability improvement of {reference} over B: "
        f"1 - MASD_{reference} / MASD_B "
        f"per seed, then mean ± sample std over the seeds.",
        "- Staleness: model versions between the one a node was sent and the one its update "
        "met. Under the virtual clock the dispatch schedule is the same for every method, so "
        "methods "
        "that step on every update (all but GSGM's deferred slot updates and FedBuff's buffer) "
        "show "
        "the same staleness.",
        "- Diverged: a non-finite loss or accuracy at some evaluation, weights that became "
        "non-finite, "
        f"or a final accuracy <= "
        f"{100 * (chance + plan.get('chance_margin', 0.05)):.0f}% (chance + margin). Diverged "
        "runs are "
        f"counted in the tables and left out of the means.",
    ]


def _ordered_settings(qrows, q: Mapping[str, Any]) -> list[Setting]:
    """The settings of a question's rows, in the preset's order (nodes, partitions,
    limits, device profiles)."""
    settings = _settings(qrows)
    if not (q.get("nodes") and q.get("partitions")):
        return settings
    planned = [
        (int(n), partition_label(p), effective_limit(int(n), int(f)), prof)
        for n in q["nodes"]
        for p in q["partitions"]
        for f in q.get("max_in_flight", [0])
        for prof in q.get("device_profiles", [""])
    ]
    return [s for s in planned if s in settings] + [s for s in settings if s not in planned]


def _series_in(rows, methods: Sequence[str], works: Sequence[str]) -> list[str]:
    """The ``method/work`` series of ``rows`` (:func:`series_rows`): methods in the
    plan's order, each with its works in the preset's order (the base config's first)."""
    present = set(series_rows(rows)["method"])
    ordered = [
        series_label(m, w)
        for m in _methods_in(rows, methods)
        for w in ("", *works)
        if series_label(m, w) in present
    ]
    return ordered + sorted(present - set(ordered))


def _virtual_x(q: Mapping[str, Any]) -> bool:
    """Whether a question's curves are against virtual time rather than client updates:
    time to target, and where updates do not compare (client works, device profiles,
    a time budget)."""
    return (
        q.get("kind", "stability") == "time-to-target"
        or bool(q.get("client_works"))
        or bool(q.get("device_profiles"))
        or float((q.get("config") or {}).get("max-seconds", 0) or 0) > 0
    )


def _question_figures(qname, q, qrows, methods, settings, figures: Path, md_dir: Path):
    """A ``scale`` question's plots per partition, a ``noniid`` one's grouped bars.

    ``qrows``: :func:`series_rows`, ``methods`` their series.
    """
    md: list[str] = []
    kind, title = q.get("kind", "stability"), q.get("title", qname)
    if kind == "scale" and len(settings) > 1:
        for part, limit, profile in dict.fromkeys(s[1:] for s in settings):
            prow = qrows[[s[1:] == (part, limit, profile) for s in qrows["setting"]]]
            group = part + (f"-f{limit}" if limit else "") + (f"-{profile}" if profile else "")
            where = part + (f", {limit} in flight" if limit else "")
            where += f", {profile} devices" if profile else ""
            p = plot_scale(
                prow,
                methods,
                figures / f"{qname}_{group}_scale.png",
                f"{title}: final accuracy and MASD vs nodes ({where})",
            )
            if p:
                md += [f"![final accuracy and MASD vs number of nodes]({_rel(p, md_dir)})", ""]
    if kind == "noniid" and len(settings) > 1:
        p = plot_grouped(qrows, methods, settings, figures / f"{qname}_grouped.png", title)
        if p:
            md += [f"![final accuracy and MASD per partition]({_rel(p, md_dir)})", ""]
    return md


def _setting_section(sweep: _Sweep, qname, q, srows, methods, setting, single, figures, md_dir):
    """One setting of a question: the table (a row per method and client work), the
    improvements and the curves. ``srows``: runs.csv rows, ``methods``: their methods."""
    reference, label = sweep.reference, _label(setting)
    md = [f"### {_setting_name(setting)}", ""]
    view = series_rows(srows)
    series = _series_in(srows, methods, list(sweep.plan.get("client_works") or {}))
    ref = sweep.plan.get("speed_reference")
    speed = (ref, times_to_reference(srows, ref, sweep.out)) if ref and ref in methods else None
    md += _method_table(view, series, True, sweep.target, speed)
    md.append("")
    if speed is not None:
        title = f"{_setting_name(setting)}: time to {ref}'s final accuracy"
        path = figures / f"{qname}_{label}_time_to_{ref}.png"
        p = plot_time_to_reference(speed[1], series, ref, path, title)
        if p:
            md += [f"![time to {ref}'s final accuracy]({_rel(p, md_dir)})", ""]
    imps = improvements(view, reference, series)
    if imps and view["method"].eq(reference).any():
        md += [f"Stability improvement of {reference} over each method (paired by seed):", ""]
        md += _improvement_table(imps, reference)
        md.append("")
        title = q.get("title", qname) if single else f"{qname}: {_setting_name(setting)}"
        p = plot_improvement(
            imps,
            reference,
            figures / f"{qname}_{label}_improvement.png",
            title,
            (sweep.plan.get("headline") or {}).get("target"),
        )
        if p:
            md += [f"![stability improvement]({_rel(p, md_dir)})", ""]
    p = plot_curves(
        view,
        series,
        sweep.out,
        figures / f"{qname}_{label}_curves.png",
        f"{_setting_name(setting)}",
        x="virtual_time" if _virtual_x(q) else "updates",
    )
    if p:
        md += [f"![accuracy curves]({_rel(p, md_dir)})", ""]
    if _virtual_x(q):  # a time question is read per client training too (parity)
        p = plot_curves(
            view,
            series,
            sweep.out,
            figures / f"{qname}_{label}_curves_trainings.png",
            f"{_setting_name(setting)}: per client training",
            x="updates",
        )
        if p:
            md += [f"![accuracy per client training]({_rel(p, md_dir)})", ""]
    return md


def _question_section(sweep: _Sweep, qname: str, q, figures: Path, md_dir: Path) -> list[str]:
    """A question's heading, description, figures and one section per setting."""
    qrows = _answering(sweep.rows, qname)
    if qrows.empty:
        return []
    methods = _methods_in(qrows, sweep.plan.get("methods") or [])
    md = [f"## {q.get('title', qname)}", ""]
    if q.get("description"):
        md += [q["description"], ""]
    settings = _ordered_settings(qrows, q)
    series = _series_in(qrows, methods, list(sweep.plan.get("client_works") or {}))
    md += _question_figures(qname, q, series_rows(qrows), series, settings, figures, md_dir)
    for setting in settings:
        srows = _in_setting(qrows, setting)
        single = len(settings) == 1
        md += _setting_section(sweep, qname, q, srows, methods, setting, single, figures, md_dir)
    return md


def write_report(out: Path, md_path: Path | None = None, figures: Path | None = None) -> Path:
    """Write the Markdown results file and its figures; return the Markdown path.

    Also writes ``runs.csv`` (:data:`PAGE_COLUMNS`) beside the Markdown file, its
    ``time_to_fedavg_accuracy`` computed again from the rows
    (:func:`~simulations.results.fill_times_to_reference`).
    """
    sweep = read_sweep(out)
    md_path = Path(md_path or sweep.plan.get("results_md") or "docs/RESULTS.md")
    figures = Path(figures or md_path.parent / "figures" / sweep.name)
    figures.mkdir(parents=True, exist_ok=True)
    md = _overview(sweep)
    md += _notes_section(out)
    md += _headline_section(sweep)
    md += _tuned_section(out)
    for qname, q in sweep.questions().items():
        md += _question_section(sweep, qname, q, figures, md_path.parent)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text("\n".join(md).rstrip() + "\n")
    # from the rows as they are now (also a runs.csv written before the column existed)
    rows = sweep.rows.to_dict("records")
    fill_times_to_reference(rows, sweep.plan.get("speed_reference", ""), out)
    write_csv(md_path.parent / "runs.csv", rows, PAGE_COLUMNS)
    return md_path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m simulations.report", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("out", help="the sweep's output folder (holds runs.csv)")
    parser.add_argument("--md", help="Markdown file to write (default: the preset's results-md)")
    parser.add_argument(
        "--figures", help="folder of the figures (default: beside the Markdown file)"
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    if not (out / "runs.csv").is_file():
        print(
            f"error: {out / 'runs.csv'} not found: run python -m simulations.sweep first",
            file=sys.stderr,
        )
        return 2
    md = write_report(
        out, Path(args.md) if args.md else None, Path(args.figures) if args.figures else None
    )
    print(f"[report] wrote {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
