"""On a machine with CUDA (a Jetson, a GPU server): the ClientApp's gradient on the GPU
matches the CPU's to float32 round-off. Not part of the test suite, which runs where
there is no GPU: ``python benchmarks/check_cuda_matches_cpu.py``; exits 1 on a mismatch
and 2 without CUDA."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clients.models import build_model  # noqa: E402
from clients.training import compute_update  # noqa: E402


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (40, 1, 28, 28), dtype=torch.uint8, generator=gen)
    labels = torch.randint(0, 10, (40,), generator=gen)
    model = build_model("fashion-mnist", seed=1)
    cpu, _ = compute_update(model, images, labels, mode="gradient", batch_size=8, seed=5)
    gpu, _ = compute_update(
        model, images, labels, mode="gradient", batch_size=8, seed=5, device="cuda"
    )
    worst = max(float(np.max(np.abs(a - b) / (np.abs(a) + 1e-5))) for a, b in zip(cpu, gpu))
    ok = all(
        np.allclose(a, b, rtol=1e-3, atol=1e-5) and a.dtype == b.dtype == np.float32
        for a, b in zip(cpu, gpu)
    )
    print(f"largest relative difference CPU vs CUDA: {worst:.2e} -> {'ok' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
