"""Deployment round trip per update: stock per-message ClientApps against the warm
executor, on a real SuperLink + 2 SuperNodes on 127.0.0.1 with TLS and SuperNode
authentication (the deploy/ scripts).

Modes (``--modes``, each on a fresh SuperLink and SuperNodes):

- ``per-message``: stock ``flower-supernode`` (``CLIENTAPP_MODE=per-message``): a new
  ``flwr-clientapp`` process per message, ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL=0.1``;
- ``warm``: ``flwr-gsgm-supernode --warm-executor --preload torch`` (the deploy
  default): one warm executor per SuperNode, the SuperNode's idle and reply polls
  shortened;
- ``warm-prefetch``: as ``warm``, with two messages per node in flight (the engine's
  ``prefetch`` option).

A probe ServerApp (a temporary Flower App next to a copy of ``clients/``) drives the
nodes as the asynchronous engine does without a rule: it keeps every node busy with
one (two with prefetch) train message, pushes the next one as soon as a reply is
pulled, sleeps the deployment's ``poll-interval`` (0.05 s) when no reply is ready and
pulls reply objects with the engine's short back-off. Its ClientApp is the project's,
wrapped to stamp when it started and ended each message and when its process started.
Per update it records the wall-clock instants (one machine, one clock) and derives:

- round trip: push start -> reply pulled (what the server waits per update);
- push: the ServerApp's upload of the message to the SuperLink;
- delivery: push end -> ClientApp process start (per-message) or -> handler start (warm:
  the SuperNode's poll, its pull of the message, the executor's pick-up; with prefetch
  also the time queued behind the node's previous message);
- process start + imports: process start -> handler start (per-message only);
- compute: the ClientApp's ``compute-time`` metric; app: the rest of the handler;
- reply to SuperLink + poll: handler end -> start of the ServerApp's pull that got
  the reply (executor or process -> SuperNode -> SuperLink, then up to one
  ``poll-interval``);
- pull: that pull (request and reply objects).

push + pull + half a ``poll-interval`` on average is what the ServerApp itself adds.

The first update of every node (cold: imports, data partition) is left out of the
statistics and printed apart. Each SuperNode's process tree (SuperNode + executor, or
SuperNode + SuperExec + ClientApp processes) is sampled every 0.1 s for its peak RSS;
after the run, its CPU use is measured while idle.

Usage (from the repository, with the venv):
    .venv/bin/python benchmarks/bench_deployment.py [--updates 32] [--json out.json]

Takes a few minutes per mode on a loaded 2-core machine; every process it starts is
stopped at the end, also on an error, Ctrl-C, SIGTERM or SIGHUP (exit code 1, saying
so), and by a watchdog when it is killed outright (each mode's deployment is guarded:
:meth:`benchmarks.local_deployment.Deployment.guard`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the shared deployment harness
from benchmarks.local_deployment import (  # noqa: E402
    REPO,
    Deployment,
    Interrupted,
    command_line,
    probe_app,
    process_tree,
)

MIB = 1024 * 1024
MODES = ("per-message", "warm", "warm-prefetch")
NODES = 2

PROBE_SERVER = '''"""Probe ServerApp: every node kept busy with `depth` train messages, timed."""

import json
import time

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

from clients.models import build_model
from flwr_gsgm.deploy.flower_waits import shorten_reply_pull_backoff

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    shorten_reply_pull_backoff()  # as the engine does on Flower's HTTP grid
    deadline = time.monotonic() + 300
    while len(nodes := sorted(grid.get_node_ids())) < int(cfg["nodes"]):
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(nodes)} SuperNode(s) connected within 300 s")
        time.sleep(0.5)
    arrays = ArrayRecord(build_model(cfg["dataset"], seed=0).state_dict())
    per_node = int(cfg["updates-per-node"]) + 1  # + the cold first one
    depth = int(cfg["depth"])
    sent = {n: 0 for n in nodes}
    waiting = {}  # message id -> row
    rows = []

    def push(node):
        i = sent[node]
        sent[node] += 1
        config = ConfigRecord({"mode": "gradient", "batch-size": int(cfg["batch-size"]),
                               "local-batches": int(cfg["local-batches"]), "seed": i,
                               "model-version": i})
        message = Message(RecordDict({"arrays": arrays, "config": config}), node, "train")
        row = {"node": node, "index": i, "push_start": time.time()}
        (mid,) = list(grid.push_messages([message]))
        row["push_end"] = time.time()
        waiting[mid] = row

    for _ in range(depth):
        for node in nodes:
            push(node)
    while waiting:
        pull_start = time.time()
        replies = list(grid.pull_messages(list(waiting)))
        if not replies:
            time.sleep(float(cfg["poll-interval"]))
            continue
        for reply in replies:
            row = waiting.pop(reply.metadata.reply_to_message_id)
            row["pull_start"], row["pulled"] = pull_start, time.time()
            if reply.has_error():
                row["error"] = reply.error.reason
            else:
                row.update({k: float(v) for k, v in reply.content["metrics"].items()})
            rows.append(row)
            if sent[row["node"]] < per_node:
                push(row["node"])
        if time.monotonic() > deadline + 60 * per_node * len(nodes):
            raise RuntimeError("the probe did not finish in time")
    with open(cfg["out"], "w") as fh:
        json.dump({"nodes": nodes, "rows": rows}, fh)
'''

PROBE_CLIENT = '''"""The project's ClientApp, stamping its process start and each message."""

import os
import time

from flwr.clientapp import ClientApp

from clients.client_app import app as project_app


def _process_start() -> float:
    # From /proc/uptime (10 ms), not /proc/stat's btime (whole seconds).
    ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
    uptime = float(open("/proc/uptime").read().split()[0])
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


PROCESS_START = _process_start()
app = ClientApp()


@app.train()
def train(msg, context):
    start = time.time()
    reply = project_app(msg, context)
    end = time.time()
    metrics = reply.content["metrics"]
    metrics["t-start"], metrics["t-end"], metrics["t-process"] = start, end, PROCESS_START
    metrics["pid"] = os.getpid()
    return reply
'''

PROBE_CONFIG = {
    "nodes": NODES,
    "updates-per-node": 16,
    "depth": 1,
    "out": "",
    "batch-size": 32,
    "local-batches": 1,
    "poll-interval": 0.05,
}


# ------------------------------------------------------------------ process sampling
_KINDS = (
    ("flwr_gsgm.deploy.executor", "executor"),
    ("flwr-clientapp", "clientapp"),
    ("flower-superexec", "superexec"),
    ("supernode", "supernode"),
)
_CUDA_LIB = re.compile(
    r"nvidia|cuda|cublas|cudnn|cufft|curand|cusparse|cusolver|nccl|nvrtc|"
    r"nvJitLink|nvToolsExt|cupti|triton",
    re.I,
)


def _kind(pid: int) -> str:
    cmd = command_line(pid)
    return next((kind for needle, kind in _KINDS if needle in cmd), "other" if cmd else "gone")


def _cuda_rss(proc: psutil.Process) -> int:
    """Bytes of RSS in the CUDA libraries ``proc`` maps (what a CPU build of torch lacks)."""
    return sum(m.rss for m in proc.memory_maps() if _CUDA_LIB.search(m.path))


class TreeSampler(threading.Thread):
    """Peak summed RSS (bytes) of a SuperNode's process tree, peak RSS per process
    kind, and the peak of the tree's RSS without CUDA library pages (that one sampled
    every tenth tick: reading the memory maps is slow)."""

    def __init__(self, root: int, interval: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.root, self.interval = root, interval
        self.stop = threading.Event()
        self.peak_tree = self.peak_tree_no_cuda = 0
        self.peak_kind: dict[str, int] = {}

    def run(self) -> None:
        tick = 0
        while not self.stop.is_set():
            total = cuda = 0
            for pid in process_tree(self.root):
                try:
                    proc = psutil.Process(pid)
                    rss = proc.memory_info().rss
                    cuda += _cuda_rss(proc) if tick % 10 == 0 else 0
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
                total += rss
                kind = _kind(pid)
                self.peak_kind[kind] = max(self.peak_kind.get(kind, 0), rss)
            self.peak_tree = max(self.peak_tree, total)
            if tick % 10 == 0:
                self.peak_tree_no_cuda = max(self.peak_tree_no_cuda, total - cuda)
            tick += 1
            self.stop.wait(self.interval)


def _cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        total += times.user + times.system
    return total


def idle_cpu(root: int, seconds: float) -> float:
    """Percent of one core the process tree of ``root`` used over ``seconds``."""
    before, t0 = _cpu_seconds(process_tree(root)), time.monotonic()
    time.sleep(seconds)
    after = _cpu_seconds(process_tree(root))
    return 100.0 * (after - before) / (time.monotonic() - t0)


# ------------------------------------------------------------------------ driver
def start(dep: Deployment) -> list[int]:
    """start_local.sh with :data:`NODES` SuperNodes, guarded first
    (:meth:`Deployment.guard`: the caller stops it in a ``finally``); their launcher
    pids once connected."""
    dep.guard()
    dep.start(NODES, timeout=300)
    return [dep.pid(f"supernode-node-{i}") for i in range(NODES)]


def run_mode(base: Path, mode: str, args: argparse.Namespace) -> dict:
    """One mode on a fresh deployment: the probe's rows, RSS peaks, idle CPU."""
    dep = Deployment(
        base,
        f"run-{mode}",
        CLIENTAPP_MODE="per-message" if mode == "per-message" else "warm",
        PYTHONPATH=str(REPO),  # the probe's ServerApp imports flwr_gsgm
    )
    app = probe_app(
        base / "probe-app",
        "gsgm-deployment-probe",
        "1.0.0",
        {"probe_server.py": PROBE_SERVER, "probe_client.py": PROBE_CLIENT},
        "probe_client:app",
        PROBE_CONFIG,
    )
    out = base / f"probe-{mode}.json"
    samplers: list[TreeSampler] = []
    load_before = os.getloadavg()
    try:
        supernodes = start(dep)
        samplers = [TreeSampler(pid) for pid in supernodes]
        for sampler in samplers:
            sampler.start()
        per_node = -(-args.updates // NODES)
        config = (
            f'nodes={NODES} updates-per-node={per_node} out="{out}" '
            f"depth={2 if mode == 'warm-prefetch' else 1} batch-size={args.batch_size} "
            f"local-batches={args.local_batches}"
        )
        started = time.monotonic()
        run = dep.flwr_run(app, config, base / f"probe-{mode}.log", cwd=app)
        try:
            run.wait(timeout=300 + 90 * per_node * NODES)
        except subprocess.TimeoutExpired:
            pass  # reported below: the probe wrote no result
        wall = time.monotonic() - started
        if not out.is_file():
            raise RuntimeError(
                f"{mode}: the probe wrote no result\n"
                + (base / f"probe-{mode}.log").read_text()[-3000:]
            )
        time.sleep(args.settle)  # past the fast-poll windows after the last message
        idle = [idle_cpu(pid, args.idle_seconds) for pid in supernodes]
    finally:
        for sampler in samplers:
            sampler.stop.set()
            sampler.join()
        dep.stop_everything()
    return {
        "mode": mode,
        "probe": json.loads(out.read_text()),
        "wall_s": wall,
        "peak_tree_mib": [s.peak_tree / MIB for s in samplers],
        "peak_tree_no_cuda_mib": [s.peak_tree_no_cuda / MIB for s in samplers],
        "peak_kind_mib": [{k: v / MIB for k, v in s.peak_kind.items()} for s in samplers],
        "idle_cpu_percent": idle,
        "load_average": [load_before, os.getloadavg()],
    }


# --------------------------------------------------------------------- figures
def breakdown(result: dict) -> dict:
    """Per-update figures (cold first update of each node excluded)."""
    rows = [r for r in result["probe"]["rows"] if "error" not in r]
    errors = len(result["probe"]["rows"]) - len(rows)
    cold = [r for r in rows if r["index"] == 0]
    warm = sorted((r for r in rows if r["index"] > 0), key=lambda r: r["pulled"])
    per_message = result["mode"] == "per-message"
    parts = {
        "round trip": [r["pulled"] - r["push_start"] for r in warm],
        "push": [r["push_end"] - r["push_start"] for r in warm],
        "delivery": [
            (r["t-process"] if per_message else r["t-start"]) - r["push_end"] for r in warm
        ],
        "process start + imports": [
            (r["t-start"] - r["t-process"]) if per_message else 0.0 for r in warm
        ],
        "compute": [r["compute-time"] for r in warm],
        "app (data, model, reply)": [r["t-end"] - r["t-start"] - r["compute-time"] for r in warm],
        "reply to SuperLink + poll": [r["pull_start"] - r["t-end"] for r in warm],
        "pull": [r["pulled"] - r["pull_start"] for r in warm],
    }
    periods = []
    for node in result["probe"]["nodes"]:
        pulled = sorted(r["pulled"] for r in warm if r["node"] == node)
        periods += [b - a for a, b in zip(pulled, pulled[1:])]
    return {
        "updates": len(warm),
        "errors": errors,
        "cold_round_trip_s": [r["pulled"] - r["push_start"] for r in cold],
        "median": {k: statistics.median(v) for k, v in parts.items()},
        "min": {k: min(v) for k, v in parts.items()},
        "node_period_median_s": statistics.median(periods) if periods else float("nan"),
        "processes": len({r["pid"] for r in warm}),
        "updates_per_s": (len(warm) - 1) / (warm[-1]["pulled"] - warm[0]["pulled"])
        if len(warm) > 1
        else float("nan"),
    }


def report(results: list[dict]) -> str:
    lines = []
    figures = {r["mode"]: breakdown(r) for r in results}
    modes = [r["mode"] for r in results]
    width = 26
    lines.append(
        f"SuperLink + {NODES} SuperNodes on 127.0.0.1, TLS + SuperNode authentication; "
        "Fashion-MNIST CNN, gradient mode, batch 32 x 1"
    )
    lines.append("per update (first update of each node left out), seconds, median [min]:")
    lines.append(" " * width + "".join(f"{m:>22}" for m in modes))
    for part in figures[modes[0]]["median"]:
        cells = "".join(
            f"{figures[m]['median'][part]:>13.3f} [{figures[m]['min'][part]:5.2f}]" for m in modes
        )
        lines.append(f"{part:<{width}}{cells}")
    rows = {
        "updates timed (errors)": lambda m: f"{figures[m]['updates']} ({figures[m]['errors']})",
        "per-node update period": lambda m: f"{figures[m]['node_period_median_s']:.3f}",
        "updates per second": lambda m: f"{figures[m]['updates_per_s']:.2f}",
        "ClientApp processes": lambda m: str(figures[m]["processes"]),
        "cold first update": lambda m: "/".join(
            f"{x:.1f}" for x in figures[m]["cold_round_trip_s"]
        ),
    }
    for label, cell in rows.items():
        lines.append(f"{label:<{width}}" + "".join(f"{cell(m):>22}" for m in modes))
    lines.append("per SuperNode (node-0 / node-1):")
    by_mode = {r["mode"]: r for r in results}
    per_node = {
        "peak RSS of its tree, MiB": lambda r: "/".join(f"{x:.0f}" for x in r["peak_tree_mib"]),
        "  without CUDA libraries": lambda r: "/".join(
            f"{x:.0f}" for x in r["peak_tree_no_cuda_mib"]
        ),
        "idle CPU, % of a core": lambda r: "/".join(f"{x:.2f}" for x in r["idle_cpu_percent"]),
    }
    for label, cell in per_node.items():
        lines.append(f"{label:<{width}}" + "".join(f"{cell(by_mode[m]):>22}" for m in modes))
    for m in modes:
        kinds = by_mode[m]["peak_kind_mib"][0]
        lines.append(
            f"  {m}: peak RSS per process (node-0): "
            + ", ".join(f"{k} {v:.0f} MiB" for k, v in sorted(kinds.items()) if k != "gone")
        )
    for m in modes:
        f = figures[m]
        target = 2 * f["median"]["compute"] + 1.0
        verdict = "met" if f["median"]["round trip"] <= target else "MISSED"
        lines.append(
            f"  {m}: round trip {f['median']['round trip']:.3f} s vs target 2 x compute + 1.0 s "
            f"= {target:.3f} s: {verdict}"
        )
    loads = [
        f"{m} {by_mode[m]['load_average'][0][0]:.1f}-{by_mode[m]['load_average'][1][0]:.1f}"
        for m in modes
    ]
    lines.append("load average (1 min, before-after each mode): " + ", ".join(loads))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--updates", type=int, default=32, help="timed updates per mode")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated: {MODES}")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--local-batches", type=int, default=1)
    parser.add_argument("--idle-seconds", type=float, default=30.0)
    parser.add_argument("--settle", type=float, default=20.0, help="seconds before idle CPU")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    parser.add_argument("--workdir", type=Path, help="keep certificates, logs, ... here")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; expected some of {MODES}")
    base = (args.workdir or Path(tempfile.mkdtemp(prefix="bench-deployment-"))).resolve()
    base.mkdir(parents=True, exist_ok=True)
    try:
        results = [run_mode(base, mode, args) for mode in modes]
    except Interrupted as err:
        print(
            f"bench deployment interrupted ({err}); every process it started was stopped",
            file=sys.stderr,
            flush=True,
        )
        return 1
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    if not args.workdir:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
