"""The asynchronous baselines with hand-computed numbers (two nodes, two elements)."""

from __future__ import annotations

import numpy as np
import pytest
from core_testutil import assert_bits_equal, f32

from flwr_gsgm.core import (
    ASGDRule,
    DCASGDRule,
    FedAsyncRule,
    FedBuffRule,
    MomentumASGDRule,
    Outcome,
    UpdateRejected,
)


def test_asgd():
    opt = ASGDRule([f32(1, 2)], [1, 2], lr=0.5)
    # node 1 [2,4]: w = [1,2] - 0.5 [2,4] = [0,0].
    assert opt.on_update(1, [f32(2, 4)], 0) is Outcome.APPLIED
    assert_bits_equal(opt.weights[0], f32(0, 0))
    # node 2 [-2,1] computed at version 0 (staleness 1): w = [0,0] - [-1,0.5].
    assert opt.on_update(2, [f32(-2, 1)], 0) is Outcome.APPLIED
    assert_bits_equal(opt.weights[0], f32(1, -0.5))
    assert opt.version == 2


def test_asgd_staleness_bound():
    opt = ASGDRule([f32(1, 2)], [1, 2], lr=0.5, max_staleness=0)
    opt.on_update(1, [f32(2, 4)], 0)
    # staleness 1 > 0: dropped, w stays [0,0].
    assert opt.on_update(2, [f32(-2, 1)], 0) is Outcome.STALE
    assert_bits_equal(opt.weights[0], f32(0, 0))
    c = opt.counters
    assert (c["arrivals"], c["applied"], c["stale"], opt.version) == (2, 1, 1, 1)


def test_momentum_asgd():
    opt = MomentumASGDRule([f32(0, 0)], [1, 2], lr=0.5, beta=0.5)
    # g [2,4]: v = [2,4]; w = -0.5 [2,4] = [-1,-2].
    opt.on_update(1, [f32(2, 4)], 0)
    assert_bits_equal(opt.velocity, f32(2, 4))
    assert_bits_equal(opt.weights[0], f32(-1, -2))
    # g [2,0]: v = 0.5 [2,4] + [2,0] = [3,2]; w = [-1,-2] - [1.5,1] = [-2.5,-3].
    opt.on_update(2, [f32(2, 0)], 0)
    assert_bits_equal(opt.velocity, f32(3, 2))
    assert_bits_equal(opt.weights[0], f32(-2.5, -3))
    # g [0,0]: v = [1.5,1]; w = [-2.5,-3] - [0.75,0.5] = [-3.25,-3.5].
    opt.on_update(1, [f32(0, 0)], 1)
    assert_bits_equal(opt.weights[0], f32(-3.25, -3.5))


def test_dcasgd():
    opt = DCASGDRule([f32(0, 0)], [1, 2], lr=0.5, dc_lambda=0.5)
    opt.on_dispatch(1)  # w_tau = [0,0] at version 0
    opt.on_dispatch(2)
    # node 1 [2,4] at version 0: w_t - w_tau = 0, g~ = g: w = [-1,-2].
    opt.on_update(1, [f32(2, 4)], 0)
    assert_bits_equal(opt.weights[0], f32(-1, -2))
    opt.on_dispatch(1)  # w_tau = [-1,-2] at version 1
    # node 2 [1,2] at version 0: w_t - w_tau = [-1,-2];
    # g~ = [1,2] + 0.5 * [1,4] * [-1,-2] = [1,2] + [-0.5,-4] = [0.5,-2];
    # w = [-1,-2] - 0.5 [0.5,-2] = [-1.25,-1].
    opt.on_update(2, [f32(1, 2)], 0)
    assert_bits_equal(opt.weights[0], f32(-1.25, -1))
    assert opt.backup_versions == {1: 1, 2: 0}


def test_dcasgd_on_displacements_reads_them_as_update_scale_times_a_gradient():
    # test_dcasgd's gradients as displacements of a client at lr 0.25: d = 0.25 g, and
    # the server lr 0.5 per gradient is 0.5 / 0.25 = 2 of the displacement. With
    # update_scale 0.25 the compensation is (0.5 / 0.25) d * d * (w_t - w_tau): the
    # same steps as in gradient mode, bit for bit.
    opt = DCASGDRule([f32(0, 0)], [1, 2], lr=2.0, dc_lambda=0.5, update_scale=0.25)
    opt.on_dispatch(1)
    opt.on_dispatch(2)
    # node 1 d = [0.5, 1]: w = [0, 0] - 2 [0.5, 1] = [-1, -2].
    opt.on_update(1, [f32(0.5, 1)], 0)
    assert_bits_equal(opt.weights[0], f32(-1, -2))
    # node 2 d = [0.25, 0.5] at version 0, w_t - w_tau = [-1, -2]:
    # d~ = [0.25, 0.5] + 2 * [0.0625, 0.25] * [-1, -2] = [0.125, -0.5];
    # w = [-1, -2] - 2 [0.125, -0.5] = [-1.25, -1], test_dcasgd's result.
    opt.on_update(2, [f32(0.25, 0.5)], 0)
    assert_bits_equal(opt.weights[0], f32(-1.25, -1))
    with pytest.raises(ValueError, match="update_scale must be > 0"):
        DCASGDRule([f32(0, 0)], [1], lr=1.0, update_scale=0.0)


def test_fedasync_with_lr_one_mixes_the_node_model_rebuilt_from_its_displacement():
    # Displacement modes, lr 1.0 (the paper's rule; the declared default there is 0.3,
    # tuned): w_i = w_tau - d is the node's local model. Node 1 trained [0, 0] to [2, 4]: d = [-2, -4]; alpha 0.5,
    # staleness 0: w = 0.5 [0, 0] + 0.5 [2, 4] = [1, 2].
    assert FedAsyncRule.declared_params()[0].default_for("weights") == 0.3
    opt = FedAsyncRule([f32(0, 0)], [1, 2], lr=1.0, alpha=0.5, poly_a=1.0)
    opt.on_dispatch(1)
    opt.on_update(1, [f32(-2, -4)], 0)
    assert_bits_equal(opt.weights[0], f32(1, 2))


def test_dcasgd_needs_the_dispatch_of_the_base_version():
    opt = DCASGDRule([f32(0, 0)], [1, 2], lr=0.5)
    with pytest.raises(UpdateRejected) as info:  # never dispatched
        opt.on_update(1, [f32(2, 4)], 0)
    assert info.value.reason == "base-version"
    opt.on_dispatch(1)
    opt.on_dispatch(2)
    opt.on_update(1, [f32(2, 4)], 0)
    opt.on_dispatch(1)  # now at version 1
    with pytest.raises(UpdateRejected) as info:  # claims version 0
        opt.on_update(1, [f32(2, 4)], 0)
    assert info.value.reason == "base-version"
    assert "version 1" in str(info.value)
    assert opt.counters["rejected"] == 2
    with pytest.raises(ValueError):
        opt.on_dispatch(3)  # not an active node
    opt.on_node_lost(2)
    assert opt.backup_versions == {1: 1}  # the lost node's copy is freed


def test_fedasync():
    opt = FedAsyncRule([f32(0, 0)], [1, 2], lr=0.5, alpha=0.5, poly_a=1.0)
    opt.on_dispatch(1)
    opt.on_dispatch(2)
    # node 1 [2,4], staleness 0: a = 0.5 * 1^-1 = 0.5; w_1 = [0,0] - 0.5 [2,4]
    # = [-1,-2]; w = 0.5 [0,0] + 0.5 [-1,-2] = [-0.5,-1].
    opt.on_update(1, [f32(2, 4)], 0)
    assert_bits_equal(opt.weights[0], f32(-0.5, -1))
    # node 2 [4,0] sent at version 0, staleness 1: a = 0.5 * 2^-1 = 0.25;
    # w_2 = [0,0] - 0.5 [4,0] = [-2,0]; w = 0.75 [-0.5,-1] + 0.25 [-2,0]
    # = [-0.375,-0.75] + [-0.5,0] = [-0.875,-0.75].
    opt.on_update(2, [f32(4, 0)], 0)
    assert_bits_equal(opt.weights[0], f32(-0.875, -0.75))
    assert opt.mixing_weight(3) == 0.5 / 4


def test_fedasync_default_staleness_function():
    opt = FedAsyncRule([f32(0, 0)], [1], lr=0.1)  # alpha = 0.6, poly_a = 0.5
    assert opt.mixing_weight(0) == pytest.approx(0.6)
    assert opt.mixing_weight(3) == pytest.approx(0.6 / 2)


def test_fedbuff():
    opt = FedBuffRule([f32(0, 0)], [1, 2], lr=0.5, buffer_size=2)
    # [2,4]: buffered. [4,0]: K = 2 reached, mean [3,2]: w = -0.5 [3,2] = [-1.5,-1].
    assert opt.on_update(1, [f32(2, 4)], 0) is Outcome.DEFERRED
    assert_bits_equal(opt.weights[0], f32(0, 0))
    assert opt.version == 0
    assert opt.on_update(2, [f32(4, 0)], 0) is Outcome.APPLIED
    assert_bits_equal(opt.weights[0], f32(-1.5, -1))
    assert opt.version == 1
    # [1,1]: buffered again.
    assert opt.on_update(1, [f32(1, 1)], 1) is Outcome.DEFERRED
    assert opt.buffer_count == 1
    assert_bits_equal(opt.buffer_sum, f32(1, 1))
    c = opt.counters
    assert (c["arrivals"], c["applied"], c["deferred"]) == (3, 1, 2)


def test_fedbuff_weighs_a_stale_update_by_one_over_sqrt_one_plus_staleness():
    # The paper's staleness scaling s(tau) = 1 / sqrt(1 + tau).
    opt = FedBuffRule([f32(0, 0)], [1, 2], lr=1.0, buffer_size=1)
    assert opt.on_update(1, [f32(2, 2)], 0) is Outcome.APPLIED  # tau 0: w = [-2,-2]
    assert opt.on_update(1, [f32(2, 2)], 1) is Outcome.APPLIED  # tau 0: w = [-4,-4]
    # Base 0 at version 2: tau = 2, s = 1/sqrt(3); w = [-4,-4] - [3,3]/sqrt(3).
    assert opt.on_update(2, [f32(3, 3)], 0) is Outcome.APPLIED
    step = np.float32(3) * np.float32(1 / np.sqrt(3))
    assert_bits_equal(opt.weights[0], np.array([-4 - step, -4 - step], dtype=np.float32))
    assert float(opt.weights[0][0]) == pytest.approx(-4 - np.sqrt(3), abs=1e-6)
    # A buffer of K = 2: tau 3 (s = 1/2) and tau 0, step -(1/2 [4,0] + [0,2]) / 2.
    opt = FedBuffRule([f32(0, 0)], [1, 2], lr=1.0, buffer_size=2)
    for base in range(3):  # three steps of two fresh zero updates: version 3
        opt.on_update(1, [f32(0, 0)], base)
        opt.on_update(2, [f32(0, 0)], base)
    assert opt.version == 3
    assert opt.on_update(1, [f32(4, 0)], 0) is Outcome.DEFERRED
    assert_bits_equal(opt.buffer_sum, f32(2, 0))
    assert opt.on_update(2, [f32(0, 2)], 3) is Outcome.APPLIED
    assert_bits_equal(opt.weights[0], f32(-1, -1))


def test_fedbuff_default_buffer_and_stale_updates():
    opt = FedBuffRule([f32(0, 0)], [1], lr=1.0, max_staleness=0)
    for _ in range(4):
        assert opt.on_update(1, [f32(1, 1)], 0) is Outcome.DEFERRED
    assert opt.on_update(1, [f32(1, 1)], 0) is Outcome.APPLIED  # K = 5 by default
    assert_bits_equal(opt.weights[0], f32(-1, -1))
    assert opt.on_update(1, [f32(1, 1)], 0) is Outcome.STALE  # staleness 1
    assert opt.buffer_count == 0


@pytest.mark.parametrize(
    "cls,kw",
    [
        (MomentumASGDRule, dict(beta=1.0)),
        (DCASGDRule, dict(dc_lambda=-1.0)),
        (FedAsyncRule, dict(alpha=0.0)),
        (FedAsyncRule, dict(alpha=1.5)),
        (FedAsyncRule, dict(poly_a=-1.0)),
        (FedBuffRule, dict(buffer_size=0)),
        (ASGDRule, dict(lr=0)),
        (ASGDRule, dict(max_staleness=1.5)),
    ],
)
def test_constructor_rejects_bad_parameters_naming_them(cls, kw):
    params = dict(lr=0.5)
    params.update(kw)
    with pytest.raises(ValueError) as info:
        cls([f32(0, 0)], [1], **params)
    assert next(iter(kw)) in str(info.value)


def test_constructor_rejects_bad_weights():
    with pytest.raises(ValueError, match="at least one array"):
        ASGDRule([], [1], lr=0.1)
    with pytest.raises(TypeError, match="sequence"):
        ASGDRule(f32(1, 2), [1], lr=0.1)
    with pytest.raises(ValueError, match="finite"):
        ASGDRule([f32(1, float("nan"))], [1], lr=0.1)
    with pytest.raises(ValueError, match="partition-id must be an integer"):
        ASGDRule([f32(1, 2)], ["a"], lr=0.1)


@pytest.mark.parametrize("cls", [ASGDRule, MomentumASGDRule, DCASGDRule, FedAsyncRule, FedBuffRule])
def test_docstrings_cite_and_document(cls):
    import sys

    module_doc = sys.modules[cls.__module__].__doc__
    assert "Reference" in module_doc
    assert "Args:" in cls.__doc__ and "Raises:" in cls.__doc__
