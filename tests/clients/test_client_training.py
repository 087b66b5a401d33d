"""compute_update / evaluate against hand computations, autograd and each other."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from clients.datasets import load_dataset
from clients.models import build_model, get_weights
from clients.training import (
    compute_update,
    epoch_batches,
    evaluate,
    num_examples_used,
    sample_batches,
    steps_per_message,
)

FMNIST_ROOT = Path("/usr/share/datasets/fashion-mnist")
EPS32 = 2.0**-24  # unit roundoff of float32


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def node_data():
    """2,000 real Fashion-MNIST training images (classes as they come)."""
    train, _ = load_dataset("fashion-mnist", FMNIST_ROOT)
    return train.images[:2000], train.labels[:2000]


def linear_problem(n=50, d=6, k=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen)
    y = torch.randint(0, k, (n,), generator=gen)
    model = nn.Linear(d, k)
    with torch.no_grad():
        model.weight.copy_(torch.randn(k, d, generator=gen) * 0.5)
        model.bias.copy_(torch.randn(k, generator=gen) * 0.1)
    return model, x, y


def hand_gradient(model, x, y):
    """Softmax regression: dL/dlogits = (softmax - onehot) / n, float64 numpy."""
    w = model.weight.detach().double().numpy()
    b = model.bias.detach().double().numpy()
    xx = x.double().numpy()
    logits = xx @ w.T + b
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(len(y)), y.numpy()] -= 1.0
    p /= len(y)
    return [p.T @ xx, p.sum(0)]


# ------------------------------------------------------------------ sampling
def test_sample_batches_walks_permutations():
    batches = sample_batches(10, 4, 5, seed=1)
    assert [len(b) for b in batches] == [4] * 5
    # first pass: two full batches of one permutation (8 distinct rows), then a new one
    assert len(set(torch.cat(batches[:2]).tolist())) == 8
    assert all(len(set(b.tolist())) == len(b) for b in batches)
    same = sample_batches(10, 4, 5, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(batches, same))
    assert not torch.equal(torch.cat(batches), torch.cat(sample_batches(10, 4, 5, seed=2)))
    # batch larger than the data: every batch is the whole (shuffled) set
    assert [sorted(b.tolist()) for b in sample_batches(3, 32, 2, seed=0)] == [[0, 1, 2]] * 2
    assert num_examples_used(3, mode="gradient", batch_size=32, local_batches=2) == 6
    assert num_examples_used(600, mode="delta", batch_size=32, local_steps=5) == 160
    # local epochs: every example once per epoch (local-steps ignored)
    assert (
        num_examples_used(600, mode="weights", batch_size=32, local_steps=5, local_epochs=2) == 1200
    )
    # ... but not in gradient mode
    assert num_examples_used(600, mode="gradient", batch_size=32, local_epochs=2) == 32


def test_epoch_batches_cover_every_example_once_per_epoch():
    batches = epoch_batches(10, 4, 2, seed=3)
    # ceil(10 / 4) = 3 batches per epoch, the last one 10 - 2 * 4 = 2 long
    assert [len(b) for b in batches] == [4, 4, 2, 4, 4, 2]
    for epoch in (batches[:3], batches[3:]):
        assert sorted(torch.cat(epoch).tolist()) == list(range(10))
    assert not torch.equal(torch.cat(batches[:3]), torch.cat(batches[3:]))  # reshuffled
    same = epoch_batches(10, 4, 2, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(batches, same))
    assert [len(b) for b in epoch_batches(3, 32, 1, seed=0)] == [3]  # one batch of all


@pytest.mark.parametrize(
    ("args", "steps"),
    [
        (("weights", 1, 7, 0, 32, 600), 7),  # local-steps
        (("weights", 1, 7, 2, 32, 600), 38),  # 2 epochs of ceil(600 / 32) = 19 steps
        (("delta", 1, 1, 1, 32, 640), 20),  # 640 / 32 exactly
        (("delta", 1, 1, 3, 32, 10), 3),  # batch above N: one step per epoch
        (("gradient", 3, 7, 2, 32, 600), 3),  # gradient mode: local-batches
    ],
)
def test_steps_per_message(args, steps):
    assert steps_per_message(*args) == steps


def test_steps_per_message_refuses_bad_values():
    with pytest.raises(ValueError, match="mode='sgd'"):
        steps_per_message("sgd", 1, 1, 0, 32, 10)
    with pytest.raises(ValueError, match="local-epochs=-1"):
        steps_per_message("weights", 1, 1, -1, 32, 10)
    with pytest.raises(ValueError, match="num-examples=0"):
        steps_per_message("weights", 1, 1, 1, 32, 0)


# ------------------------------------------------------------- gradient mode
def test_gradient_mode_equals_hand_computed_softmax_regression_gradient():
    model, x, y = linear_problem()
    update, loss = compute_update(
        model, x, y, mode="gradient", batch_size=8, local_batches=3, seed=11
    )
    batches = sample_batches(len(y), 8, 3, seed=11)
    per_batch = [hand_gradient(model, x[i], y[i]) for i in batches]
    expected = [np.mean([g[j] for g in per_batch], axis=0) for j in range(2)]
    assert [u.dtype for u in update] == [np.float32, np.float32]
    np.testing.assert_allclose(update[0], expected[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(update[1], expected[1], rtol=1e-5, atol=1e-6)
    expected_loss = np.mean([F.cross_entropy(model(x[i]), y[i]).item() for i in batches])
    assert loss == pytest.approx(expected_loss, rel=1e-6)


def test_gradient_mode_equals_autograd_on_the_cnn_and_leaves_model_untouched(node_data):
    images, labels = node_data
    model = build_model("fashion-mnist", seed=0)
    before = copy.deepcopy(model.state_dict())
    update, loss = compute_update(model, images, labels, mode="gradient", batch_size=32, seed=5)
    (idx,) = sample_batches(len(labels), 32, 1, seed=5)
    ref = build_model("fashion-mnist", seed=0)
    ref_loss = F.cross_entropy(ref(images[idx]), labels[idx])
    ref_loss.backward()
    for u, (name, p) in zip(update, ref.named_parameters()):
        assert u.shape == tuple(p.shape), name
        # same operations in the same order on one thread: bit-identical
        np.testing.assert_array_equal(u, p.grad.numpy(), err_msg=name)
    assert loss == ref_loss.item()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


# ------------------------------------------------------- delta / weights mode
def test_delta_one_step_is_the_displacement_local_lr_times_the_gradient(node_data):
    """Delta mode returns the displacement d = w - w_local, not divided by lr: one step
    gives w - (w - lr*g) == lr * g in exact arithmetic. In float32, with u = 2**-24:
    the step w_local = fl(w - fl(lr*g)) errs by <= (|w| + lr|g|) u + lr|g| u and the
    difference w - w_local by <= lr|g| u (it is about lr*g), so element-wise
    |d - lr g| <= (|w| + 3 lr|g|) u; we allow twice that."""
    images, labels = node_data
    model = build_model("fashion-mnist", seed=0)
    lr = 0.05
    grad, loss_g = compute_update(model, images, labels, mode="gradient", batch_size=32, seed=9)
    delta, loss_d = compute_update(
        model, images, labels, mode="delta", batch_size=32, local_steps=1, local_lr=lr, seed=9
    )
    assert loss_g == loss_d  # same first batch, same weights
    for w, g, d in zip(get_weights(model), grad, delta):
        w, g, d = (a.astype(np.float64) for a in (w, g, d))
        bound = 2 * (np.abs(w) + 3 * lr * np.abs(g)) * EPS32
        assert np.all(np.abs(d - lr * g) <= bound), (np.abs(d - lr * g).max(), bound.max())
    # For this model (|w| <= 0.2) that is below 2 * 0.2 * 2**-24 ~ 2.4e-8 + O(lr |g| u);
    # d / lr is the gradient up to 5e-7 (the former delta mode's update)
    assert max(np.abs(d - lr * g).max() for g, d in zip(grad, delta)) < 3e-8
    assert max(np.abs(d / lr - g).max() for g, d in zip(grad, delta)) < 1e-6


def test_delta_and_weights_modes_equal_manual_sgd(node_data):
    images, labels = node_data
    model = build_model("fashion-mnist", seed=0)
    lr, steps = 0.1, 3
    new_w, loss_w = compute_update(
        model, images, labels, mode="weights", batch_size=16, local_steps=steps, local_lr=lr, seed=4
    )
    delta, loss_d = compute_update(
        model, images, labels, mode="delta", batch_size=16, local_steps=steps, local_lr=lr, seed=4
    )
    ref = build_model("fashion-mnist", seed=0)
    opt = torch.optim.SGD(ref.parameters(), lr=lr)  # plain SGD, no momentum
    losses = []
    for idx in sample_batches(len(labels), 16, steps, seed=4):
        opt.zero_grad()
        loss = F.cross_entropy(ref(images[idx]), labels[idx])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    w0 = get_weights(model)
    for a, r, d, w in zip(new_w, get_weights(ref), delta, w0):
        np.testing.assert_allclose(a, r, rtol=0, atol=1e-6)
        # the displacement, the same float32 subtraction as on the server: bit for bit
        np.testing.assert_array_equal(d, w - a)
    assert loss_w == loss_d == pytest.approx(np.mean(losses), rel=1e-6)
    assert losses[-1] != losses[0]  # the steps did move the weights


def torch_sgd_epochs(model, x, y, lr, momentum, batch_size, epochs, seed):
    """torch.optim.SGD(momentum) over epoch_batches: the FedAvg-style client's loop."""
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=momentum)
    losses = []
    for idx in epoch_batches(len(y), batch_size, epochs, seed):
        opt.zero_grad()
        loss = F.cross_entropy(ref(x[idx]), y[idx])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return [p.detach().numpy() for p in ref.parameters()], losses


def test_local_epochs_with_momentum_follow_torch_sgd():
    # N = 50, B = 16: ceil(50 / 16) = 4 steps per epoch, 2 epochs = 8 steps (the last
    # batch of each epoch 2 long); momentum 0.9 as torch.optim.SGD (buffer = first
    # gradient, then 0.9 buf + g; w -= lr buf).
    model, x, y = linear_problem()
    kw = dict(mode="weights", batch_size=16, local_steps=3, local_lr=0.2, seed=5)
    new_w, loss = compute_update(model, x, y, local_epochs=2, local_momentum=0.9, **kw)
    ref_w, ref_losses = torch_sgd_epochs(model, x, y, 0.2, 0.9, 16, 2, seed=5)
    assert len(ref_losses) == 8
    for a, r in zip(new_w, ref_w):
        np.testing.assert_allclose(a, r, rtol=0, atol=1e-6)
    assert loss == pytest.approx(np.mean(ref_losses), rel=1e-6)
    # momentum changes the trajectory as torch's does: without it, the plain-SGD path
    plain_w, _ = compute_update(model, x, y, local_epochs=2, **kw)
    ref_plain, _ = torch_sgd_epochs(model, x, y, 0.2, 0.0, 16, 2, seed=5)
    for a, r, m in zip(plain_w, ref_plain, new_w):
        np.testing.assert_allclose(a, r, rtol=0, atol=1e-6)
        assert np.abs(m - a).max() > 1e-2  # far apart: momentum took other steps
    # delta mode: the same local work, the displacement returned
    delta, _ = compute_update(
        model, x, y, **{**kw, "mode": "delta"}, local_epochs=2, local_momentum=0.9
    )
    for d, a, w in zip(delta, new_w, get_weights(model)):
        np.testing.assert_array_equal(d, w - a)


def test_momentum_by_hand_on_two_steps():
    # One example x = 1 of label 0, a linear model without bias of 2 outputs: logits
    # (w0, w1), L = -log softmax(w0, w1)[0], dL/dw = (p0 - 1, p1); two steps of SGD
    # with momentum 0.9 from w = (0, 0), by hand.
    model = nn.Linear(1, 2, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.0], [0.0]]))
    x, y = torch.ones(1, 1), torch.zeros(1, dtype=torch.int64)
    lr, mu = 0.5, 0.9
    out, _ = compute_update(
        model, x, y, mode="weights", batch_size=1, local_steps=2, local_lr=lr, local_momentum=mu
    )
    # logits (a, b) = (w0, w1); dL/da = p0 - 1, dL/db = p1 with p = softmax(a, b).
    w = np.zeros(2)
    v = None
    for _ in range(2):
        p = np.exp(w) / np.exp(w).sum()
        g = np.array([p[0] - 1.0, p[1]])
        v = g.copy() if v is None else mu * v + g
        w = w - lr * v
    # step 1: g = (-0.5, 0.5), w = (0.25, -0.25); step 2: v = 0.9 g1 + g2
    np.testing.assert_allclose(out[0].reshape(-1), w, rtol=0, atol=1e-6)
    p1 = 1.0 / (1.0 + np.exp(-0.5))  # softmax(0.25, -0.25)[0]
    v2 = 0.9 * np.array([-0.5, 0.5]) + np.array([p1 - 1.0, 1.0 - p1])
    np.testing.assert_allclose(w, np.array([0.25, -0.25]) - 0.5 * v2, rtol=0, atol=1e-12)


# --------------------------------------------------------------- determinism
@pytest.mark.parametrize("mode", ["gradient", "delta", "weights"])
def test_same_seed_bit_identical_other_seed_different(node_data, mode):
    images, labels = node_data
    model = build_model("fashion-mnist", seed=0)
    kw = dict(mode=mode, batch_size=32, local_batches=2, local_steps=2, local_lr=0.05)
    a, la = compute_update(model, images, labels, seed=21, **kw)
    b, lb = compute_update(model, images, labels, seed=21, **kw)
    c, _ = compute_update(model, images, labels, seed=22, **kw)
    assert la == lb
    assert all(x.tobytes() == y.tobytes() for x, y in zip(a, b))
    assert any(x.tobytes() != z.tobytes() for x, z in zip(a, c))


# ------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(mode="adam"), "mode='adam'"),
        (dict(mode="delta", local_lr=0.0), "local-lr=0.0"),
        (dict(mode="delta", local_lr=float("inf")), "local-lr=inf"),
        (dict(mode="gradient", batch_size=0), "batch-size=0"),
        (dict(mode="gradient", local_batches=0), "local-batches=0"),
        (dict(mode="weights", local_steps=-1), "local-steps=-1"),
        (dict(mode="weights", local_epochs=-1), "local-epochs=-1"),
        (dict(mode="delta", local_momentum=1.0), "local-momentum=1.0"),
        (dict(mode="delta", local_momentum=-0.1), "local-momentum=-0.1"),
    ],
)
def test_invalid_arguments(kwargs, match):
    model, x, y = linear_problem()
    with pytest.raises(ValueError, match=match):
        compute_update(model, x, y, **kwargs)


def test_empty_data_and_models_with_buffers_are_rejected():
    model, x, y = linear_problem()
    with pytest.raises(ValueError, match="empty"):
        compute_update(model, x[:0], y[:0], mode="gradient")
    bn = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4))
    with pytest.raises(ValueError, match="num_batches_tracked"):
        compute_update(bn, x, y, mode="gradient")


# ----------------------------------------------------------------- evaluate
def test_evaluate_matches_hand_computation_and_batch_size():
    model, x, y = linear_problem(n=37)
    loss, acc = evaluate(model, x, y, batch_size=5)
    logits = model(x).detach()
    assert acc == pytest.approx((logits.argmax(1) == y).double().mean().item())
    assert loss == pytest.approx(F.cross_entropy(logits, y).item(), rel=1e-6)
    loss2, acc2 = evaluate(model, x, y, batch_size=1000)
    assert acc2 == acc and loss2 == pytest.approx(loss, rel=1e-6)
    assert model.training  # mode restored
    with pytest.raises(ValueError, match="empty"):
        evaluate(model, x[:0], y[:0])


@pytest.mark.parametrize("threads", [2, 3, 8, 40])
def test_evaluate_in_threads_covers_every_row_once(threads):
    # 37 rows in batches of 5: 2 threads get 20 + 17 rows, 3 get 15 + 15 + 7, and
    # 8 or 40 threads get 5-row parts (8 parts); 11 of the 37 rows are classified
    # right, so a missed or repeated right row would move the accuracy by 1/37.
    model, x, y = linear_problem(n=37)
    logits = model(x).detach()
    right = (logits.argmax(1) == y).tolist()
    loss, acc = evaluate(model, x, y, batch_size=5, threads=threads)
    assert acc == sum(right) / 37
    assert loss == pytest.approx(F.cross_entropy(logits, y).item(), rel=1e-6)
    assert model.training
    with pytest.raises(ValueError, match="threads"):
        evaluate(model, x, y, threads=0)


def test_untrained_cnn_is_near_chance_on_real_test_set():
    _, test = load_dataset("fashion-mnist", FMNIST_ROOT)
    loss, acc = evaluate(
        build_model("fashion-mnist", seed=0), test.images[:2000], test.labels[:2000]
    )
    assert 0.0 <= acc <= 0.3
    assert loss == pytest.approx(np.log(10), abs=0.3)
