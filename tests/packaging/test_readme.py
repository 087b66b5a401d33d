"""README.md: at most 250 lines, opening with the two commands, its imports real.

Issue 25 item 5: the first screen holds what a new user runs (`make run`, `make test`);
the reference lives in docs/ (docs/REFERENCE.md, generated; docs/USER_GUIDE.md).
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
MAX_LINES = 250


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced code block of ``text``, in order."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)


def test_fenced_blocks_hand_made():
    text = "# t\n\n```bash\nmake run\n```\n\ntext\n\n```\nplain\n```\n"
    assert fenced_blocks(text) == [("bash", "make run\n"), ("", "plain\n")]


def test_readme_is_at_most_250_lines():
    lines = README.splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines (at most {MAX_LINES})"


def test_readme_opens_with_the_two_commands():
    lines = README.splitlines()
    assert lines[0].startswith("# ") and lines[1] == ""
    # The first thing after the title is the bash block of the two commands.
    assert lines[2] == "```bash"
    first = fenced_blocks(README)[0]
    commands = [ln.split("#")[0].strip() for ln in first[1].splitlines()]
    assert first[0] == "bash" and commands == ["make run", "make test"]
    # Both are targets of the Makefile, and CI runs the second as written.
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^run: ", makefile, re.M) and re.search(r"^test: ", makefile, re.M)
    assert "\nmake test\n" in (ROOT / ".ci" / "run").read_text()


def imports_of(text: str) -> list[tuple[str, list[str]]]:
    """``(module, names)`` of every ``from flwr_gsgm... import ...`` line in the code blocks
    of ``text`` (a diff's ``+`` lines included)."""
    found = []
    for _, body in fenced_blocks(text):
        for line in body.splitlines():
            match = re.match(r"^\+?\s*from (flwr_gsgm[\w.]*) import ([\w, ]+)$", line)
            if match:
                found.append((match[1], [n.strip() for n in match[2].split(",")]))
    return found


def test_imports_of_hand_made():
    text = "```diff\n-from flwr import A\n+from flwr_gsgm import GSGM, X\n```\n"
    assert imports_of(text) == [("flwr_gsgm", ["GSGM", "X"])]


def test_every_flwr_gsgm_import_the_readme_shows_works():
    found = imports_of(README)
    assert ("flwr_gsgm", ["GSGM", "FederatedEvaluation"]) in found  # the FedAvg diff
    for module, names in found:
        imported = importlib.import_module(module)
        for name in names:
            assert hasattr(imported, name), f"README: from {module} import {name} fails"
    from flwr_gsgm import FederatedEvaluation
    from flwr_gsgm.federated_evaluation import FederatedEvaluation as defined

    assert FederatedEvaluation is defined
