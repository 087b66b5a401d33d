"""Sweep presets (TOML) and the runs they expand to.

A preset names *methods* (each a set of run-config overrides plus an optional tuning
grid) and *questions* (each a set of node counts and partitions, answered on the
reporting seeds). Layout (every run-config key is a key of
:data:`serverapp.app_config.RUN_CONFIG`, kebab-case)::

    [sweep]
    name = "fashion_mnist"
    out = "outputs/sweeps/fashion_mnist"   # relative to the current folder
    seeds = [1, 2, 3]                      # reporting seeds; tuning never sees them
    target-accuracy = 0.70                 # for time to target
    chance-margin = 0.05                   # divergence: final accuracy <= 1/classes + margin
    tie-tolerance = 0.0                    # tuning: final accuracies this close tie
    reference = "gsgm"                     # stability improvement of it over the others
    results-md = "docs/RESULTS.md"         # default output of simulations.report
    headline-baselines = ["asgd", "masgd"] # the report's headline: reference vs these,
    headline-settings = ["n10-k2", "n30-k2"]  # in these settings (nodes-partition labels),
    headline-target = 0.20                 # against this stability improvement,
    headline-accuracy-tolerance = 0.0      # with final accuracy at most this much lower
    headline-accuracy-baselines = ["asgd"] # optional: reference vs the best of these, everywhere
    headline-speed-settings = ["n10-k2"]   # optional: reference reaches speed-reference's
                                           #   accuracy in less virtual time, there
    speed-reference = "fedavg"             # optional: a column "time to its accuracy"

    [base]                                 # run config shared by every run
    dataset = "fashion-mnist"
    max-updates = 2000

    [tune]                                 # the single setting tuning runs in
    seed = 0
    nodes = 10
    partition = { partitioner = "pathological", classes-per-node = 2 }
    device-profile = "edge"                # optional; default: the base config's
    client-works = ["batch", "epoch"]      # optional; default: every work a question runs
                                           #   the method (or an ablation of it) with
    config = { max-seconds = 600 }         # optional; run config of the tuning runs

    [client-works.batch]                   # optional: named client works (what a node
    title = "one gradient mini-batch"      #   computes per message), client keys only
    config = { client-mode = "gradient", local-batches = 1 }
    [client-works.epoch]
    config = { client-mode = "weights", local-steps = 150 }

    [methods.gsgm]
    config = { strategy = "gsgm" }
    grid = { server-learning-rate = [0.01, 0.02, 0.05], beta = [0.5, 0.9] }
    work-grid = { epoch = { server-learning-rate = [0.5, 1.0] } }  # optional: replaces
                                           #   grid for that client work

    [methods.gsgm-beta0]                   # an ablation: GSGM's tuned choice, then beta = 0,
    inherit = "gsgm"                       # then its own grid (tuned after gsgm)
    config = { beta = 0.0 }
    grid = { server-learning-rate = [0.01, 0.02, 0.05] }

    [methods.fedavg]
    config = { strategy = "fedavg" }
    client-works = ["epoch"]               # optional; runs only with these works

    [questions.stability]
    title = "Stability: 10 nodes, 2 classes per node"
    kind = "stability"                     # stability | scale | noniid | time-to-target
    nodes = [10]
    partitions = [{ partitioner = "pathological", classes-per-node = 2 }]
    methods = ["gsgm", "asgd"]             # optional; default every method
    max-in-flight = [0, 20]                # optional; nodes training at once (0 = all, default [0])
    config = { max-updates = 10000 }       # optional; run config of this question's runs
    client-works = ["batch", "epoch"]      # optional; default: the base config's client work
    device-profiles = ["edge", "loopback"] # optional; run config device-profile per run
                                           #   (default: the base config's)

    [estimate]                             # cost model of --dry-run (seconds)
    updates-per-second = 40.0              # client updates per second, in process
    eval-seconds-per-10k = 4.0             # one evaluation of 10,000 test images
    overhead-seconds = 6.0                 # process start, data loading, partitioning

A run is identified by its folder under the sweep's output folder:
``tune/<method>/<grid point>`` (``tune/<method>/<work>/<grid point>`` for a named
client work) or ``runs/<method>/<setting>/s<seed>``, where the setting is
``n<nodes>-<partition>`` with ``-f<max-in-flight>`` appended when fewer than all
nodes train at once (a max-in-flight of at least the number of nodes is "all"), then
``-<work>`` when the question lists ``client-works`` and ``-<profile>`` when it lists
``device-profiles`` (``n10-k2-f20-epoch-edge``; without those keys the labels are as
before); a run shared by several questions (same method, seed and setting) runs once,
and two questions that would give it different run configs are refused.

Client works and device profiles. A question's runs are methods x settings x client
works x device profiles x seeds. A method runs with the question's works it allows
(``[methods.X] client-works``; none of them: refused). A run's config is the base
config, the question's ``config``, the tuned choice of its (method, work) -- which
holds the work's ``config``, then the method's -- and the setting's partition,
max-in-flight and ``device-profile``. Tuning runs each method's grid once per work it
is tuned with (:func:`tune_works`); an ablation starts from its parent's choice for
the same work. Refused, naming them: an unknown work; a work's config with a key that
is not client work (``strategy``, partition keys, ``max-in-flight``,
``device-profile``) or a bad value; a method whose config sets a key of a work it runs
with to another value, or whose grid tunes a key the work sets; an ablation with a
work its parent does not run with; a question whose config sets a key one of its works
sets; a (method, work) a question runs but ``[tune] client-works`` leaves out; any run
config :func:`~serverapp.app_config.parse_app_config` refuses. With a time budget
(``max-seconds`` in ``[tune] config``) tuning picks by the accuracy at the budget.
"""

from __future__ import annotations

import itertools
import math
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flwr_gsgm.config.run_config import OPTIMIZER_KEYS, SYNC_STRATEGIES, strategy_keys
from serverapp.app_config import DATASET_CLASSES, RUN_CONFIG, parse_app_config

__all__ = [
    "Method",
    "ClientWork",
    "Question",
    "Preset",
    "RunSpec",
    "QUESTION_KINDS",
    "PARTITION_KEYS",
    "load_preset",
    "partition_label",
    "grid_points",
    "grid_label",
    "tune_runs",
    "report_runs",
    "estimate_seconds",
    "effective_limit",
    "setting_label",
    "stand_in_tuned",
    "tuned_key",
    "tune_works",
    "question_works",
]

QUESTION_KINDS = ("stability", "scale", "noniid", "time-to-target")
PARTITION_KEYS = ("partitioner", "classes-per-node", "dirichlet-alpha")
# Keys the sweep sets itself.
_RESERVED = ("seed", "run-name", "output-dir")
_ESTIMATE_DEFAULTS = {
    "updates-per-second": 40.0,
    "eval-seconds-per-10k": 4.0,
    "overhead-seconds": 6.0,
}
_DATASET_TEST_SIZE = {"fashion-mnist": 10_000, "cifar10": 10_000, "cifar100": 10_000}


@dataclass(frozen=True)
class Method:
    """A named method: run-config overrides, tuning grid, optional parent.

    ``client_works``: the named client works it may run with (``[methods.X]
    client-works``); None = any, including the base config's (the implicit work).
    ``work_grids``: a grid per named client work that replaces ``grid`` for that work
    (``[methods.X] work-grid = { batch = { ... } }``): a gradient-mode work and a
    weights-mode work read the server learning rate on different scales.
    """

    name: str
    config: dict[str, Any]
    grid: dict[str, list[Any]]
    inherit: str | None = None
    client_works: list[str] | None = None
    work_grids: dict[str, dict[str, list[Any]]] = field(default_factory=dict)

    def grid_for(self, work: str) -> dict[str, list[Any]]:
        """The tuning grid of this method with client work ``work``."""
        return self.work_grids.get(work, self.grid)

    def allows(self, work: str) -> bool:
        """Whether this method runs with ``work`` (``""``: the base config's client work)."""
        return self.client_works is None or work in self.client_works


@dataclass(frozen=True)
class ClientWork:
    """A named client work (``[client-works.NAME]``): what a node computes per message.

    ``config``: run-config overrides of the client (``client-mode``, ``local-steps``,
    ``local-batches``, ...), applied to every run of this work before the method's
    tuned choice.
    """

    name: str
    config: dict[str, Any]
    title: str = ""


@dataclass(frozen=True)
class Question:
    """A question of the sweep: methods x reporting seeds x nodes x partitions."""

    name: str
    title: str
    kind: str
    nodes: list[int]
    partitions: list[dict[str, Any]]
    methods: list[str]
    description: str = ""
    max_in_flight: list[int] = field(default_factory=lambda: [0])
    config: dict[str, Any] = field(default_factory=dict)
    # "" = the base config's client work / device profile (no dimension, no label suffix)
    client_works: list[str] = field(default_factory=lambda: [""])
    device_profiles: list[str] = field(default_factory=lambda: [""])
    fleets: list[str] = field(default_factory=lambda: [""])  # [fleets] names; "" = none

    def settings(self) -> list[tuple[int, dict[str, Any], int]]:
        """``(nodes, partition, limit)`` in the preset's order; ``limit`` 0 = all nodes in flight.

        A max-in-flight of at least the number of nodes is "all" (limit 0), so it
        gives the same setting as 0 and is listed once.
        """
        out: list[tuple[int, dict[str, Any], int]] = []
        for nodes in self.nodes:
            for part in self.partitions:
                for limit in self.max_in_flight:
                    s = (nodes, part, effective_limit(nodes, limit))
                    if s not in out:
                        out.append(s)
        return out


@dataclass
class Preset:
    """A validated preset (see the module docstring for the TOML layout)."""

    name: str
    path: Path
    out: Path
    seeds: list[int]
    target_accuracy: float
    chance_margin: float
    tie_tolerance: float
    reference: str
    results_md: Path
    base: dict[str, Any]
    tune_seed: int
    tune_nodes: int
    tune_partition: dict[str, Any]
    methods: dict[str, Method]
    questions: dict[str, Question]
    estimate: dict[str, float] = field(default_factory=lambda: dict(_ESTIMATE_DEFAULTS))
    headline: dict[str, Any] = field(default_factory=dict)
    speed_reference: str = ""  # the method whose final accuracy the report times others to
    client_works: dict[str, ClientWork] = field(default_factory=dict)
    tune_profile: str = ""  # [tune] device-profile; "" = the base config's
    tune_client_works: list[str] | None = None  # [tune] client-works; None = those run
    tune_config: dict[str, Any] = field(default_factory=dict)  # [tune] config
    # [fleets.NAME] config: how the fleet behaves over time (availability, speed variance)
    fleets: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def num_classes(self) -> int:
        return DATASET_CLASSES[self.base.get("dataset", RUN_CONFIG["dataset"].default)]

    @property
    def chance_accuracy(self) -> float:
        return 1.0 / self.num_classes

    def tune_order(self) -> list[list[str]]:
        """Methods in layers: a method comes after the method it inherits from."""
        done: set[str] = set()
        layers: list[list[str]] = []
        left = list(self.methods)
        while left:
            layer = [m for m in left if self.methods[m].inherit in (None, *done)]
            layers.append(layer)
            done.update(layer)
            left = [m for m in left if m not in done]
        return layers

    def to_plan(self) -> dict[str, Any]:
        """What :mod:`simulations.report` needs to know about the preset (``plan.json``)."""
        return {
            "name": self.name,
            "preset": str(self.path),
            "seeds": self.seeds,
            "tune": {
                "seed": self.tune_seed,
                "nodes": self.tune_nodes,
                "partition": self.tune_partition,
                **({"device_profile": self.tune_profile} if self.tune_profile else {}),
                **({"config": self.tune_config} if self.tune_config else {}),
            },
            "target_accuracy": self.target_accuracy,
            "chance_accuracy": self.chance_accuracy,
            "chance_margin": self.chance_margin,
            "tie_tolerance": self.tie_tolerance,
            "reference": self.reference,
            "speed_reference": self.speed_reference,
            "results_md": str(self.results_md),
            "base": self.base,
            "methods": list(self.methods),
            "headline": self.headline,
            **(
                {
                    "client_works": {
                        w.name: {"title": w.title, "config": w.config}
                        for w in self.client_works.values()
                    }
                }
                if self.client_works
                else {}
            ),
            **({"fleets": self.fleets} if self.fleets else {}),
            "questions": {
                q.name: {
                    "title": q.title,
                    "kind": q.kind,
                    "nodes": q.nodes,
                    "partitions": q.partitions,
                    "methods": q.methods,
                    "description": q.description,
                    "max_in_flight": q.max_in_flight,
                    "config": q.config,
                    **({"client_works": q.client_works} if q.client_works != [""] else {}),
                    **({"device_profiles": q.device_profiles} if q.device_profiles != [""] else {}),
                    **({"fleets": q.fleets} if q.fleets != [""] else {}),
                }
                for q in self.questions.values()
            },
        }


@dataclass(frozen=True)
class RunSpec:
    """One run: where it goes, what it runs and which questions it answers."""

    run_id: str
    stage: str  # "tune" or "report"
    method: str
    seed: int
    nodes: int
    partition: dict[str, Any]
    run_config: dict[str, Any]
    questions: tuple[str, ...] = ()
    grid_point: dict[str, Any] = field(default_factory=dict)
    max_in_flight: int = 0  # 0 = every node trains at once
    client_work: str = ""  # a [client-works] name; "" = the base config's
    fleet: str = ""  # a [fleets] name; "" = the base config's (a steady fleet)

    @property
    def device_profile(self) -> str:
        """The run config's ``device-profile``; ``""`` when it leaves the default."""
        return str(self.run_config.get("device-profile", ""))

    @property
    def partition_label(self) -> str:
        return partition_label(self.partition)

    @property
    def in_flight(self) -> int:
        """Nodes training at once: ``max_in_flight``, or every node when it is 0."""
        return self.max_in_flight or self.nodes


# ------------------------------------------------------------------ helpers
def _headline(
    path: Path,
    sweep: Mapping[str, Any],
    methods: Mapping[str, Any],
    questions: Mapping[str, Question],
) -> dict[str, Any]:
    """``[sweep] headline-*``: which comparisons the report puts first (may be empty).

    ``headline-baselines`` / ``-settings`` / ``-target`` / ``-accuracy-tolerance``: the
    stability target. ``headline-accuracy-baselines`` (optional): the reference's final
    accuracy against the best of these in every setting, within the same tolerance.
    ``headline-speed-settings`` (optional, needs ``speed-reference``): settings where
    the reference should reach the speed reference's accuracy in less virtual time.
    """
    baselines = _method_list(path, sweep, "headline-baselines", methods)
    settings = _setting_list(path, sweep, "headline-settings", questions)
    target = float(sweep.get("headline-target", 0.2))
    if not 0 < target < 1:
        _fail(path, f"[sweep] headline-target={target!r}: expected a fraction in (0, 1)")
    tolerance = float(sweep.get("headline-accuracy-tolerance", 0.0))
    if not 0 <= tolerance < 1:
        _fail(
            path,
            f"[sweep] headline-accuracy-tolerance={tolerance!r}: expected a fraction of "
            "accuracy in [0, 1) (0.01 = 1 pp)",
        )
    speed_settings = _setting_list(path, sweep, "headline-speed-settings", questions)
    if speed_settings and not sweep.get("speed-reference"):
        _fail(path, "[sweep] headline-speed-settings needs a speed-reference (a method)")
    if not (baselines and settings):
        return {}
    return {
        "baselines": baselines,
        "settings": settings,
        "target": target,
        "accuracy_tolerance": tolerance,
        "accuracy_baselines": _method_list(path, sweep, "headline-accuracy-baselines", methods),
        "speed_settings": speed_settings,
    }


def _method_list(path: Path, sweep: Mapping[str, Any], key: str, methods) -> list[str]:
    """``[sweep] key``: a list of the preset's method names ([] if absent)."""
    names = [str(m) for m in sweep.get(key, [])]
    for m in names:
        if m not in methods:
            _fail(path, f"[sweep] {key} names unknown method {m!r}")
    return names


def _setting_list(path: Path, sweep: Mapping[str, Any], key: str, questions) -> list[str]:
    """``[sweep] key``: a list of setting labels (``n30-k2-f20``, ``n10-k2-edge``) some
    question runs; a device profile is part of the setting, a client work is not (the
    report compares each method with its best client work)."""
    labels = [str(s) for s in sweep.get(key, [])]
    known = {
        setting_label(n, partition_label(p), f, profile=prof, fleet=fleet)
        for q in questions.values()
        for n, p, f in q.settings()
        for prof in q.device_profiles
        for fleet in q.fleets
    }
    for label in labels:
        if label not in known:
            _fail(path, f"[sweep] {key} {label!r} is no question's setting; known: {sorted(known)}")
    return labels


def setting_label(
    nodes: int,
    partition: str,
    limit: int = 0,
    work: str = "",
    profile: str = "",
    fleet: str = "",
) -> str:
    """``n10-k2``, ``n100-k2-f20``, ``n10-k2-f20-epoch-edge-churn`` (run folders, reports).

    Nodes, a :func:`partition_label`, ``-f<max-in-flight>`` when fewer than all nodes
    train at once, ``-<work>`` for a named client work, ``-<profile>`` for a device
    profile and ``-<fleet>`` for a ``[fleets]`` entry; ``""`` (the base config's) adds
    nothing, so labels without those dimensions are as before.
    """
    label = f"n{nodes}-{partition}" + (f"-f{limit}" if effective_limit(nodes, limit) else "")
    label += (f"-{work}" if work else "") + (f"-{profile}" if profile else "")
    return label + (f"-{fleet}" if fleet else "")


def effective_limit(nodes: int, limit: int) -> int:
    """``limit`` nodes in flight, or 0 (= all) when ``limit`` is 0 or at least ``nodes``."""
    return 0 if not limit or limit >= nodes else int(limit)


def partition_label(partition: Mapping[str, Any]) -> str:
    """``k2`` (2 classes per node), ``dir0.5`` (Dirichlet alpha 0.5) or ``iid``."""
    kind = partition.get("partitioner", RUN_CONFIG["partitioner"].default)
    if kind == "pathological":
        return f"k{partition.get('classes-per-node', RUN_CONFIG['classes-per-node'].default)}"
    if kind == "dirichlet":
        return (
            f"dir{float(partition.get('dirichlet-alpha', RUN_CONFIG['dirichlet-alpha'].default)):g}"
        )
    return kind


def grid_points(grid: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """Every combination of the grid's values (first key varies slowest); ``[{}]`` if empty."""
    keys = list(grid)
    return [dict(zip(keys, values)) for values in itertools.product(*(grid[k] for k in keys))]


def grid_label(point: Mapping[str, Any]) -> str:
    """Folder name of a grid point, e.g. ``server-learning-rate=0.02__beta=0.5``.

    ``default`` if the point is empty.
    """
    if not point:
        return "default"
    return "__".join(f"{k}={_fmt_value(v)}" for k, v in point.items())


def _fmt_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def _fail(path: Path, msg: str) -> None:
    raise ValueError(f"preset {path}: {msg}")


def _check_config(path: Path, where: str, config: Mapping[str, Any]) -> None:
    for key in config:
        if key not in RUN_CONFIG:
            _fail(path, f"{where}: unknown run config key {key!r}")
        if key in _RESERVED:
            _fail(path, f"{where}: {key!r} is set by the sweep, not by a preset")


def _partition(path: Path, where: str, raw: Any) -> dict[str, Any]:
    if not isinstance(raw, Mapping):
        _fail(path, f'{where}: a partition is a table like {{ partitioner = "iid" }}')
    part = dict(raw)
    bad = set(part) - set(PARTITION_KEYS)
    if bad:
        _fail(path, f"{where}: partition keys must be among {PARTITION_KEYS}, got {sorted(bad)}")
    if "partitioner" not in part:
        _fail(path, f"{where}: a partition needs a 'partitioner'")
    return part


def load_preset(path: str | Path, out: str | Path | None = None) -> Preset:
    """Read and validate a preset; every run config it implies is checked here.

    Three steps: parse the TOML into a :class:`Preset` (each table checked on its
    own), then expand every run config the preset can produce and check it.

    Raises
    ------
    ValueError
        Naming the preset file and what is wrong (unknown key, bad value, unknown
        method in a question, tuning seed among the reporting seeds, ...).
    """
    path = Path(path)
    preset = _parse_preset(path, tomllib.loads(path.read_text()), out)
    _check_run_configs(path, preset)
    return preset


_TABLES = {"sweep", "base", "tune", "methods", "questions", "estimate", "client-works", "fleets"}
#: The run config keys a ``[fleets.NAME]`` config may set: the time model's fleet.
FLEET_KEYS = ("availability", "speed-variance", "offline-detection-seconds")
_QUESTION_KEYS = {
    "title",
    "kind",
    "nodes",
    "partitions",
    "methods",
    "description",
    "max-in-flight",
    "config",
    "client-works",
    "device-profiles",
    "fleets",
}
_TUNE_KEYS = {"seed", "nodes", "partition", "device-profile", "client-works", "config"}
#: The run config key a device profile sets (the time model's).
PROFILE_KEY = "device-profile"
# Keys a client work may not set: the method's, the setting's, a dimension's.
_NOT_CLIENT_WORK = ("strategy", "max-in-flight", PROFILE_KEY, *PARTITION_KEYS)
_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def _parse_preset(path: Path, raw: Mapping[str, Any], out: str | Path | None) -> Preset:
    """The :class:`Preset` of the parsed TOML ``raw``, each table checked on its own."""
    unknown = set(raw) - _TABLES
    if unknown:
        _fail(path, f"unknown table(s) {sorted(unknown)}")
    sweep = raw.get("sweep", {})
    base = dict(raw.get("base", {}))
    _check_config(path, "[base]", base)
    tune = raw.get("tune", {})
    extra = set(tune) - _TUNE_KEYS
    if extra:
        _fail(path, f"[tune]: unknown key(s) {sorted(extra)}; known: {sorted(_TUNE_KEYS)}")
    seeds, tune_seed = _seeds(path, sweep, tune)
    works = _parse_client_works(path, raw.get("client-works", {}))
    fleets = _parse_fleets(path, raw.get("fleets", {}))
    methods = _parse_methods(path, raw.get("methods", {}), works)
    questions = {
        name: _parse_question(path, name, spec, methods, works, fleets)
        for name, spec in raw.get("questions", {}).items()
    }
    tune_profile, tune_works, tune_config = _parse_tune_dimensions(path, tune, works)
    if not questions:
        _fail(path, "no [questions.*]")
    reference = sweep.get("reference", "gsgm")
    if reference not in methods:
        _fail(path, f"[sweep] reference {reference!r} is not a method")
    speed_reference = str(sweep.get("speed-reference", ""))
    if speed_reference and speed_reference not in methods:
        _fail(path, f"[sweep] speed-reference {speed_reference!r} is not a method")
    name = sweep.get("name", path.stem)
    return Preset(
        name=name,
        path=path,
        out=Path(out if out is not None else sweep.get("out", f"outputs/sweeps/{name}")),
        seeds=seeds,
        target_accuracy=float(sweep.get("target-accuracy", 0.7)),
        chance_margin=float(sweep.get("chance-margin", 0.05)),
        tie_tolerance=float(sweep.get("tie-tolerance", 0.0)),
        reference=reference,
        speed_reference=speed_reference,
        results_md=Path(sweep.get("results-md", "docs/RESULTS.md")),
        base=base,
        tune_seed=tune_seed,
        tune_nodes=int(tune.get("nodes", 10)),
        tune_partition=_partition(path, "[tune]", tune.get("partition", {"partitioner": "iid"})),
        methods=methods,
        questions=questions,
        estimate=_parse_estimate(path, raw.get("estimate", {})),
        headline=_headline(path, sweep, methods, questions),
        client_works=works,
        tune_profile=tune_profile,
        tune_client_works=tune_works,
        tune_config=tune_config,
        fleets=fleets,
    )


def _name_list(path: Path, where: str, raw: Any, known: Mapping[str, Any] | None) -> list[str]:
    """A non-empty list of distinct names (of ``known`` when given), as strings."""
    if not isinstance(raw, list) or not raw or not all(isinstance(x, str) and x for x in raw):
        _fail(path, f"{where}: expected a non-empty list of names, got {raw!r}")
    if len(set(raw)) != len(raw):
        _fail(path, f"{where}: names repeat in {raw}")
    for name in raw:
        if known is not None and name not in known:
            _fail(path, f"{where} names unknown client work {name!r}; known: {sorted(known)}")
    return list(raw)


def _parse_client_works(path: Path, raw: Mapping[str, Any]) -> dict[str, ClientWork]:
    """``[client-works.*]``: a ``config`` of client keys (and a ``title``) each."""
    works: dict[str, ClientWork] = {}
    for name, spec in raw.items():
        where = f"[client-works.{name}]"
        if not set(name) <= _NAME_CHARS:
            _fail(path, f"{where}: a client work's name is letters, digits, '_' and '-' only")
        if not isinstance(spec, Mapping):
            _fail(path, f"{where}: expected a table with a config")
        extra = set(spec) - {"config", "title"}
        if extra:
            _fail(path, f"{where}: unknown key(s) {sorted(extra)}")
        config = dict(spec.get("config", {}))
        _check_config(path, f"{where} config", config)
        for key in config:
            if key in _NOT_CLIENT_WORK:
                _fail(
                    path,
                    f"{where} config: {key!r} is not client work (set by the methods, "
                    "partitions, max-in-flight or device-profiles)",
                )
        try:  # its values on their own, before any run config that holds them
            parse_app_config(config)
        except ValueError as err:
            _fail(path, f"{where} config: {err}")
        works[name] = ClientWork(name, config, str(spec.get("title", "")))
    return works


def _parse_fleets(path: Path, raw: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``[fleets.NAME]``: each a ``config`` of the time model's fleet keys
    (:data:`FLEET_KEYS`: availability, speed variance), checked as a run config."""
    fleets: dict[str, dict[str, Any]] = {}
    for name, spec in raw.items():
        extra = set(spec) - {"config"}
        if extra:
            _fail(path, f"[fleets.{name}]: unknown key(s) {sorted(extra)}; expected config")
        config = dict(spec.get("config", {}))
        other = sorted(set(config) - set(FLEET_KEYS))
        if other:
            _fail(path, f"[fleets.{name}] config: {other} are not fleet keys {list(FLEET_KEYS)}")
        _check_config(path, f"[fleets.{name}] config", config)
        fleets[name] = config
    return fleets


def _parse_device_profiles(path: Path, where: str, raw: Any) -> list[str]:
    """A question's ``device-profiles``: names of the run config's ``device-profile``."""
    return _name_list(path, f"{where} device-profiles", raw, None)


def _parse_tune_dimensions(
    path: Path, tune: Mapping[str, Any], works: Mapping[str, ClientWork]
) -> tuple[str, list[str] | None, dict[str, Any]]:
    """``[tune]`` ``device-profile``, ``client-works`` (None if absent) and ``config``."""
    profile = ""
    if "device-profile" in tune:
        profile = _parse_device_profiles(path, "[tune]", [tune["device-profile"]])[0]
    tune_works = None
    if "client-works" in tune:
        tune_works = _name_list(path, "[tune] client-works", tune["client-works"], works)
    config = dict(tune.get("config", {}))
    _check_config(path, "[tune] config", config)
    for key in config:
        if key in PARTITION_KEYS or key in ("strategy", "max-in-flight", PROFILE_KEY):
            _fail(
                path,
                f"[tune] config: {key!r} is set by [tune] partition / device-profile / "
                "the methods, not by [tune] config",
            )
    return profile, tune_works, config


def _seeds(path: Path, sweep: Mapping[str, Any], tune: Mapping[str, Any]) -> tuple[list[int], int]:
    """The reporting seeds and the tuning seed (not among them)."""
    seeds = [int(s) for s in sweep.get("seeds", [1, 2, 3])]
    tune_seed = int(tune.get("seed", 0))
    if tune_seed in seeds:
        _fail(path, f"the tuning seed {tune_seed} is also a reporting seed {seeds}")
    if not seeds or len(set(seeds)) != len(seeds):
        _fail(path, f"[sweep] seeds must be distinct and non-empty, got {seeds}")
    return seeds, tune_seed


def _parse_methods(
    path: Path, raw: Mapping[str, Any], works: Mapping[str, ClientWork]
) -> dict[str, Method]:
    """``[methods.*]``: known keys and run config keys, non-empty grids, no inheritance
    cycle, known client works."""
    methods: dict[str, Method] = {}
    for name, spec in raw.items():
        extra = set(spec) - {"config", "grid", "inherit", "client-works", "work-grid"}
        if extra:
            _fail(path, f"[methods.{name}]: unknown key(s) {sorted(extra)}")
        config = dict(spec.get("config", {}))
        grid = {k: list(v) for k, v in spec.get("grid", {}).items()}
        work_grids = {
            w: {k: list(v) for k, v in g.items()} for w, g in spec.get("work-grid", {}).items()
        }
        _check_config(path, f"[methods.{name}] config", config)
        for where, g in (("grid", grid), *((f"work-grid.{w}", g) for w, g in work_grids.items())):
            _check_config(path, f"[methods.{name}] {where}", g)
            for k, values in g.items():
                if not values:
                    _fail(path, f"[methods.{name}] {where} {k!r} is empty")
        for w in work_grids:
            if w not in works:
                _fail(
                    path,
                    f"[methods.{name}] work-grid: unknown client work {w!r}; "
                    f"known: {sorted(works)}",
                )
        for key in (*config, *grid, *(k for g in work_grids.values() for k in g)):
            if key == PROFILE_KEY:
                _fail(path, f"[methods.{name}]: {key!r} is set by device-profiles, not a method")
        allowed = None
        if "client-works" in spec:
            allowed = _name_list(
                path, f"[methods.{name}] client-works", spec["client-works"], works
            )
        methods[name] = Method(name, config, grid, spec.get("inherit"), allowed, work_grids)
    if not methods:
        _fail(path, "no [methods.*]")
    for m in methods.values():
        _check_lineage(path, m, methods)
    return methods


def _check_lineage(path: Path, method: Method, methods: Mapping[str, Method]) -> None:
    """Every ancestor of ``method`` exists and none repeats."""
    seen = {method.name}
    parent = method.inherit
    while parent is not None:
        if parent not in methods:
            _fail(path, f"[methods.{method.name}] inherits from unknown method {parent!r}")
        if parent in seen:
            _fail(path, f"[methods.{method.name}]: inheritance cycle through {parent!r}")
        seen.add(parent)
        parent = methods[parent].inherit


def _parse_question(
    path: Path,
    name: str,
    spec: Mapping[str, Any],
    methods: Mapping[str, Method],
    works: Mapping[str, ClientWork],
    fleets: Mapping[str, Mapping[str, Any]] | None = None,
) -> Question:
    """One ``[questions.NAME]`` table: kind, methods, nodes, partitions, limits, config,
    client works, device profiles and fleets."""
    where = f"[questions.{name}]"
    extra = set(spec) - _QUESTION_KEYS
    if extra:
        _fail(path, f"{where}: unknown key(s) {sorted(extra)}")
    kind = spec.get("kind", "stability")
    if kind not in QUESTION_KINDS:
        _fail(path, f"{where} kind {kind!r}: expected one of {QUESTION_KINDS}")
    qmethods = list(spec.get("methods", list(methods)))
    for m in qmethods:
        if m not in methods:
            _fail(path, f"{where} names unknown method {m!r}")
    nodes = [int(n) for n in spec.get("nodes", [10])]
    if any(n < 1 for n in nodes):
        _fail(path, f"{where} nodes must be >= 1")
    parts = [_partition(path, where, p) for p in spec.get("partitions", [{"partitioner": "iid"}])]
    limits = [int(f) for f in spec.get("max-in-flight", [0])]
    if not limits or any(f < 0 for f in limits):
        _fail(
            path,
            f"{where} max-in-flight must be a non-empty list of integers >= 0 "
            f"(0 = all nodes), got {limits}",
        )
    qconfig = dict(spec.get("config", {}))
    _check_config(path, f"{where} config", qconfig)
    for key in qconfig:
        if key in PARTITION_KEYS or key in ("strategy", "max-in-flight"):
            _fail(
                path,
                f"{where} config: {key!r} is set by partitions / max-in-flight / "
                "the methods, not by a question's config",
            )
    qworks = [""]
    if "client-works" in spec:
        qworks = _name_list(path, f"{where} client-works", spec["client-works"], works)
        for w in qworks:
            for key in qconfig.keys() & works[w].config.keys():
                _fail(path, f"{where} config: {key!r} is set by its client work {w!r}")
    for m in qmethods:
        runs_with = [w for w in qworks if methods[m].allows(w)]
        if not runs_with:
            what = f"client works {qworks}" if qworks != [""] else "the base config's client work"
            _fail(
                path,
                f"{where}: method {m!r} runs only with client works "
                f"{methods[m].client_works} ([methods.{m}] client-works), not with {what}",
            )
    profiles = [""]
    if "device-profiles" in spec:
        profiles = _parse_device_profiles(path, where, spec["device-profiles"])
        if PROFILE_KEY in qconfig:
            _fail(path, f"{where}: {PROFILE_KEY!r} in config and device-profiles; keep one")
    qfleets = [""]
    if "fleets" in spec:
        qfleets = _name_list(path, f"{where} fleets", spec["fleets"], fleets or {})
        for f in qfleets:
            for key in qconfig.keys() & (fleets or {})[f].keys():
                _fail(path, f"{where} config: {key!r} is set by its fleet {f!r}")
    title, description = spec.get("title", name), spec.get("description", "")
    return Question(
        name,
        title,
        kind,
        nodes,
        parts,
        qmethods,
        description,
        limits,
        qconfig,
        qworks,
        profiles,
        qfleets,
    )


def _parse_estimate(path: Path, raw: Mapping[str, Any]) -> dict[str, float]:
    """``[estimate]`` over the defaults; an unknown key fails."""
    estimate = dict(_ESTIMATE_DEFAULTS)
    for k, v in raw.items():
        if k not in estimate:
            _fail(path, f"[estimate] unknown key {k!r}; known: {sorted(estimate)}")
        estimate[k] = float(v)
    return estimate


def _check_run_configs(path: Path, preset: Preset) -> None:
    """Expand every run config the preset can produce and check it.

    Each ancestor's first grid point stands in for its tuned choice. A method and a
    client work that set one key to different values, a grid over a key the work sets,
    an ablation whose parent does not run with its work, and a run config that
    :func:`~serverapp.app_config.parse_app_config` refuses are refused naming them.
    """
    for m in preset.methods:
        _check_works_of(path, preset, m)
    stand_in = stand_in_tuned(preset)
    for m, method in preset.methods.items():
        for work in tune_works(preset, m):
            with_work = f" with client work {work!r}" if work else ""
            for point in grid_points(method.grid_for(work)):
                cfg = {
                    **_tune_run_config(preset, method_base_config(preset, m, stand_in, work)),
                    **point,
                }
                try:
                    parse_app_config(cfg)
                except ValueError as err:
                    _fail(path, f"method {m!r}{with_work} grid point {point}: {err}")
    for q in preset.questions.values():
        for part in q.partitions:
            try:
                parse_app_config({**preset.base, **q.config, **part})
            except ValueError as err:
                _fail(path, f"[questions.{q.name}] partition {part}: {err}")
    for m in preset.methods:
        _check_method_keys(path, preset, m)
    try:
        specs = report_runs(preset, stand_in)
    except ValueError as err:
        _fail(path, str(err))
    for spec in specs:
        try:
            parse_app_config(spec.run_config)
        except ValueError as err:
            _fail(
                path,
                f"run {spec.run_id} (method {spec.method!r}, client work "
                f"{spec.client_work or 'of the base config'}, questions {list(spec.questions)}): "
                f"{err}",
            )


def _check_works_of(path: Path, preset: Preset, method: str) -> None:
    """``method`` can run with each client work it is tuned with (:func:`_check_run_configs`)."""
    m = preset.methods[method]
    for work in tune_works(preset, method):
        if not work:
            continue
        wcfg = preset.client_works[work].config
        for key, value in m.config.items():
            if key in wcfg and wcfg[key] != value:
                _fail(
                    path,
                    f"method {method!r} cannot run with client work {work!r}: [methods.{method}] "
                    f"config sets {key} = {value!r}, [client-works.{work}] {key} = "
                    f"{wcfg[key]!r} (restrict the method with client-works = [...])",
                )
        for key in m.grid_for(work).keys() & wcfg.keys():
            _fail(
                path,
                f"method {method!r} cannot run with client work {work!r}: [methods.{method}] "
                f"grid tunes {key!r}, which [client-works.{work}] sets",
            )
        parent = m.inherit
        while parent is not None:
            if not preset.methods[parent].allows(work):
                _fail(
                    path,
                    f"method {method!r} runs with client work {work!r}, but the method it "
                    f"inherits from, {parent!r}, does not ([methods.{parent}] client-works)",
                )
            parent = preset.methods[parent].inherit
    for q in preset.questions.values():
        if method not in q.methods:
            continue
        for work in question_works(preset, q, method):
            if work not in tune_works(preset, method):
                _fail(
                    path,
                    f"[questions.{q.name}] runs method {method!r} with client work "
                    f"{work or 'of the base config'!r}, which [tune] client-works "
                    f"{preset.tune_client_works} does not tune it with",
                )


def tuned_key(method: str, work: str = "") -> str:
    """Key of a tuned choice in ``tuned`` and ``tuned.toml``: ``gsgm``, or ``gsgm/epoch``
    for a named client work."""
    return f"{method}/{work}" if work else method


def question_works(preset: Preset, question: Question, method: str) -> list[str]:
    """The client works ``question`` runs ``method`` with (``""``: the base config's)."""
    return [w for w in question.client_works if preset.methods[method].allows(w)]


def tune_works(preset: Preset, method: str) -> list[str]:
    """The client works ``method`` is tuned with, ``""`` (the base config's) first.

    ``[tune] client-works`` when set (those the method allows), else every work some
    question runs the method or a method inheriting from it with; a method no question
    runs: the base config's work, or the works it is restricted to.
    """
    m = preset.methods[method]
    if preset.tune_client_works is not None:
        return [w for w in preset.tune_client_works if m.allows(w)]
    lineage = {method}
    grew = True
    while grew:  # the method and every method inheriting from it, directly or not
        more = {n for n, other in preset.methods.items() if other.inherit in lineage}
        grew = not more <= lineage
        lineage |= more
    needed = {
        w
        for q in preset.questions.values()
        for d in lineage
        if d in q.methods
        for w in question_works(preset, q, d)
    }
    works = [w for w in ("", *preset.client_works) if w in needed and m.allows(w)]
    return works or ([""] if m.client_works is None else list(m.client_works))


def stand_in_tuned(preset: Preset) -> dict[str, dict[str, Any]]:
    """First grid point of every method (per client work it is tuned with, keys
    :func:`tuned_key`): a stand-in for its tuned choice (checks, estimates)."""
    tuned: dict[str, dict[str, Any]] = {}
    for layer in preset.tune_order():
        for m in layer:
            for work in tune_works(preset, m):
                tuned[tuned_key(m, work)] = {
                    **method_base_config(preset, m, tuned, work),
                    **grid_points(preset.methods[m].grid_for(work))[0],
                }
    return tuned


def _check_method_keys(path: Path, preset: Preset, method: str) -> None:
    """Refuse a server optimizer key in a method's config or grid that its strategy ignores.

    Which keys a strategy reads comes from the rules' declarations
    (:func:`flwr_gsgm.config.run_config.strategy_keys`); values were checked before, so a bad
    value is reported as such first.
    """
    m = preset.methods[method]
    work = tune_works(preset, method)[0]  # a client work does not set the strategy
    lineage = {
        **preset.base,
        **method_base_config(preset, method, stand_in_tuned(preset), work),
    }
    strategy = lineage.get("strategy", RUN_CONFIG["strategy"].default)
    takes = strategy_keys(strategy)
    grids = (("grid", m.grid), *((f"work-grid.{w}", g) for w, g in m.work_grids.items()))
    for where, keys in (("config", m.config), *grids):
        for key in keys:
            if key in OPTIMIZER_KEYS and key not in takes:
                _fail(
                    path,
                    f"[methods.{method}] {where}: {key!r} is not a parameter of strategy "
                    f"{strategy!r}; it takes {sorted(takes) or 'none of them'}",
                )


def method_base_config(
    preset: Preset, method: str, tuned: Mapping[str, Mapping[str, Any]], work: str = ""
) -> dict[str, Any]:
    """Overrides of ``method`` with client work ``work`` before its own grid.

    Its parent's tuned config for that work (which holds the work's config), else the
    work's config; then the method's config. ``tuned`` maps :func:`tuned_key` of a
    method and a work to its full tuned overrides (as in ``tuned.toml``).

    Raises
    ------
    KeyError
        The parent has no tuned choice for ``work`` yet.
    """
    m = preset.methods[method]
    cfg: dict[str, Any] = {}
    if m.inherit is not None:
        key = tuned_key(m.inherit, work)
        if key not in tuned:
            raise KeyError(f"method {method!r} inherits from {key!r}, which is not tuned yet")
        cfg.update(tuned[key])
    elif work:
        cfg.update(preset.client_works[work].config)
    cfg.update(m.config)
    return cfg


def _tune_run_config(preset: Preset, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A tuning run's config: base, ``[tune] config``, ``overrides``, the tuning setting."""
    cfg = {**preset.base, **preset.tune_config, **overrides, **preset.tune_partition}
    if preset.tune_profile:
        cfg[PROFILE_KEY] = preset.tune_profile
    cfg["seed"] = preset.tune_seed
    return cfg


def tune_runs(
    preset: Preset, method: str, tuned: Mapping[str, Mapping[str, Any]], work: str = ""
) -> list[RunSpec]:
    """The tuning runs of ``method`` with client work ``work`` (empty if it has no grid).

    On the tuning seed, in the ``[tune]`` setting; folders ``tune/<method>/<grid point>``,
    or ``tune/<method>/<work>/<grid point>`` for a named work.
    """
    m = preset.methods[method]
    grid = m.grid_for(work)
    if not grid:
        return []
    base = method_base_config(preset, method, tuned, work)
    runs = []
    for point in grid_points(grid):
        cfg = _tune_run_config(preset, {**base, **point})
        runs.append(
            RunSpec(
                run_id=f"tune/{method}/" + (f"{work}/" if work else "") + grid_label(point),
                stage="tune",
                method=method,
                seed=preset.tune_seed,
                nodes=preset.tune_nodes,
                partition=dict(preset.tune_partition),
                run_config=cfg,
                grid_point=dict(point),
                client_work=work,
            )
        )
    return runs


def report_runs(
    preset: Preset, tuned: Mapping[str, Mapping[str, Any]], only: Sequence[str] | None = None
) -> list[RunSpec]:
    """The reporting runs of the questions (all, or those in ``only``), deduplicated.

    Per question: methods x settings (nodes, partition, max-in-flight) x the client
    works each method runs with x device profiles x seeds. ``tuned[tuned_key(method,
    work)]`` is the method's full set of overrides for that work (its tuned choice);
    a question's ``config`` comes before it, so the tuned choice wins.

    Raises
    ------
    ValueError
        Two questions give one run (same method, seed and setting) different run
        configs, or a (method, client work) a question runs has no tuned choice.
    """
    by_id: dict[str, RunSpec] = {}
    questions_of: dict[str, list[str]] = {}
    for q in preset.questions.values():
        if only and q.name not in only:
            continue
        for method in q.methods:
            for nodes, part, limit in q.settings():
                for work in question_works(preset, q, method):
                    key = tuned_key(method, work)
                    if key not in tuned:
                        raise ValueError(
                            f"question {q.name!r} runs {key!r} (method, client work), which "
                            "has no tuned choice (run the tune stage again)"
                        )
                    for profile, fleet in itertools.product(q.device_profiles, q.fleets):
                        for seed in preset.seeds:
                            label = setting_label(
                                nodes, partition_label(part), limit, work, profile, fleet
                            )
                            run_id = f"runs/{method}/{label}/s{seed}"
                            cfg = {**preset.base, **q.config, **tuned[key], **part, "seed": seed}
                            cfg.update(preset.fleets.get(fleet, {}))
                            if limit:
                                cfg["max-in-flight"] = limit
                            if profile:
                                cfg[PROFILE_KEY] = profile
                            if run_id in by_id and by_id[run_id].run_config != cfg:
                                raise ValueError(
                                    f"questions {questions_of[run_id]} and {q.name!r} give run "
                                    f"{run_id} different run configs (set the differing keys "
                                    "in one place)"
                                )
                            by_id.setdefault(
                                run_id,
                                RunSpec(
                                    run_id,
                                    "report",
                                    method,
                                    seed,
                                    nodes,
                                    dict(part),
                                    cfg,
                                    max_in_flight=limit,
                                    client_work=work,
                                    fleet=fleet,
                                ),
                            )
                            questions_of.setdefault(run_id, []).append(q.name)
    return [
        RunSpec(**{**spec.__dict__, "questions": tuple(questions_of[rid])})
        for rid, spec in by_id.items()
    ]


def estimate_seconds(spec: RunSpec, estimate: Mapping[str, float]) -> float:
    """Estimated wall seconds of one run, from the preset's cost model.

    ``overhead + updates / updates-per-second + evaluations * eval cost``, where an
    evaluation of n test images costs ``n / 10,000 * eval-seconds-per-10k`` and a run
    evaluates at 0 and every ``eval-every`` client updates (a synchronous run at the
    same counts, rounded to whole rounds).
    """
    cfg = parse_app_config(spec.run_config)
    updates = cfg["max-updates"]
    if cfg["strategy"] in SYNC_STRATEGIES:  # whole rounds of the nodes sampled per round
        updates = max(1, updates // spec.in_flight) * spec.in_flight
    evaluations = 1 + updates // cfg["eval-every"]
    test_size = _DATASET_TEST_SIZE[cfg["dataset"]]
    examples = min(cfg["eval-examples"] or test_size, test_size)
    eval_cost = examples / 10_000 * estimate["eval-seconds-per-10k"]
    return (
        estimate["overhead-seconds"]
        + updates / estimate["updates-per-second"]
        + evaluations * eval_cost
    )


def human_seconds(seconds: float) -> str:
    """``1 h 05 min``, ``12 min 30 s`` or ``42 s``."""
    if not math.isfinite(seconds):
        return "n/a"
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600} h {s % 3600 // 60:02d} min"
    if s >= 60:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s} s"
