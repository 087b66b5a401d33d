"""Size limits of the team conventions: in ``flwr_gsgm/`` outside ``core/``, no module
above 400 lines and no class above 250 lines (counted with ``ast``, docstrings and
comments included)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "flwr_gsgm"
MODULES = sorted(p for p in PACKAGE.rglob("*.py") if "core" not in p.relative_to(PACKAGE).parts)
MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 250


def class_sizes(source: str) -> dict[str, int]:
    """``{qualified class name: lines from its first decorator to its last line}``."""
    sizes: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                name = prefix + child.name
                sizes[name] = child.end_lineno - first + 1
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return sizes


def test_the_package_has_modules_outside_core():
    names = {p.name for p in MODULES}
    assert {"async_engine.py", "membership.py", "strategies.py"} <= names
    assert not any(p.parent.name == "core" for p in MODULES)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_and_class_sizes(path):
    source = path.read_text()
    lines = len(source.splitlines())
    assert lines <= MAX_MODULE_LINES, f"{path.name}: {lines} lines > {MAX_MODULE_LINES}"
    big = {k: v for k, v in class_sizes(source).items() if v > MAX_CLASS_LINES}
    assert not big, f"{path.name}: classes above {MAX_CLASS_LINES} lines: {big}"


def test_class_sizes_counts_decorators_and_nested_classes():
    source = "@dataclass\nclass A:\n    x: int\n\n    class B:\n        y: int\n"
    assert class_sizes(source) == {"A": 6, "A.B": 2}
