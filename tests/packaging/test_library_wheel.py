"""The library installs alone: the ``flwr-gsgm`` wheel ships ``flwr_gsgm`` and nothing of the app.

``clients/``, ``serverapp/`` and ``simulations/`` are this repository's Flower App and
experiments; a user's app has its own packages of those names, so the wheel must not
install them and ``flwr_gsgm`` must not import them. The wheel depends on flwr and
numpy only (issue 25 item 4): torch, torchvision, flwr-datasets, matplotlib, tqdm and
cachetools are the app's (the ``app`` extra), and a fresh venv with the wheel alone
runs a strategy.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
APP_PACKAGES = ("clients", "serverapp", "simulations")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel ``pip wheel .`` builds, offline (hatchling from the test venv)."""
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation"]
        + ["--no-index", "-q", "-w", str(out)],
        check=True,
        capture_output=True,
        text=True,
    )
    (path,) = out.glob("flwr_gsgm-*.whl")
    return path


def test_the_wheel_ships_flwr_gsgm_only(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"flwr_gsgm"}
    assert "flwr_gsgm/core/gsgm.py" in names and "flwr_gsgm/strategy/strategies.py" in names
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    assert "Name: flwr-gsgm" in zipfile.ZipFile(wheel).read(metadata).decode()


def test_no_module_of_flwr_gsgm_imports_the_app_layer():
    offenders = []
    for path in sorted((REPO / "flwr_gsgm").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            offenders += [
                f"{path.relative_to(REPO)}:{node.lineno} imports {name}"
                for name in names
                if name.split(".")[0] in APP_PACKAGES
            ]
    assert offenders == []


# Run inside the fresh venv: import the library and every module of it, and show that
# none of the app layer is there or got imported on the way.
IMPORT_CHECK = """
import importlib, importlib.util, pkgutil, sys
import flwr_gsgm, flwr_gsgm.strategy.strategies
from flwr_gsgm import GSGM, ASGD, FedBuff
print("file", flwr_gsgm.__file__)
for mod in pkgutil.walk_packages(flwr_gsgm.__path__, "flwr_gsgm."):
    importlib.import_module(mod.name)
app = [n for n in ("clients", "serverapp", "simulations") if importlib.util.find_spec(n)]
loaded = sorted(n for n in sys.modules if n.split(".")[0] in ("clients", "serverapp", "simulations"))
print("findable", app, "loaded", loaded)
print("strategy", type(GSGM()).__name__)
"""


def test_a_fresh_venv_with_the_wheel_imports_flwr_gsgm_without_the_app(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q"]
        + ["--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
        text=True,
    )
    # The dependencies (flwr, numpy, torch) come from this test's site-packages, added
    # as a plain path: its .pth files (an editable install of this repository) are
    # not processed, so the repository is not on the venv's sys.path.
    site = Path(
        subprocess.check_output(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            text=True,
        ).strip()
    )
    (site / "project-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [str(python), "-c", IMPORT_CHECK],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert lines["file"].startswith(str(site / "flwr_gsgm"))
    assert lines["findable"] == "[] loaded []"
    assert lines["strategy"] == "GSGM"


def test_the_library_depends_on_flwr_and_numpy_only(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    metadata = zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith(".dist-info/METADATA"))
    )
    requires = [
        line.split(": ", 1)[1]
        for line in metadata.decode().splitlines()
        if line.startswith("Requires-Dist: ") and "extra ==" not in line
    ]
    assert requires == ["flwr<1.44,>=1.42", "numpy>=1.26"]
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    app = " ".join(project["optional-dependencies"]["app"])
    for name in ("flwr[simulation]", "flwr-datasets", "torch", "torchvision", "matplotlib"):
        assert name in app, name


# Run inside a venv holding the wheel and what it depends on, nothing else: every module
# imports, none of the app's packages is there, and two strategies run on the in-process
# grid with a numpy-only ClientApp. Its one node returns the gradient of
# 0.5 * ||w - (1, 2)||^2 at the weights it was sent, w - (1, 2); with one node every
# update is fresh (staleness 0), so ASGD's w_k = w_{k-1} - 0.5 (w_{k-1} - (1, 2)) from
# w_0 = 0 is (1, 2) * (1 - 0.5^k): (0.5, 1), (0.75, 1.5), (0.875, 1.75), (0.9375, 1.875),
# exact in float32.
LEAN_RUN = """
import importlib, importlib.util, json, pkgutil, sys
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

import flwr_gsgm
from flwr_gsgm import ASGD, GSGM, InProcessGrid
from flwr_gsgm.checkpoint import files
from flwr_gsgm.config import outputs
from flwr_gsgm.config.build import build_strategy
from flwr_gsgm.config.run_config import parse_run_config
from flwr_gsgm.engine.settings import EngineSettings

for mod in pkgutil.walk_packages(flwr_gsgm.__path__, "flwr_gsgm."):
    importlib.import_module(mod.name)
heavy = ("torch", "torchvision", "matplotlib", "flwr_datasets", "tqdm", "cachetools", "ray")
print(json.dumps({
    "file": flwr_gsgm.__file__,
    "importable": [m for m in heavy if importlib.util.find_spec(m)],
    "loaded": sorted({n.split(".")[0] for n in sys.modules} & set(heavy)),
}))

TARGET = np.array([1.0, 2.0], np.float32)
app = ClientApp()


@app.query()
def query(msg, context):
    cfg = context.node_config
    metrics = {"partition-id": cfg["partition-id"], "num-partitions": cfg["num-partitions"]}
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)


@app.train()
def train(msg, context):
    (w,) = msg.content["arrays"].to_numpy_ndarrays()
    metrics = {
        "partition-id": int(context.node_config["partition-id"]),
        "model-version": int(msg.content["config"]["model-version"]),
        "num-examples": 1,
    }
    reply = {"arrays": ArrayRecord({"w": Array(w - TARGET)}), "metrics": MetricRecord(metrics)}
    return Message(RecordDict(reply), reply_to=msg)


def initial():
    return ArrayRecord({"w": Array(np.zeros(2, np.float32))})


out = Path(sys.argv[1])
seen = []


def evaluate(step, arrays):
    seen.append([step, arrays["w"].numpy().tolist()])
    return MetricRecord({"accuracy": 0.0, "loss": 0.0})


engine = EngineSettings(checkpoint_every=2, checkpoint_path=out / "checkpoint.pt")
with InProcessGrid(app, 1, run_config={}) as grid:
    result = ASGD(server_learning_rate=0.5, engine=engine).start(
        grid, initial(), max_updates=4, eval_every=1, evaluate_fn=evaluate
    )
model = outputs.write_model(out, result.arrays)
print(json.dumps({
    "updates": result.report.counters["updates_received"],
    "w": result.arrays["w"].numpy().tolist(),
    "seen": seen,
    "checkpoint": int(files.load(out / "checkpoint.pt")["received"]),
    "model": [model.name, np.load(model, allow_pickle=False)["w"].tolist()],
}))

# GSGM from a run config holding a key of the user's own app: left to the app.
cfg = parse_run_config({"strategy": "gsgm", "max-updates": 12, "my-app-key": "mine"})
with InProcessGrid(app, 3, run_config=cfg) as grid:
    result = build_strategy(cfg).start(grid, initial(), max_updates=12)
w = result.arrays["w"].numpy()
print(json.dumps({
    "strategy": type(build_strategy(cfg)).__name__,
    "updates": result.report.counters["updates_received"],
    "finite": bool(np.isfinite(w).all()),
    "my-app-key": cfg["my-app-key"],
}))
"""


def test_a_fresh_venv_with_the_wheel_alone_runs_a_strategy_without_torch(wheel, tmp_path):
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    assert uv, "uv (the test extra) is needed to make the venv"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    venv = tmp_path / "venv"
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True, env=env)
    python = venv / "bin" / "python"
    # The wheel and no extras: flwr and numpy come from the package index (or uv's cache).
    install = subprocess.run(
        [uv, "pip", "install", "-q", "--python", str(python), str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    listed = subprocess.check_output(
        [uv, "pip", "freeze", "--python", str(python)], text=True, env=env
    )
    # "name==version", or "name @ file:///..." for the wheel
    installed = {line.split("==")[0].split(" @ ")[0].lower() for line in listed.splitlines()}
    assert {"flwr", "numpy", "flwr-gsgm"} <= installed
    assert not installed & {"torch", "torchvision", "matplotlib", "flwr-datasets", "ray"}
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run(
        [str(python), "-c", LEAN_RUN, str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    imports, asgd, gsgm = (json.loads(line) for line in proc.stdout.splitlines())
    assert imports["file"].startswith(str(venv))
    assert imports["importable"] == [] and imports["loaded"] == []
    assert asgd["updates"] == 4
    assert asgd["seen"] == [
        [0, [0.0, 0.0]],
        [1, [0.5, 1.0]],
        [2, [0.75, 1.5]],
        [3, [0.875, 1.75]],
        [4, [0.9375, 1.875]],
    ]
    assert asgd["w"] == [0.9375, 1.875]
    assert asgd["checkpoint"] == 4  # the last checkpoint, written and read without torch
    assert asgd["model"] == ["model.npz", [0.9375, 1.875]]
    assert gsgm == {"strategy": "GSGM", "updates": 12, "finite": True, "my-app-key": "mine"}


# A user's Flower app, built with hatchling (as `flwr new` makes them), that depends on
# flwr-gsgm (issue 24 item 1). {extra} is the dependency line and any settings.
HATCHLING_APP = """
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "myapp"
version = "1.0.0"
dependencies = ["flwr>=1.42,<1.44", {dependency}]
{settings}
[tool.hatch.build.targets.wheel]
packages = ["myapp"]

[tool.flwr.app]
publisher = "me"

[tool.flwr.app.components]
serverapp = "myapp.server_app:app"
clientapp = "myapp.client_app:app"
"""


def _venv_without_flwr_gsgm(tmp_path: Path) -> Path:
    """A fresh venv that sees this test's packages (flwr, numpy, torch, hatchling) but not
    flwr-gsgm: a folder of links to every entry of this environment's site-packages but
    flwr-gsgm's (and editable-install hooks), added to the venv by a .pth file."""
    venv = tmp_path / "venv"
    # without pip (and the old setuptools it brings, which would shadow torch's need)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    shared = tmp_path / "shared-site"
    shared.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        name = entry.name.lower()
        if name.startswith(("flwr_gsgm", "__editable__", "_flwr_gsgm")) or name.endswith(".pth"):
            continue
        (shared / entry.name).symlink_to(entry)
    site = subprocess.check_output(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        text=True,
    ).strip()
    Path(site, "project-deps.pth").write_text(f"{shared}\n")
    return python


def _install_app(python: Path, app: Path, wheels: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_CONSTRAINT")}
    return subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-index"]
        + ["--no-build-isolation"]
        + ["--find-links", str(wheels), str(app)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "PIP_CONFIG_FILE": os.devnull},
    )


def _app(tmp_path: Path, name: str, dependency: str, settings: str = "") -> Path:
    app = tmp_path / name
    (app / "myapp").mkdir(parents=True)
    (app / "myapp" / "__init__.py").write_text("")
    (app / "pyproject.toml").write_text(
        HATCHLING_APP.format(dependency=dependency, settings=settings)
    )
    return app


def test_a_hatchling_flower_app_installs_flwr_gsgm_as_the_readme_shows(wheel, tmp_path):
    python = _venv_without_flwr_gsgm(tmp_path)
    wheels = wheel.parent
    # The README's way: the dependency by name, the wheel found with --find-links.
    done = _install_app(python, _app(tmp_path, "by-name", '"flwr-gsgm"'), wheels)
    assert done.returncode == 0, done.stderr[-3000:]
    where = subprocess.check_output(
        [str(python), "-c", "import flwr_gsgm; print(flwr_gsgm.__file__)"],
        text=True,
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert str(tmp_path / "venv") in where  # from the wheel, not this checkout
    # A direct reference needs hatchling's allow-direct-references (docs/USER_GUIDE.md says so).
    direct = f'"flwr-gsgm @ {wheel.as_uri()}"'
    refused = _install_app(python, _app(tmp_path, "direct", direct), wheels)
    assert refused.returncode != 0
    assert "allow-direct-references" in refused.stderr
    allowed = "\n[tool.hatch.metadata]\nallow-direct-references = true\n"
    done = _install_app(python, _app(tmp_path, "direct-allowed", direct, allowed), wheels)
    assert done.returncode == 0, done.stderr[-3000:]
