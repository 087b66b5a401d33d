"""Partitioning the real Fashion-MNIST training labels with flwr-datasets."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from clients.datasets import load_dataset
from clients.partitioning import (
    ImpossiblePartitioning,
    PartitionConfig,
    all_partition_indices,
    load_partition,
    partition_indices,
    partitioning_warnings,
)

FMNIST_ROOT = Path("/usr/share/datasets/fashion-mnist")


@pytest.fixture(scope="module")
def labels() -> torch.Tensor:
    return load_dataset("fashion-mnist", FMNIST_ROOT)[0].labels


def assert_disjoint_cover(parts, n):
    allidx = torch.cat(parts)
    assert len(allidx) == n
    assert torch.equal(torch.sort(allidx).values, torch.arange(n))


def test_pathological_k2_10_nodes_exactly_two_classes_each(labels):
    parts = all_partition_indices(labels, PartitionConfig("pathological", 10, 2, seed=0))
    assert_disjoint_cover(parts, 60000)
    for p, idx in enumerate(parts):
        assert idx.dtype == torch.int64
        assert len(idx) == 6000
        assert sorted(torch.unique(labels[idx]).tolist()) == sorted({p, (p + 1) % 10})
        # each class is split evenly between the two nodes holding it
        assert torch.bincount(labels[idx], minlength=10).max().item() == 3000


def test_pathological_100_nodes(labels):
    for k in (2, 5):
        parts = all_partition_indices(labels, PartitionConfig("pathological", 100, k))
        assert_disjoint_cover(parts, 60000)
        assert {len(i) for i in parts} == {600}
        assert {len(torch.unique(labels[i])) for i in parts} == {k}


def test_pathological_k1_and_k10(labels):
    parts = all_partition_indices(labels, PartitionConfig("pathological", 10, 1))
    assert [torch.unique(labels[i]).tolist() for i in parts] == [[c] for c in range(10)]
    parts = all_partition_indices(labels, PartitionConfig("pathological", 10, 10))
    assert {len(torch.unique(labels[i])) for i in parts} == {10}


def test_pathological_seed_only_shuffles_within_partition(labels):
    a = partition_indices(labels, PartitionConfig("pathological", 10, 2, seed=0), 4)
    b = partition_indices(labels, PartitionConfig("pathological", 10, 2, seed=1), 4)
    assert not torch.equal(a, b)
    assert torch.equal(torch.sort(a).values, torch.sort(b).values)


def test_dirichlet_seeded_reproducible_and_covering(labels):
    cfg = PartitionConfig("dirichlet", 10, dirichlet_alpha=0.5, seed=3)
    parts = all_partition_indices(labels, cfg)
    again = all_partition_indices(labels, cfg)
    assert all(torch.equal(a, b) for a, b in zip(parts, again))
    assert_disjoint_cover(parts, 60000)
    sizes = [len(i) for i in parts]
    assert min(sizes) >= 5 and len(set(sizes)) > 1  # label skew gives unequal sizes
    other = all_partition_indices(
        labels, PartitionConfig("dirichlet", 10, dirichlet_alpha=0.5, seed=4)
    )
    assert not all(torch.equal(a, b) for a, b in zip(parts, other))
    # a single partition equals the same one from the full split
    assert torch.equal(partition_indices(labels, cfg, 7), parts[7])


def test_dirichlet_small_alpha_is_more_skewed(labels):
    def mean_max_class_share(alpha):
        parts = all_partition_indices(
            labels, PartitionConfig("dirichlet", 10, dirichlet_alpha=alpha, seed=0)
        )
        return np.mean(
            [torch.bincount(labels[i], minlength=10).max().item() / len(i) for i in parts]
        )

    assert mean_max_class_share(0.1) > mean_max_class_share(1.0) + 0.2


def test_iid_seeded_equal_sizes_all_classes(labels):
    parts = all_partition_indices(labels, PartitionConfig("iid", 10, seed=0))
    assert_disjoint_cover(parts, 60000)
    assert {len(i) for i in parts} == {6000}
    for idx in parts:
        counts = torch.bincount(labels[idx], minlength=10)
        assert counts.min().item() > 500  # about 600 per class
    other = partition_indices(labels, PartitionConfig("iid", 10, seed=1), 0)
    assert not torch.equal(parts[0], other)


def test_load_partition_cached_and_equal_to_pure_function(labels):
    cfg = PartitionConfig("pathological", 10, 2, seed=0)
    a = load_partition("fashion-mnist", FMNIST_ROOT, cfg, 3)
    assert load_partition("fashion-mnist", str(FMNIST_ROOT), cfg, 3) is a
    assert torch.equal(a, partition_indices(labels, cfg, 3))


@pytest.mark.parametrize(
    ("cfg", "pid", "match"),
    [
        (PartitionConfig("shards", 10), 0, "partitioner='shards'"),
        (PartitionConfig("pathological", 10, classes_per_node=0), 0, "classes-per-node=0"),
        (PartitionConfig("pathological", 10, classes_per_node=11), 0, "classes-per-node=11"),
        (PartitionConfig("dirichlet", 10, dirichlet_alpha=0.0), 0, "dirichlet-alpha=0.0"),
        (PartitionConfig("dirichlet", 10, dirichlet_alpha=-1.0), 0, "dirichlet-alpha=-1.0"),
        (PartitionConfig("dirichlet", 10, dirichlet_alpha=float("nan")), 0, "dirichlet-alpha=nan"),
        (PartitionConfig("iid", 0), 0, "num-partitions=0"),
        (PartitionConfig("iid", 10), 10, "partition-id=10"),
        (PartitionConfig("iid", 10), -1, "partition-id=-1"),
    ],
)
def test_invalid_values_name_key_and_value(labels, cfg, pid, match):
    with pytest.raises(ValueError, match=match):
        partition_indices(labels, cfg, pid)
    with pytest.raises(ValueError, match=match):
        load_partition("fashion-mnist", FMNIST_ROOT, cfg, pid)


@pytest.mark.parametrize(
    "cfg",
    [
        PartitionConfig("pathological", 10, 2, seed=1),
        PartitionConfig("dirichlet", 10, dirichlet_alpha=0.3, seed=2),
        PartitionConfig("iid", 10, seed=3),
    ],
)
def test_fast_index_path_equals_public_load_partition(labels, cfg):
    """partition_indices may read the partitioner's computed assignment directly;
    it must give exactly what the public load_partition API gives."""
    from clients.partitioning import _build_partitioner

    partitioner = _build_partitioner(labels.numpy(), 10, cfg)
    for pid in (0, 9):
        public = partitioner.load_partition(pid)["index"].to_numpy()
        assert torch.equal(partition_indices(labels, cfg, pid), torch.from_numpy(np.array(public)))


def test_an_impossible_dirichlet_split_names_key_value_smallest_partition_and_fix():
    # What every node of such a run raises (its error reply in deployment): 30 nodes,
    # alpha 0.01, 1,000 labels of 10 classes. The Dirichlet partitioner redraws 10
    # times and gives up; the message says why and what to change.
    labels = np.repeat(np.arange(10), 100)
    with pytest.raises(ImpossiblePartitioning) as info:
        partition_indices(labels, PartitionConfig("dirichlet", 30, 2, 0.01, seed=0), 0)
    assert str(info.value) == (
        "dirichlet-alpha=0.01 with num-partitions=30 cannot give every node 5 examples: the "
        "first draw leaves partition 4 with 0 of 1000 (flwr-datasets' DirichletPartitioner "
        "gave up after 10 draws). Raise dirichlet-alpha (dirichlet-alpha=0.2 gives every node "
        "at least 5 at its first draw) or use fewer nodes"
    )
    # The suggested value does work.
    parts = all_partition_indices(labels, PartitionConfig("dirichlet", 30, 2, 0.2, seed=0))
    assert min(len(p) for p in parts) >= 5


def test_a_pathological_split_that_skips_classes_is_a_warning():
    assert partitioning_warnings(PartitionConfig("pathological", 5, 2), 10) == [
        "pathological partitioning with num-partitions=5 and classes-per-node=2 uses only "
        "classes 0..5 of 10"
    ]
    assert partitioning_warnings(PartitionConfig("pathological", 10, 2), 10) == []
    assert partitioning_warnings(PartitionConfig("dirichlet", 5, 2), 10) == []
