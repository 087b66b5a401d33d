"""The board requirements resolve for a 64-bit ARM board (aarch64, Python 3.11) to the
CPU-only set: torch 2.9.1 / torchvision 0.24.1 and no NVIDIA package (issue 24 item 6).

pip evaluates environment markers against the machine it runs on, even with
``--platform``, so a dry run on x86_64 would pull the CUDA stack whatever the board
gets; uv resolves for the target platform (``--python-platform``). Needs the package
index (PyPI), as ``make setup`` does.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def resolve_for_aarch64(requirements: Path, out: Path) -> dict[str, str]:
    """``name -> version`` of what ``requirements`` resolves to on aarch64 Linux, cp311."""
    done = subprocess.run(
        [sys.executable, "-m", "uv", "pip", "compile", "--quiet", "--no-header",
         "--python-version", "3.11", "--python-platform", "aarch64-manylinux_2_28",
         str(requirements), "-o", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    pins = {}
    for line in out.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "==" in line:
            name, version = line.split("==", 1)
            pins[name.lower()] = version.split()[0]
    return pins


def test_the_aarch64_file_installs_the_cpu_only_set(tmp_path):
    pins = resolve_for_aarch64(DEPLOY / "requirements-supernode-aarch64.txt", tmp_path / "a.txt")
    assert (pins["torch"], pins["torchvision"]) == ("2.9.1", "0.24.1")
    assert pins["flwr"].startswith("1.42.")
    assert not [n for n in pins if n.startswith(("nvidia", "triton", "cuda"))], sorted(pins)


def test_the_generic_file_alone_would_pull_the_cuda_stack_on_aarch64(tmp_path):
    # Why the aarch64 file exists: the newest torch on PyPI for aarch64 is a CUDA build.
    # If this starts failing, PyPI's aarch64 torch became CPU-only and the pins can go.
    pins = resolve_for_aarch64(DEPLOY / "requirements-supernode.txt", tmp_path / "g.txt")
    assert [n for n in pins if n.startswith("nvidia")], sorted(pins)
