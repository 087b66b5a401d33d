"""flwr_gsgm.core imports, and every optimizer works, with flwr and torch absent."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

REPO = pathlib.Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import importlib.abc
    import sys

    BLOCKED = ("flwr", "flwr_datasets", "torch", "torchvision")

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"blocked for this test: {name}", name=name)
            return None

    sys.meta_path.insert(0, Block())
    try:
        import flwr  # noqa: F401
    except ModuleNotFoundError:
        pass
    else:
        raise SystemExit("the import blocker does not work")

    import numpy as np
    import flwr_gsgm.core as core

    w = [np.zeros((2, 3), np.float32), np.zeros(4, np.float32)]
    g = [np.ones((2, 3), np.float32), np.ones(4, np.float32)]
    for name in sorted(core.OPTIMIZERS):
        opt = core.make_optimizer(name, w, [1, 2], lr=0.1)
        opt.on_dispatch(1)
        opt.on_update(1, g, 0, now=1.0)
        opt.on_node_lost(2)
        opt.load_state_dict(opt.state_dict())
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    if leaked:
        raise SystemExit(f"imported: {leaked}")
    print("ok", ",".join(sorted(core.OPTIMIZERS)))
    """
)


def test_core_imports_and_runs_without_flwr_and_torch():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (
        proc.stdout.strip()
        == "ok ace,asgd,ca2fl,daasgd,dcasgd,fedasync,fedbuff,fedcompass,gsgm,masgd"
    )


def test_core_sources_import_numpy_only():
    # Static check, complementary to the subprocess: no module of the package
    # mentions an import of flwr or torch.
    for path in (REPO / "flwr_gsgm" / "core").glob("*.py"):
        for line in path.read_text().splitlines():
            stripped = line.strip()
            if stripped.startswith(("import ", "from ")):
                mod = stripped.split()[1]
                assert mod.split(".")[0] not in ("flwr", "torch"), f"{path.name}: {line}"
