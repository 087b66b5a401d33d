"""Run real configs in-process and compare their metrics to a reference.

Usage (from any folder, with the tree under test first on PYTHONPATH)::

    python scripts/compare_runs.py record REF_DIR [SET ...]  # write REF_DIR/<name>.txt
    python scripts/compare_runs.py check REF_DIR [SET ...]   # run again; exit 1 on a difference

``--strategy NAME[,NAME]`` (anywhere after the command) keeps only the runs of those
strategies, e.g. ``--strategy fedavg,fedavgm,fednova,time-budget-fedavg`` to check a
change to the synchronous runs alone; ``--only NAME[,NAME]`` keeps the runs whose name
is one of those or starts with one followed by a dot (``--only smoke,main`` keeps every
run of the smoke preset and the main job), e.g. to finish a check that ran out of time.

To show that a change keeps the behaviour, record with the old tree and check
with the new one::

    git worktree add --detach /work/wt-before <old commit>
    PYTHONPATH=/work/wt-before python scripts/compare_runs.py record /tmp/ref small presets main
    PYTHONPATH=$PWD python scripts/compare_runs.py check /tmp/ref small presets main

The sets (default: ``small``):

- ``small``: five configs on 4 nodes, 200 client updates, Fashion-MNIST at
  /usr/share/datasets/fashion-mnist, centralized evaluation on 500 test images
  every 50 updates (GSGM, ASGD, FedBuff, and two with ``max-in-flight`` 2).
- ``presets``: the smoke run of every sweep preset in ``simulations/presets`` of the
  tree under test (each tree reads its own presets, so a renamed run config key is
  the same run on both sides): every method at the preset's tuning setting (nodes,
  partition, seed), its first grid point standing in for the tuned choice, and,
  per question, the reference method at the question's first setting (so that a
  ``max-in-flight`` question is covered); each shrunk to 60 client updates,
  evaluation on 500 test images every 20. A preset whose data set is not on this
  machine (CIFAR) is reported as skipped.
- ``main``: the main job, ``make run``'s run config (``[tool.flwr.app.config]`` of
  the tree's pyproject.toml, 10 nodes: GSGM, 4000 updates, evaluation on the whole
  test set every 100), run in-process on the project's InProcessGrid rather than in
  Flower's simulation engine (the same ServerApp code path, ``run_experiment``, on
  the same virtual clock; several times faster).

``metrics.csv`` is compared byte for byte after dropping the ``wall_time`` column
(the only column that depends on the machine), and so is every ``summary.json`` value
of the reference but ``wall_seconds`` (keys only the newer tree writes are named).
Runs go one at a time (CPU use: one core plus evaluation threads).
"""

from __future__ import annotations

import csv
import io
import json
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

RUNS = {
    "gsgm": {"strategy": "gsgm"},
    "asgd": {"strategy": "asgd"},
    "fedbuff": {"strategy": "fedbuff"},
    "gsgm-mif2-scheduled": {"strategy": "gsgm", "max-in-flight": 2, "dispatch": "scheduled"},
    "asgd-mif2-random": {"strategy": "asgd", "max-in-flight": 2, "dispatch": "random"},
}
COMMON = {
    "max-updates": 200,
    "eval-every": 50,
    "eval-examples": 500,
    "seed": 3,
    "data-root": "/usr/share/datasets/fashion-mnist",
}
#: The smoke size of a preset's run.
SMOKE = {"max-updates": 60, "eval-every": 20, "eval-examples": 500}
DATA = {"fashion-mnist": Path("/usr/share/datasets/fashion-mnist")}
SETS = ("small", "presets", "main")


def _without(text: str, column: str) -> str:
    rows = list(csv.reader(io.StringIO(text)))
    drop = rows[0].index(column)
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows([r[:drop] + r[drop + 1 :] for r in rows])
    return out.getvalue()


def _tree() -> Path:
    """The root of the tree under test (the one ``flwr_gsgm`` is imported from)."""
    import flwr_gsgm

    return Path(flwr_gsgm.__file__).resolve().parents[1]


def run_config(config: dict[str, Any], nodes: int, name: str) -> str:
    """Run ``config`` on ``nodes`` in-process; metrics.csv (no wall_time) + summary."""
    from clients.client_app import app
    from flwr_gsgm.simulation.inprocess_grid import InProcessGrid

    try:
        from serverapp.app_config import parse_app_config
    except ImportError:  # a tree from before the app declared its own keys
        from flwr_gsgm.config.run_config import parse_run_config as parse_app_config

    try:
        from serverapp.experiment import run_experiment
    except ImportError:  # a tree from before the ServerApp moved out of flwr_gsgm
        from flwr_gsgm.experiment import run_experiment

    cfg = parse_app_config(config)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / name
        grid = InProcessGrid(app, nodes, cfg)
        run_experiment(grid, cfg, run_dir)
        metrics = _without((run_dir / "metrics.csv").read_text(), "wall_time")
        summary = json.loads((run_dir / "summary.json").read_text())
    summary.pop("wall_seconds")
    return metrics + "\n" + json.dumps(summary, indent=2, sort_keys=True) + "\n"


def small_runs() -> dict[str, tuple[dict[str, Any], int]]:
    """``small``: name -> (run config, nodes)."""
    return {name: ({**COMMON, **cfg}, 4) for name, cfg in RUNS.items()}


def preset_runs() -> tuple[dict[str, tuple[dict[str, Any], int]], list[str]]:
    """``presets``: name -> (run config, nodes), and the presets skipped (why)."""
    from simulations.preset import (
        load_preset,
        question_works,
        stand_in_tuned,
        tune_works,
        tuned_key,
    )

    runs: dict[str, tuple[dict[str, Any], int]] = {}
    skipped = []
    for path in sorted((_tree() / "simulations" / "presets").glob("*.toml")):
        preset = load_preset(path)
        dataset = preset.base.get("dataset", "fashion-mnist")
        if not (DATA.get(dataset) or Path("/nonexistent")).is_dir():
            skipped.append(f"{path.name} (data set {dataset} is not on this machine)")
            continue
        tuned = stand_in_tuned(preset)
        # The smoke size last: it overrides a question's own budget too.
        smoke = {**SMOKE, "data-root": str(DATA[dataset])}
        for method in preset.methods:
            # One run per client work the method is tuned with (a preset without
            # client works: the base config's work only, named by the method alone).
            for work in tune_works(preset, method):
                key = tuned_key(method, work)
                cfg = {**preset.base, **tuned[key], **preset.tune_partition, **smoke}
                cfg["seed"] = preset.tune_seed
                runs[f"{path.stem}.{key.replace('/', '.')}"] = (cfg, preset.tune_nodes)
        for q in preset.questions.values():
            nodes, part, limit = q.settings()[0]
            method = preset.reference if preset.reference in q.methods else q.methods[0]
            key = tuned_key(method, (question_works(preset, q, method) or [""])[0])
            cfg = {**preset.base, **q.config, **tuned[key], **part, **smoke}
            cfg["seed"] = preset.seeds[0]
            if limit:
                cfg["max-in-flight"] = limit
            runs[f"{path.stem}.question-{q.name}.{key.replace('/', '.')}"] = (cfg, nodes)
    return runs, skipped


def main_run() -> dict[str, tuple[dict[str, Any], int]]:
    """``main``: ``make run``'s run config on its 10 nodes."""
    pyproject = tomllib.loads((_tree() / "pyproject.toml").read_text())
    return {"main": (dict(pyproject["tool"]["flwr"]["app"]["config"]), 10)}


def runs_of(sets: list[str]) -> dict[str, tuple[dict[str, Any], int]]:
    runs: dict[str, tuple[dict[str, Any], int]] = {}
    for name in sets:
        if name == "small":
            runs.update(small_runs())
        elif name == "presets":
            found, skipped = preset_runs()
            runs.update(found)
            for why in skipped:
                print(f"skipped: {why}")
        else:
            runs.update(main_run())
    return runs


def _option(argv: list[str], flag: str) -> set[str] | None:
    """The comma-separated values of ``flag``, removed from ``argv`` (None without it).

    Raises
    ------
    SystemExit
        With code 2 (and the usage) if ``flag`` has no value.
    """
    if flag not in argv:
        return None
    at = argv.index(flag)
    if at + 1 >= len(argv):
        print(__doc__, file=sys.stderr)
        raise SystemExit(2)
    values = set(argv[at + 1].split(","))
    del argv[at : at + 2]
    return values


def selected(name: str, only: set[str]) -> bool:
    """Whether run ``name`` is one of ``only`` or under one (``smoke`` keeps ``smoke.gsgm``)."""
    return any(name == o or name.startswith(o + ".") for o in only)


def main(argv: list[str]) -> int:
    argv = list(argv)
    strategies, only = _option(argv, "--strategy"), _option(argv, "--only")
    if len(argv) < 2 or argv[0] not in ("record", "check") or set(argv[2:]) - set(SETS):
        print(__doc__, file=sys.stderr)
        return 2
    ref = Path(argv[1])
    ref.mkdir(parents=True, exist_ok=True)
    status = 0
    runs = runs_of(argv[2:] or ["small"])
    if strategies is not None:
        runs = {n: r for n, r in runs.items() if r[0].get("strategy", "gsgm") in strategies}
        print(f"{len(runs)} run(s) of strategies {sorted(strategies)}", flush=True)
    if only is not None:
        runs = {n: r for n, r in runs.items() if selected(n, only)}
        print(f"{len(runs)} run(s) named {sorted(only)}", flush=True)
    for name, (config, nodes) in runs.items():
        got = run_config(config, nodes, name)
        path = ref / f"{name}.txt"
        if argv[0] == "record":
            path.write_text(got)
            print(f"{name}: recorded -> {path}", flush=True)
            continue
        before = path.read_text() if path.is_file() else "(none recorded)"
        verdict = compare(before, got)
        print(f"{name}: {verdict}", flush=True)
        if not verdict.startswith("IDENTICAL"):
            status = 1
            print(f"--- reference\n{before}\n--- now\n{got}", flush=True)
    return status


def compare(before: str, got: str) -> str:
    """``IDENTICAL`` when metrics.csv is the same byte for byte and every summary.json
    key of the reference has the same value now (keys a later tree adds, such as
    ``per_node`` and ``status``, are named, not compared); else
    ``DIFFERENT`` and what differs."""
    if "\n{" not in before:
        return "DIFFERENT (no reference recorded)"
    metrics_before, summary_before = before.split("\n{", 1)
    metrics_now, summary_now = got.split("\n{", 1)
    old, new = json.loads("{" + summary_before), json.loads("{" + summary_now)
    changed = sorted(k for k in old if old[k] != new.get(k, object()))
    if metrics_before != metrics_now or changed:
        what = ["metrics.csv"] if metrics_before != metrics_now else []
        return f"DIFFERENT ({', '.join(what + [f'summary {k}' for k in changed])})"
    added = sorted(set(new) - set(old))
    return "IDENTICAL" + (f" (summary keys added since: {', '.join(added)})" if added else "")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
