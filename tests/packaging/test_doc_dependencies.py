"""The docs claim no dependency the wheel does not bring, and follow Flower 1.42's way
to set the number of simulated nodes (issue 35 item 6).

A claim is a sentence that says what comes with flwr-gsgm: "X and Y come with
flwr-gsgm", "it brings X and Y only", "depending on X and Y only". Each package it
names must be in pyproject.toml's ``[project].dependencies`` (the wheel's metadata),
and an "only" claim must name all of them.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted(
    [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "examples").glob("*/README.md")]
)
#: "<packages> come(s) with flwr-gsgm"
COME_WITH = re.compile(r"([\w\[\]\-.,` ]+?) comes? with flwr-gsgm")
#: "brings <packages> only", "depending on <packages> only"
ONLY = re.compile(r"(?:brings|depending on) ([\w\[\]\-.,` ]+?) only")


def wheel_dependencies() -> set[str]:
    """The distribution names of ``[project].dependencies`` (extras and versions cut)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {re.split(r"[\[<>=!~; ]", d, maxsplit=1)[0].lower() for d in deps}


def packages(phrase: str) -> set[str]:
    """``"torch and flwr[simulation]"`` -> ``{"torch", "flwr[simulation]"}``."""
    words = re.split(r",\s*|\s+and\s+|\s+", phrase.replace("`", "").strip())
    return {w.lower() for w in words if w and w not in {"the", "its", "it"}}


def claims() -> list[tuple[str, str, set[str]]]:
    """``(doc, kind, packages)`` of every dependency claim of the docs, lines joined."""
    found = []
    for doc in DOCS:
        text = " ".join(doc.read_text().split())
        for kind, pattern in (("come with", COME_WITH), ("only", ONLY)):
            for match in pattern.finditer(text):
                found.append((doc.relative_to(ROOT).as_posix(), kind, packages(match.group(1))))
    return found


def test_the_wheel_brings_flwr_and_numpy_only():
    assert wheel_dependencies() == {"flwr", "numpy"}


def test_every_dependency_claim_of_the_docs_is_the_wheels():
    deps = wheel_dependencies()
    found = claims()
    # The claims there are: ARCHITECTURE.md's and the quickstart's install line.
    assert ("docs/ARCHITECTURE.md", "only", {"flwr", "numpy"}) in found
    assert ("examples/quickstart-async/README.md", "only", {"flwr", "numpy"}) in found
    for doc, kind, names in found:
        assert names <= deps, f"{doc}: claims {sorted(names - deps)} come with flwr-gsgm"
        if kind == "only":
            assert names == deps, f"{doc}: the wheel brings {sorted(deps)}, it says {names}"


def test_a_claim_of_torch_is_caught():
    text = "pip install -e . --no-deps   # this app; torch and flwr[simulation] come with flwr-gsgm"
    (match,) = COME_WITH.finditer(text)
    assert packages(match.group(1)) - wheel_dependencies() >= {"torch", "flwr[simulation]"}


def test_the_docs_set_the_simulated_nodes_with_federation_config():
    # Flower 1.42: "`options.` fields in the SuperLink connection configuration are
    # deprecated. Use `--federation-config` with `flwr run` instead."
    for doc in ("README.md", "docs/USER_GUIDE.md", "examples/quickstart-async/README.md"):
        text = " ".join((ROOT / doc).read_text().split())
        assert '--federation-config "num-supernodes=10"' in text, doc
        assert "options.num-supernodes = " not in text, doc
    script = (ROOT / "scripts" / "run_simulation.sh").read_text()
    assert "options.num-supernodes" not in script and "options.backend" not in script
    assert 'federation="num-supernodes=$NUM_NODES ' in script
    assert 'args=(run . local --stream --federation-config "$federation")' in script
