"""The run's plot, ``accuracy.png`` (the app layer: matplotlib is no need of the library).

:func:`plot_accuracy` draws the centralized test accuracy of the evaluation rows
(:mod:`flwr_gsgm.config.outputs`'s ``metrics.csv`` rows) against client updates and
against virtual time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["plot_accuracy"]


def plot_accuracy(run_dir: Path, rows: Sequence[Mapping[str, Any]], title: str) -> Path:
    """Write ``run_dir/accuracy.png``: test accuracy (%) vs client updates and vs
    virtual time (s); return its path."""
    import matplotlib  # here, not at import: a run that plots nothing never loads it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    updates = [r["updates"] for r in rows]
    vtime = [r["virtual_time"] for r in rows]
    acc = [100.0 * float(r["accuracy"]) for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    axes[0].plot(updates, acc, marker=".")
    axes[0].set_xlabel("client updates received")
    axes[1].plot(vtime, acc, marker=".", color="tab:orange")
    axes[1].set_xlabel("virtual time (s)")
    axes[0].set_ylabel("test accuracy (%)")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    path = run_dir / "accuracy.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
