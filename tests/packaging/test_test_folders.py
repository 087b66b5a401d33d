"""The test folders mirror the library's packages (issue 36 item 6).

A test file lives in ``tests/<package>/``, the package of ``flwr_gsgm`` it mainly
tests (``tests/engine/`` for the engine, ``tests/config/`` for the run config, ...);
a file that spans several stays with its main subject. The other folders are the
app layers' tests and the test infrastructure, listed below: a new folder is either
a package's or added here on purpose.
"""

from __future__ import annotations

from pathlib import Path

from tests.packaging.test_layers import LAYERS

TESTS = Path(__file__).resolve().parents[1]

#: Test folders that are not a package of flwr_gsgm: the app layers' tests (the
#: repository's serverapp/, clients/ and simulations/ folders), the tests
#: that run ``flwr run`` on a local SuperLink, and those of the repository as a whole.
OTHER_FOLDERS = {
    "serverapp": "the ServerApp (serverapp/): its runner, the FedAvg baselines, the split check",
    "clients": "the ClientApp (clients/)",
    "simulations": "the simulation presets and reports (simulations/)",
    "simulation_engine": "runs under `flwr run` with Flower's simulation engine",
    "packaging": "the wheel, the public names, the import layers, the docs",
}


def test_every_test_folder_is_a_package_of_the_library_or_listed():
    packages = set(LAYERS) - {"flwr_gsgm"}
    assert not packages & set(OTHER_FOLDERS), "a package's tests need no listing"
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))}
    stray = sorted(folders - packages - set(OTHER_FOLDERS))
    assert not stray, (
        f"tests/{stray[0]}/ is neither a package of flwr_gsgm ({', '.join(sorted(packages))}) "
        "nor one of the app and infrastructure folders of OTHER_FOLDERS: move its tests "
        "to the folder of the package they test, or list it there"
    )
