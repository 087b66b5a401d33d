"""The ServerApp's own cost per reply, with the SuperNodes off its cores: the figure a
device profile of "a server on its own machine" needs as its ``server-seconds``.

**What it measures.** The ``loopback`` profile charges the server 0.765 s per reply
(:data:`~flwr_gsgm.simulation.virtual_clock.LOOPBACK_SERVER_SECONDS`): the deployment
race's reference probe (``benchmarks/race_deployment.py``, ``server_seconds``), 10
SuperNodes answering at once, 7.646 s per round trip over 10 replies, with the
SuperLink, the ServerApp and the 10 SuperNodes all sharing this machine's 2 cores. How
much of that is the ServerApp's own work and how much is the SuperNodes taking its
cores is not known. This script separates them:

1. it pins itself to ``--node-cpus`` (so that everything it starts inherits them),
   starts the project's local deployment (``deploy/start_local.sh`` through
   :func:`benchmarks.local_deployment.start_deployment`: SuperLink + ``--nodes``
   SuperNodes with ``--warm-executor``, TLS, SuperNode authentication), then pins every
   thread of the SuperLink and of its SuperExec to ``--server-cpus``
   (``os.sched_setaffinity`` on each thread, :func:`pin_tree`): the ServerApp processes
   the SuperExec starts for each run inherit them, every SuperNode and its warm executor
   keep ``--node-cpus``. Both are checked (:func:`tree_cpus`) and printed;
2. a warm-up probe (two messages per node, not recorded), so that every executor has
   imported the probe's ClientApp;
3. ``--repeats`` times: ``--idle-seconds`` of the deployment idle, then the race's
   round-trip probe (:class:`benchmarks.race_deployment.Probe`: bench_deployment.py's
   probe ServerApp, one-batch gradient messages, every node kept busy with one
   message) for ``--replies`` replies, while a sampler thread reads
   ``/proc/<pid>/stat`` every ``--sample-interval`` s (:class:`CpuSampler`): the
   ServerApp's, the SuperLink's and SuperExec's, and every SuperNode's and executor's
   user + system CPU seconds, stamped with ``time.time()`` (the clock of the probe's
   own rows). The ServerApp is found as the SuperLink's descendant (its SuperExec's
   child) whose command line is ``flwr-serverapp`` and that did not run before the
   probe started; ``/proc/<pid>/stat``'s ``utime`` and ``stime`` are of the whole
   process, every thread included (:func:`stat_cpu_seconds`).

Per repetition (one CSV row, :data:`CSV_COLUMNS`; :func:`measure`): the **window** runs
from the probe's first push to its last reply pulled (its rows' ``push_start`` and
``pulled``), so that the ServerApp's start-up (imports, the run's context, waiting for
the nodes) and its end are left out. Over the window:

- ``serverapp_cpu_per_reply``: the ServerApp's CPU seconds (interpolated between the
  samples at both ends) over the replies: **the figure**;
- ``superlink_cpu_per_reply``: the SuperLink's and SuperExec's, which run on the
  server's cores too; ``server_cpu_per_reply`` is their sum with the ServerApp's. The
  SuperLink also answers the SuperNodes' polls whether replies flow or not: before each
  probe the deployment is sampled idle for ``--idle-seconds``
  (``superlink_idle_cpu_rate``, ``node_idle_cpu_rate``: CPU seconds per second), and
  ``superlink_cpu_per_reply_above_idle`` is the SuperLink's CPU in the window less that
  rate x the window, over the replies. Above idle the SuperLink serves every pull of the
  ServerApp (the empty ones too), the messages' pushes and pulls (each model-sized,
  through TLS) and the log stream of ``flwr run --stream``;
- ``handling_wall_per_reply``: the wall seconds of the ServerApp's pushes and of its
  pulls that brought replies (a pull of k replies counted once, up to its first reply),
  over the replies: the server's handling as the ServerApp waits for it (the SuperLink's
  part included);
- ``window_wall_per_reply``: the window over the replies (the inverse throughput);
- ``round_trip``: the probe's median round trip, push -> reply pulled, the first message
  of each node left out (:func:`benchmarks.race_deployment.probe_figures`), and
  ``round_trip_per_node``: that over the nodes, the race's own estimator
  (``server_seconds``), now with the cores separated;
- ``server_cores_busy`` / ``node_cores_busy``: CPU seconds over window x cores of each
  side: a side near 1 was the bottleneck;
- the 1- and 5-minute load averages just before and after the probe, and the ratio of
  ``serverapp_cpu_per_reply`` (and of ``server_cpu_per_reply``) to ``loopback``'s 0.765 s.

**Why the probe and not the project's ServerApp with GSGM in weights mode.** The probe
is the ServerApp whose round trip gave the 0.765 s, so the ratio compares like with
like. Its loop does only per-reply work (pull, the reply's bookkeeping, the next push,
a 0.05 s sleep when no reply is ready, as the engine's ``poll-interval``), its rows
stamp the window's ends and each push and pull, and with one batch per message the
nodes answer fast, so replies queue at the server as in the reference probe. The
project's ServerApp adds, in the same process and so in the same ``/proc`` CPU
figure, its start-up (the test set, the model), a centralized evaluation every
``eval-every`` updates and its reply log, none of which is per reply; its 20 local
steps per message (the race's client work) would spread the replies so that the server
waits on the nodes instead. What the probe leaves out is the rule's step and the
engine's checks: at 1,000,000 parameters GSGM's steps take 0.5-3.6 ms
(docs/results/bench_core.txt), the CNN has 184,586; add them if the figure comes close.
The empty pulls (every 0.05 s while no reply is ready) are in the figure: the engine
makes them too; with ``node_cores_busy`` near 1 the nodes, not the server, set the pace
and the empty pulls grow.

**How the figure becomes a device profile's ``server-seconds``.** The time model
(``flwr_gsgm/simulation/virtual_clock.py``, docs/GSGM.md "Time model") charges each
reply ``server_seconds``, one reply at a time. A built-in profile carries it
(:class:`~flwr_gsgm.simulation.virtual_clock.DeviceProfile` ``server_seconds``, as
``loopback`` carries ``LOOPBACK_SERVER_SECONDS``); a device profile file carries none,
so run config ``server-seconds`` gives it (docs/REFERENCE.md), beside the file or a
built-in. A server machine that runs the SuperLink too has both on its cores: take the
median ``server_cpu_per_reply`` (ServerApp + SuperLink) for a server of one core, the
ServerApp's alone where the SuperLink has a core of its own. The profile's latency
must then be the quiet probe's latency less that figure
(:func:`benchmarks.race_deployment.model_latency`: ``loopback``'s 0.904 s is 1.669 s
less 0.765 s), or the server's time is counted twice. For example, for the fleet of
``loopback`` with a server of one core measured at S seconds per reply and a quiet
latency of L seconds: run config ``server-seconds = S`` and ``latency-seconds = L - S``
beside ``device-profile = "loopback"``; or a new entry of ``DEVICE_PROFILES`` with
``server_seconds=S``.

**It must run alone**: no sweep, test suite, helper session or other benchmark on the
machine. A process beside it on the server's CPUs makes the ServerApp wait (wall
figures) and, through the caches, costs it CPU; one on the nodes' CPUs slows the nodes.
A run beside other work is a smoke run, not the measurement: compare the load averages
it prints (before and after) with the machine's idle load.

Usage (from the repository, with the venv; the machine otherwise idle)::

    .venv/bin/python benchmarks/server_cost.py                # 10 SuperNodes, 3 x 100 replies
    .venv/bin/python benchmarks/server_cost.py --nodes 2 --replies 8 --repeats 1  # smoke

``--server-cpus`` (default ``0``) and ``--node-cpus`` (default ``1``) are CPU lists
(``0``, ``0-3,6``); overlapping sets and CPUs this process may not use (the machine
lacks them) are refused, naming them (exit 2). Certificates, keys, logs and the probe's
results go to ``--workdir`` (default ``outputs/server_cost``, git-ignored), the rows to
``--out`` (default ``<workdir>/server_cost.csv``; rows are appended to an existing file
with the same columns). 10 SuperNodes take ~10 GB of RAM (the race's figure) and start
one after another on the nodes' core; a repetition is ``--idle-seconds``, the
ServerApp's start-up and ``--replies`` / ``--nodes`` round trips (2-9 s each in the
race's probes of 10 SuperNodes on 2 shared cores).

Every process it starts is stopped when it ends: normally, on an error, on SIGINT,
SIGTERM or SIGHUP, and when it is killed outright. Its deployment is guarded
(:func:`benchmarks.local_deployment.start_deployment`, see that module's docstring):
the signals are raised as KeyboardInterrupt, then
:meth:`~benchmarks.local_deployment.Deployment.stop_everything` runs in a ``finally``;
a watchdog process in a session of its own stops the deployment if this process ends
without stopping it (its log: ``<workdir>/run/watchdog.log``).

Exit code: 0 when every repetition was measured; 1 with the reason when the deployment
or a probe failed, a window could not be measured, or a process was left; 2 on bad
arguments.
"""

from __future__ import annotations

import argparse
import bisect
import csv
import json
import math
import os
import statistics
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's packages
from benchmarks.local_deployment import (  # noqa: E402
    REPO,
    Deployment,
    command_line,
    process_tree,
    start_deployment,
)
from benchmarks.race_deployment import Probe, RaceError, server_seconds  # noqa: E402
from flwr_gsgm.simulation.virtual_clock import LOOPBACK_SERVER_SECONDS  # noqa: E402

#: The deployment's run folder under ``--workdir``.
RUN_NAME = "run"
#: The command of Flower's ServerApp process (started by the SuperLink's SuperExec).
SERVERAPP_COMMAND = "flwr-serverapp"
#: Where utime and stime are in /proc/<pid>/stat, counting from the field after the
#: command's closing parenthesis (the state, field 3): fields 14 and 15 (proc(5)).
UTIME_INDEX, STIME_INDEX = 14 - 3, 15 - 3

CSV_COLUMNS = (
    "repeat",
    "status",
    "nodes",
    "replies",
    "server_cpus",
    "node_cpus",
    "serverapp_pid",
    "serverapp_cpus",
    "window_seconds",
    "serverapp_cpu_seconds",
    "serverapp_cpu_per_reply",
    "superlink_cpu_per_reply",
    "server_cpu_per_reply",
    "superlink_idle_cpu_rate",
    "node_idle_cpu_rate",
    "superlink_cpu_per_reply_above_idle",
    "handling_wall_per_reply",
    "window_wall_per_reply",
    "round_trip",
    "round_trip_per_node",
    "latency",
    "server_cores_busy",
    "node_cores_busy",
    "serverapp_cpu_lifetime",
    "ratio_to_loopback",
    "server_ratio_to_loopback",
    "load_before",
    "load_before_5min",
    "load_after",
    "load_after_5min",
    "samples",
    "sample_interval",
)


class CpuSetError(ValueError):
    """A ``--server-cpus`` / ``--node-cpus`` value that cannot be used."""


class MeasureError(RuntimeError):
    """A repetition whose window cannot be measured (named in the message)."""


# ------------------------------------------------------------------ pure parts
def parse_cpus(text: str) -> frozenset[int]:
    """A CPU list (``0``, ``1,3``, ``0-3,6``) as a set of CPU numbers.

    Raises
    ------
    CpuSetError
        If it is empty or not such a list.
    """
    cpus: set[int] = set()
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        if not (low.isdigit() and (high.isdigit() if dash else not high)):
            raise CpuSetError(f"CPU list {text!r}: expected numbers and ranges such as 0 or 0-3,6")
        first, last = int(low), int(high) if dash else int(low)
        if last < first:
            raise CpuSetError(f"CPU list {text!r}: the range {part.strip()} runs backwards")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def format_cpus(cpus: Iterable[int]) -> str:
    """A set of CPUs as a compact list: {0, 1, 2, 5} -> ``0-2,5``."""
    ordered, parts = sorted(set(cpus)), []
    for cpu in ordered:
        if parts and cpu == parts[-1][1] + 1:
            parts[-1][1] = cpu
        else:
            parts.append([cpu, cpu])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in parts)


def check_cpu_sets(server: frozenset[int], node: frozenset[int], available: Iterable[int]) -> None:
    """Refuse CPU sets the machine lacks (not in ``available``: the CPUs this process
    may run on) and overlapping sets (the SuperNodes would share the server's cores).

    Raises
    ------
    CpuSetError
        Naming every missing CPU, each option's, and the CPUs both sets hold.
    """
    available = frozenset(available)
    problems = []
    for option, cpus in (("--server-cpus", server), ("--node-cpus", node)):
        if not cpus:
            problems.append(f"{option} is empty")
        elif missing := cpus - available:
            problems.append(
                f"{option} {format_cpus(cpus)}: this machine has no CPU {format_cpus(missing)} "
                f"(CPUs available: {format_cpus(available)})"
            )
    if overlap := server & node:
        problems.append(
            f"--server-cpus {format_cpus(server)} and --node-cpus {format_cpus(node)} overlap "
            f"on CPU {format_cpus(overlap)}: the SuperNodes would share the server's cores"
        )
    if problems:
        raise CpuSetError("; ".join(problems))


def stat_cpu_seconds(stat: str, ticks_per_second: float) -> float:
    """User + system CPU seconds of a process from the text of its ``/proc/<pid>/stat``
    (``utime`` + ``stime``, fields 14 and 15, in clock ticks: of every thread of the
    process, those that ended included; not its children's). The command (field 2)
    may hold spaces and parentheses, so fields are counted after its last ``)``.

    Raises
    ------
    ValueError
        If the text is not such a line.
    """
    head, paren, rest = stat.rpartition(")")
    fields = rest.split()
    if not paren or "(" not in head or len(fields) <= STIME_INDEX:
        raise ValueError(f"not a /proc/<pid>/stat line: {stat[:80]!r}")
    return (int(fields[UTIME_INDEX]) + int(fields[STIME_INDEX])) / ticks_per_second


def cpu_at(series: Sequence[tuple[float, float]], when: float) -> float:
    """Cumulative CPU seconds at ``when`` from samples (time, CPU seconds) in time order,
    linearly interpolated between the two samples around it.

    Raises
    ------
    MeasureError
        If ``when`` is outside the samples (the window is not bracketed).
    """
    if not series or not series[0][0] <= when <= series[-1][0]:
        span = f"{series[0][0]:.3f}-{series[-1][0]:.3f}" if series else "none"
        raise MeasureError(f"no samples around {when:.3f} (samples {span})")
    i = bisect.bisect_left([t for t, _ in series], when)
    t1, c1 = series[i]
    if t1 == when or i == 0:
        return c1
    t0, c0 = series[i - 1]
    return c0 + (c1 - c0) * (when - t0) / (t1 - t0)


def probe_window(rows: Sequence[dict]) -> tuple[float, float]:
    """(first push, last reply pulled) of the probe's rows, ``time.time()`` seconds."""
    if not rows:
        raise MeasureError("the probe recorded no reply")
    return min(r["push_start"] for r in rows), max(r["pulled"] for r in rows)


def handling_seconds(rows: Sequence[dict]) -> float:
    """Wall seconds the ServerApp spent in its pushes and in its pulls that brought
    replies: each push's ``push_end - push_start``, and each pull once (its rows share
    ``pull_start``) up to its first reply (the probe pushes the next message between the
    replies of one pull, counted as pushes)."""
    pushes = sum(r["push_end"] - r["push_start"] for r in rows)
    first_reply: dict[float, float] = {}
    for r in rows:
        first_reply[r["pull_start"]] = min(first_reply.get(r["pull_start"], math.inf), r["pulled"])
    return pushes + sum(end - start for start, end in first_reply.items())


def per_reply(seconds: float, replies: int) -> float:
    """Seconds over replies.

    Raises
    ------
    MeasureError
        If there is no reply.
    """
    if replies < 1:
        raise MeasureError(f"no reply to share {seconds:.3f} s among")
    return seconds / replies


def window_figures(
    rows: Sequence[dict],
    samples: dict[str, list[tuple[float, float]]],
    server_cores: int,
    node_cores: int,
    idle_end: float | None = None,
) -> dict[str, float]:
    """The per-reply figures of one probe (module docstring) from its rows and the
    sampler's series (``serverapp``, ``superlink``, ``nodes``: (time, cumulative CPU
    seconds)); with ``idle_end``, the series' samples up to then are of the deployment
    idle (before the probe started): the SuperLink's and the nodes' idle CPU seconds per
    second, and the SuperLink's CPU per reply above its idle rate (NaN without).

    Raises
    ------
    MeasureError
        If there is no reply, or a series does not bracket the window.
    """
    start, end = probe_window(rows)
    replies = len(rows)
    window = end - start

    def spent(key: str) -> float:
        return cpu_at(samples[key], end) - cpu_at(samples[key], start)

    serverapp, superlink, nodes = spent("serverapp"), spent("superlink"), spent("nodes")
    if idle_end is None:
        superlink_idle = node_idle = math.nan
    else:
        superlink_idle = idle_rate(samples["superlink"], idle_end)
        node_idle = idle_rate(samples["nodes"], idle_end)
    return {
        "replies": replies,
        "window_seconds": window,
        "serverapp_cpu_seconds": serverapp,
        "serverapp_cpu_per_reply": per_reply(serverapp, replies),
        "superlink_cpu_per_reply": per_reply(superlink, replies),
        "server_cpu_per_reply": per_reply(serverapp + superlink, replies),
        "superlink_idle_cpu_rate": superlink_idle,
        "node_idle_cpu_rate": node_idle,
        "superlink_cpu_per_reply_above_idle": per_reply(
            superlink - superlink_idle * window, replies
        ),
        "handling_wall_per_reply": per_reply(handling_seconds(rows), replies),
        "window_wall_per_reply": per_reply(window, replies),
        "server_cores_busy": (serverapp + superlink) / (window * server_cores),
        "node_cores_busy": nodes / (window * node_cores),
        "serverapp_cpu_lifetime": samples["serverapp"][-1][1],
        "ratio_to_loopback": per_reply(serverapp, replies) / LOOPBACK_SERVER_SECONDS,
        "server_ratio_to_loopback": per_reply(serverapp + superlink, replies)
        / LOOPBACK_SERVER_SECONDS,
    }


def idle_rate(series: Sequence[tuple[float, float]], idle_end: float) -> float:
    """CPU seconds per second from the first sample to ``idle_end``.

    Raises
    ------
    MeasureError
        If ``idle_end`` is not after the first sample or past the last.
    """
    if not series or not idle_end > series[0][0]:
        raise MeasureError(f"no idle samples before {idle_end:.3f}")
    return (cpu_at(series, idle_end) - series[0][1]) / (idle_end - series[0][0])


def updates_per_node(replies: int, nodes: int) -> int:
    """The probe's ``updates-per-node`` for at least ``replies`` replies: it sends each
    node that many messages + 1 (its first, left out of the round trip)."""
    return max(1, math.ceil(replies / nodes) - 1)


# ------------------------------------------------------------------ processes
def read_stat(pid: int) -> str | None:
    """The text of ``/proc/<pid>/stat`` (a zombie's too: its final times), None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read()
    except (FileNotFoundError, ProcessLookupError):
        return None


def thread_ids(pid: int) -> list[int]:
    """The thread ids of ``pid`` ([] if it is gone)."""
    try:
        return [t.id for t in psutil.Process(pid).threads()]
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return []


def pin_tree(root: int, cpus: frozenset[int]) -> int:
    """Pin every thread of ``root`` and of its descendants to ``cpus``, again until a
    pass finds none to change (a thread started meanwhile inherits its creator's, which
    may not have been pinned yet); the threads changed.

    Raises
    ------
    RuntimeError
        If threads still change after 10 passes.
    """
    changed = 0
    for _ in range(10):
        this_pass = 0
        for pid in process_tree(root):
            for tid in thread_ids(pid):
                try:
                    if os.sched_getaffinity(tid) != cpus:
                        os.sched_setaffinity(tid, cpus)
                        this_pass += 1
                except ProcessLookupError:
                    continue
        changed += this_pass
        if not this_pass:
            return changed
    raise RuntimeError(f"the threads of process {root}'s tree kept changing CPUs")


def tree_cpus(root: int) -> frozenset[int]:
    """The CPUs any thread of ``root`` and its descendants may run on."""
    cpus: set[int] = set()
    for pid in process_tree(root):
        for tid in thread_ids(pid):
            try:
                cpus |= os.sched_getaffinity(tid)
            except ProcessLookupError:
                continue
    return frozenset(cpus)


def serverapp_pids(superlink: int) -> list[int]:
    """The running ServerApp processes under the SuperLink (its SuperExec's children)."""
    return [pid for pid in process_tree(superlink)[1:] if is_serverapp(command_line(pid))]


def is_serverapp(command: str) -> bool:
    """Whether a command line (words joined by spaces) runs Flower's ServerApp process:
    ``flwr-serverapp ...`` or, as a console script, ``.../python .../flwr-serverapp ...``."""
    return any(Path(word).name == SERVERAPP_COMMAND for word in command.split(" ")[:2])


class CpuSampler(threading.Thread):
    """Every ``interval`` s, the cumulative CPU seconds of three groups, stamped with
    ``time.time()``: ``serverapp`` (the first ServerApp under ``superlink`` that is not
    in ``earlier``, from when it appears until it is gone), ``superlink`` (the SuperLink
    and its other descendants: its SuperExec) and ``nodes`` (``node_pids``: SuperNodes
    and executors). A process gone keeps its last figure in its group's sum."""

    def __init__(
        self, superlink: int, node_pids: list[int], earlier: set[int], interval: float
    ) -> None:
        super().__init__(daemon=True, name="cpu-sampler")
        self.superlink, self.earlier, self.interval = superlink, earlier, interval
        self.server_pids = [p for p in process_tree(superlink) if p not in earlier]
        self.node_pids = node_pids
        self.serverapp: int | None = None
        self.serverapp_cpus: frozenset[int] = frozenset()
        self.samples: dict[str, list[tuple[float, float]]] = {
            "serverapp": [],
            "superlink": [],
            "nodes": [],
        }
        self.last: dict[int, float] = {}
        self.hz = os.sysconf("SC_CLK_TCK")
        self.halt = threading.Event()
        self.error: BaseException | None = None

    def cpu(self, pid: int) -> float | None:
        stat = read_stat(pid)
        if stat is None:
            return None
        self.last[pid] = stat_cpu_seconds(stat, self.hz)
        return self.last[pid]

    def group(self, pids: list[int]) -> float:
        for pid in pids:
            self.cpu(pid)
        return sum(self.last.get(pid, 0.0) for pid in pids)

    def tick(self) -> None:
        now = time.time()
        if self.serverapp is None:
            found = [p for p in serverapp_pids(self.superlink) if p not in self.earlier]
            if found:
                self.serverapp = found[-1]
                self.serverapp_cpus = tree_cpus(self.serverapp)
                self.server_pids = [p for p in self.server_pids if p != self.serverapp]
        if self.serverapp is not None and (own := self.cpu(self.serverapp)) is not None:
            self.samples["serverapp"].append((now, own))
        self.samples["superlink"].append((now, self.group(self.server_pids)))
        self.samples["nodes"].append((now, self.group(self.node_pids)))

    def run(self) -> None:
        try:
            while True:
                self.tick()
                if self.halt.wait(self.interval):
                    self.tick()  # one more after the probe ended: the window's end
                    return
        except BaseException as err:  # reported by the caller
            self.error = err


# ------------------------------------------------------------------ the measurement
def node_pids(dep: Deployment, nodes: int) -> list[int]:
    """Every SuperNode launcher and its descendants (the warm executor)."""
    return [p for i in range(nodes) for p in process_tree(dep.pid(f"supernode-node-{i}"))]


def measure(
    probe: Probe,
    dep: Deployment,
    args: argparse.Namespace,
    repeat: int,
) -> dict[str, Any]:
    """One probe of ``args.replies`` replies, sampled; its CSV row (:data:`CSV_COLUMNS`).

    Raises
    ------
    RaceError
        If the probe wrote no result (its log's tail in the message).
    MeasureError
        If the ServerApp was not found or the samples do not bracket the window.
    """
    superlink = dep.pid("superlink")
    earlier = set(serverapp_pids(superlink))
    sampler = CpuSampler(superlink, node_pids(dep, args.nodes), earlier, args.sample_interval)
    sampler.start()
    try:
        time.sleep(args.idle_seconds)  # the deployment idle: the SuperLink's idle rate
        idle_end = time.time()
        load_before = os.getloadavg()
        probe_result = probe(f"r{repeat}")
    finally:
        sampler.halt.set()
        sampler.join()
    load_after = os.getloadavg()
    if sampler.error is not None:
        raise MeasureError(f"the CPU sampler failed: {sampler.error!r}")
    if sampler.serverapp is None:
        raise MeasureError(f"no new {SERVERAPP_COMMAND} process appeared under the SuperLink")
    assert probe.out is not None
    rows = json.loads(probe.out.read_text())["rows"]
    figures = window_figures(
        rows, sampler.samples, len(args.server_cpus), len(args.node_cpus), idle_end
    )
    return {
        "repeat": repeat,
        "status": "measured",
        "nodes": args.nodes,
        "server_cpus": format_cpus(args.server_cpus),
        "node_cpus": format_cpus(args.node_cpus),
        "serverapp_pid": sampler.serverapp,
        "serverapp_cpus": format_cpus(sampler.serverapp_cpus),
        **figures,
        "round_trip": probe_result["round_trip"],
        "round_trip_per_node": server_seconds(probe_result["round_trip"], args.nodes),
        "latency": probe_result["latency"],
        "load_before": load_before[0],
        "load_before_5min": load_before[1],
        "load_after": load_after[0],
        "load_after_5min": load_after[1],
        "samples": len(sampler.samples["serverapp"]),
        "sample_interval": args.sample_interval,
    }


def row_text(row: dict[str, Any]) -> str:
    """One repetition, as printed."""
    return (
        f"repeat {row['repeat']}: {row['replies']} replies in {row['window_seconds']:.2f} s; "
        f"ServerApp CPU {row['serverapp_cpu_per_reply']:.4f} s/reply "
        f"({row['ratio_to_loopback']:.3f} x loopback's {LOOPBACK_SERVER_SECONDS} s), "
        f"SuperLink + SuperExec CPU {row['superlink_cpu_per_reply']:.4f} s/reply "
        f"({row['superlink_cpu_per_reply_above_idle']:.4f} above its idle "
        f"{row['superlink_idle_cpu_rate']:.3f} CPU s/s; server side "
        f"{row['server_cpu_per_reply']:.4f}, {row['server_ratio_to_loopback']:.3f} x); "
        f"push + pull wall {row['handling_wall_per_reply']:.4f} s/reply, "
        f"window {row['window_wall_per_reply']:.4f} s/reply; round trip median "
        f"{row['round_trip']:.3f} s (/ {row['nodes']} nodes = "
        f"{row['round_trip_per_node']:.3f} s); cores busy: server "
        f"{row['server_cores_busy']:.2f}, nodes {row['node_cores_busy']:.2f}; "
        f"load average {row['load_before']:.2f} -> {row['load_after']:.2f}; "
        f"ServerApp pid {row['serverapp_pid']} on CPUs {row['serverapp_cpus']}, "
        f"{row['serverapp_cpu_lifetime']:.2f} s CPU in its life, {row['samples']} samples"
    )


def summary_text(rows: list[dict[str, Any]]) -> str:
    """Medians over the repetitions measured."""
    if not rows:
        return "no repetition measured"

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    return (
        f"median of {len(rows)} repetition(s), {rows[0]['nodes']} SuperNodes on CPUs "
        f"{rows[0]['node_cpus']}, SuperLink + ServerApp on CPUs {rows[0]['server_cpus']}:\n"
        f"  replies per repetition      {med('replies'):.0f}\n"
        f"  ServerApp CPU s per reply   {med('serverapp_cpu_per_reply'):.4f} "
        f"(ratio to loopback's {LOOPBACK_SERVER_SECONDS} s: {med('ratio_to_loopback'):.3f})\n"
        f"  + SuperLink, SuperExec      {med('server_cpu_per_reply'):.4f} "
        f"(ratio {med('server_ratio_to_loopback'):.3f}); SuperLink above its idle "
        f"{med('superlink_cpu_per_reply_above_idle'):.4f}\n"
        f"  push + pull wall s / reply  {med('handling_wall_per_reply'):.4f}\n"
        f"  window wall s / reply       {med('window_wall_per_reply'):.4f}\n"
        f"  round trip median s         {med('round_trip'):.3f} "
        f"(/ nodes {med('round_trip_per_node'):.3f})\n"
        f"  load average before / after "
        + ", ".join(f"{r['load_before']:.2f}/{r['load_after']:.2f}" for r in rows)
    )


def write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """Append ``rows`` to the CSV at ``path`` (header first if it is new).

    Raises
    ------
    MeasureError
        If the file exists with other columns.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_file() and path.stat().st_size:
        with path.open(newline="") as fh:
            header = next(csv.reader(fh), [])
        if tuple(header) != CSV_COLUMNS:
            raise MeasureError(f"{path} has other columns: move it aside or pass --out")
    new = not path.is_file() or not path.stat().st_size
    with path.open("a", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_COLUMNS, lineterminator="\n")
        if new:
            writer.writeheader()
        for row in rows:
            writer.writerow({k: _cell(row.get(k, "")) for k in CSV_COLUMNS})


def _cell(value: Any) -> Any:
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.6g}"
    return value


def run(args: argparse.Namespace) -> list[str]:
    """Steps 1-3 of the module's docstring; the failures (empty: every row measured)."""
    base = args.workdir
    failures: list[str] = []
    updates = updates_per_node(args.replies, args.nodes)
    print(
        f"server cost: {args.nodes} SuperNodes on CPUs {format_cpus(args.node_cpus)}, "
        f"SuperLink + ServerApp on CPUs {format_cpus(args.server_cpus)}; {args.repeats} "
        f"repetition(s) of {args.nodes * (updates + 1)} replies ({updates + 1} per node); "
        f"work folder {base}",
        flush=True,
    )
    os.sched_setaffinity(0, args.node_cpus)  # inherited by everything started below
    started = time.monotonic()
    dep = start_deployment(base, RUN_NAME, args.nodes)
    try:
        superlink = dep.pid("superlink")
        changed = pin_tree(superlink, args.server_cpus)
        for i in range(args.nodes):
            pin_tree(dep.pid(f"supernode-node-{i}"), args.node_cpus)
        server_side = tree_cpus(superlink)
        node_side = frozenset().union(
            *(tree_cpus(dep.pid(f"supernode-node-{i}")) for i in range(args.nodes))
        )
        print(
            f"deployment up in {time.monotonic() - started:.0f} s; SuperLink pid {superlink} "
            f"and its SuperExec on CPUs {format_cpus(server_side)} ({changed} threads "
            f"pinned), SuperNodes and executors on CPUs {format_cpus(node_side)}",
            flush=True,
        )
        if server_side != args.server_cpus or node_side != args.node_cpus:
            raise MeasureError("the processes are not on the CPUs asked (see above)")
        probe = Probe(dep, base, args.nodes, 1)
        if args.warmup:
            probe("warmup")
            print(f"warm-up probe done ({time.monotonic() - started:.0f} s so far)", flush=True)
        probe.updates = updates
        rows = []
        for repeat in range(1, args.repeats + 1):
            try:
                row = measure(probe, dep, args, repeat)
            except (MeasureError, RaceError) as err:
                failures.append(f"repeat {repeat}: {err}")
                print(f"repeat {repeat}: FAILED: {err}", flush=True)
                continue
            rows.append(row)
            write_rows(args.out, [row])
            print(row_text(row), flush=True)
        print(summary_text(rows), flush=True)
        print(f"wrote {args.out}; {time.monotonic() - started:.0f} s in all", flush=True)
    finally:
        dep.stop_everything()
        if leftovers := dep.leftover_pids():
            failures.append(f"processes still alive after the deployment's stop: {leftovers}")
    return failures


# ------------------------------------------------------------------ main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=10, help="SuperNodes (default 10)")
    parser.add_argument(
        "--replies",
        type=int,
        default=100,
        help="replies per repetition, at least (rounded up to a multiple of --nodes, "
        "2 per node at least; default 100)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="repetitions (default 3)")
    parser.add_argument(
        "--server-cpus", default="0", help="CPU list of the SuperLink and ServerApp (0)"
    )
    parser.add_argument("--node-cpus", default="1", help="CPU list of the SuperNodes (1)")
    parser.add_argument(
        "--sample-interval", type=float, default=0.1, help="seconds between CPU samples"
    )
    parser.add_argument(
        "--idle-seconds",
        type=float,
        default=10.0,
        help="seconds the deployment is sampled idle before each probe (default 10)",
    )
    parser.add_argument(
        "--no-warmup", dest="warmup", action="store_false", help="skip the warm-up probe"
    )
    parser.add_argument("--workdir", type=Path, default=REPO / "outputs" / "server_cost")
    parser.add_argument("--out", type=Path, help="CSV (default <workdir>/server_cost.csv)")
    args = parser.parse_args(argv)
    args.workdir = args.workdir.resolve()
    args.out = (args.out or args.workdir / "server_cost.csv").resolve()
    problems = [
        f"--nodes {args.nodes}: expected an integer >= 1" * (args.nodes < 1),
        f"--replies {args.replies}: expected an integer >= 1" * (args.replies < 1),
        f"--repeats {args.repeats}: expected an integer >= 1" * (args.repeats < 1),
        f"--sample-interval {args.sample_interval}: expected seconds > 0"
        * (not args.sample_interval > 0),
        f"--idle-seconds {args.idle_seconds}: expected seconds > 0" * (not args.idle_seconds > 0),
    ]
    cpus = {}
    for option in ("server_cpus", "node_cpus"):
        try:
            cpus[option] = parse_cpus(getattr(args, option))
        except CpuSetError as err:
            problems.append(f"--{option.replace('_', '-')}: {err}")
    if len(cpus) == 2:
        args.server_cpus, args.node_cpus = cpus["server_cpus"], cpus["node_cpus"]
        try:
            check_cpu_sets(args.server_cpus, args.node_cpus, os.sched_getaffinity(0))
        except CpuSetError as err:
            problems.append(str(err))
    if any(problems):
        parser.error("; ".join(p for p in problems if p))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    failures: list[str] = []
    try:
        failures = run(args)
    except (MeasureError, RaceError, TimeoutError, RuntimeError, OSError) as err:
        failures.append(f"{type(err).__name__}: {err}")
    except KeyboardInterrupt as err:  # Ctrl-C, or a stop signal (Interrupted)
        failures.append(f"interrupted ({err or 'Ctrl-C'}); every process it started was stopped")
    if failures:
        print("server cost failed: " + "; ".join(failures), file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
