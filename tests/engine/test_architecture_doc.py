"""docs/ARCHITECTURE.md names only modules and functions that exist."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = (REPO / "docs" / "ARCHITECTURE.md").read_text()


def test_every_module_path_the_doc_names_exists():
    paths = set(re.findall(r"\b((?:flwr_gsgm|clients|serverapp|simulations)/[\w/]*\w\.py)\b", DOC))
    assert len(paths) >= 18  # the layer picture names the engine's modules
    missing = sorted(p for p in paths if not (REPO / p).is_file())
    assert not missing, f"docs/ARCHITECTURE.md names missing modules: {missing}"


def test_every_module_of_the_engine_is_in_the_doc():
    engine = sorted(p.name for p in (REPO / "flwr_gsgm").glob("*.py") if p.name != "__init__.py")
    absent = [name for name in engine if name not in DOC]
    assert not absent, f"modules missing from docs/ARCHITECTURE.md: {absent}"


def test_the_path_of_one_update_names_real_functions():
    steps = re.findall(r"^(\w+)\.(\w+)\s", DOC, re.M)
    assert len(steps) >= 5
    for module, name in steps:
        if module == "core":
            continue
        source = (REPO / "flwr_gsgm" / f"{module}.py").read_text()
        assert f"def {name}(" in source, f"{module}.{name} named in the doc does not exist"
