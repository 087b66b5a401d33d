"""The CNN: architecture, float32-only state_dict, seeded init, weight conversion."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchvision.transforms import v2

from clients.models import SmallCNN, build_model, count_parameters, get_weights, set_weights

EXPECTED = [
    ("conv1.weight", (32, 1, 5, 5)),
    ("conv1.bias", (32,)),
    ("conv2.weight", (64, 32, 5, 5)),
    ("conv2.bias", (64,)),
    ("fc1.weight", (128, 1024)),
    ("fc1.bias", (128,)),
    ("fc2.weight", (10, 128)),
    ("fc2.bias", (10,)),
]


def test_architecture_keys_order_and_parameter_count():
    model = build_model("fashion-mnist", seed=0)
    state = model.state_dict()
    assert [(k, tuple(v.shape)) for k, v in state.items()] == EXPECTED
    assert all(v.dtype == torch.float32 for v in state.values())
    # 832 + 51,264 + 131,200 + 1,290
    assert count_parameters(model) == 184_586
    # every state_dict entry is a trainable parameter (no BatchNorm counters)
    assert list(state) == [name for name, _ in model.named_parameters()]


def test_forward_shape_dtype_and_uint8_input():
    model = build_model("fashion-mnist", seed=0)
    x = torch.randint(0, 256, (5, 1, 28, 28), dtype=torch.uint8)
    out = model(x)
    assert out.shape == (5, 10) and out.dtype == torch.float32
    assert torch.equal(out, model(x.to(torch.float32)))


def test_normalisation_matches_torchvision_normalize():
    model = build_model("fashion-mnist", seed=0)
    x = torch.randint(0, 256, (4, 1, 28, 28), dtype=torch.uint8)
    ref = v2.Normalize(mean=[0.2860], std=[0.3530])(x.to(torch.float32) / 255.0)
    torch.testing.assert_close(model.normalize(x), ref, rtol=1e-6, atol=1e-6)


def test_seeded_init_is_reproducible_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = get_weights(build_model("fashion-mnist", seed=7))
    assert torch.equal(torch.rand(3), expected_next)
    b = get_weights(build_model("fashion-mnist", seed=7))
    c = get_weights(build_model("fashion-mnist", seed=8))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[0], c[0])


def test_get_set_weights_roundtrip_copies():
    src = build_model("fashion-mnist", seed=1)
    dst = build_model("fashion-mnist", seed=2)
    arrays = get_weights(src)
    assert all(a.dtype == np.float32 for a in arrays)
    set_weights(dst, arrays)
    arrays[0][...] = 0.0  # the model holds its own copy
    assert all(
        torch.equal(p, q) for p, q in zip(src.state_dict().values(), dst.state_dict().values())
    )


def test_set_weights_rejects_wrong_count_or_shape():
    model = build_model("fashion-mnist", seed=0)
    arrays = get_weights(model)
    with pytest.raises(ValueError, match="Expected 8 arrays"):
        set_weights(model, arrays[:-1])
    arrays[2] = np.zeros((64, 32, 3, 3), dtype=np.float32)
    with pytest.raises(ValueError, match="conv2.weight"):
        set_weights(model, arrays)


def test_unknown_dataset_and_bad_image_size():
    with pytest.raises(ValueError, match="dataset='svhn'"):
        build_model("svhn")
    with pytest.raises(ValueError, match="too small"):
        SmallCNN(image_size=12)
