"""``examples-per-node``: each node keeps a seeded subset of its partition."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from clients.partitioning import PartitionConfig, all_partition_indices, capped, partition_indices


def test_capped_keeps_a_seeded_sorted_subset_of_the_partition():
    index = torch.arange(100, 200)
    kept = capped(index, 10, seed=1, partition_id=3)
    assert len(kept) == 10
    assert set(kept.tolist()) <= set(index.tolist())
    assert kept.tolist() == sorted(kept.tolist())
    assert torch.equal(kept, capped(index, 10, seed=1, partition_id=3))  # reproducible
    assert not torch.equal(kept, capped(index, 10, seed=1, partition_id=4))  # per node
    assert torch.equal(capped(index, 0, seed=1, partition_id=3), index)  # 0: all
    assert torch.equal(capped(index, 500, seed=1, partition_id=3), index)  # fewer than the cap


def test_every_partition_is_capped_alike_by_each_path():
    labels = np.repeat(np.arange(10), 100)  # 1000 examples, 100 per class
    config = PartitionConfig(partitioner="iid", num_partitions=4, seed=2, examples_per_node=30)
    every = all_partition_indices(labels, config, num_classes=10)
    assert [len(i) for i in every] == [30, 30, 30, 30]
    for p in range(4):
        assert torch.equal(every[p], partition_indices(labels, config, p, num_classes=10))


def test_a_negative_cap_is_refused_naming_it():
    with pytest.raises(ValueError, match="Invalid examples-per-node=-1: expected an integer >= 0"):
        PartitionConfig(examples_per_node=-1).validate(10)
