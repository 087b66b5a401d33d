"""SuperNode footprint and per-update round trip in a real deployment on 127.0.0.1.

Starts a SuperLink (TLS, SuperNode authentication) and ONE SuperNode with the
deploy/ scripts, then runs a probe ServerApp (built here into a temporary Flower App
next to a copy of ``clients/``, the real ClientApp) that sends the SuperNode
``--updates`` train messages one after the other with the default model
(Fashion-MNIST CNN, gradient mode, batch-size 32, one mini-batch) and records, per
update:

- round trip: wall seconds from ``push_messages`` to the reply being pulled, as the
  server sees it (SuperLink -> SuperNode poll -> new ClientApp process -> reply);
- compute time: the ``compute-time`` metric of the reply (the local computation).

Meanwhile it samples, every 0.1 s from /proc, the SuperNode process and all its
descendants (SuperExec and the ClientApp process of each message): the peak of the
summed RSS, the peak of the summed PSS (shared pages split between processes, from
``smaps_rollup``; what the processes really cost together) and the peak RSS of each
kind of process.

Usage (from the repository, with the venv):
    .venv/bin/python benchmarks/bench_supernode.py [--updates 20] [--json out.json]

Prints the figures; ``--json`` also writes them. Takes about 10 s per update on a
loaded 2-core machine. Every process it starts is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
BIN = Path(sys.executable).parent

PROBE_SERVER = '''"""Probe ServerApp: sequential train messages to one SuperNode, timed."""

import json
import time

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

from clients.models import build_model

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    deadline = time.monotonic() + 120
    while not (nodes := sorted(grid.get_node_ids())):
        if time.monotonic() > deadline:
            raise RuntimeError("no SuperNode connected within 120 s")
        time.sleep(1)
    node = nodes[0]
    arrays = ArrayRecord(build_model(cfg["dataset"], seed=0).state_dict())
    rows = []
    for i in range(int(cfg["updates"]) + 1):  # the first one is the cold start
        config = ConfigRecord({"mode": cfg["mode"], "batch-size": int(cfg["batch-size"]),
                               "local-batches": int(cfg["local-batches"]), "seed": i,
                               "model-version": i})
        message = Message(RecordDict({"arrays": arrays, "config": config}), node, "train")
        sent = time.monotonic()
        (mid,) = list(grid.push_messages([message]))
        while not (replies := list(grid.pull_messages([mid]))):
            time.sleep(float(cfg["poll-interval"]))
        reply = replies[0]
        row = {"round_trip": time.monotonic() - sent, "error": reply.has_error()}
        if not reply.has_error():
            row["compute_time"] = float(reply.content["metrics"]["compute-time"])
        rows.append(row)
        print(f"[probe] update {i}: {row}", flush=True)
    with open(cfg["out"], "w") as fh:
        json.dump({"node_id": node, "rows": rows}, fh)
'''

PROBE_PYPROJECT = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "gsgm-supernode-probe"
version = "0.1.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["clients"]

[tool.flwr.app]
publisher = "flwr-gsgm"

[tool.flwr.app.components]
serverapp = "probe_server:app"
clientapp = "clients.client_app:app"

[tool.flwr.app.config]
updates = 20
out = ""
mode = "gradient"
batch-size = 32
local-batches = 1
poll-interval = 0.05
dataset = "fashion-mnist"
data-root = "/usr/share/datasets/fashion-mnist"
partitioner = "pathological"
classes-per-node = 2
seed = 0
client-threads = 1
"""


# ------------------------------------------------------------------ /proc sampling
def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    return children


def process_tree(pid: int) -> list[int]:
    children, tree, todo = _children_map(), [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(children.get(current, []))
    return tree


def _kib(text: str, key: str) -> int:
    match = re.search(rf"^{key}:\s+(\d+) kB", text, re.M)
    return int(match.group(1)) if match else 0


def _kind(pid: int) -> str:
    try:
        cmd = (Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")).decode(
            errors="replace"
        )
    except OSError:
        return "gone"
    for kind in ("flwr-clientapp", "flower-superexec", "flower-supernode"):
        if kind in cmd:
            return kind
    return "other" if cmd.strip() else "gone"


class TreeSampler(threading.Thread):
    """Samples RSS / PSS of a process and its descendants until stopped.

    Keeps, per sample, the tree's summed RSS, PSS and anonymous RSS and which
    ClientApp processes were alive; per process, its kind and peak RSS (VmHWM).
    """

    def __init__(self, root_pid: int, interval: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.root_pid, self.interval = root_pid, interval
        self.stop = threading.Event()
        self.samples: list[tuple[int, int, int, frozenset[int]]] = []  # KiB, clientapp pids
        self.kind: dict[int, str] = {}
        self.hwm: dict[int, int] = {}  # KiB
        self.first_seen: dict[int, float] = {}
        self.last_seen: dict[int, float] = {}

    def run(self) -> None:
        while not self.stop.is_set():
            rss = pss = anon = 0
            apps = set()
            for pid in process_tree(self.root_pid):
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                    rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
                except OSError:
                    continue
                if pid not in self.kind or self.kind[pid] in ("gone", "other"):
                    kind = _kind(pid)
                    if kind != "gone" or pid not in self.kind:
                        self.kind[pid] = kind
                    self.first_seen.setdefault(pid, time.monotonic())
                if self.kind[pid] == "flwr-clientapp":
                    apps.add(pid)
                rss += _kib(status, "VmRSS")
                anon += _kib(status, "RssAnon")
                pss += _kib(rollup, "Pss")
                self.hwm[pid] = max(self.hwm.get(pid, 0), _kib(status, "VmHWM"))
                self.last_seen[pid] = time.monotonic()
            self.samples.append((rss, pss, anon, frozenset(apps)))
            self.stop.wait(self.interval)

    def figures(self) -> dict[str, object]:
        """Peaks in MiB: over the whole run, and without the first (cold) ClientApp."""
        apps = sorted(
            (p for p, k in self.kind.items() if k == "flwr-clientapp"),
            key=self.first_seen.__getitem__,
        )
        cold = apps[0] if apps else None
        warm = [s for s in self.samples if cold not in s[3]]

        def mib(kib: float) -> float:
            return round(kib / 1024, 1)

        def peak(samples, index):
            return mib(max((s[index] for s in samples), default=0))

        per_kind: dict[str, int] = {}
        for pid, kind in self.kind.items():
            if kind in ("flower-supernode", "flower-superexec"):
                per_kind[kind] = max(per_kind.get(kind, 0), self.hwm.get(pid, 0))
        return {
            "peak_rss_tree_mib": peak(self.samples, 0),
            "peak_pss_tree_mib": peak(self.samples, 1),
            "peak_anon_rss_tree_mib": peak(self.samples, 2),
            "steady_peak_rss_tree_mib": peak(warm, 0),
            "steady_peak_pss_tree_mib": peak(warm, 1),
            "peak_rss_supernode_mib": mib(per_kind.get("flower-supernode", 0)),
            "peak_rss_superexec_mib": mib(per_kind.get("flower-superexec", 0)),
            "peak_rss_clientapp_cold_mib": mib(self.hwm.get(cold, 0)) if cold else None,
            "peak_rss_clientapp_warm_mib": mib(
                max((self.hwm.get(p, 0) for p in apps[1:]), default=0)
            ),
            "clientapp_processes": len(apps),
            # wall seconds each warm ClientApp process was seen alive (start-up + work + exit)
            "clientapp_lifetime_s": round(
                statistics.mean(self.last_seen[p] - self.first_seen[p] for p in apps[1:]), 2
            )
            if len(apps) > 1
            else None,
            "samples": len(self.samples),
        }


# ------------------------------------------------------------------------ driver
def _leftovers(base: Path, ports: set[int]) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        used = {int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)\b", cmd)}
        if str(base) in cmd or used & ports:
            found.append(int(entry.name))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--updates", type=int, default=20, help="timed updates (after one cold start)"
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--local-batches", type=int, default=1)
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--workdir", type=Path, help="keep certificates, logs, ... here")
    args = parser.parse_args()

    base = (args.workdir or Path(tempfile.mkdtemp(prefix="bench-supernode-"))).resolve()
    base.mkdir(parents=True, exist_ok=True)
    run_dir = base / "run"
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "VENV": str(BIN.parent),
        "RUN_DIR": str(run_dir),
        "CERT_DIR": str(base / "certs"),
        "KEY_DIR": str(base / "keys"),
        "FLWR_HOME": str(run_dir / "flwr-home"),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "STOP_TIMEOUT": "10",
    }

    app_dir = base / "probe-app"
    shutil.rmtree(app_dir, ignore_errors=True)
    (app_dir / "clients").mkdir(parents=True)
    for source in (REPO / "clients").glob("*.py"):
        shutil.copy2(source, app_dir / "clients" / source.name)
    (app_dir / "probe_server.py").write_text(PROBE_SERVER)
    (app_dir / "pyproject.toml").write_text(PROBE_PYPROJECT)
    out = base / "probe.json"

    flwr_run = None
    sampler = None
    try:
        subprocess.run(
            ["bash", str(DEPLOY / "start_local.sh"), "1"],
            env=env,
            check=True,
            timeout=180,
            stdout=subprocess.DEVNULL,
        )
        supernode_pid = int((run_dir / "pids" / "supernode-node-0.pid").read_text())
        sampler = TreeSampler(supernode_pid)
        sampler.start()
        run_config = (
            f'updates={args.updates} out="{out}" batch-size={args.batch_size} '
            f"local-batches={args.local_batches}"
        )
        started = time.monotonic()
        with (base / "probe-run.log").open("w") as log:
            flwr_run = subprocess.Popen(
                [
                    str(BIN / "flwr"),
                    "run",
                    str(app_dir),
                    "gsgm-local",
                    "--stream",
                    "--run-config",
                    run_config,
                ],
                env=env,
                cwd=app_dir,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            flwr_run.wait(timeout=120 + 60 * (args.updates + 1))
        elapsed = time.monotonic() - started
        if not out.is_file():
            print((base / "probe-run.log").read_text()[-3000:], file=sys.stderr)
            raise RuntimeError("the probe ServerApp wrote no result")
    finally:
        if sampler is not None:
            sampler.stop.set()
            sampler.join()
        if flwr_run is not None and flwr_run.poll() is None:
            os.killpg(flwr_run.pid, signal.SIGKILL)
        ports = set()
        for log in (run_dir / "logs").glob("*.log"):
            ports.update(
                int(p)
                for p in re.findall(
                    r"running on https?://127\.0\.0\.1:(\d+)", log.read_text(errors="replace")
                )
            )
        subprocess.run(
            ["bash", str(DEPLOY / "stop_local.sh")], env=env, timeout=60, stdout=subprocess.DEVNULL
        )
        for _ in range(10):
            left = _leftovers(base, ports)
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.5)

    rows = json.loads(out.read_text())["rows"]
    cold, warm = rows[0], [r for r in rows[1:] if not r["error"]]
    rt = [r["round_trip"] for r in warm]
    ct = [r["compute_time"] for r in warm]
    figures = {
        "updates": len(warm),
        "errors": sum(r["error"] for r in rows),
        "cold_round_trip_s": round(cold["round_trip"], 3),
        "round_trip_s": {
            "mean": round(statistics.mean(rt), 3),
            "median": round(statistics.median(rt), 3),
            "min": round(min(rt), 3),
            "max": round(max(rt), 3),
        },
        "compute_time_s": {
            "mean": round(statistics.mean(ct), 4),
            "median": round(statistics.median(ct), 4),
            "min": round(min(ct), 4),
            "max": round(max(ct), 4),
        },
        "overhead_per_update_s": round(statistics.mean(rt) - statistics.mean(ct), 3),
        **sampler.figures(),
        "wall_s": round(elapsed, 1),
        "torch": subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.__version__)"],
            capture_output=True,
            text=True,
        ).stdout.strip(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    print(
        f"SuperNode + ClientApp, default model (fashion-mnist CNN, gradient, batch-size "
        f"{args.batch_size} x {args.local_batches}), torch {figures['torch']}"
    )
    f = figures
    print("  memory, SuperNode + SuperExec + ClientApp process(es), summed over the tree:")
    print(
        f"    peak RSS  {f['peak_rss_tree_mib']:7.1f} MiB (with the cold first ClientApp), "
        f"{f['steady_peak_rss_tree_mib']:7.1f} MiB afterwards"
    )
    print(
        f"    peak PSS  {f['peak_pss_tree_mib']:7.1f} MiB (with the cold first ClientApp), "
        f"{f['steady_peak_pss_tree_mib']:7.1f} MiB afterwards"
    )
    print(f"    peak anonymous RSS {f['peak_anon_rss_tree_mib']:7.1f} MiB")
    print(
        f"  peak RSS per process: SuperNode {f['peak_rss_supernode_mib']} MiB, SuperExec "
        f"{f['peak_rss_superexec_mib']} MiB, ClientApp cold {f['peak_rss_clientapp_cold_mib']} "
        "MiB, "
        f"warm {f['peak_rss_clientapp_warm_mib']} MiB ({f['clientapp_processes']} ClientApp "
        "processes)"
    )
    print(
        f"  a warm ClientApp process lives {f['clientapp_lifetime_s']} s on average "
        "(Python + flwr + torch start-up, FAB install, data from the cache-dir, compute, exit)"
    )
    r, c = figures["round_trip_s"], figures["compute_time_s"]
    print(
        f"  round trip per update ({figures['updates']} updates): mean {r['mean']:.2f} s, "
        f"median {r['median']:.2f} s, min {r['min']:.2f} s, max {r['max']:.2f} s "
        f"(first, cold: {figures['cold_round_trip_s']:.2f} s)"
    )
    print(
        f"  client compute-time per update:          mean {c['mean'] * 1000:.1f} ms, "
        f"median {c['median'] * 1000:.1f} ms, max {c['max'] * 1000:.1f} ms"
    )
    print(
        f"  overhead per update (round trip - compute): {figures['overhead_per_update_s']:.2f} s; "
        f"load average {figures['load_average']}"
    )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    if not args.workdir:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
