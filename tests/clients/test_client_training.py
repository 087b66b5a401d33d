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
from clients.training import compute_update, evaluate, num_examples_used, sample_batches

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
def test_delta_one_step_equals_gradient_up_to_float32_rounding(node_data):
    """(w - (w - lr*g)) / lr == g in exact arithmetic. In float32, with u = 2**-24:
    the step w_local = fl(w - fl(lr*g)) errs by <= (|w| + lr|g|) u + lr|g| u,
    the difference w - w_local by <= lr|g| u (it is about lr*g), and the division by
    lr by <= |g| u. Dividing the first two by lr gives, element-wise,
    |d - g| <= (|w| / lr + 4 |g|) u; we allow twice that."""
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
        bound = 2 * (np.abs(w) / lr + 4 * np.abs(g)) * EPS32
        assert np.all(np.abs(d - g) <= bound), (np.abs(d - g).max(), bound.max())
    # For this model (|w| <= 0.2) that is below 2 * 0.2 / 0.05 * 2**-24 ~ 5e-7 + O(|g| u).
    assert max(np.abs(d - g).max() for g, d in zip(grad, delta)) < 1e-6


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
        np.testing.assert_allclose(d, (w - a) / lr, rtol=0, atol=1e-5)
    assert loss_w == loss_d == pytest.approx(np.mean(losses), rel=1e-6)
    assert losses[-1] != losses[0]  # the steps did move the weights


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
