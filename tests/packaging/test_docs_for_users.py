"""The docs are for users: no reference to the project's issue tracker in them.

README.md, every Markdown page under docs/, simulations/README.md and the public
docstrings of flwr_gsgm (module, class and function docstrings) must not cite an issue
("issue 33", "issues 25"): say what the result, the setting or the reason is, or point to
the section or results page that holds it. History goes to CHANGELOG.md, which is not
checked.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ISSUE = re.compile(r"\bissues? \d+\b", re.IGNORECASE)


def markdown_pages() -> list[Path]:
    pages = [
        ROOT / "README.md",
        *sorted((ROOT / "docs").rglob("*.md")),
        ROOT / "simulations" / "README.md",
    ]
    return [page for page in pages if page.name != "CHANGELOG.md"]


def text_hits(text: str, where: str, first_line: int = 1) -> list[str]:
    """``where:line: text`` for every line of ``text`` that cites an issue."""
    return [
        f"{where}:{first_line + n}: {line.strip()}"
        for n, line in enumerate(text.splitlines())
        if ISSUE.search(line)
    ]


def docstring_hits(source: str, where: str) -> list[str]:
    """The issue references in the module, class and function docstrings of ``source``,
    leaving out the docstrings of private classes and functions (a leading underscore)."""
    tree = ast.parse(source)
    hits: list[str] = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if not isinstance(node, ast.Module) and node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node, clean=False)
        if doc is None:
            continue
        first = node.body[0].lineno  # the docstring's own first line
        hits += text_hits(doc, where, first)
    return sorted(set(hits), key=lambda hit: int(hit.split(":")[1]))


def test_the_pattern_and_the_docstring_reader_hand_made():
    assert ISSUE.search("as corrected in issue 34") and ISSUE.search("Issues 25 and 33")
    assert not ISSUE.search("tissue 3") and not ISSUE.search("the issue's targets")
    assert not ISSUE.search("issue34") and not ISSUE.search("2 issues")
    source = (
        '"""Module.\n\nSee issue 7."""\n\n'
        "class A:\n"
        '    """Fine."""\n\n'
        "    def f(self):\n"
        '        """Why: issue 12."""\n\n'
        "def _private():\n"
        '    """issue 3"""\n'
    )
    assert docstring_hits(source, "m.py") == ["m.py:3: See issue 7.", "m.py:9: Why: issue 12."]
    assert text_hits("a\nissue 5 b\n", "p.md") == ["p.md:2: issue 5 b"]


def test_the_docs_cite_no_issue():
    pages = markdown_pages()
    assert len(pages) >= 10 and all(page.exists() for page in pages)
    hits: list[str] = []
    for page in pages:
        hits += text_hits(page.read_text(), str(page.relative_to(ROOT)))
    assert not hits, (
        "user docs cite the issue tracker (say what the result, setting or reason is; "
        "history goes to CHANGELOG.md):\n" + "\n".join(hits)
    )


def test_the_public_docstrings_cite_no_issue():
    modules = sorted((ROOT / "flwr_gsgm").rglob("*.py"))
    assert len(modules) >= 20
    hits: list[str] = []
    for module in modules:
        hits += docstring_hits(module.read_text(), str(module.relative_to(ROOT)))
    assert not hits, (
        "flwr_gsgm's docstrings cite the issue tracker (say what the result, setting or "
        "reason is; history goes to CHANGELOG.md):\n" + "\n".join(hits)
    )
