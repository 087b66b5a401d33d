"""The core's modules import alone, and import each other without a cycle.

The cycle check parses the imports with ``ast`` (every ``import`` / ``from ... import``
statement, at any depth, ``if TYPE_CHECKING:`` blocks included: a cycle there is
still a cycle of the design) and looks for a cycle among the modules of a package;
``PACKAGES`` lists those checked (the whole of ``flwr_gsgm`` to come).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Packages whose internal imports must form no cycle (dotted name).
PACKAGES = ["flwr_gsgm.core"]


def package_modules(package: str) -> dict[str, Path]:
    """``{dotted module name: file}`` of every module of ``package`` (sub-packages too)."""
    base = ROOT.joinpath(*package.split("."))
    found = {}
    for path in sorted(base.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that module ``name`` (file ``path``) imports."""
    is_package = path.name == "__init__.py"
    here = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pkg = here.split(".")
                pkg = pkg[: len(pkg) - (node.level - 1)]
                stem = ".".join(pkg + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # ``from pkg import mod`` imports the module pkg.mod when there is one.
            targets = [stem] + [f"{stem}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def import_graph(package: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports. A package's ``__init__`` importing
    its own modules is left out (importing ``a.b`` runs ``a/__init__`` first anyway,
    so those edges are not the design's dependencies but the package's assembly)."""
    modules = package_modules(package)
    known = set(modules)
    graph = {}
    for name, path in modules.items():
        deps = imported_modules(name, path, known)
        if path.name == "__init__.py":
            deps = {d for d in deps if not d.startswith(name + ".")}
        graph[name] = deps
    return graph


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_imported_modules_resolves_relative_imports(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("from .base import X\nfrom . import params\nimport numpy\n")
    known = {"p.base", "p.params", "p.m"}
    assert imported_modules("p.m", src, known) == {"p.base", "p.params"}


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle(package: str) -> None:
    graph = import_graph(package)
    assert graph["flwr_gsgm.core.base"] >= {"flwr_gsgm.core.registry"}  # the check sees edges
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


@pytest.mark.parametrize("module", sorted(package_modules("flwr_gsgm.core")))
def test_module_imports_alone(module: str) -> None:
    """Each module imports first in a fresh interpreter, and pulls in no flwr or torch."""
    code = (
        f"import sys, {module}\n"
        "bad = sorted(m for m in ('flwr', 'torch') if m in sys.modules)\n"
        "assert not bad, bad\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
