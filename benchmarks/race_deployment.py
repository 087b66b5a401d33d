"""A real deployment race: FedAvg, GSGM, FedBuff and FedCompass on a SuperLink +
SuperNodes on 127.0.0.1, in wall-clock seconds, beside the time model's prediction of
each, with every run's validity measured.

**The race runs alone.** No helper session, no test suite, no sweep, no other benchmark
may run on the machine while it runs: the round trip of a message is what the machine's
load makes it (a race beside other work measured 16 s per message against 2.2 s quiet),
and a run whose round trip grew is marked invalid below and must be re-run.

The deployment is the project's (``deploy/start_local.sh`` through
:mod:`benchmarks.local_deployment`): TLS, SuperNode authentication, one
``flwr-gsgm-supernode --warm-executor`` per node, each node holding partition i of
Fashion-MNIST, 2 classes per node. Every method runs the project's own ServerApp
(``flwr run <repo> gsgm-local --run-config ...``: what users run) and the same
ClientApp in weights mode, with the same client work (``local-steps`` = 20 SGD steps of
32 images at lr 0.05: the results pages give no one recommendation for this setting:
``loopback`` in docs/results/fashion_mnist_realtime recommends 20 steps in weights mode
for FedAvg and GSGM, ``edge`` one gradient batch for the asynchronous rules, which
neither work scheduling nor FedCompass can size; so every method gets the same work).
GSGM runs with its defaults and work scheduling ``equal-time`` (the project's ClientApp
does the ``local-steps`` it is sent and reports ``train-steps``: docs/GSGM.md, "Work
scheduling"); FedCompass sizes every message itself; FedAvg and FedBuff send the run's
own 20 steps.

Device speeds are emulated (node config ``step-seconds``, docs/DEPLOYMENT.md section
5): each local step of node i lasts its seconds per step, the ClientApp sleeping what
its real computation did not use, so the race measures the protocol and the scheduling,
not this machine's cores. ``--speeds``:

- ``appfl10`` (default): APPFL's measured seconds per step of 10 clients (FedCompass,
  Li et al., ICLR 2024; :data:`~flwr_gsgm.simulation.virtual_clock.APPFL10_STEP_SECONDS`,
  the ``appfl10`` device profile): node i runs at entry ``i % 10`` over the table's
  median, the whole fleet scaled so that the fastest node's update (its 20 steps) lasts
  :data:`ROUND_TRIP_MULTIPLE` (5) x the quiet round trip (:func:`appfl10_step_seconds`;
  rounded up to the millisecond). With a quiet round trip of 2.2 s: 0.55 s per step on
  the fastest node (11 s per update), 4.94 s on the slowest (99 s per update; 9.0x).
- ``slow-quarter``: the first race's setting: ``--step-seconds`` (0.1) per step, 4x on
  the virtual clock's seeded quarter of the nodes
  (:meth:`~flwr_gsgm.simulation.virtual_clock.VirtualClock.speed_factors`).

Steps:

1. the quiet round trip (unless ``--quiet-round-trip`` gives it): a deployment of 2
   SuperNodes without emulated speeds, the probe ServerApp of
   ``benchmarks/bench_deployment.py`` keeping both busy with one-batch messages
   (``--probe-updates`` per node, the first, cold one of each node left out); the median
   round trip (push -> reply pulled); the deployment is then stopped;
2. the emulated speeds (they need the quiet round trip), then the race's deployment
   (``--nodes`` SuperNodes, node i emulating its seconds per step); wait until every
   SuperNode is connected;
3. a warm-up run (one FedAvg round of one step, not recorded) so that every executor
   has imported the race's app and cached its data;
4. the probe on the race's deployment (its ClientApp with the emulation off, so that
   its round trip is the protocol's, comparable with the quiet figure), then the
   repetitions ``--repeat`` (default all ``--repeats``) of every method, interleaved
   (repeat r starts with method r - 1 mod the number of methods), a (method, repeat)
   with a valid row in the CSV skipped (see "Resuming"), each run followed by the probe
   again, and the CSV written after every run: a run's
   ``probe_round_trip_before`` is the probe just before it, ``probe_round_trip_after``
   the one just after, ``probe_round_trip`` the larger; the 1- and 5-minute load
   averages (``os.getloadavg``) are read just before and just after the run. Each run
   has the wall-clock budget ``max-seconds = --budget`` and the server's centralized
   evaluation on a fixed subset of ``eval-examples`` test images every ``eval-every`` =
   nodes updates (one FedAvg round);
5. stop the deployment; write the device profile file (``<out stem>-device-profile.csv``
   beside the CSV: each node's emulated seconds per step and the quiet probe's latency,
   bytes free; kept as it is when the CSV already holds predictions made with it; not the
   race probes' latency, which holds the queue of 10 replies at once: see ``race()``);
   then the prediction (unless ``--skip-prediction``) of each method the CSV
   has no predicted figures for yet (the others' are reused): the same configuration
   on the in-process grid under the virtual clock with ``device-profile`` = that file
   and a server that handles one reply at a time, ``server-seconds`` =
   :func:`server_seconds` (the reference round trip / nodes), the latency less that
   (:func:`model_latency`) (:func:`predict`; one run per method: the virtual clock is
   deterministic). ``--predict-again`` makes every method's prediction again with the
   current time model and replaces the CSV's predicted columns (no deployment);
6. write the CSV and print the summary of all its rows.

**Resuming** (the full race lasts about 5 h, a working session at most 3 h): the race
runs one repetition per session, ``--repeat 1``, then ``--repeat 2``, then ``--repeat 3``
(``--repeat`` is 1-based, repeatable or a comma list). Each session does the whole
start-up (steps 1-3) and appends its rows to the CSV (:func:`read_csv`: its columns must
be :data:`CSV_COLUMNS`, its rows the same ``--speeds``, ``--nodes``, ``--budget``,
``--target``, else it stops, naming them). A (method, repeat) that already has a valid
row is skipped, said in the output; an invalid row stays in the CSV (``valid`` False)
and its repetition is run again under a new name (``race-<method>-r<repeat>-a2``, ...:
:func:`run_name_for`, never an earlier attempt's run folder). On start, a row whose run
folder (``<workdir>/runs/<run_name>``) exists without a ``completed`` summary.json is
ignored: marked invalid, its ``status`` prefixed ``ignored:`` (:func:`mark_incomplete`).
The CSV is rewritten after every run (a temporary file renamed over it), so a session
killed mid-race keeps the runs it finished; the run it was in leaves no row and is run
again. ``appfl10``'s speeds are scaled by the quiet round trip of the CSV's first row,
so that every session races the first session's devices, and every run's validity is
against the first session's reference round trip (below). ``--summary-only``
reads the CSV, prints the summary and exits (no deployment).

**Validity.** A run is valid when it completed and its ``probe_round_trip`` is at most
:data:`VALIDITY_FACTOR` (2) x the **reference round trip** (:func:`is_valid`): the probe
on the race's own deployment at the start of the CSV's first session, before any run
(its row's ``start_round_trip``), on a machine running nothing else. Why not the quiet
round trip of 2 SuperNodes: with all 10 SuperNodes answering the probe at once the
ServerApp's pulls queue at the SuperLink, so the same probe measures a longer round
trip on the race's own deployment with nothing else running (the first session: 7.65 s
against 1.69 s with 2 SuperNodes, 4.5x); compared with the 2-node figure every run would
be invalid whatever the machine's load. The quiet figure still scales the devices
(``appfl10``) and is kept in each row (``quiet_round_trip``); each session's own start
probe is its rows' ``start_round_trip``. The summary is
computed from the whole CSV (every session's rows): per method the median over its
valid repetitions (one row each) with how many and which; it says how many runs were
excluded, which, those whose repetition must still be re-run, and the (method, repeat)
without a valid run yet (an invalid race is re-run, not reported).

Per run (one CSV row, :data:`CSV_COLUMNS`): ``wall_seconds_to_target`` is the
``wall_time`` of the first evaluation at or above ``--target`` (engine seconds since the
run's start: for the asynchronous methods the start-up query of the nodes is included,
about one round trip), empty (NaN) if never reached; ``accuracy_at_budget`` the accuracy
of the last evaluation within the budget (:data:`BUDGET_SLACK_SECONDS` allowed for the
final evaluation's stamp; a FedAvg round still running at the budget does not count);
``final_accuracy`` the project's final accuracy (mean of the last 5 evaluations,
summary.json); ``updates`` the updates received. The predicted columns are the same
figures in virtual seconds.

The run config of every run is :data:`COMMON_OVERRIDES` + :data:`METHOD_OVERRIDES`
[method] (+ :data:`PREDICTION_OVERRIDES` for the prediction): edit those tables to
change what is raced.

Usage (from the repository, with the venv; on a quiet machine, nothing else running):

    .venv/bin/python benchmarks/race_deployment.py --repeat 1    # session 1, ~1 h 45 min
    .venv/bin/python benchmarks/race_deployment.py --repeat 2    # session 2, the same
    .venv/bin/python benchmarks/race_deployment.py --repeat 3    # session 3, the same
    .venv/bin/python benchmarks/race_deployment.py --summary-only  # the summary again
    .venv/bin/python benchmarks/race_deployment.py --predict-again # the model again
    .venv/bin/python benchmarks/race_deployment.py --quick       # the whole path, small

Full race (defaults): 10 SuperNodes, ``appfl10`` speeds, 4 methods x 3 repetitions of
:data:`FULL_BUDGET_SECONDS` each, about 5 h in one go (each run its 1200 s + ~1-2 min:
12 runs about 4.5 h, + ~25 min of quiet measurement, start-up, warm-up and predictions);
one repetition per session: 4 runs x (1200 s + 1-2 min) = 84-88 min + the start-up and,
in the first session, the predictions (part of those ~25 min): about 1 h 45 min
(docs/results/deployment_race/README.md, "Running it"). ~10 GB of RAM (a SuperNode with
its warm executor is ~950 MiB). Writes (appends to)
docs/results/deployment_race/race.csv. ``--quick``: 3 SuperNodes, 60 s budget, 1
repetition, 2 probe updates per node, the fastest update 1 x the quiet round trip
(``--round-trip-multiple``) so that a run holds a few updates; writes
``<workdir>/race-quick.csv`` unless ``--out`` is given: 14.4 min measured (864 s, load
average 9-14). Every process it starts is
stopped at the end (also on an error, Ctrl-C, SIGTERM or SIGHUP, and by a watchdog
when it is killed outright: :func:`benchmarks.local_deployment.start_deployment` guards
each deployment), and the in-process predictions' client
threads are joined before the interpreter exits. Certificates, keys, logs and run
folders go to ``--workdir`` (default ``outputs/deployment_race``, git-ignored).

Exit code: 0 when every run completed and the CSV is written (invalid runs are flagged
in the CSV and the summary, not an error; also when every asked run was skipped, and for
``--summary-only`` with rows to summarise); 1 with the reason printed when a run failed,
the CSV has other columns or another configuration's rows (or, ``--summary-only``, no
rows),
the deployment or a probe could not be started, the prediction failed, or a process it
started was still alive at the end; 2 on bad arguments.
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
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's packages
from benchmarks.bench_deployment import PROBE_CLIENT, PROBE_CONFIG, PROBE_SERVER  # noqa: E402
from benchmarks.local_deployment import (  # noqa: E402
    REPO,
    Deployment,
    kill_all,
    probe_app,
    process_tree,
    run_config_pairs,
    tail,
)
from benchmarks.local_deployment import start_deployment as start_nodes  # noqa: E402
from flwr_gsgm.evaluation.stability import time_to_target  # noqa: E402
from flwr_gsgm.simulation.virtual_clock import (  # noqa: E402
    APPFL10_STEP_SECONDS,
    VirtualClock,
)

METHODS = ("fedavg", "gsgm", "fedbuff", "fedcompass")
SPEEDS = ("appfl10", "slow-quarter")

#: ``appfl10``: the fastest node's update lasts at least this many quiet round trips.
ROUND_TRIP_MULTIPLE = 5.0
#: A run is valid if its probe round trip is at most this many reference round trips
#: (the probe on the race's deployment at the start of the first session).
VALIDITY_FACTOR = 2.0
#: SuperNodes of the quiet round-trip measurement (docs/DEPLOYMENT.md section 8's).
QUIET_NODES = 2
#: The full race's wall budget per run (seconds): with ``appfl10`` at a quiet round trip
#: of 2.2 s a FedAvg round lasts the slowest node's ~99 s + a round trip, so about 11
#: rounds fit; the time model has FedAvg reach 0.70 after 10 (1009 s) and GSGM with work
#: scheduling at 585 s (docs/results/deployment_race/README.md, "Running it").
FULL_BUDGET_SECONDS = 1200.0

#: ``slow-quarter``: the virtual clock's slow set and factor (the first race's devices).
SLOW_QUARTER: dict[str, float] = {"slow-fraction": 0.25, "slow-factor": 4.0}

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
    "seed": 0,  # the same partitions in every repetition
    "partitioner": "pathological",
    "classes-per-node": 2,
    "checkpoint-every": 0,
    # deployment timing, as deploy/run-config.toml
    "message-ttl": 600.0,
    "startup-timeout": 300.0,
    "dispatch-timeout": 180.0,  # raised for slow emulated devices: deployment_timeouts
    "poll-interval": 0.05,
    "prefetch": False,
}

#: Per-method overrides (server-learning-rate 0 = the rule's default in weights mode:
#: GSGM 1.0 per cycle, FedBuff 0.25, FedCompass APPFL's 0.9).
METHOD_OVERRIDES: dict[str, dict[str, Any]] = {
    "fedavg": {"strategy": "fedavg"},
    "gsgm": {"strategy": "gsgm", "server-learning-rate": 0.0, "work-scheduling": "equal-time"},
    "fedbuff": {"strategy": "fedbuff", "server-learning-rate": 0.0},
    "fedcompass": {"strategy": "fedcompass", "server-learning-rate": 0.0},
}

#: The time model's run config for the prediction (the script fills in the profile
#: file); on top of COMMON_OVERRIDES and METHOD_OVERRIDES. step-seconds and
#: latency-seconds 0: each node's own from the file.
PREDICTION_OVERRIDES: dict[str, Any] = {
    "virtual-clock": True,
    "device-profile": None,  # the race's device profile file (write_device_profile)
    "step-seconds": 0.0,
    "latency-seconds": 0.0,
    "jitter": 0.0,  # the emulated devices sleep exactly; the real jitter is measured
}

#: Seconds after the budget within which an evaluation still counts as "at the budget"
#: (the asynchronous engine stamps its final evaluation when it stops, a few ms late).
BUDGET_SLACK_SECONDS = 1.0

CSV_COLUMNS = (
    "method",
    "repeat",
    "order",
    "speeds",
    "status",
    "valid",
    "load_before",
    "load_before_5min",
    "load_after",
    "load_after_5min",
    "probe_round_trip",
    "probe_round_trip_before",
    "probe_round_trip_after",
    "quiet_round_trip",
    "start_round_trip",
    "target_accuracy",
    "wall_seconds_to_target",
    "predicted_seconds_to_target",
    "updates",
    "predicted_updates",
    "accuracy_at_budget",
    "predicted_accuracy_at_budget",
    "final_accuracy",
    "wall_budget_seconds",
    "wall_seconds",
    "evaluations",
    "nodes",
    "local_steps",
    "batch_size",
    "local_lr",
    "work_scheduling",
    "fastest_step_seconds",
    "median_step_seconds",
    "slowest_step_seconds",
    "server_learning_rate",
    "latency_seconds",
    "run_name",
)


class RaceError(RuntimeError):
    """A reason the race cannot go on or did not succeed (printed, exit code 1)."""


# ------------------------------------------------------------------ pure parts
def appfl10_step_seconds(
    nodes: int,
    quiet_round_trip: float,
    local_steps: int,
    multiple: float = ROUND_TRIP_MULTIPLE,
) -> dict[int, float]:
    """Partition-id -> emulated seconds per step: APPFL's measured profile scaled.

    Node i runs at ``APPFL10_STEP_SECONDS[i % 10] / median`` of the median node's
    seconds per step (the ``appfl10`` device profile's ratios); the median node's
    seconds per step is chosen so that the fastest of the ``nodes`` nodes needs
    ``multiple x quiet_round_trip`` seconds for ``local_steps`` steps. Each value is
    rounded up to the millisecond, so the fastest update lasts at least that long.

    Example: 10 nodes, quiet round trip 2.0 s, 20 steps: the fastest node (0.099 s,
    ratio 0.099 / 0.312) gets 0.5 s per step (20 x 0.5 = 10 s = 5 x 2.0 s), the median
    node 1.576 s, the slowest (0.889 s) 4.490 s.
    """
    median = statistics.median(APPFL10_STEP_SECONDS)
    ratios = {p: APPFL10_STEP_SECONDS[p % len(APPFL10_STEP_SECONDS)] / median for p in range(nodes)}
    median_seconds = multiple * quiet_round_trip / (local_steps * min(ratios.values()))
    return {p: _ceil_ms(median_seconds * ratio) for p, ratio in ratios.items()}


def _ceil_ms(seconds: float) -> float:
    """Seconds rounded up to the millisecond (a float's last-digit noise ignored)."""
    return math.ceil(round(seconds * 1000, 6)) / 1000


def slow_quarter_step_seconds(nodes: int, step_seconds: float) -> dict[int, float]:
    """Partition-id -> emulated seconds per step: ``step_seconds``, x 4 on the virtual
    clock's seeded quarter of the nodes (the first race's devices)."""
    clock = VirtualClock(
        seed=COMMON_OVERRIDES["seed"],
        slow_fraction=SLOW_QUARTER["slow-fraction"],
        slow_factor=SLOW_QUARTER["slow-factor"],
    )
    factors = clock.speed_factors(list(range(nodes)))
    return {pid: step_seconds * factor for pid, factor in factors.items()}


def node_step_seconds(args: argparse.Namespace, quiet_round_trip: float) -> dict[int, float]:
    """The race's emulated seconds per step of each partition-id (``--speeds``)."""
    if args.speeds == "appfl10":
        return appfl10_step_seconds(
            args.nodes,
            quiet_round_trip,
            COMMON_OVERRIDES["local-steps"],
            args.round_trip_multiple,
        )
    return slow_quarter_step_seconds(args.nodes, args.step_seconds)


def is_valid(status: str, probe_round_trip: float, reference_round_trip: float) -> bool:
    """A run counts if it completed and its probe round trip (the larger of the probes
    before and after it) is at most :data:`VALIDITY_FACTOR` x the reference round trip
    (:func:`reference_round_trip`); a probe that failed (NaN) makes it invalid."""
    return (
        status == "completed"
        and math.isfinite(probe_round_trip)
        and probe_round_trip <= VALIDITY_FACTOR * reference_round_trip
    )


def reference_round_trip(rows: list[dict], start_round_trip: float) -> float:
    """The reference of every run's validity: the first session's probe on the race's
    deployment before any run (the CSV's first row's ``start_round_trip``), or this
    session's (``start_round_trip``) when the CSV has no row yet."""
    return rows[0]["start_round_trip"] if rows else start_round_trip


def probe_figures(rows: list[dict]) -> dict:
    """The probe's rows (bench_deployment.py's ServerApp) -> median round trip (push ->
    reply pulled) and latency (round trip - the ClientApp handler's time), seconds;
    the first, cold update of each node and error replies left out.

    Raises
    ------
    RaceError
        If no update is left to time.
    """
    timed = [r for r in rows if "error" not in r and r["index"] > 0]
    if not timed:
        raise RaceError(f"the round-trip probe timed no update ({len(rows)} replies)")
    round_trips = [r["pulled"] - r["push_start"] for r in timed]
    latencies = [rt - (r["t-end"] - r["t-start"]) for rt, r in zip(round_trips, timed)]
    return {
        "round_trip": statistics.median(round_trips),
        "latency": statistics.median(latencies),
        "updates": len(timed),
    }


def server_seconds(reference_round_trip: float, nodes: int) -> float:
    """The time model's server seconds per reply (run config ``server-seconds``): the
    reference probe's round trip over the nodes. That probe keeps every node busy at
    once (one message each, a handler of milliseconds), so their replies queue at the
    server and a node's round trip is the time the server takes for all of them: one
    reply costs round trip / nodes (the first session: 7.646 s / 10 = 0.765 s).

    Raises
    ------
    RaceError
        If the round trip is not > 0 or nodes < 1.
    """
    if not (reference_round_trip > 0 and nodes >= 1):
        raise RaceError(
            f"server seconds need a reference round trip > 0 and nodes >= 1; got "
            f"{reference_round_trip!r} s and {nodes!r} nodes"
        )
    return reference_round_trip / nodes


def model_latency(quiet_latency: float, server: float) -> float:
    """The time model's latency per message (run config ``latency-seconds``) beside a
    server of ``server`` seconds per reply: the quiet probe's latency, which holds one
    reply's server time, less that time.

    Raises
    ------
    RaceError
        If what is left is not > 0 (the server estimate exceeds the quiet latency).
    """
    latency = quiet_latency - server
    if not latency > 0:
        raise RaceError(
            f"the quiet latency {quiet_latency:.3f} s does not exceed the server's "
            f"{server:.3f} s per reply: expected a quiet probe on 2 SuperNodes and a "
            "reference probe on the race's own deployment"
        )
    return latency


def device_profile_rows(step_seconds: dict[int, float], latency: float) -> list[list[str]]:
    """The rows (header first) of the race's device profile file
    (:mod:`flwr_gsgm.simulation.profile_file`): each node's emulated seconds per step,
    free bytes (the measured latency already holds the model's transfer on loopback),
    the measured latency."""
    rows = [["partition-id", "step-seconds", "bandwidth", "latency-seconds"]]
    rows += [[str(p), repr(s), "", repr(float(latency))] for p, s in sorted(step_seconds.items())]
    return rows


# ------------------------------------------------------------------ run configs
def race_config(
    method: str,
    args: argparse.Namespace,
    output_dir: Path,
    name: str,
    slowest_update: float = 0.0,
) -> dict:
    """The run config of one raced run of ``method``; ``slowest_update`` (seconds of the
    slowest node's update) raises the deployment's waits (:func:`deployment_timeouts`)."""
    return {
        **COMMON_OVERRIDES,
        **METHOD_OVERRIDES[method],
        **deployment_timeouts(slowest_update),
        "eval-every": args.nodes,
        "min-nodes": args.nodes,
        "max-seconds": float(args.budget),
        "output-dir": str(output_dir),
        "run-name": name,
    }


def deployment_timeouts(slowest_update: float) -> dict[str, float]:
    """``dispatch-timeout`` and ``message-ttl`` for emulated updates of up to
    ``slowest_update`` seconds: a dispatch is given 3 of them + 60 s (at least
    :data:`COMMON_OVERRIDES`' figure), a message 120 s more (at least its figure)."""
    dispatch = max(COMMON_OVERRIDES["dispatch-timeout"], 3 * slowest_update + 60)
    return {
        "dispatch-timeout": float(dispatch),
        "message-ttl": float(max(COMMON_OVERRIDES["message-ttl"], dispatch + 120)),
    }


def work_scheduling(config: dict) -> str:
    """What sizes each message's local steps: ``equal-time``, ``compass`` (FedCompass's
    own scheduler) or ``off`` (the run's own ``local-steps``)."""
    if config["strategy"] == "fedcompass":
        return "compass"
    return str(config.get("work-scheduling", "off"))


def update_seconds(step_seconds: dict[int, float]) -> tuple[float, float]:
    """(fastest, slowest) seconds of one update of the run's own ``local-steps``."""
    steps = COMMON_OVERRIDES["local-steps"]
    return steps * min(step_seconds.values()), steps * max(step_seconds.values())


# ------------------------------------------------------------------ the deployment
def start_deployment(
    base: Path, run_name: str, nodes: int, step_seconds: dict[int, float] | None
) -> Deployment:
    """SuperLink + ``nodes`` SuperNodes, partition i emulating ``step_seconds[i]`` (no
    emulation if None), guarded (stop signals raised as KeyboardInterrupt, a watchdog:
    :func:`benchmarks.local_deployment.start_deployment`); returns once every SuperNode
    is connected. The caller stops it (:meth:`Deployment.stop_everything`) in a
    ``finally``; if this raises, it is stopped already."""
    per_node = {
        f"NODE_CONFIG_EXTRA_{pid}": f"step-seconds={seconds!r}"
        for pid, seconds in (step_seconds or {}).items()
    }
    return start_nodes(base, run_name, nodes, **per_node)


def flwr_run(
    dep: Deployment, app: Path, config: str, log: Path, timeout: float
) -> tuple[int | None, float]:
    """``flwr run APP gsgm-local --stream --run-config CONFIG``; (exit code or None on a
    time-out, wall seconds). A run that outlives ``timeout`` is killed."""
    started = time.monotonic()
    proc = dep.flwr_run(app, config, log, cwd=app)
    try:
        code: int | None = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_all(process_tree(proc.pid))
        proc.wait()
        code = None
    return code, time.monotonic() - started


#: The probe's ClientApp in the race: bench_deployment.py's (``probe_client.py``, its
#: stamps and all), called with the device emulation off (node config
#: ``step-seconds`` dropped), so that the probe's round trip is the protocol's plus one
#: real batch, as in the quiet measurement.
RACE_PROBE_CLIENT = '''"""bench_deployment.py's probe ClientApp with the device emulation off."""

import dataclasses

from flwr.clientapp import ClientApp

from probe_client import app as probe_app

app = ClientApp()


@app.train()
def train(msg, context):
    config = {k: v for k, v in context.node_config.items() if k != "step-seconds"}
    return probe_app(msg, dataclasses.replace(context, node_config=config))
'''


def race_probe_app(folder: Path) -> Path:
    """The probe's Flower App in ``folder`` (replaced if it exists): bench_deployment.py's
    probe ServerApp and ClientApp, the latter served through :data:`RACE_PROBE_CLIENT`."""
    return probe_app(
        folder,
        "gsgm-race-probe",
        "1.0.0",
        {
            "probe_server.py": PROBE_SERVER,
            "probe_client.py": PROBE_CLIENT,
            "race_probe_client.py": RACE_PROBE_CLIENT,
        },
        "race_probe_client:app",
        PROBE_CONFIG,
    )


class Probe:
    """The round-trip probe on one deployment (its app built once, in ``folder``)."""

    def __init__(self, dep: Deployment, folder: Path, nodes: int, updates: int) -> None:
        self.dep, self.folder, self.nodes, self.updates = dep, folder, nodes, updates
        self.app = race_probe_app(folder / "probe-app")
        self.count = 0
        self.out: Path | None = None  # the last probe's result file (its rows)

    def __call__(self, label: str) -> dict:
        """One probe: {round_trip, latency, updates}. Raises RaceError with its log."""
        self.count += 1
        name = f"probe-{self.count:02d}-{label}"
        out = self.out = self.folder / f"{name}.json"
        out.unlink(missing_ok=True)
        config = (
            f'nodes={self.nodes} updates-per-node={self.updates} out="{out}" depth=1 '
            "batch-size=32 local-batches=1"
        )
        log = self.folder / f"{name}.log"
        code, _ = flwr_run(self.dep, self.app, config, log, 300 + 60 * (self.updates + 1))
        if not out.is_file():
            raise RaceError(f"the round-trip probe wrote no result (exit {code})\n" + tail(log))
        return probe_figures(json.loads(out.read_text())["rows"])


def measure_quiet_round_trip(args: argparse.Namespace, base: Path) -> dict:
    """The quiet figure: the probe on its own deployment of :data:`QUIET_NODES`
    SuperNodes without emulated speeds, stopped afterwards."""
    folder = base / "quiet"
    folder.mkdir(parents=True, exist_ok=True)
    dep = start_deployment(base, "quiet-run", QUIET_NODES, None)
    try:
        return Probe(dep, folder, QUIET_NODES, args.probe_updates)("quiet")
    finally:
        dep.stop_everything()


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
    speeds: dict[int, float],
    name: str | None = None,
) -> dict:
    """One raced run on the deployment, in run folder ``name`` (default
    ``race-<method>-r<repeat>``); its CSV row (probe and validity columns are filled in
    by the caller)."""
    name = name or f"race-{method}-r{repeat}"
    runs = base / "runs"
    config = race_config(method, args, runs, name, update_seconds(speeds)[1])
    load_before = os.getloadavg()
    timeout = args.budget + 300 + 2 * update_seconds(speeds)[1]
    code, wall = flwr_run(dep, REPO, run_config_pairs(config), base / f"{name}.log", timeout)
    load_after = os.getloadavg()
    run_dir = runs / name
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    rows = read_rows(run_dir)
    got = figures(rows, "wall_time", args.target, args.budget)
    status = summary.get("status", "no summary") if code == 0 else f"flwr run exit {code}"
    if status != "completed":
        print(f"  {name}: {status}\n{tail(base / f'{name}.log', 20)}", flush=True)
    ordered = sorted(speeds.values())
    return {
        "method": method,
        "repeat": repeat,
        "order": order,
        "speeds": args.speeds,
        "status": status,
        "valid": False,
        "load_before": load_before[0],
        "load_before_5min": load_before[1],
        "load_after": load_after[0],
        "load_after_5min": load_after[1],
        "probe_round_trip": math.nan,
        "probe_round_trip_before": math.nan,
        "probe_round_trip_after": math.nan,
        "quiet_round_trip": args.quiet_round_trip,
        "start_round_trip": args.start_round_trip,
        "target_accuracy": args.target,
        "wall_seconds_to_target": got["seconds_to_target"],
        "predicted_seconds_to_target": math.nan,
        "updates": summary.get("updates_received", 0),
        "predicted_updates": math.nan,
        "accuracy_at_budget": got["accuracy_at_budget"],
        "predicted_accuracy_at_budget": math.nan,
        "final_accuracy": summary.get("final_accuracy", math.nan),
        "wall_budget_seconds": float(args.budget),
        "wall_seconds": summary.get("wall_seconds", wall),
        "evaluations": len(rows),
        "nodes": args.nodes,
        "local_steps": config["local-steps"],
        "batch_size": config["batch-size"],
        "local_lr": config["local-lr"],
        "work_scheduling": work_scheduling(config),
        "fastest_step_seconds": ordered[0],
        "median_step_seconds": statistics.median(ordered),
        "slowest_step_seconds": ordered[-1],
        "server_learning_rate": config.get("server-learning-rate", math.nan),
        "latency_seconds": math.nan,
        "run_name": name,
    }


def set_probes(row: dict, before: dict | None, after: dict | None, reference: float) -> None:
    """The probe columns of a run's row, and its validity against ``reference``
    (:func:`reference_round_trip`)."""
    row["probe_round_trip_before"] = before["round_trip"] if before else math.nan
    row["probe_round_trip_after"] = after["round_trip"] if after else math.nan
    pair = [row["probe_round_trip_before"], row["probe_round_trip_after"]]
    row["probe_round_trip"] = math.nan if any(math.isnan(x) for x in pair) else max(pair)
    row["valid"] = is_valid(row["status"], row["probe_round_trip"], reference)


# ------------------------------------------------------------------ the prediction
def write_device_profile(path: Path, step_seconds: dict[int, float], latency: float) -> Path:
    """The race's device profile file (:func:`device_profile_rows`) at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        csv.writer(fh, lineterminator="\n").writerows(device_profile_rows(step_seconds, latency))
    return path


def prediction_config(
    method: str,
    args: argparse.Namespace,
    profile: Path,
    step_seconds: dict[int, float],
    latency: float,
    output_dir: Path,
    server: float = 0.0,
) -> dict:
    """The raced configuration of ``method`` under the time model (virtual seconds),
    ``device-profile`` = the race's profile file (its latency the quiet probe's,
    ``latency``); with ``server`` > 0 seconds per reply (:func:`server_seconds`) the
    model's ``server-seconds``, and its ``latency-seconds`` the quiet latency less
    that (:func:`model_latency`).

    Every method stops at the budget in virtual seconds (``max-seconds``); FedAvg's
    ``max-updates`` is set to the rounds that can fit in it, + 1 (a round lasts at
    least the slowest node's compute plus the latency)."""
    config = race_config(method, args, output_dir, f"predict-{method}")
    config.update(PREDICTION_OVERRIDES)
    config["device-profile"] = str(profile)
    if server > 0:
        config["server-seconds"] = server
        config["latency-seconds"] = model_latency(latency, server)
    for key in ("min-nodes", "dispatch-timeout", "message-ttl", "startup-timeout", "poll-interval"):
        config.pop(key, None)  # deployment-only: the in-process grid answers at once
    if method == "fedavg":
        shortest_round = update_seconds(step_seconds)[1] + latency
        config["max-updates"] = args.nodes * (math.ceil(args.budget / shortest_round) + 1)
    return config


def predict(method: str, args: argparse.Namespace, config: dict, base: Path) -> dict:
    """The time model's prediction of one raced configuration: the project's
    experiment on the in-process grid with the virtual clock; its virtual seconds to
    ``--target``, accuracy at the budget and updates. The grid's client threads are
    joined before it returns (a thread still in torch at interpreter exit aborts it)."""
    from clients.client_app import app as client_app
    from flwr_gsgm.simulation.inprocess_grid import InProcessGrid
    from serverapp.app_config import parse_app_config
    from serverapp.experiment import run_experiment

    cfg = parse_app_config(config)
    run_dir = Path(cfg["output-dir"]) / cfg["run-name"]
    grid = InProcessGrid(client_app, args.nodes, cfg, workers=2)
    try:
        summary = run_experiment(grid, cfg, run_dir)
    finally:
        grid.close()
        join_client_threads(timeout=300)
    got = figures(read_rows(run_dir), "virtual_time", args.target, args.budget)
    return {**got, "updates": summary["updates_received"]}


#: The name of the in-process grid's ClientApp threads (InProcessGrid._start).
CLIENT_THREAD_NAME = "inprocess-node"


def join_client_threads(timeout: float) -> list[str]:
    """Wait up to ``timeout`` seconds in all for the in-process grid's ClientApp threads
    (daemons, still training when the engine stopped) to end; the names of the threads
    other than the main one still alive then.

    A daemon thread still inside torch when the interpreter exits kills the process with
    "terminate called without an active exception" (exit 134), after the CSV was
    written: what ended the race's first quiet run.
    """
    deadline = time.monotonic() + timeout
    for thread in threading.enumerate():
        if thread.name == CLIENT_THREAD_NAME:
            thread.join(max(0.0, deadline - time.monotonic()))
    return [
        t.name
        for t in threading.enumerate()
        if t.is_alive() and t is not threading.main_thread() and t.name == CLIENT_THREAD_NAME
    ]


def missing_prediction_keys() -> list[str]:
    """The time model's run config keys the run config does not know (yet)."""
    from serverapp.app_config import RUN_CONFIG

    return sorted(set(PREDICTION_OVERRIDES) - set(RUN_CONFIG))


# ------------------------------------------------------------------ outputs
#: CSV columns read back as text, as integers, as a boolean; the others as floats.
TEXT_COLUMNS = ("method", "speeds", "status", "work_scheduling", "run_name")
INT_COLUMNS = ("repeat", "order", "nodes", "local_steps", "batch_size", "evaluations")


def write_csv(path: Path, rows: list[dict]) -> None:
    """All the race's rows at ``path``, written to a temporary file first and renamed,
    so that a session killed while writing leaves the previous file whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _cell(row[k]) for k in CSV_COLUMNS})
    os.replace(tmp, path)


def read_csv(path: Path) -> list[dict]:
    """The rows of an earlier session's CSV, typed as :func:`run_method` makes them
    ([] if the file does not exist).

    Raises
    ------
    RaceError
        If the file's columns are not :data:`CSV_COLUMNS` (another version's race).
    """
    if not path.is_file():
        return []
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        if tuple(reader.fieldnames or ()) != CSV_COLUMNS:
            raise RaceError(
                f"{path} does not have this race's columns (another version's race?): "
                "move it aside or pass --out"
            )
        return [_typed(raw) for raw in reader]


def _typed(raw: dict[str, str]) -> dict:
    row: dict[str, Any] = {}
    for key, cell in raw.items():
        if key in TEXT_COLUMNS:
            row[key] = cell
        elif key == "valid":
            row[key] = cell == "True"
        elif key in INT_COLUMNS and cell:
            row[key] = int(float(cell))
        else:
            row[key] = float(cell) if cell else math.nan
    return row


def mark_incomplete(rows: list[dict], runs: Path) -> list[str]:
    """Rows whose run folder (``runs/<run_name>``) shows the run did not complete (no
    ``summary.json``, or its status is not ``completed``) are ignored: marked invalid,
    ``status`` prefixed with ``ignored:``, kept in the CSV; their repetitions are run
    again. A missing folder shows nothing (the row stands). Returns the messages."""
    said = []
    for row in rows:
        if row["status"].startswith("ignored:"):
            continue
        folder = runs / row["run_name"]
        if not folder.is_dir():
            continue
        summary = folder / "summary.json"
        status = json.loads(summary.read_text()).get("status") if summary.is_file() else None
        if status != "completed":
            reason = f"its run folder {folder} has " + (
                f"status {status!r}" if summary.is_file() else "no summary.json"
            )
            row["status"], row["valid"] = f"ignored: {reason} (was {row['status']})", False
            said.append(f"ignored {row['run_name']}: {reason}; its repetition runs again")
    return said


def check_same_race(rows: list[dict], args: argparse.Namespace) -> None:
    """Refuse to append to a CSV holding rows of another configuration (their medians
    would be mixed with this one's).

    Raises
    ------
    RaceError
        Naming the first rows that differ.
    """
    own = {
        "speeds": args.speeds,
        "nodes": args.nodes,
        "wall_budget_seconds": float(args.budget),
        "target_accuracy": args.target,
        "local_steps": COMMON_OVERRIDES["local-steps"],
    }
    differ = [
        f"{r['run_name']} ({', '.join(f'{k} {r[k]}' for k in own if r[k] != own[k])})"
        for r in rows
        if any(r[k] != own[k] for k in own)
    ]
    if differ:
        raise RaceError(
            f"{args.out} holds rows of another configuration than {own}: "
            + "; ".join(differ[:4])
            + ": pass the same options as its first session, or --out for a new race"
        )


def has_valid_row(rows: list[dict], method: str, repeat: int) -> dict | None:
    """The first valid row of (method, repeat), if any."""
    return next(
        (r for r in rows if (r["method"], r["repeat"], r["valid"]) == (method, repeat, True)), None
    )


def plan_runs(
    rows: list[dict], methods: list[str], repeats: list[int]
) -> tuple[list[tuple[int, int, str]], list[str]]:
    """The runs of ``repeats`` still to do, each repetition interleaved in its method
    order (repeat r starts with method r - 1 mod the number of methods), as (repeat,
    order, method); and a message per (method, repeat) skipped (a valid row) or run
    again (only invalid rows)."""
    todo: list[tuple[int, int, str]] = []
    said: list[str] = []
    for repeat in repeats:
        shift = (repeat - 1) % len(methods)
        for order, method in enumerate(methods[shift:] + methods[:shift], start=1):
            valid = has_valid_row(rows, method, repeat)
            if valid is not None:
                said.append(
                    f"skipped {method} repeat {repeat}: valid row {valid['run_name']} in the CSV"
                )
                continue
            invalid = [
                r["run_name"] for r in rows if (r["method"], r["repeat"]) == (method, repeat)
            ]
            if invalid:
                said.append(
                    f"re-running {method} repeat {repeat}: its row(s) {', '.join(invalid)} "
                    "are invalid (kept in the CSV, valid=False)"
                )
            todo.append((repeat, order, method))
    return todo, said


def run_name_for(method: str, repeat: int, rows: list[dict], base: Path) -> str:
    """``race-<method>-r<repeat>``, or ``...-a2``, ``-a3`` ... for a later attempt: the
    first name no row, run folder or log uses (an attempt never writes into an earlier
    one's folder)."""
    used = {r["run_name"] for r in rows}
    attempt = 1
    while True:
        name = f"race-{method}-r{repeat}" + (f"-a{attempt}" if attempt > 1 else "")
        if (
            name not in used
            and not (base / "runs" / name).exists()
            and not (base / f"{name}.log").exists()
        ):
            return name
        attempt += 1


#: The predicted columns of a row and the prediction's keys (:func:`predict`).
PREDICTED = {
    "predicted_seconds_to_target": "seconds_to_target",
    "predicted_accuracy_at_budget": "accuracy_at_budget",
    "predicted_updates": "updates",
}


def earlier_prediction(rows: list[dict], method: str) -> dict | None:
    """The predicted figures of ``method`` already in the CSV (the prediction is
    deterministic: made once per method), or None."""
    row = next(
        (r for r in rows if r["method"] == method and not math.isnan(r["predicted_updates"])),
        None,
    )
    return None if row is None else {key: row[col] for col, key in PREDICTED.items()}


def set_prediction(rows: list[dict], method: str, got: dict) -> None:
    """The predicted columns of every row of ``method``."""
    for row in rows:
        if row["method"] == method:
            for col, key in PREDICTED.items():
                row[col] = got[key]


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


def valid_runs(rows: list[dict], method: str) -> list[dict]:
    """The valid rows of ``method``, one per repetition (the first valid one)."""
    mine: dict[int, dict] = {}
    for row in rows:
        if row["method"] == method and row["valid"]:
            mine.setdefault(row["repeat"], row)
    return [mine[r] for r in sorted(mine)]


def method_medians(rows: list[dict], methods: list[str] | tuple[str, ...]) -> dict:
    """Per method, over its **valid** repetitions only: runs (how many), repeats (which),
    reached, medians of the time to target, accuracy at the budget, final accuracy and
    updates, and the prediction."""
    medians: dict[str, dict[str, Any]] = {}
    for method in methods:
        mine = valid_runs(rows, method)
        if not mine:
            continue
        medians[method] = {
            "runs": len(mine),
            "repeats": [r["repeat"] for r in mine],
            "reached": sum(not math.isnan(r["wall_seconds_to_target"]) for r in mine),
            "time": _median([r["wall_seconds_to_target"] for r in mine]),
            "predicted": mine[0]["predicted_seconds_to_target"],
            "acc": statistics.median(r["accuracy_at_budget"] for r in mine),
            "pred_acc": mine[0]["predicted_accuracy_at_budget"],
            "final": statistics.median(r["final_accuracy"] for r in mine),
            "updates": statistics.median(r["updates"] for r in mine),
            "pred_updates": mine[0]["predicted_updates"],
        }
    return medians


def _ratio(a: float, b: float) -> float:
    return a / b if b and not (math.isnan(a) or math.isnan(b)) else math.nan


def _span(values: list[float], fmt: str) -> str:
    """``a`` or ``a-b`` of the finite values (``nan`` if none)."""
    finite = sorted({v for v in values if math.isfinite(v)})
    if not finite:
        return "nan"
    low, high = format(finite[0], fmt), format(finite[-1], fmt)
    return low if low == high else f"{low}-{high}"


def summary_text(
    rows: list[dict], args: argparse.Namespace, speeds: dict[int, float] | None = None
) -> str:
    """Medians per method over the valid runs of the whole CSV (every session's rows),
    the excluded runs, the repetitions still without a valid run, and the race's
    targets. The emulated speeds and quiet round trips are the rows' own where they
    have them (``speeds`` and ``args.quiet_round_trip`` otherwise)."""
    steps = COMMON_OVERRIDES["local-steps"]
    if rows and "fastest_step_seconds" in rows[0]:
        fastest_step = [r["fastest_step_seconds"] for r in rows]
        slowest_step = [r["slowest_step_seconds"] for r in rows]
    else:
        fastest_step, slowest_step = [min(speeds.values())], [max(speeds.values())]  # type: ignore[union-attr]
    quiet = [r["quiet_round_trip"] for r in rows if "quiet_round_trip" in r]
    quiet = [q for q in quiet or [args.quiet_round_trip] if q is not None and math.isfinite(q)]
    starts = [r.get("start_round_trip", math.nan) for r in rows]
    starts = [t for t in starts if math.isfinite(t)]
    reference = reference_round_trip(rows, math.nan)
    invalid = [r for r in rows if not r["valid"]]
    quiet = quiet or [math.nan]
    lines = [
        f"Deployment race: {args.nodes} SuperNodes on 127.0.0.1 (TLS, authentication, warm "
        f"executor), Fashion-MNIST 2 classes per node, weights mode, "
        f"{steps} steps x batch {COMMON_OVERRIDES['batch-size']} at "
        f"lr {COMMON_OVERRIDES['local-lr']}; speeds {args.speeds}: "
        f"{_span(fastest_step, 'g')}-{_span(slowest_step, 'g')} s per step, an update of "
        f"{_span([steps * s for s in fastest_step], '.1f')}-"
        f"{_span([steps * s for s in slowest_step], '.1f')} s; budget {args.budget:g} s; "
        f"target accuracy {args.target}",
        f"quiet round trip{'s' * (len({f'{q:.3f}' for q in quiet}) > 1)} "
        f"{_span(quiet, '.3f')} s ({QUIET_NODES} SuperNodes, each session's); the probe on the "
        f"race's {args.nodes} SuperNodes before any run {_span(starts or [math.nan], '.3f')} s "
        f"(each session's); a run is valid if its probe round trip <= {VALIDITY_FACTOR:g} x "
        f"the first session's = {VALIDITY_FACTOR * reference:.3f} s",
        f"the prediction's time model: the server handles one reply at a time, "
        f"{reference / args.nodes:.3f} s each (the first session's probe round trip / "
        f"{args.nodes} nodes), and a message's latency is the quiet probe's less that",
        f"medians over the valid runs only ({len(rows) - len(invalid)} of {len(rows)}), one "
        "per repetition:",
        f"{'method':<10} {'runs':>4} {'reached':>7} {'s to target':>12} {'predicted':>10} "
        f"{'pred/meas':>9} {'acc@budget':>10} {'pred acc':>8} {'final acc':>9} {'updates':>8} "
        f"{'predicted':>9} {'repeats':>7}",
    ]
    med = method_medians(rows, args.methods)
    for method, m in med.items():
        lines.append(
            f"{method:<10} {m['runs']:>4} {m['reached']:>7} {m['time']:>12.1f} "
            f"{m['predicted']:>10.1f} {_ratio(m['predicted'], m['time']):>9.2f} {m['acc']:>10.4f} "
            f"{m['pred_acc']:>8.4f} {m['final']:>9.4f} {m['updates']:>8.0f} "
            f"{m['pred_updates']:>9.0f} {','.join(map(str, m['repeats'])):>7}"
        )
    if invalid:
        names, pending = [], 0
        for r in invalid:
            again = has_valid_row(rows, r["method"], r["repeat"])
            pending += again is None
            names.append(
                f"{r['run_name']} ({r['status']}, probe {r['probe_round_trip']:.2f} s"
                + (f"; re-run as {again['run_name']})" if again else ")")
            )
        lines.append(
            f"EXCLUDED {len(invalid)} invalid run(s): {', '.join(names)}."
            + (
                " They must be re-run on a quiet machine (nothing else running) before the "
                "race is reported."
                if pending
                else ""
            )
        )
    missing = [
        f"{method} r{repeat}"
        for repeat in range(1, args.repeats + 1)
        for method in args.methods
        if repeat not in med.get(method, {}).get("repeats", [])
    ]
    if missing:
        lines.append(
            f"without a valid run yet ({len(missing)} of {args.repeats * len(args.methods)}): "
            f"{', '.join(missing)}: run them with --repeat"
        )
    if "fedavg" in med and "gsgm" in med:
        ratio = _ratio(med["fedavg"]["time"], med["gsgm"]["time"])
        verdict = "n/a" if math.isnan(ratio) else ("met" if ratio >= 1.5 else "MISSED")
        lines.append(f"FedAvg/GSGM median time to target: {ratio:.2f}x (target >= 1.5x: {verdict})")
    for other in ("fedbuff", "fedcompass"):
        if other in med and "gsgm" in med:
            ratio = _ratio(med[other]["time"], med["gsgm"]["time"])
            verdict = "n/a" if math.isnan(ratio) else ("met" if ratio >= 1.0 else "MISSED")
            lines.append(
                f"{other}/GSGM median time to target: {ratio:.2f}x (GSGM no slower: {verdict})"
            )
    for method, m in med.items():
        for label, predicted, measured in (
            ("time to target", m["predicted"], m["time"]),
            ("updates", m["pred_updates"], m["updates"]),
        ):
            ratio = _ratio(predicted, measured)
            verdict = (
                "n/a" if math.isnan(ratio) else ("met" if abs(ratio - 1) <= 0.15 else "MISSED")
            )
            lines.append(
                f"{method}: predicted/measured {label} {ratio:.2f} (within 15%: {verdict})"
            )
    return "\n".join(lines)


# ------------------------------------------------------------------ main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 nodes, 60 s, 1 repetition")
    parser.add_argument("--nodes", type=int, help="SuperNodes (default 10; --quick 3)")
    parser.add_argument("--repeats", type=int, help="repetitions per method (default 3; --quick 1)")
    parser.add_argument(
        "--budget",
        type=float,
        help=f"wall seconds per run (default {FULL_BUDGET_SECONDS:g}; --quick 60)",
    )
    parser.add_argument("--target", type=float, default=0.70, help="target accuracy, in (0, 1)")
    parser.add_argument("--speeds", choices=SPEEDS, default="appfl10", help="emulated devices")
    parser.add_argument(
        "--step-seconds",
        type=float,
        default=0.1,
        help="slow-quarter: emulated seconds per step of the fast nodes",
    )
    parser.add_argument(
        "--quiet-round-trip",
        type=float,
        help="seconds: the quiet figure (default: measured at the start with 2 SuperNodes)",
    )
    parser.add_argument(
        "--round-trip-multiple",
        type=float,
        help="appfl10: the fastest update lasts this many quiet round trips "
        f"(default {ROUND_TRIP_MULTIPLE:g}; --quick 1)",
    )
    parser.add_argument(
        "--probe-updates", type=int, help="probe updates per node (default 3; --quick 2)"
    )
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated: {METHODS}")
    parser.add_argument(
        "--repeat",
        action="append",
        metavar="R",
        help="run only repetition R (1-based; repeatable or a comma list: --repeat 2,3); "
        "default every one of --repeats",
    )
    parser.add_argument(
        "--summary-only",
        action="store_true",
        help="read the CSV (--out), print the summary of its rows and exit",
    )
    parser.add_argument("--skip-prediction", action="store_true", help="no time-model prediction")
    parser.add_argument(
        "--predict-again",
        action="store_true",
        help="make every method's prediction again with the current time model (the CSV's "
        "device profile file and reference round trip), replace the CSV's predicted columns, "
        "print the summary and exit (no deployment)",
    )
    parser.add_argument(
        "--out", type=Path, help="CSV (default docs/results/deployment_race/race.csv)"
    )
    parser.add_argument("--workdir", type=Path, default=REPO / "outputs" / "deployment_race")
    args = parser.parse_args(argv)
    quick = {
        "nodes": 3,
        "repeats": 1,
        "budget": 60.0,
        "probe_updates": 2,
        "round_trip_multiple": 1.0,
    }
    full = {
        "nodes": 10,
        "repeats": 3,
        "budget": FULL_BUDGET_SECONDS,
        "probe_updates": 3,
        "round_trip_multiple": ROUND_TRIP_MULTIPLE,
    }
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
    args.out = args.out.resolve()
    args.start_round_trip = math.nan  # this session's probe before its first run (race())
    # The time model's latency per message: the quiet probe's (round trip less the
    # ClientApp's time); with --quiet-round-trip given, that round trip.
    args.quiet_latency = args.quiet_round_trip
    args.methods = [m for m in args.methods.split(",") if m]
    asked = [part.strip() for value in args.repeat or [] for part in value.split(",")]
    bad_repeat = [r for r in asked if not (r.isdigit() and int(r) >= 1)]
    args.repeat = (
        sorted({int(r) for r in asked}) if asked else list(range(1, max(args.repeats, 0) + 1))
    )
    quiet = args.quiet_round_trip
    problems = [
        f"--nodes {args.nodes}: expected an integer >= 2" * (args.nodes < 2),
        f"--repeats {args.repeats}: expected an integer >= 1" * (args.repeats < 1),
        f"--budget {args.budget}: expected seconds > 0" * (not args.budget > 0),
        f"--target {args.target}: expected a fraction in (0, 1)" * (not 0 < args.target < 1),
        f"--step-seconds {args.step_seconds}: expected seconds >= 0" * (args.step_seconds < 0),
        f"--quiet-round-trip {quiet}: expected seconds > 0"
        * (quiet is not None and not (math.isfinite(quiet) and quiet > 0)),
        f"--round-trip-multiple {args.round_trip_multiple}: expected a number > 0"
        * (not args.round_trip_multiple > 0),
        f"--probe-updates {args.probe_updates}: expected an integer >= 1"
        * (args.probe_updates < 1),
        f"--methods {args.methods}: expected some of {METHODS}"
        * (not args.methods or bool(set(args.methods) - set(METHODS))),
        f"--repeat {','.join(bad_repeat)}: expected integers >= 1" * bool(bad_repeat),
    ]
    if (
        not args.skip_prediction
        and not args.summary_only
        and (missing := missing_prediction_keys())
    ):
        problems.append(
            f"the time model's run config keys {missing} are unknown to "
            "flwr_gsgm/config/run_config.py "
            "(not merged yet): pass --skip-prediction"
        )
    if any(problems):
        parser.error("; ".join(p for p in problems if p))
    return args


def load_rows(args: argparse.Namespace) -> list[dict]:
    """The CSV's rows (every earlier session's), those whose run folder shows they did
    not complete marked ignored (:func:`mark_incomplete`, said in the output)."""
    rows = read_csv(args.out)
    for message in mark_incomplete(rows, args.workdir / "runs"):
        print(message, flush=True)
    return rows


def race(
    args: argparse.Namespace, rows: list[dict] | None = None
) -> tuple[list[dict], dict[int, float] | None, list[str]]:
    """Steps 1-6 of the module's docstring for the repetitions ``args.repeat``, appending
    to ``rows`` (the CSV's earlier rows: default :func:`load_rows`); (all rows, speeds or
    None if nothing ran, failures). The CSV is written after every run."""
    rows = load_rows(args) if rows is None else rows
    check_same_race(rows, args)
    todo, said = plan_runs(rows, args.methods, args.repeat)
    for message in said:
        print(message, flush=True)
    if not todo:
        print(
            f"nothing to run: every (method, repeat) of repetition(s) {args.repeat} has a "
            f"valid row in {args.out}",
            flush=True,
        )
        return rows, None, []
    base = args.workdir
    base.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    def so_far() -> str:
        return f"({time.monotonic() - started:.0f} s so far)"

    print(
        f"to run: {', '.join(f'{m} r{r}' for r, _, m in todo)}; appending to {args.out} "
        f"({len(rows)} earlier row(s))",
        flush=True,
    )
    if args.quiet_round_trip is None:
        print(f"quiet round trip: the probe on {QUIET_NODES} SuperNodes", flush=True)
        quiet = measure_quiet_round_trip(args, base)
        args.quiet_round_trip = quiet["round_trip"]
        args.quiet_latency = quiet["latency"]
        print(
            f"quiet round trip {quiet['round_trip']:.3f} s (latency {quiet['latency']:.3f} s, "
            f"{quiet['updates']} updates) {so_far()}",
            flush=True,
        )
    # every session races the first session's devices: appfl10 is scaled by the quiet
    # round trip of the CSV's first row (validity is against this session's own figure)
    fleet_round_trip = rows[0]["quiet_round_trip"] if rows else args.quiet_round_trip
    speeds = node_step_seconds(args, fleet_round_trip)
    fastest, slowest = update_seconds(speeds)
    print(
        f"speeds {args.speeds}"
        + (
            f" (scaled by the first session's quiet round trip {fleet_round_trip:.3f} s)"
            if rows and args.speeds == "appfl10"
            else ""
        )
        + ": "
        + ", ".join(f"node {p} {s:g} s/step" for p, s in sorted(speeds.items()))
        + f"; an update of {COMMON_OVERRIDES['local-steps']} steps lasts {fastest:.1f}-"
        f"{slowest:.1f} s",
        flush=True,
    )
    print(f"starting the deployment: {args.nodes} SuperNodes, work folder {base}", flush=True)
    mine: list[dict] = []  # this session's rows
    failures: list[str] = []
    probes: list[dict] = []
    dep = start_deployment(base, "run", args.nodes, speeds)
    try:
        probe = Probe(dep, base, args.nodes, args.probe_updates)
        warmup = {
            **race_config("fedavg", args, base / "runs", "warmup", slowest),
            "max-updates": args.nodes,  # one round
            "local-steps": 1,  # of one step: the slowest node's 20 would last minutes
            "max-seconds": 0.0,
            "eval-examples": 100,
        }
        code, wall = flwr_run(dep, REPO, run_config_pairs(warmup), base / "warmup.log", 600)
        print(f"warm-up run: exit {code}, {wall:.0f} s", flush=True)
        if code != 0:
            raise RaceError(f"the warm-up run failed (exit {code})\n" + tail(base / "warmup.log"))
        before: dict | None = probe("start")
        probes.append(before)
        args.start_round_trip = before["round_trip"]
        reference = reference_round_trip(rows, args.start_round_trip)
        print(
            f"probe: round trip {before['round_trip']:.3f} s; runs are valid up to "
            f"{VALIDITY_FACTOR:g} x {reference:.3f} s {so_far()}",
            flush=True,
        )
        for repeat, order, method in todo:
            name = run_name_for(method, repeat, rows, base)
            row = run_method(dep, method, repeat, order, args, base, speeds, name)
            try:
                after: dict | None = probe(f"after-{name}")
                probes.append(after)
            except RaceError as err:
                print(f"  the probe after {row['run_name']} failed: {err}", flush=True)
                after = None
            set_probes(row, before, after, reference)
            before = after
            if (earlier := earlier_prediction(rows, method)) is not None:
                set_prediction([row], method, earlier)
            rows.append(row)
            mine.append(row)
            latency = statistics.median(p["latency"] for p in probes)
            for done in mine:  # this session's probes so far
                done["latency_seconds"] = latency
            if row["status"] != "completed":
                failures.append(f"{row['run_name']}: {row['status']}")
            print(
                f"{method} repeat {repeat} ({name}): {row['status']}, "
                f"{'valid' if row['valid'] else 'INVALID'} (probe "
                f"{row['probe_round_trip']:.2f} s, load {row['load_before']:.1f}-"
                f"{row['load_after']:.1f}), to target {row['wall_seconds_to_target']:.1f} s, "
                f"at budget {row['accuracy_at_budget']:.4f}, {row['updates']} updates "
                f"{so_far()}",
                flush=True,
            )
            write_csv(args.out, rows)  # a session killed later keeps this run
    finally:
        dep.stop_everything()
        leftovers = dep.leftover_pids()
        if leftovers:
            failures.append(f"processes still alive after the deployment's stop: {leftovers}")
    # The model's latency is the quiet probe's, not the race probes': those keep all the
    # SuperNodes busy at once, so their replies queue at the SuperLink (7.6 s against
    # 1.7 s), while in a run the replies are spread out. Measured in the first session:
    # FedBuff's 20-step updates took 1.8-2.6 s more than their emulated compute on 7 of
    # the 10 nodes, and a model at the race probes' 6.8 s predicted 25% too few updates.
    # That queue is modelled instead as a server of server_seconds() per reply, which
    # costs the replies that do arrive together (FedCompass's groups) their wait.
    latency = args.quiet_latency
    to_predict = [m for m in args.methods if earlier_prediction(rows, m) is None]
    path = device_profile_path(args)
    if path.is_file() and len(to_predict) < len(args.methods):
        profile = path  # the file the earlier predictions were made with
        latency = profile_latency(path)
        print(f"device profile file {profile}: kept (the earlier predictions' own)", flush=True)
    else:
        profile = write_device_profile(path, speeds, latency)
        print(f"device profile file {profile} (latency {latency:.3f} s)", flush=True)
    for method in args.methods:
        if method not in to_predict:
            print(f"predicted {method}: reused from the CSV", flush=True)
    if not args.skip_prediction and to_predict:
        server = server_seconds(reference_round_trip(rows, math.nan), args.nodes)
        for method in to_predict:
            got = predict_method(method, args, profile, speeds, latency, server)
            set_prediction(rows, method, got)
            write_csv(args.out, rows)
            print(f"predicted {method}: {got} {so_far()}", flush=True)
    return rows, speeds, failures


def device_profile_path(args: argparse.Namespace) -> Path:
    """The race's device profile file: ``<out stem>-device-profile.csv`` beside the CSV."""
    return args.out.parent / f"{args.out.stem}-device-profile.csv"


def profile_latency(path: Path) -> float:
    """The latency of the race's device profile file (every node's: the quiet probe's)."""
    from flwr_gsgm.simulation.profile_file import read_profile_file

    return statistics.median(n.latency_seconds for n in read_profile_file(str(path)).values())


def predict_method(
    method: str,
    args: argparse.Namespace,
    profile: Path,
    speeds: dict[int, float],
    latency: float,
    server: float,
) -> dict:
    """:func:`predict` of ``method`` with the model of :func:`prediction_config`."""
    base = args.workdir
    config = prediction_config(method, args, profile, speeds, latency, base / "predictions", server)
    return predict(method, args, config, base)


def predict_again(args: argparse.Namespace) -> list[dict]:
    """``--predict-again``: every method's prediction made again with the current time
    model, replacing the predicted columns of every row of the CSV; no deployment. The
    devices and the quiet latency are the device profile file's (the first session's),
    the server's seconds per reply the CSV's reference round trip over the nodes
    (:func:`server_seconds`).

    Raises
    ------
    RaceError
        If the CSV has no row or the device profile file is missing.
    """
    from flwr_gsgm.simulation.profile_file import read_profile_file

    rows = load_rows(args)
    path = device_profile_path(args)
    if not rows or not path.is_file():
        raise RaceError(
            f"--predict-again needs the race's rows ({args.out}: {len(rows)}) and its "
            f"device profile file ({path}: {'found' if path.is_file() else 'missing'})"
        )
    check_same_race(rows, args)
    speeds = {p: n.step_seconds for p, n in read_profile_file(str(path)).items()}
    latency = profile_latency(path)
    server = server_seconds(reference_round_trip(rows, math.nan), args.nodes)
    print(
        f"predicting again: latency {model_latency(latency, server):.3f} s per message + the "
        f"server's {server:.3f} s per reply (quiet latency {latency:.3f} s, {path})",
        flush=True,
    )
    started = time.monotonic()
    for method in args.methods:
        got = predict_method(method, args, path, speeds, latency, server)
        set_prediction(rows, method, got)
        write_csv(args.out, rows)
        print(f"predicted {method}: {got} ({time.monotonic() - started:.0f} s so far)", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    failures: list[str] = []
    if args.predict_again:
        try:
            rows = predict_again(args)
        except (RaceError, ValueError, OSError) as err:
            print(f"race failed: {err}", file=sys.stderr, flush=True)
            return 1
        finally:
            alive = join_client_threads(timeout=60)
        print(summary_text(rows, args))
        if alive:
            print(f"race failed: client threads still alive: {alive}", file=sys.stderr)
            return 1
        return 0
    if args.summary_only:
        try:
            rows = load_rows(args)
        except RaceError as err:
            print(f"race failed: {err}", file=sys.stderr, flush=True)
            return 1
        if not rows:
            print(f"race failed: no rows in {args.out}", file=sys.stderr, flush=True)
            return 1
        print(summary_text(rows, args))
        return 0
    try:
        rows, speeds, failures = race(args)
        write_csv(args.out, rows)
        print(summary_text(rows, args, speeds))
        print(f"wrote {args.out}; {time.monotonic() - started:.0f} s in all", flush=True)
    except (RaceError, TimeoutError, RuntimeError, OSError, ValueError) as err:
        failures.append(f"{type(err).__name__}: {err}")
    except KeyboardInterrupt as err:  # Ctrl-C, or a stop signal (Interrupted)
        failures.append(f"interrupted ({err or 'Ctrl-C'}); every process it started was stopped")
    finally:
        alive = join_client_threads(timeout=60)
    if alive:
        failures.append(f"client threads still alive at the end: {alive}")
    if failures:
        print("race failed: " + "; ".join(failures), file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)
