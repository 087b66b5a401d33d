"""The import graph of ``flwr_gsgm``: no module imports itself back, by any path.

An import counts wherever it is written: at module level, inside a function (a lazy
import is still a dependency) and under ``if TYPE_CHECKING:`` (a module that names its
caller's type knows its caller: the coupling the layering forbids). ``from package
import name`` counts as importing ``package.name`` when that is a module, and as
importing ``package`` itself only for the names that are not modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import flwr_gsgm

ROOT = Path(flwr_gsgm.__file__).resolve().parent


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The ``flwr_gsgm`` modules ``name`` imports (see the module docstring)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            submodules = {f"{target}.{a.name}" for a in node.names} & known
            found.update(submodules)
            # `from package import module` needs the module, not the package's own
            # names (Python runs the package's __init__ for any submodule anyway).
            if len(submodules) < len(node.names):
                found.add(target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return {m for m in found if m in known and m != name}


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return sorted(found)


def test_the_cycle_finder_finds_a_hand_made_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_type_checking_function_level_and_relative_imports(tmp_path):
    pkg = tmp_path / "flwr_gsgm" / "sub"
    pkg.mkdir(parents=True)
    (pkg / "x.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "import numpy\n"
        "if TYPE_CHECKING:\n    from flwr_gsgm import y\n"
        "def f():\n    from flwr_gsgm.z import thing\n"
        "from . import w\n"
    )
    known = {"flwr_gsgm", "flwr_gsgm.sub", "flwr_gsgm.sub.w", "flwr_gsgm.sub.x"}
    known |= {"flwr_gsgm.y", "flwr_gsgm.z"}
    assert imports_of("flwr_gsgm.sub.x", pkg / "x.py", known) == {
        "flwr_gsgm.y",
        "flwr_gsgm.z",
        "flwr_gsgm.sub.w",
    }
    (pkg / "v.py").write_text("from flwr_gsgm import GSGM\nfrom . import w, helper\n")
    assert imports_of("flwr_gsgm.sub.v", pkg / "v.py", known | {"flwr_gsgm.sub.v"}) == {
        "flwr_gsgm",
        "flwr_gsgm.sub",
        "flwr_gsgm.sub.w",
    }


def test_flwr_gsgm_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 40  # every module of the library was read
    assert cycles(graph) == []
