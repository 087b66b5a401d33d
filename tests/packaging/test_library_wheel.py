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
