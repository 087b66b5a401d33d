"""The library installs alone: the ``flwr-gsgm`` wheel ships ``flwr_gsgm`` and nothing of the app.

``clients/``, ``serverapp/`` and ``simulations/`` are this repository's Flower App and
experiments; a user's app has its own packages of those names, so the wheel must not
install them and ``flwr_gsgm`` must not import them.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import sysconfig
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
    assert "flwr_gsgm/core/gsgm.py" in names and "flwr_gsgm/strategies.py" in names
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
import flwr_gsgm, flwr_gsgm.strategies
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
