"""Lying nodes (clients/attacks.py): hand-computed lies."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from clients.attacks import flip_labels, is_attacker, lie

SENT = [np.array([1.0, 2.0], np.float32), np.array([[0.5]], np.float32)]
# weights mode: the node moved w by d = (3, -4, 0): |d| = 5
LOCAL = [np.array([4.0, -2.0], np.float32), np.array([[0.5]], np.float32)]


def test_sign_flip_sends_the_opposite_move():
    got = lie("sign-flip", LOCAL, SENT, seed=0)  # w_sent - d = (1 - 3, 2 + 4, 0.5)
    assert [a.tolist() for a in got] == [[-2.0, 6.0], [[0.5]]]
    assert all(a.dtype == np.float32 for a in got)
    grad = [np.array([3.0, -4.0], np.float32)]  # gradient / delta modes: -u
    assert lie("sign-flip", grad, None, seed=0)[0].tolist() == [-3.0, 4.0]


def test_noise_has_the_honest_norm_and_repeats_with_its_seed():
    got = lie("noise", LOCAL, SENT, seed=7)
    moved = np.concatenate([(g - s).ravel() for g, s in zip(got, SENT)])
    assert np.linalg.norm(moved) == pytest.approx(5.0, rel=1e-6)
    again = lie("noise", LOCAL, SENT, seed=7)
    assert all(np.array_equal(a, b) for a, b in zip(got, again))
    other = lie("noise", LOCAL, SENT, seed=8)
    assert not np.array_equal(got[0], other[0])


def test_label_flip_and_none_leave_the_update_as_computed():
    assert lie("label-flip", LOCAL, SENT, seed=0) is LOCAL
    assert lie("none", LOCAL, SENT, seed=0) is LOCAL
    labels = torch.tensor([0, 3, 9], dtype=torch.int64)
    assert flip_labels(labels, 10).tolist() == [9, 6, 0]


def test_the_first_partitions_lie():
    assert [is_attacker(p, "noise", 3) for p in range(5)] == [True, True, True, False, False]
    assert not is_attacker(0, "none", 3)


def test_a_bad_attack_or_shape_is_refused():
    with pytest.raises(ValueError, match="attack 'flip' is unknown"):
        lie("flip", LOCAL, SENT, seed=0)
    with pytest.raises(ValueError, match="do not match"):
        lie("noise", LOCAL, SENT[:1] + [np.zeros((2, 2), np.float32)], seed=0)
