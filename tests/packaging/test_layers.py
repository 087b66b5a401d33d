"""The packages of ``flwr_gsgm`` are layers: no module imports a package above its own.

:data:`LAYERS` is the order, top first, declared here once; docs/ARCHITECTURE.md draws
it (a test below keeps the drawing equal to it). A module may import its own package
and any package below it, never one above. Every import counts, as in
:mod:`tests.packaging.test_import_graph`: module level, inside a function, and under
``if TYPE_CHECKING:`` (a module that names its caller's type knows its caller).
``flwr_gsgm/__init__.py``, the public names, is above every package.

``python -m tests.packaging.test_layers`` prints the package-level import graph.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from tests.packaging.test_import_graph import import_graph

REPO = Path(__file__).resolve().parents[2]

#: The packages of flwr_gsgm, top first. ``flwr_gsgm`` is the package's own
#: ``__init__.py`` (the public names); each other entry is a sub-package.
LAYERS = (
    "flwr_gsgm",
    "config",
    "strategy",
    "engine",
    "nodes",
    "intake",
    "model",
    "checkpoint",
    "evaluation",
    "scheduling",
    "simulation",
    "deploy",
    "core",
)


def package_of(module: str) -> str:
    """``flwr_gsgm.engine.ledger`` -> ``engine``; ``flwr_gsgm`` -> ``flwr_gsgm``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_graph(graph: dict[str, set[str]]) -> dict[str, dict[str, list[str]]]:
    """Package -> the packages it imports -> the module imports that make the arrow."""
    packages: dict[str, dict[str, list[str]]] = {}
    for module, targets in sorted(graph.items()):
        source = package_of(module)
        for target in sorted(targets):
            if package_of(target) != source:
                arrows = packages.setdefault(source, {}).setdefault(package_of(target), [])
                arrows.append(f"{module} imports {target}")
    return packages


def upward_imports(graph: dict[str, set[str]], layers: tuple[str, ...]) -> list[str]:
    """Every import of a module from a package above its own (or from no known layer)."""
    rank = {name: i for i, name in enumerate(layers)}
    found = []
    for module, targets in sorted(graph.items()):
        source = package_of(module)
        for target in sorted(targets):
            above = package_of(target)
            if source not in rank or above not in rank:
                unknown = source if source not in rank else above
                found.append(f"{module} imports {target}: package {unknown!r} is not in LAYERS")
            elif rank[above] < rank[source]:
                found.append(
                    f"{module} imports {target}: {above} is above {source} "
                    f"(LAYERS: {' -> '.join(layers)})"
                )
    return found


def test_the_check_finds_a_hand_made_upward_import():
    graph = {
        "flwr_gsgm.engine.a": {"flwr_gsgm.core.x", "flwr_gsgm.engine.b"},
        "flwr_gsgm.engine.b": set(),
        "flwr_gsgm.core.x": {"flwr_gsgm.engine.b"},
        "flwr_gsgm.core": set(),
    }
    assert upward_imports(graph, ("flwr_gsgm", "engine", "core")) == [
        "flwr_gsgm.core.x imports flwr_gsgm.engine.b: engine is above core "
        "(LAYERS: flwr_gsgm -> engine -> core)"
    ]
    assert upward_imports(graph, ("flwr_gsgm", "core", "engine")) == [
        "flwr_gsgm.engine.a imports flwr_gsgm.core.x: core is above engine "
        "(LAYERS: flwr_gsgm -> core -> engine)"
    ]
    del graph["flwr_gsgm.core.x"]
    assert upward_imports(graph, ("flwr_gsgm", "engine", "core")) == []
    assert upward_imports({"flwr_gsgm.new.m": set()}, ("flwr_gsgm",)) == []
    assert upward_imports({"flwr_gsgm.new.m": {"flwr_gsgm.core"}}, ("flwr_gsgm", "core")) == [
        "flwr_gsgm.new.m imports flwr_gsgm.core: package 'new' is not in LAYERS"
    ]


def test_every_package_of_the_library_is_a_layer():
    library = REPO / "flwr_gsgm"
    packages = {p.parent.name for p in library.glob("*/__init__.py")}
    assert packages == set(LAYERS) - {"flwr_gsgm"}, "LAYERS names each sub-package once"
    assert len(LAYERS) == len(set(LAYERS))


def test_no_module_imports_a_package_above_its_own():
    graph = import_graph()
    assert len(graph) > 40  # every module of the library was read
    upward = upward_imports(graph, LAYERS)
    assert not upward, "imports against the layers of docs/ARCHITECTURE.md:\n" + "\n".join(upward)


def test_architecture_md_draws_the_declared_order():
    doc = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    drawing = doc.split("## The layers", 1)[1].split("```")[1]
    drawn = re.findall(r"^\s*\d+\.\s+(\w+)", drawing, re.M)
    assert tuple(drawn) == LAYERS, "docs/ARCHITECTURE.md's layer drawing is not LAYERS"


def print_package_graph() -> None:
    """The package-level import graph, top layer first, each arrow with its imports."""
    packages = package_graph(import_graph())
    rank = {name: i for i, name in enumerate(LAYERS)}
    for source in sorted(packages, key=lambda p: rank.get(p, len(rank))):
        targets = sorted(packages[source], key=lambda p: rank.get(p, len(rank)))
        print(f"{source} -> {', '.join(targets)}")
        if "-v" in sys.argv:
            for target in targets:
                for arrow in packages[source][target]:
                    print(f"    {arrow}")


if __name__ == "__main__":
    print_package_graph()
