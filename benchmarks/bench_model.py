"""Speed of the Fashion-MNIST SmallCNN on one CPU thread, by memory layout.

Prints the median time of one client training step (forward + backward on a
32-image mini-batch, as a node computes in gradient mode) and of one evaluation of
2000 test-sized images (forward only, in chunks of 32 and 1000), with the model's
weights in the default (NCHW) layout and in ``torch.channels_last``, and the ratio.
``clients.models.build_model`` returns channels_last models because of these
ratios. Not a test: run ``python benchmarks/bench_model.py``.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from clients.models import SmallCNN


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up: allocator and kernel selection
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(samples)


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    batch = torch.randint(0, 256, (32, 1, 28, 28), dtype=torch.uint8)
    labels = torch.randint(0, 10, (32,))
    test = torch.randint(0, 256, (2000, 1, 28, 28), dtype=torch.uint8)
    nchw = SmallCNN()
    channels_last = SmallCNN().to(memory_format=torch.channels_last)
    channels_last.load_state_dict(nchw.state_dict())

    def train_step(model):
        loss = F.cross_entropy(model(batch), labels)
        torch.autograd.grad(loss, list(model.parameters()))

    def evaluate(model, chunk):
        with torch.no_grad():
            for start in range(0, len(test), chunk):
                model(test[start : start + chunk])

    rows = [("training step, 32 images", lambda m: train_step(m), 100)]
    rows += [
        (f"evaluation, 2000 images in chunks of {c}", lambda m, c=c: evaluate(m, c), 10)
        for c in (32, 1000)
    ]
    print(f"{'':42s} {'NCHW ms':>9s} {'ch.last ms':>11s} {'ratio':>6s}")
    for name, fn, repeats in rows:
        a = _median_ms(lambda fn=fn: fn(nchw), repeats)
        b = _median_ms(lambda fn=fn: fn(channels_last), repeats)
        print(f"{name:42s} {a:9.2f} {b:11.2f} {a / b:6.2f}")


if __name__ == "__main__":
    main()
