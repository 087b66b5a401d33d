"""Local computations of a node, as pure PyTorch functions (no Flower import).

:func:`compute_update` turns (model at the received weights w, local data, seed) into
the update the node sends back, in one of three modes:

- ``"gradient"``: g = (1/B) * sum_b grad L_b(w), the mean of the gradients of
  ``local_batches`` (B) mini-batches, all taken at w; no step is taken.
- ``"delta"``: E local SGD steps (``local_steps``, or ``local_epochs`` passes over
  the data: :func:`steps_per_message`) at rate ``local_lr`` give w_local; the update
  is the displacement d = w - w_local, whatever ``local_lr`` (the server's learning
  rate is a fraction of it). With E = 1 and no momentum it equals ``local_lr``
  times the gradient of the first mini-batch, up to float32 rounding.
- ``"weights"``: the same E SGD steps; the update is w_local itself (what Flower's
  synchronous FedAvg / FedAvgM average; the server forms w - w_local).

L_b is the mean cross-entropy over mini-batch b. Local SGD is torch.optim.SGD's
rule with momentum mu = ``local_momentum`` (no dampening, no Nesterov, no weight
decay): v <- g_b at the first step, v <- mu * v + g_b after, w <- w - local_lr * v;
mu = 0 (the default) is plain SGD, w <- w - local_lr * g_b. The momentum buffer
starts at zero in every message (a stateless client).

Mini-batches: with ``local_steps`` (and in gradient mode), :func:`sample_batches`
walks a random permutation of the node's examples (``torch.Generator`` seeded with
``seed``) in chunks of ``min(batch_size, N)``, drawing a fresh permutation when fewer
than a full chunk remain. So the first batch is the same in every mode for the same
seed, batches never repeat an example within a pass, and every batch has the same
size. With ``local_epochs`` > 0, :func:`epoch_batches`: each epoch a fresh
permutation cut into ``ceil(N / batch_size)`` batches, the last one smaller when
``batch_size`` does not divide N (as a torch DataLoader with ``shuffle=True``), so
every example is used once per epoch.

Determinism: the outputs are a function of (weights, data, arguments, seed) only;
with the same number of torch threads they are bit-identical across calls and
processes (the ClientApp sets the thread count, default 1).

The model passed in is never modified: gradients come from
``torch.autograd.grad`` (no ``.grad`` is written) and SGD runs on a deep copy.
"""

from __future__ import annotations

import copy
import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

__all__ = [
    "MODES",
    "compute_update",
    "epoch_batches",
    "evaluate",
    "num_examples_used",
    "sample_batches",
    "steps_per_message",
]

MODES = ("gradient", "delta", "weights")


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"Invalid {name}={value!r}: expected an integer >= 1")
    return int(value)


def _check_non_negative_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"Invalid {name}={value!r}: expected an integer >= 0")
    return int(value)


def _check_momentum(value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float, np.integer, np.floating))
        or not 0 <= value < 1
    ):
        raise ValueError(f"Invalid local-momentum={value!r}: expected a number in [0, 1)")
    return float(value)


def steps_per_message(
    mode: str,
    local_batches: int,
    local_steps: int,
    local_epochs: int,
    batch_size: int,
    num_examples: int,
) -> int:
    """Mini-batches one train message makes a node compute (a pure function).

    Gradient mode: ``local_batches`` gradients at the received weights. Delta and
    weights modes: SGD steps, ``local_epochs * ceil(num_examples / batch_size)``
    when ``local_epochs`` > 0, else ``local_steps``. Each is one forward and
    backward pass of a mini-batch of at most ``batch_size`` examples (the unit a
    time model charges per step).

    Raises
    ------
    ValueError
        Unknown mode, sizes that are not integers >= 1 (``local_epochs``: >= 0).
    """
    if mode not in MODES:
        raise ValueError(f"Invalid mode={mode!r}: expected one of {MODES}")
    _check_positive_int("local-batches", local_batches)
    _check_positive_int("local-steps", local_steps)
    epochs = _check_non_negative_int("local-epochs", local_epochs)
    b = _check_positive_int("batch-size", batch_size)
    n = _check_positive_int("num-examples", num_examples)
    if mode == "gradient":
        return int(local_batches)
    if epochs:
        return epochs * -(-n // b)
    return int(local_steps)


def _parameters_in_state_order(model: nn.Module) -> list[torch.Tensor]:
    """The model's parameters in ``state_dict`` key order.

    Raises
    ------
    ValueError
        If the ``state_dict`` holds anything but trainable parameters (e.g. BatchNorm
        buffers): such entries would have no gradient to send.
    """
    params = dict(model.named_parameters())
    keys = list(model.state_dict().keys())
    if set(keys) != set(params) or not all(p.requires_grad for p in params.values()):
        extra = sorted(set(keys) - set(params))
        raise ValueError(
            "compute_update needs a model whose state_dict holds only trainable "
            f"parameters; non-parameter entries: {extra}"
        )
    return [params[k] for k in keys]


def _model_device(model: nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    return torch.device("cpu")


def _on_device(
    model: nn.Module, device: torch.device | str | None
) -> tuple[nn.Module, torch.device | None]:
    """``(model, None)`` if ``device`` is None or the model's device (no copy, no
    transfer: the CPU path is the plain one); else a copy of the model on ``device``
    and that device, to which each batch is moved."""
    if device is None:
        return model, None
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device == _model_device(model):
        return model, None
    return copy.deepcopy(model).to(device), device


def _batch(
    images: torch.Tensor, labels: torch.Tensor, idx: torch.Tensor, device: torch.device | None
) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = images[idx], labels[idx]
    if device is not None:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    return x, y


def sample_batches(
    num_examples: int, batch_size: int, num_batches: int, seed: int
) -> list[torch.Tensor]:
    """Draw ``num_batches`` mini-batches of row indices, seeded.

    Parameters
    ----------
    num_examples : int
        N, size of the local data set (>= 1).
    batch_size : int
        Requested batch size; every batch has ``min(batch_size, N)`` rows.
    num_batches : int
        How many batches.
    seed : int
        Seed of the ``torch.Generator`` (any Python int; taken modulo 2**64).

    Returns
    -------
    list[torch.Tensor]
        ``num_batches`` int64 tensors of distinct indices in ``[0, N)``.

    Raises
    ------
    ValueError
        If N, batch_size or num_batches is not a positive integer.
    """
    n = _check_positive_int("num-examples", num_examples)
    b = min(_check_positive_int("batch-size", batch_size), n)
    _check_positive_int("num-batches", num_batches)
    generator = torch.Generator().manual_seed(int(seed) % 2**64)
    batches = []
    perm = torch.randperm(n, generator=generator)
    pos = 0
    for _ in range(num_batches):
        if pos + b > n:
            perm = torch.randperm(n, generator=generator)
            pos = 0
        batches.append(perm[pos : pos + b])
        pos += b
    return batches


def epoch_batches(
    num_examples: int, batch_size: int, num_epochs: int, seed: int
) -> list[torch.Tensor]:
    """Mini-batches of ``num_epochs`` passes over the data, seeded.

    Each epoch draws a fresh permutation of ``[0, N)`` (``torch.Generator`` seeded
    with ``seed``, one generator for all epochs) and cuts it into
    ``ceil(N / batch_size)`` consecutive batches: every example once per epoch, the
    last batch of an epoch ``N - (ceil(N / batch_size) - 1) * batch_size`` long.

    Raises
    ------
    ValueError
        If N, batch_size or num_epochs is not a positive integer.
    """
    n = _check_positive_int("num-examples", num_examples)
    b = _check_positive_int("batch-size", batch_size)
    _check_positive_int("local-epochs", num_epochs)
    generator = torch.Generator().manual_seed(int(seed) % 2**64)
    batches = []
    for _ in range(num_epochs):
        perm = torch.randperm(n, generator=generator)
        batches.extend(perm[s : s + b] for s in range(0, n, b))
    return batches


def num_examples_used(
    num_examples: int,
    *,
    mode: str,
    batch_size: int,
    local_batches: int = 1,
    local_steps: int = 1,
    local_epochs: int = 0,
) -> int:
    """Number of example-gradients :func:`compute_update` computes (reported as
    ``num-examples``): ``min(batch_size, N) * B`` in gradient mode, ``N *
    local_epochs`` with local epochs, ``min(batch_size, N) * E`` otherwise."""
    if mode != "gradient" and local_epochs:
        return num_examples * local_epochs
    count = local_batches if mode == "gradient" else local_steps
    return min(batch_size, num_examples) * count


def compute_update(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    *,
    mode: str,
    batch_size: int = 32,
    local_batches: int = 1,
    local_steps: int = 1,
    local_lr: float = 0.05,
    seed: int = 0,
    device: torch.device | str | None = None,
    local_epochs: int = 0,
    local_momentum: float = 0.0,
) -> tuple[list[np.ndarray], float]:
    """Compute a node's update at the model's current weights.

    Parameters
    ----------
    model : torch.nn.Module
        Holds the received weights w; not modified. Its ``state_dict`` must hold
        only trainable parameters.
    images : torch.Tensor
        The node's images, ``[N, C, H, W]`` uint8 (raw pixels; the model
        normalises).
    labels : torch.Tensor
        ``[N]`` int64 class indices.
    mode : {"gradient", "delta", "weights"}
        See the module docstring.
    batch_size : int
        Mini-batch size (>= 1; capped at N).
    local_batches : int
        B, number of mini-batches averaged in gradient mode (>= 1).
    local_steps : int
        E, number of SGD steps in delta and weights modes (>= 1), unless
        ``local_epochs`` > 0.
    local_lr : float
        SGD learning rate of delta and weights modes (finite, > 0).
    local_epochs : int
        Delta and weights modes: passes over the data (>= 0); > 0 replaces
        ``local_steps`` by ``local_epochs * ceil(N / batch_size)`` steps
        (:func:`epoch_batches`); 0 (default): ``local_steps``.
    local_momentum : float
        SGD momentum mu of delta and weights modes, in [0, 1) (default 0: plain SGD).
    seed : int
        Seed of the mini-batch sampling (:func:`sample_batches`).
    device : torch.device or str, optional
        Where to compute (e.g. ``"cuda"``, see :mod:`clients.device`). None or the
        model's own device: computed in place, as without the argument; another
        device: on a copy of the model moved there, each mini-batch moved there.
        The batches drawn and the returned arrays (CPU numpy) do not depend on it.

    Returns
    -------
    (list[np.ndarray], float)
        The update as float32 arrays in ``state_dict`` key order and shapes, and the
        training loss: mean cross-entropy (nats) of the mini-batches used, each
        measured at the weights it was evaluated at (w in gradient mode, the
        current local weights before each step otherwise).

    Raises
    ------
    ValueError
        Unknown mode, non-positive sizes or learning rate, negative local epochs, a
        momentum outside [0, 1), empty or mismatched data, or a model with
        non-parameter state.
    """
    _check_update_args(mode, images, labels, local_lr, local_batches, local_steps)
    epochs = _check_non_negative_int("local-epochs", local_epochs)
    momentum = _check_momentum(local_momentum)
    if mode != "gradient" and epochs:
        batches = epoch_batches(len(labels), batch_size, epochs, seed)
    else:
        num_batches = local_batches if mode == "gradient" else local_steps
        batches = sample_batches(len(labels), batch_size, num_batches, seed)
    model, target = _on_device(model, device)
    data = (images, labels, target)
    if mode == "gradient":
        update, losses = _gradient_update(model, data, batches)
    elif mode == "delta":
        update, losses = _delta_update(model, data, batches, local_lr, momentum)
    else:
        update, losses = _weights_update(model, data, batches, local_lr, momentum)
    arrays = [np.ascontiguousarray(t.cpu().numpy(), dtype=np.float32).copy() for t in update]
    return arrays, float(np.mean(losses))


def _check_update_args(
    mode: str,
    images: torch.Tensor,
    labels: torch.Tensor,
    local_lr: float,
    local_batches: int,
    local_steps: int,
) -> None:
    """Raise ValueError (see :func:`compute_update`) before any computation."""
    if mode not in MODES:
        raise ValueError(f"Invalid mode={mode!r}: expected one of {MODES}")
    if len(images) != len(labels):
        raise ValueError(f"{len(images)} images but {len(labels)} labels")
    if len(labels) == 0:
        raise ValueError("Cannot compute an update on an empty data set")
    if (
        isinstance(local_lr, bool)
        or not isinstance(local_lr, (int, float, np.integer, np.floating))
        or not math.isfinite(local_lr)
        or local_lr <= 0
    ):
        raise ValueError(f"Invalid local-lr={local_lr!r}: expected a finite number > 0")
    _check_positive_int("local-batches", local_batches)
    _check_positive_int("local-steps", local_steps)


#: ``(images, labels, device)``: a node's data and where its batches go (None: stay).
_Data = tuple[torch.Tensor, torch.Tensor, torch.device | None]


def _gradient_update(
    model: nn.Module, data: _Data, batches: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[float]]:
    """Gradient mode: mean gradient at w over ``batches`` (w untouched), batch losses."""
    images, labels, target = data
    params = _parameters_in_state_order(model)
    was_training = model.training
    model.train()
    total = [torch.zeros_like(p) for p in params]
    losses = []
    try:
        for idx in batches:
            x, y = _batch(images, labels, idx, target)
            loss = F.cross_entropy(model(x), y)
            grads = torch.autograd.grad(loss, params)
            for acc, g in zip(total, grads):
                acc.add_(g)
            losses.append(loss.item())
    finally:
        model.train(was_training)
    if len(batches) > 1:
        for acc in total:
            acc.div_(len(batches))
    return total, losses


def _local_sgd(
    model: nn.Module,
    data: _Data,
    batches: list[torch.Tensor],
    local_lr: float,
    momentum: float = 0.0,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[float]]:
    """One SGD step per batch on a copy of ``model``: (w, local weights, batch losses).

    torch.optim.SGD's update (momentum buffer = the first gradient, then
    ``mu * buf + g``; ``p -= lr * buf``), written out so that no ``.grad`` is kept.
    """
    images, labels, target = data
    local = copy.deepcopy(model)
    params = _parameters_in_state_order(local)
    start = [p.detach().clone() for p in params]
    local.train()
    losses = []
    velocity: list[torch.Tensor] | None = None
    for idx in batches:
        x, y = _batch(images, labels, idx, target)
        loss = F.cross_entropy(local(x), y)
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            if momentum == 0.0:  # plain SGD: the same float operations as before momentum
                for p, g in zip(params, grads):
                    p.add_(g, alpha=-local_lr)
            else:
                if velocity is None:
                    velocity = [g.clone() for g in grads]
                else:
                    for v, g in zip(velocity, grads):
                        v.mul_(momentum).add_(g)
                for p, v in zip(params, velocity):
                    p.add_(v, alpha=-local_lr)
        losses.append(loss.item())
    return start, [p.detach() for p in params], losses


def _delta_update(
    model: nn.Module,
    data: _Data,
    batches: list[torch.Tensor],
    local_lr: float,
    momentum: float = 0.0,
) -> tuple[list[torch.Tensor], list[float]]:
    """Delta mode: the displacement ``w - w_local`` after the local steps, batch losses."""
    start, local, losses = _local_sgd(model, data, batches, local_lr, momentum)
    return [w0 - w for w0, w in zip(start, local)], losses


def _weights_update(
    model: nn.Module,
    data: _Data,
    batches: list[torch.Tensor],
    local_lr: float,
    momentum: float = 0.0,
) -> tuple[list[torch.Tensor], list[float]]:
    """Weights mode: the local weights after the local steps, batch losses."""
    _start, local, losses = _local_sgd(model, data, batches, local_lr, momentum)
    return local, losses


def evaluate(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    batch_size: int = 32,
    device: torch.device | str | None = None,
    threads: int = 1,
) -> tuple[float, float]:
    """Loss and accuracy of ``model`` on a labelled set.

    Parameters
    ----------
    model : torch.nn.Module
        Evaluated in eval mode under ``torch.no_grad()``; its train/eval flag is
        restored afterwards.
    images : torch.Tensor
        ``[N, C, H, W]`` uint8 raw pixels.
    labels : torch.Tensor
        ``[N]`` int64.
    batch_size : int
        Forward-pass chunk size (memory only; does not change the result beyond
        float rounding).
    device : torch.device or str, optional
        As in :func:`compute_update`.
    threads : int
        Python threads, each evaluating one contiguous part of the set (the model is
        shared; torch releases the GIL in its kernels). The accuracy does not depend
        on it; the loss only up to float rounding (the parts are summed in order).

    Returns
    -------
    (float, float)
        Mean cross-entropy (nats per example) and accuracy (fraction in [0, 1]).

    Raises
    ------
    ValueError
        Empty set, mismatched lengths, non-positive batch size or threads.
    """
    if len(images) != len(labels):
        raise ValueError(f"{len(images)} images but {len(labels)} labels")
    if len(labels) == 0:
        raise ValueError("Cannot evaluate on an empty data set")
    batch_size = _check_positive_int("batch-size", batch_size)
    threads = _check_positive_int("threads", threads)
    model, target = _on_device(model, device)
    was_training = model.training
    model.eval()
    # Contiguous parts, whole batches each, summed in order: the result depends on
    # ``threads`` (float rounding of the loss) but never on thread timing.
    n = len(labels)
    per_part = -(-n // (threads * batch_size)) * batch_size
    parts = [range(s, min(s + per_part, n)) for s in range(0, n, per_part)]

    def part_sums(rows: range) -> tuple[float, int]:
        loss_sum, correct = 0.0, 0
        with torch.no_grad():  # grad mode is per thread
            for start in rows[::batch_size]:
                x, y = images[start : start + batch_size], labels[start : start + batch_size]
                if target is not None:
                    x, y = x.to(target), y.to(target)
                logits = model(x)
                loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
                correct += int((logits.argmax(dim=1) == y).sum())
        return loss_sum, correct

    try:
        if len(parts) == 1:
            sums = [part_sums(parts[0])]
        else:  # torch releases the GIL in its kernels: the parts run in parallel
            with ThreadPoolExecutor(len(parts), thread_name_prefix="evaluate") as pool:
                sums = list(pool.map(part_sums, parts))
    finally:
        model.train(was_training)
    return sum(s for s, _ in sums) / n, sum(c for _, c in sums) / n
