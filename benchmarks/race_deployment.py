"""A real deployment race: FedAvg, GSGM and FedBuff on a SuperLink + SuperNodes on
127.0.0.1, in wall-clock seconds, beside the time model's prediction of each.

The deployment is the project's (``deploy/start_local.sh`` through
:mod:`benchmarks.local_deployment`): TLS, SuperNode authentication, one
``flwr-gsgm-supernode --warm-executor`` per node, each node holding partition i of
Fashion-MNIST, 2 classes per node. Every method runs the project's own ServerApp
(``flwr run <repo> gsgm-local --run-config ...``: what users run) and the same
ClientApp in weights mode, with the same client work (``local-steps`` SGD steps of
``batch-size`` images at ``local-lr``).

Device speeds are emulated (node config ``step-seconds``, docs/DEPLOYMENT.md section
5): each local step of a node lasts ``--step-seconds`` (x ``slow-factor`` on the slow
nodes, the virtual clock's seeded choice of a ``slow-fraction`` of the partitions:
:meth:`flwr_gsgm.simulation.virtual_clock.VirtualClock.speed_factors`), the ClientApp sleeping
what its real computation did not use. So the race measures the protocol and the
scheduling, not this machine's cores.

Steps:

1. start the deployment (``--nodes`` SuperNodes) and wait until every SuperNode is
   connected;
2. measure the round trip: the probe ServerApp of ``benchmarks/bench_deployment.py``
   keeps every node busy with one-batch messages (``--probe-updates`` per node, the
   first, cold one of each node left out); the latency of a message is its round trip
   minus the ClientApp handler's time (median over the timed updates);
3. a warm-up run (one FedAvg round, not recorded) so that every executor has imported
   the race's app and cached its data;
4. ``--repeats`` repetitions of every method, interleaved (repeat r starts with
   method r mod 3), each with the wall-clock budget ``max-seconds = --budget`` and the
   server's centralized evaluation on a fixed subset of ``eval-examples`` test images
   every ``eval-every`` = nodes updates (one FedAvg round; about every 5 s for the
   asynchronous methods);
5. stop the deployment, then the prediction (unless ``--skip-prediction``): the same
   configuration on the in-process grid under the virtual clock with the time model's
   ``loopback`` profile, the emulated seconds per step and the measured latency
   (:func:`predict`; one run per method: the virtual clock is deterministic);
6. write the CSV and print the summary.

Per run (one CSV row): ``wall_seconds_to_target`` is the ``wall_time`` of the first
evaluation at or above ``--target`` (engine seconds since the run's start: for the
asynchronous methods the start-up query of the nodes is included, about one round
trip), NaN if never reached; ``accuracy_at_budget`` the accuracy of the last
evaluation within the budget (:data:`BUDGET_SLACK_SECONDS` allowed for the final
evaluation's stamp; a FedAvg round still running at the budget does not count);
``final_accuracy`` the project's final accuracy (mean of the last 5 evaluations,
summary.json). The predicted columns are the same figures in virtual seconds.

The run config of every run is :data:`COMMON_OVERRIDES` + :data:`METHOD_OVERRIDES`
[method] (+ :data:`PREDICTION_OVERRIDES` for the prediction): edit those tables to
change what is raced (e.g. the server learning rates once the displacement meaning of
weights mode is merged: 0 = each rule's default).

Usage (from the repository, with the venv; on a quiet machine):

    .venv/bin/python benchmarks/race_deployment.py            # the full race
    .venv/bin/python benchmarks/race_deployment.py --quick --skip-prediction

Full race: 10 SuperNodes, 3 repetitions x 3 methods of 300 s each: about 60 min on
the quiet 2-core development machine (~1 min to start 10 SuperNodes, ~1 min probe,
~0.5 min warm-up, 9 runs x ~5.3 min: the 300 s budget + ~10 s of ServerApp start,
FedAvg's last round and outputs, then ~7 min of in-process predictions: FedAvg 31
rounds ~1.2 min, each asynchronous method ~650 updates ~3 min); ~10 GB of RAM (a
SuperNode with its warm executor is ~950 MiB). Writes
docs/results/deployment_race/race.csv. ``--quick``: 3 SuperNodes, 60 s budget, 1
repetition, 2 probe updates per node: 4.4 min measured (263 s, load average ~2.5);
writes ``<workdir>/race-quick.csv`` unless ``--out`` is given. Every process it starts
is stopped at the end (also on an error or Ctrl-C); certificates, keys, logs and run
folders go to ``--workdir`` (default ``outputs/deployment_race``, git-ignored).

The default target, 0.70: FedAvg with this client work on the in-process grid (10
nodes, seed 0) reached 0.703 after 10 rounds (about 105 s in the race: a round lasts the
slow nodes' 8 s plus a round trip) and 0.741 after 30 (the budget); so FedAvg reaches
it in about a third of the budget and a 1.5x faster method within the first quarter.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's packages
from benchmarks.bench_deployment import PROBE_CLIENT, PROBE_CONFIG, PROBE_SERVER  # noqa: E402
from benchmarks.local_deployment import (  # noqa: E402
    BIN,
    REPO,
    Deployment,
    kill_all,
    probe_app,
    process_tree,
    tail,
)
from flwr_gsgm.evaluation.stability import time_to_target  # noqa: E402
from flwr_gsgm.simulation.virtual_clock import VirtualClock  # noqa: E402

METHODS = ("fedavg", "gsgm", "fedbuff")

#: Emulated devices: the virtual clock's slow set and factor (run config keys of the
#: same names), the same in the deployment and in the prediction.
EMULATED_DEVICES: dict[str, float] = {"slow-fraction": 0.25, "slow-factor": 4.0}

#: Run config of every raced run (``nodes`` and the budget are filled in by the script:
#: ``eval-every``, ``min-nodes``, ``max-seconds``, ``output-dir``, ``run-name``).
COMMON_OVERRIDES: dict[str, Any] = {
    "virtual-clock": False,  # real arrival order, wall-clock budget
    "client-mode": "weights",
    "local-steps": 20,
    "batch-size": 32,
    "local-lr": 0.05,
    "max-updates": 100000,  # the wall-clock budget ends every run
    "max-in-flight": 0,  # every node trains at once (FedAvg: every node every round)
    "eval-examples": 1000,
    "seed": 0,  # the same partitions and slow nodes in every repetition
    "partitioner": "pathological",
    "classes-per-node": 2,
    "checkpoint-every": 0,
    # deployment timing, as deploy/run-config.toml
    "message-ttl": 600.0,
    "startup-timeout": 300.0,
    "dispatch-timeout": 180.0,
    "poll-interval": 0.05,
    "prefetch": False,
    **EMULATED_DEVICES,
}

#: Per-method overrides (server-learning-rate 0 = the rule's default for the client mode).
METHOD_OVERRIDES: dict[str, dict[str, Any]] = {
    "fedavg": {"strategy": "fedavg"},
    "gsgm": {"strategy": "gsgm", "server-learning-rate": 0.0},
    "fedbuff": {"strategy": "fedbuff", "server-learning-rate": 0.0},
}

#: The time model's run config for the prediction (the script fills in the step seconds
#: and the measured latency); on top of COMMON_OVERRIDES and METHOD_OVERRIDES.
PREDICTION_OVERRIDES: dict[str, Any] = {
    "virtual-clock": True,
    "device-profile": "loopback",
    "step-seconds": None,  # --step-seconds (the fast nodes' emulated seconds per step)
    "latency-seconds": None,  # the measured round trip minus the ClientApp's time
    "jitter": 0.0,  # the emulated devices sleep exactly; the real jitter is measured
}

#: Seconds after the budget within which an evaluation still counts as "at the budget"
#: (the asynchronous engine stamps its final evaluation when it stops, a few ms late).
BUDGET_SLACK_SECONDS = 1.0

CSV_COLUMNS = (
    "method",
    "repeat",
    "order",
    "status",
    "target_accuracy",
    "wall_seconds_to_target",
    "predicted_seconds_to_target",
    "accuracy_at_budget",
    "predicted_accuracy_at_budget",
    "final_accuracy",
    "wall_budget_seconds",
    "wall_seconds",
    "updates",
    "predicted_updates",
    "evaluations",
    "nodes",
    "local_steps",
    "batch_size",
    "local_lr",
    "step_seconds",
    "slow_factor",
    "server_learning_rate",
    "round_trip_median_seconds",
    "latency_seconds",
    "load_average_before",
    "load_average_after",
    "run_name",
)


# ------------------------------------------------------------------ run configs
def toml_value(value: Any) -> str:
    """A run config value as ``flwr run --run-config`` parses it (TOML)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string
    return repr(value)


def run_config_pairs(config: dict[str, Any]) -> str:
    """``k=v k2=v2`` for ``flwr run --run-config``."""
    return " ".join(f"{key}={toml_value(value)}" for key, value in config.items())


def race_config(method: str, args: argparse.Namespace, output_dir: Path, name: str) -> dict:
    """The run config of one raced run of ``method``."""
    return {
        **COMMON_OVERRIDES,
        **METHOD_OVERRIDES[method],
        "eval-every": args.nodes,
        "min-nodes": args.nodes,
        "max-seconds": float(args.budget),
        "output-dir": str(output_dir),
        "run-name": name,
    }


def node_step_seconds(args: argparse.Namespace) -> dict[int, float]:
    """Partition-id -> emulated seconds per step (the virtual clock's slow set)."""
    clock = VirtualClock(
        seed=COMMON_OVERRIDES["seed"],
        slow_fraction=EMULATED_DEVICES["slow-fraction"],
        slow_factor=EMULATED_DEVICES["slow-factor"],
    )
    factors = clock.speed_factors(list(range(args.nodes)))
    return {pid: args.step_seconds * factor for pid, factor in factors.items()}


# ------------------------------------------------------------------ the deployment
def start_deployment(args: argparse.Namespace, base: Path) -> Deployment:
    """SuperLink + ``--nodes`` SuperNodes, partition i emulating its step seconds."""
    per_node = {
        f"NODE_CONFIG_EXTRA_{pid}": f"step-seconds={seconds!r}"
        for pid, seconds in node_step_seconds(args).items()
    }
    dep = Deployment(base, "run", PYTHONPATH=str(REPO), **per_node)
    dep.script("start_local.sh", str(args.nodes), timeout=120 + 30 * args.nodes)
    dep.wait_connected([f"node-{i}" for i in range(args.nodes)], timeout=300)
    return dep


def flwr_run(
    dep: Deployment, app: Path, config: str, log: Path, timeout: float
) -> tuple[int | None, float]:
    """``flwr run APP gsgm-local --stream --run-config CONFIG``; (exit code or None on a
    time-out, wall seconds). A run that outlives ``timeout`` is killed."""
    started = time.monotonic()
    proc = dep.popen(
        [str(BIN / "flwr"), "run", str(app), "gsgm-local", "--stream", "--run-config", config],
        log,
        cwd=app,
    )
    try:
        code: int | None = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_all(process_tree(proc.pid))
        code = None
    return code, time.monotonic() - started


def measure_round_trip(dep: Deployment, args: argparse.Namespace, base: Path) -> dict:
    """The probe ServerApp of bench_deployment.py on this deployment: median round trip
    (push -> reply pulled) and latency (round trip - ClientApp handler), seconds."""
    app = probe_app(
        base / "probe-app",
        "gsgm-race-probe",
        "1.0.0",
        {"probe_server.py": PROBE_SERVER, "probe_client.py": PROBE_CLIENT},
        "probe_client:app",
        PROBE_CONFIG,
    )
    out = base / "probe.json"
    out.unlink(missing_ok=True)
    config = (
        f'nodes={args.nodes} updates-per-node={args.probe_updates} out="{out}" depth=1 '
        "batch-size=32 local-batches=1"
    )
    code, _ = flwr_run(dep, app, config, base / "probe.log", 300 + 60 * args.probe_updates)
    if not out.is_file():
        raise RuntimeError(
            f"the round-trip probe wrote no result (exit {code})\n" + tail(base / "probe.log")
        )
    rows = [r for r in json.loads(out.read_text())["rows"] if "error" not in r and r["index"] > 0]
    if not rows:
        raise RuntimeError(f"the round-trip probe timed no update: {out}")
    round_trips = [r["pulled"] - r["push_start"] for r in rows]
    latencies = [rt - (r["t-end"] - r["t-start"]) for rt, r in zip(round_trips, rows)]
    return {
        "round_trip_median_seconds": statistics.median(round_trips),
        "latency_seconds": statistics.median(latencies),
        "updates": len(rows),
    }


# ------------------------------------------------------------------ one run's figures
def read_rows(run_dir: Path) -> list[dict[str, float]]:
    """metrics.csv of a run folder as floats ([] if it is missing)."""
    path = run_dir / "metrics.csv"
    if not path.is_file():
        return []
    with path.open() as fh:
        return [
            {
                k: float(v)
                for k, v in row.items()
                if k in ("updates", "wall_time", "virtual_time", "accuracy")
            }
            for row in csv.DictReader(fh)
        ]


def figures(rows: list[dict[str, float]], time_key: str, target: float, budget: float) -> dict:
    """Seconds to ``target`` (NaN if never) and accuracy at ``budget`` from metric rows."""
    times = [r[time_key] for r in rows]
    accuracies = [r["accuracy"] for r in rows]
    within = [r["accuracy"] for r in rows if r[time_key] <= budget + BUDGET_SLACK_SECONDS]
    return {
        "seconds_to_target": time_to_target(times, accuracies, target),
        "accuracy_at_budget": within[-1] if within else math.nan,
    }


def run_method(
    dep: Deployment,
    method: str,
    repeat: int,
    order: int,
    args: argparse.Namespace,
    base: Path,
    probe: dict,
) -> dict:
    """One raced run on the deployment; its CSV row."""
    name = f"race-{method}-r{repeat}"
    runs = base / "runs"
    config = race_config(method, args, runs, name)
    load_before = os.getloadavg()[0]
    code, wall = flwr_run(
        dep, REPO, run_config_pairs(config), base / f"{name}.log", args.budget + 300
    )
    run_dir = runs / name
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    rows = read_rows(run_dir)
    got = figures(rows, "wall_time", args.target, args.budget)
    status = summary.get("status", "no summary") if code == 0 else f"flwr run exit {code}"
    if status != "completed":
        print(f"  {name}: {status}\n{tail(base / f'{name}.log', 20)}", flush=True)
    return {
        "method": method,
        "repeat": repeat,
        "order": order,
        "status": status,
        "target_accuracy": args.target,
        "wall_seconds_to_target": got["seconds_to_target"],
        "predicted_seconds_to_target": math.nan,
        "accuracy_at_budget": got["accuracy_at_budget"],
        "predicted_accuracy_at_budget": math.nan,
        "final_accuracy": summary.get("final_accuracy", math.nan),
        "wall_budget_seconds": float(args.budget),
        "wall_seconds": summary.get("wall_seconds", wall),
        "updates": summary.get("updates_received", 0),
        "predicted_updates": math.nan,
        "evaluations": len(rows),
        "nodes": args.nodes,
        "local_steps": config["local-steps"],
        "batch_size": config["batch-size"],
        "local_lr": config["local-lr"],
        "step_seconds": args.step_seconds,
        "slow_factor": EMULATED_DEVICES["slow-factor"],
        "server_learning_rate": config.get("server-learning-rate", math.nan),
        "round_trip_median_seconds": probe["round_trip_median_seconds"],
        "latency_seconds": probe["latency_seconds"],
        "load_average_before": load_before,
        "load_average_after": os.getloadavg()[0],
        "run_name": name,
    }


# ------------------------------------------------------------------ the prediction
def prediction_config(
    method: str, args: argparse.Namespace, latency: float, output_dir: Path
) -> dict:
    """The raced configuration of ``method`` under the time model (virtual seconds).

    The asynchronous methods stop at the budget in virtual seconds (``max-seconds``);
    FedAvg, which has no virtual-time budget, gets as many rounds as can fit in it (a
    round lasts at least the slowest node's compute plus the latency).
    """
    config = race_config(method, args, output_dir, f"predict-{method}")
    config.update(PREDICTION_OVERRIDES)
    config.update({"step-seconds": args.step_seconds, "latency-seconds": latency})
    for key in ("min-nodes", "dispatch-timeout", "message-ttl", "startup-timeout", "poll-interval"):
        config.pop(key, None)  # deployment-only: the in-process grid answers at once
    if method == "fedavg":
        shortest_round = (
            config["local-steps"] * args.step_seconds * EMULATED_DEVICES["slow-factor"] + latency
        )
        config["max-updates"] = args.nodes * (math.ceil(args.budget / shortest_round) + 1)
    return config


def predict(method: str, args: argparse.Namespace, latency: float, base: Path) -> dict:
    """The time model's prediction of one raced configuration: the project's
    experiment on the in-process grid with the virtual clock (``device-profile`` =
    ``loopback``, the emulated step seconds, ``latency`` seconds per message); its
    virtual seconds to ``--target``, accuracy at the budget and updates.

    Raises
    ------
    ValueError
        If the run config does not know the time model's keys (it is not merged yet:
        run with ``--skip-prediction``), naming them.
    """
    from clients.client_app import app as client_app
    from flwr_gsgm.simulation.inprocess_grid import InProcessGrid
    from serverapp.app_config import parse_app_config
    from serverapp.experiment import run_experiment

    runs = base / "predictions"
    cfg = parse_app_config(prediction_config(method, args, latency, runs))
    run_dir = runs / cfg["run-name"]
    grid = InProcessGrid(client_app, args.nodes, cfg, workers=2)
    summary = run_experiment(grid, cfg, run_dir)
    got = figures(read_rows(run_dir), "virtual_time", args.target, args.budget)
    return {**got, "updates": summary["updates_received"]}


def missing_prediction_keys() -> list[str]:
    """The time model's run config keys the run config does not know (yet)."""
    from serverapp.app_config import RUN_CONFIG

    return sorted(set(PREDICTION_OVERRIDES) - set(RUN_CONFIG))


# ------------------------------------------------------------------ outputs
def write_csv(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _cell(row[k]) for k in CSV_COLUMNS})


def _cell(value: Any) -> Any:
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.6g}"
    return value


def _median(values: list[float]) -> float:
    """Median of the values; NaN counts as never (a run that missed the target: its
    time is infinite), so the median is NaN if half or more are NaN."""
    ordered = sorted((math.inf if math.isnan(v) else v) for v in values)
    if not ordered:
        return math.nan
    m = statistics.median(ordered)
    return math.nan if math.isinf(m) else m


def summary_text(rows: list[dict], args: argparse.Namespace, probe: dict) -> str:
    """Medians per method and the race's two ratios, with the issue's targets."""
    lines = [
        f"Deployment race: {args.nodes} SuperNodes on 127.0.0.1 (TLS, authentication, warm "
        f"executor), Fashion-MNIST 2 classes per node, weights mode, "
        f"{COMMON_OVERRIDES['local-steps']} steps x batch {COMMON_OVERRIDES['batch-size']} at "
        f"lr {COMMON_OVERRIDES['local-lr']}; {args.step_seconds} s per step "
        f"({EMULATED_DEVICES['slow-factor']:g}x on {EMULATED_DEVICES['slow-fraction']:.0%} of "
        f"the nodes); budget {args.budget:g} s; target accuracy {args.target}",
        f"round trip median {probe['round_trip_median_seconds']:.3f} s, latency (round trip - "
        f"ClientApp) {probe['latency_seconds']:.3f} s over {probe['updates']} probe updates",
        f"{'method':<8} {'runs':>4} {'reached':>7} {'s to target':>12} {'predicted':>10} "
        f"{'pred/meas':>9} {'acc@budget':>10} {'pred acc':>8} {'final acc':>9} {'updates':>8}",
    ]
    med: dict[str, dict[str, float]] = {}
    for method in METHODS:
        mine = [r for r in rows if r["method"] == method]
        if not mine:
            continue
        m = {
            "time": _median([r["wall_seconds_to_target"] for r in mine]),
            "predicted": mine[0]["predicted_seconds_to_target"],
            "acc": statistics.median(r["accuracy_at_budget"] for r in mine),
            "pred_acc": mine[0]["predicted_accuracy_at_budget"],
            "final": statistics.median(r["final_accuracy"] for r in mine),
            "updates": statistics.median(r["updates"] for r in mine),
        }
        med[method] = m
        reached = sum(not math.isnan(r["wall_seconds_to_target"]) for r in mine)
        lines.append(
            f"{method:<8} {len(mine):>4} {reached:>7} {m['time']:>12.1f} {m['predicted']:>10.1f} "
            f"{m['predicted'] / m['time']:>9.2f} {m['acc']:>10.4f} {m['pred_acc']:>8.4f} "
            f"{m['final']:>9.4f} {m['updates']:>8.0f}"
        )
    if "fedavg" in med and "gsgm" in med:
        ratio = med["fedavg"]["time"] / med["gsgm"]["time"]
        verdict = "n/a" if math.isnan(ratio) else ("met" if ratio >= 1.5 else "MISSED")
        lines.append(f"FedAvg/GSGM median time to target: {ratio:.2f}x (target >= 1.5x: {verdict})")
    if "fedavg" in med and "fedbuff" in med:
        ratio = med["fedavg"]["time"] / med["fedbuff"]["time"]
        lines.append(f"FedAvg/FedBuff median time to target: {ratio:.2f}x")
    for method, m in med.items():
        error = abs(m["predicted"] / m["time"] - 1)
        verdict = "n/a" if math.isnan(error) else ("met" if error <= 0.25 else "MISSED")
        lines.append(
            f"{method}: predicted/measured time to target {m['predicted'] / m['time']:.2f} "
            f"(within 25%: {verdict})"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------ main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 nodes, 60 s, 1 repetition")
    parser.add_argument("--nodes", type=int, help="SuperNodes (default 10; --quick 3)")
    parser.add_argument("--repeats", type=int, help="repetitions per method (default 3; --quick 1)")
    parser.add_argument(
        "--budget", type=float, help="wall seconds per run (default 300; --quick 60)"
    )
    parser.add_argument("--target", type=float, default=0.70, help="target accuracy, in (0, 1)")
    parser.add_argument(
        "--step-seconds", type=float, default=0.1, help="emulated seconds per step, fast nodes"
    )
    parser.add_argument(
        "--probe-updates", type=int, help="probe updates per node (default 4; --quick 2)"
    )
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated: {METHODS}")
    parser.add_argument("--skip-prediction", action="store_true", help="no time-model prediction")
    parser.add_argument(
        "--out", type=Path, help="CSV (default docs/results/deployment_race/race.csv)"
    )
    parser.add_argument("--workdir", type=Path, default=REPO / "outputs" / "deployment_race")
    args = parser.parse_args(argv)
    quick = {"nodes": 3, "repeats": 1, "budget": 60.0, "probe_updates": 2}
    full = {"nodes": 10, "repeats": 3, "budget": 300.0, "probe_updates": 4}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.workdir = args.workdir.resolve()
    if args.out is None:
        args.out = (
            args.workdir / "race-quick.csv"
            if args.quick
            else REPO / "docs" / "results" / "deployment_race" / "race.csv"
        )
    args.methods = [m for m in args.methods.split(",") if m]
    problems = [
        f"--nodes {args.nodes}: expected an integer >= 2" * (args.nodes < 2),
        f"--repeats {args.repeats}: expected an integer >= 1" * (args.repeats < 1),
        f"--budget {args.budget}: expected seconds > 0" * (not args.budget > 0),
        f"--target {args.target}: expected a fraction in (0, 1)" * (not 0 < args.target < 1),
        f"--step-seconds {args.step_seconds}: expected seconds >= 0" * (args.step_seconds < 0),
        f"--probe-updates {args.probe_updates}: expected an integer >= 1"
        * (args.probe_updates < 1),
        f"--methods {args.methods}: expected some of {METHODS}"
        * bool(set(args.methods) - set(METHODS)),
    ]
    if not args.skip_prediction and (missing := missing_prediction_keys()):
        problems.append(
            f"the time model's run config keys {missing} are unknown to "
            "flwr_gsgm/config/run_config.py "
            "(not merged yet): pass --skip-prediction"
        )
    if any(problems):
        parser.error("; ".join(p for p in problems if p))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base = args.workdir
    base.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    rows: list[dict] = []
    print(f"starting the deployment: {args.nodes} SuperNodes, work folder {base}", flush=True)
    dep = start_deployment(args, base)
    try:
        probe = measure_round_trip(dep, args, base)
        print(
            f"round trip median {probe['round_trip_median_seconds']:.3f} s, latency "
            f"{probe['latency_seconds']:.3f} s ({time.monotonic() - started:.0f} s so far)",
            flush=True,
        )
        warmup = {
            **race_config("fedavg", args, base / "runs", "warmup"),
            "max-updates": args.nodes,  # one round
            "max-seconds": 0.0,
            "eval-examples": 100,
        }
        code, wall = flwr_run(dep, REPO, run_config_pairs(warmup), base / "warmup.log", 600)
        print(f"warm-up run: exit {code}, {wall:.0f} s", flush=True)
        for repeat in range(1, args.repeats + 1):
            shift = (repeat - 1) % len(args.methods)
            for order, method in enumerate(args.methods[shift:] + args.methods[:shift], start=1):
                row = run_method(dep, method, repeat, order, args, base, probe)
                rows.append(row)
                print(
                    f"{method} repeat {repeat}: {row['status']}, to target "
                    f"{row['wall_seconds_to_target']:.1f} s, at budget "
                    f"{row['accuracy_at_budget']:.4f}, {row['updates']} updates "
                    f"({time.monotonic() - started:.0f} s so far)",
                    flush=True,
                )
                write_csv(args.out, rows)  # what ran so far, if a later run fails
    finally:
        dep.stop_everything()
    if not args.skip_prediction:
        for method in args.methods:
            got = predict(method, args, probe["latency_seconds"], base)
            for row in rows:
                if row["method"] == method:
                    row["predicted_seconds_to_target"] = got["seconds_to_target"]
                    row["predicted_accuracy_at_budget"] = got["accuracy_at_budget"]
                    row["predicted_updates"] = got["updates"]
            print(
                f"predicted {method}: {got} ({time.monotonic() - started:.0f} s so far)", flush=True
            )
    write_csv(args.out, rows)
    print(summary_text(rows, args, probe))
    print(f"wrote {args.out}; {time.monotonic() - started:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
