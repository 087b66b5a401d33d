"""The public names of ``flwr_gsgm``: each imported by name in its ``__init__.py``.

``flwr_gsgm/__init__.py`` imports every public name under ``if TYPE_CHECKING:`` (what
go-to-definition and type checkers follow) and, at run time, on first use from the
module ``_DEFINED_IN`` names (the core must import without flwr). The two lists must
be the same, name for name and module for module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import flwr_gsgm


def type_checking_imports() -> dict[str, str]:
    """Name -> module of the ``from ... import ...`` under ``if TYPE_CHECKING:``."""
    tree = ast.parse(Path(flwr_gsgm.__file__).read_text())
    found: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for statement in node.body:
                assert isinstance(statement, ast.ImportFrom)
                for alias in statement.names:
                    found[alias.asname or alias.name] = statement.module or ""
    return found


def test_every_public_name_is_imported_by_name_from_its_module():
    explicit = type_checking_imports()
    assert explicit == flwr_gsgm._DEFINED_IN
    assert set(flwr_gsgm.__all__) == {*explicit, "__version__"}
    for name, module in explicit.items():
        value = getattr(flwr_gsgm, name)
        if isinstance(value, type):
            assert value.__module__ == module, name  # defined there, not re-exported


def test_every_strategy_class_is_a_public_name():
    names = {cls.__name__ for cls in flwr_gsgm.STRATEGIES.values()}
    assert names <= set(flwr_gsgm.__all__)
