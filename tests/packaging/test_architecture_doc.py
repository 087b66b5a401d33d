"""docs/ARCHITECTURE.md names only modules and functions that exist."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = (REPO / "docs" / "ARCHITECTURE.md").read_text()


def tree_paths() -> set[str]:
    """The modules the tree block lists: a folder line, then its modules indented."""
    block = DOC.split("## The tree", 1)[1].split("```")[1]
    paths, folder = set(), None
    for line in block.splitlines():
        if m := re.match(r"^([\w/]+/)\s", line + " "):
            folder = m.group(1)
        elif line.startswith("  ") and folder:
            words = line.split()
            # a module line: its names first (several on a line), then what they do
            for word in words:
                if not word.endswith(".py"):
                    break
                paths.add(folder + word)
    return paths


def test_every_module_path_the_doc_names_exists():
    paths = set(re.findall(r"\b((?:flwr_gsgm|clients|serverapp|simulations)/[\w/]*\w\.py)\b", DOC))
    paths |= tree_paths()
    assert len(paths) >= 60  # the tree names every module of the library
    missing = sorted(p for p in paths if not (REPO / p).is_file())
    assert not missing, f"docs/ARCHITECTURE.md names missing modules: {missing}"


def test_every_module_of_the_library_is_in_the_doc():
    library = REPO / "flwr_gsgm"
    modules = [p for p in library.rglob("*.py") if p.name != "__init__.py"]
    assert len(modules) > 40
    # The tree lists a package's modules under its folder: `flwr_gsgm/engine/` then
    # `ledger.py`; the core's rules share a line.
    listed = tree_paths()
    absent = sorted(
        str(p.relative_to(REPO)) for p in modules if str(p.relative_to(REPO)) not in listed
    )
    assert not absent, f"modules missing from docs/ARCHITECTURE.md: {absent}"


def test_the_path_of_one_update_names_real_functions():
    steps = re.findall(r"^(\w+)\.(\w+)\s", DOC, re.M)
    assert len(steps) >= 5
    for module, name in steps:
        if module == "core":
            continue
        found = list((REPO / "flwr_gsgm").rglob(f"{module}.py"))
        assert len(found) == 1, f"{module}.py named in the doc is not one module: {found}"
        source = found[0].read_text()
        assert f"def {name}(" in source, f"{module}.{name} named in the doc does not exist"
