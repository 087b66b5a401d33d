"""Split a training set into per-node partitions with flwr-datasets partitioners.

The labels are wrapped in a :class:`datasets.Dataset` with two columns, ``"label"``
and ``"index"`` (the row number in the full training set); a flwr-datasets
partitioner splits it and we keep the ``"index"`` column of the requested partition.
The images never enter the ``datasets`` world.

Partitioners (run config key ``partitioner``):

- ``"iid"``: :class:`~flwr_datasets.partitioner.IidPartitioner` over the rows
  shuffled with ``seed``; every partition gets ``N // num_partitions`` rows
  (the first ``N % num_partitions`` partitions get one more).
- ``"pathological"``: :class:`~flwr_datasets.partitioner.PathologicalPartitioner`
  with ``num_classes_per_partition = classes-per-node`` and
  ``class_assignment_mode="deterministic"``: partition ``p`` holds exactly the classes
  ``(p + i) % num_classes, i = 0..k-1``, and each class is split evenly among the
  partitions holding it. With Fashion-MNIST this gives every node exactly ``k``
  classes and equal sizes whenever ``num_partitions`` is a multiple of 10 (10 nodes,
  k=2: 6,000 images each; 100 nodes: 600 each). ("first-deterministic" also gives
  ``k`` classes but draws the other classes at random, so sizes vary from 3,500 to
  9,000 at 10 nodes.) Caveat: only the first ``num_partitions + k - 1`` classes are
  used when that is below ``num_classes`` (5 nodes, k=2: classes 0..5); a warning is
  logged then. The seed only shuffles the order of the rows inside a partition.
- ``"dirichlet"``: :class:`~flwr_datasets.partitioner.DirichletPartitioner` with
  ``alpha = dirichlet-alpha``, ``partition_by="label"``, ``min_partition_size``
  :data:`DIRICHLET_MIN_PARTITION_SIZE` (it resamples until every node has at least that
  many rows, up to 10 times), seeded. When it gives up, :class:`ImpossiblePartitioning`
  says so with the smallest partition of its first draw and the smallest
  ``dirichlet-alpha`` (of 2, 5, 10, 20, 50, 100 times the value) that works.

The partitioning is a pure function of (labels, :class:`PartitionConfig`): the same
config gives the same partitions in every process, so the ServerApp checks, before
any message, what every node will compute (:func:`check_partitioning`).
"""

from __future__ import annotations

import logging
import math
import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from cachetools.func import lru_cache

from clients.datasets import load_dataset
from flwr_gsgm.simulation.virtual_clock import derive_seed

__all__ = [
    "DIRICHLET_MIN_PARTITION_SIZE",
    "PARTITIONERS",
    "ImpossiblePartitioning",
    "PartitionConfig",
    "all_partition_indices",
    "check_partitioning",
    "load_partition",
    "partition_indices",
    "partitioning_warnings",
]

logger = logging.getLogger(__name__)

PARTITIONERS = ("iid", "pathological", "dirichlet")
DIRICHLET_MIN_PARTITION_SIZE = 5


class ImpossiblePartitioning(ValueError):
    """The run config asks for a split the partitioner cannot make.

    The message names the run config key and value, the smallest partition and
    what to change.
    """


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclass(frozen=True)
class PartitionConfig:
    """How to split a training set; hashable, so it can key caches.

    Attributes (run config key in brackets)
    ----------------------------------------
    partitioner : str
        One of :data:`PARTITIONERS` [``partitioner``].
    num_partitions : int
        Number of nodes, >= 1 [``num-partitions``, from the node config].
    classes_per_node : int
        Classes per partition for ``"pathological"``, in ``1..num_classes``
        [``classes-per-node``].
    dirichlet_alpha : float
        Dirichlet concentration for ``"dirichlet"``, > 0 [``dirichlet-alpha``].
    seed : int
        Partitioning seed [``seed``].
    examples_per_node : int
        At most this many training examples per node, a seeded random subset of its
        partition (0: the whole partition) [``examples-per-node``]: a smaller epoch for
        sweeps that must fit a session, with each node's label mix unchanged in
        expectation.
    """

    partitioner: str = "pathological"
    num_partitions: int = 10
    classes_per_node: int = 2
    dirichlet_alpha: float = 0.5
    seed: int = 0
    examples_per_node: int = 0

    def validate(self, num_classes: int, num_examples: int | None = None) -> None:
        """Check every field.

        Parameters
        ----------
        num_classes : int
            Number of classes of the dataset (upper bound of ``classes_per_node``).
        num_examples : int, optional
            Size of the training set (upper bound of ``num_partitions``).

        Raises
        ------
        ValueError
            Naming the run config key and the offending value.
        """
        if self.partitioner not in PARTITIONERS:
            raise ValueError(
                f"Invalid partitioner={self.partitioner!r}: expected one of {PARTITIONERS}"
            )
        if not _is_int(self.num_partitions) or self.num_partitions < 1:
            raise ValueError(
                f"Invalid num-partitions={self.num_partitions!r}: expected an integer >= 1"
            )
        if num_examples is not None and self.num_partitions > num_examples:
            raise ValueError(
                f"Invalid num-partitions={self.num_partitions}: more partitions than "
                f"the {num_examples} training examples"
            )
        if not _is_int(self.classes_per_node) or not 1 <= self.classes_per_node <= num_classes:
            raise ValueError(
                f"Invalid classes-per-node={self.classes_per_node!r}: expected an "
                f"integer in 1..{num_classes}"
            )
        alpha = self.dirichlet_alpha
        if (
            isinstance(alpha, bool)
            or not isinstance(alpha, (int, float, np.floating, np.integer))
            or not math.isfinite(alpha)
            or alpha <= 0
        ):
            raise ValueError(f"Invalid dirichlet-alpha={alpha!r}: expected a finite number > 0")
        if not _is_int(self.seed):
            raise ValueError(f"Invalid seed={self.seed!r}: expected an integer")
        if not _is_int(self.examples_per_node) or self.examples_per_node < 0:
            raise ValueError(
                f"Invalid examples-per-node={self.examples_per_node!r}: expected an integer "
                ">= 0 (0 = the whole partition)"
            )


def _check_partition_id(partition_id: object, num_partitions: int) -> None:
    if not _is_int(partition_id) or not 0 <= partition_id < num_partitions:
        raise ValueError(
            f"Invalid partition-id={partition_id!r}: expected an integer in "
            f"[0, {num_partitions}) (num-partitions={num_partitions})"
        )


def _build_partitioner(
    labels: np.ndarray, num_classes: int, config: PartitionConfig, assign: bool = True
):
    """Return a flwr-datasets partitioner with its dataset attached (and, with
    ``assign``, its rows assigned: raises :class:`ImpossiblePartitioning`)."""
    # Imported here: `datasets` is heavy and only needed when partitioning.
    import datasets
    from flwr_datasets.partitioner import (
        DirichletPartitioner,
        IidPartitioner,
        PathologicalPartitioner,
    )

    index = np.arange(len(labels), dtype=np.int64)
    if config.partitioner == "iid":
        index = np.random.default_rng(config.seed).permutation(index)
    # "arrow" format: column reads are zero-copy (the partitioners read the whole
    # label column with np.asarray, which is ~50x slower with the python format).
    table = datasets.Dataset.from_dict({"label": labels[index], "index": index}).with_format(
        "arrow"
    )

    if config.partitioner == "iid":
        partitioner = IidPartitioner(num_partitions=config.num_partitions)
    elif config.partitioner == "pathological":
        partitioner = PathologicalPartitioner(
            num_partitions=config.num_partitions,
            partition_by="label",
            num_classes_per_partition=config.classes_per_node,
            class_assignment_mode="deterministic",
            shuffle=True,
            seed=config.seed,
        )
        for warning in partitioning_warnings(config, num_classes):
            logger.warning("%s", warning)
    else:
        partitioner = DirichletPartitioner(
            num_partitions=config.num_partitions,
            partition_by="label",
            alpha=float(config.dirichlet_alpha),
            min_partition_size=DIRICHLET_MIN_PARTITION_SIZE,
            self_balancing=False,
            shuffle=True,
            seed=config.seed,
        )
    partitioner.dataset = table
    if assign:
        _assign(partitioner, labels, num_classes, config)
    return partitioner


def partitioning_warnings(config: PartitionConfig, num_classes: int) -> list[str]:
    """What is legal but probably not meant in ``config`` (a list of sentences).

    Pathological partitioning with ``num_partitions + classes_per_node - 1`` below
    the number of classes uses only the first classes (5 nodes, k=2: classes 0..5).
    """
    used = config.num_partitions + config.classes_per_node - 1
    if config.partitioner == "pathological" and used < num_classes:
        return [
            f"pathological partitioning with num-partitions={config.num_partitions} and "
            f"classes-per-node={config.classes_per_node} uses only classes 0..{used - 1} "
            f"of {num_classes}"
        ]
    return []


def _assign(partitioner, labels: np.ndarray, num_classes: int, config: PartitionConfig):
    """Run the partitioner's row assignment (lazy in flwr-datasets); return it.

    Raises
    ------
    ImpossiblePartitioning
        The Dirichlet partitioner gave up, or a partition is empty.
    """
    with warnings.catch_warnings():
        # PathologicalPartitioner's "classes will NOT be used" warning points to a
        # constructor option that does not exist; we log our own (see above). The
        # Dirichlet partitioner warns at every redraw: its failure is ours to report.
        warnings.filterwarnings("ignore", message=r"Classes: .* will NOT be used")
        warnings.filterwarnings("ignore", message=r"The specified min_partition_size")
        try:
            _ = partitioner.num_partitions  # public; triggers the lazy assignment
        except ValueError as err:
            if config.partitioner != "dirichlet":
                raise
            raise ImpossiblePartitioning(_dirichlet_failure(labels, num_classes, config)) from err
    mapping = getattr(partitioner, "_partition_id_to_indices", None)
    if isinstance(mapping, dict) and mapping:
        sizes = {p: len(rows) for p, rows in mapping.items()}
        smallest = min(sizes, key=lambda p: (sizes[p], p))
        if sizes[smallest] == 0:
            raise ImpossiblePartitioning(
                f"partitioner={config.partitioner} with num-partitions={config.num_partitions} "
                f"leaves partition {smallest} with 0 examples: use fewer nodes"
                + (" or more classes-per-node" if config.partitioner == "pathological" else "")
            )
    return mapping


def _dirichlet_sizes(labels: np.ndarray, num_classes: int, config: PartitionConfig, alpha: float):
    """Partition sizes of the first Dirichlet draw (the partitioner's own, same seed)."""
    from flwr_datasets.partitioner import DirichletPartitioner

    first = DirichletPartitioner(
        num_partitions=config.num_partitions,
        partition_by="label",
        alpha=float(alpha),
        min_partition_size=0,  # one draw, kept whatever its sizes
        self_balancing=False,
        shuffle=True,
        seed=config.seed,
    )
    first.dataset = _build_partitioner(labels, num_classes, config, assign=False).dataset
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"The specified min_partition_size")
        _ = first.num_partitions
    return [len(rows) for rows in first._partition_id_to_indices.values()]


def _dirichlet_failure(labels: np.ndarray, num_classes: int, config: PartitionConfig) -> str:
    """The message of a Dirichlet split that gave up: smallest partition, what to change."""
    alpha, n = float(config.dirichlet_alpha), config.num_partitions
    sizes = _dirichlet_sizes(labels, num_classes, config, alpha)
    smallest = min(range(len(sizes)), key=lambda p: (sizes[p], p))
    works = next(
        (
            alpha * f
            for f in (2, 5, 10, 20, 50, 100)
            if min(_dirichlet_sizes(labels, num_classes, config, alpha * f))
            >= DIRICHLET_MIN_PARTITION_SIZE
        ),
        None,
    )
    hint = (
        f" (dirichlet-alpha={works:g} gives every node at least "
        f"{DIRICHLET_MIN_PARTITION_SIZE} at its first draw)"
        if works is not None
        else ""
    )
    return (
        f"dirichlet-alpha={alpha:g} with num-partitions={n} cannot give every node "
        f"{DIRICHLET_MIN_PARTITION_SIZE} examples: the first draw leaves partition {smallest} "
        f"with {sizes[smallest]} of {len(labels)} (flwr-datasets' DirichletPartitioner gave "
        f"up after 10 draws). Raise dirichlet-alpha{hint} or use fewer nodes"
    )


def check_partitioning(dataset: str, root: str | os.PathLike[str], config: PartitionConfig):
    """Compute the split every node of ``config`` will compute; return its warnings.

    The ServerApp calls it before any message. The partitioner stays cached (an
    in-process ClientApp then reuses it).

    Returns
    -------
    list[str]
        :func:`partitioning_warnings` of the config.

    Raises
    ------
    ValueError
        An invalid config (naming the key); :class:`ImpossiblePartitioning` if the
        split cannot be made (naming the key, the value, the smallest partition and
        what to change).
    FileNotFoundError
        Dataset files missing.
    """
    train, _ = load_dataset(dataset, root)
    config.validate(train.num_classes, len(train))
    _cached_partitioner(dataset, os.fspath(root), config)
    return partitioning_warnings(config, train.num_classes)


def _load_index(partitioner, partition_id: int) -> torch.Tensor:
    """The ``"index"`` column of one partition as an int64 tensor.

    Equivalent to ``partitioner.load_partition(partition_id)["index"]``. That call
    runs ``Dataset.select(list_of_rows)``, whose fingerprinting pickles the row list
    element by element (about 0.4 s per 6,000 rows for PathologicalPartitioner). When
    the partitioner exposes its computed row assignment (flwr-datasets 0.6:
    ``_partition_id_to_indices``, filled by the public ``num_partitions`` property)
    we index the column with it directly; otherwise we fall back to
    ``load_partition``. ``tests/clients`` checks that both paths agree.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Classes: .* will NOT be used")
        _ = partitioner.num_partitions  # assigned by _build_partitioner already
        mapping = getattr(partitioner, "_partition_id_to_indices", None)
        if (
            getattr(partitioner, "_partition_id_to_indices_determined", False) is True
            and isinstance(mapping, dict)
            and partition_id in mapping
        ):
            rows = np.asarray(mapping[partition_id], dtype=np.int64)
            column = partitioner.dataset["index"].to_numpy()[rows]
        else:
            column = partitioner.load_partition(partition_id)["index"].to_numpy()
    return torch.from_numpy(np.array(column, dtype=np.int64, copy=True))


def partition_indices(
    labels: torch.Tensor | np.ndarray,
    config: PartitionConfig,
    partition_id: int,
    *,
    num_classes: int | None = None,
) -> torch.Tensor:
    """Return the row indices of partition ``partition_id`` of a training set.

    Parameters
    ----------
    labels : torch.Tensor or np.ndarray
        Integer class labels ``[N]`` of the whole training set.
    config : PartitionConfig
        Partitioner, number of partitions, its parameters and seed.
    partition_id : int
        Which partition, in ``[0, config.num_partitions)``.
    num_classes : int, optional
        Number of classes; default ``labels.max() + 1``.

    Returns
    -------
    torch.Tensor
        ``torch.int64`` ``[M]``, distinct indices into ``labels`` (order: the
        partitioner's shuffled order, fixed by the seed).

    Raises
    ------
    ValueError
        Invalid config or partition id (the message names the key and value), or a
        Dirichlet split that cannot give every node ``DIRICHLET_MIN_PARTITION_SIZE``
        rows.
    """
    labels_np = np.asarray(labels, dtype=np.int64)
    if num_classes is None:
        num_classes = int(labels_np.max()) + 1 if len(labels_np) else 1
    config.validate(num_classes, len(labels_np))
    _check_partition_id(partition_id, config.num_partitions)
    index = _load_index(_build_partitioner(labels_np, num_classes, config), partition_id)
    return capped(index, config.examples_per_node, config.seed, partition_id)


def all_partition_indices(
    labels: torch.Tensor | np.ndarray,
    config: PartitionConfig,
    *,
    num_classes: int | None = None,
) -> list[torch.Tensor]:
    """Return the indices of every partition (one partitioner run).

    Same as ``[partition_indices(labels, config, p) for p in range(P)]`` but builds
    the partitioner once. Returns a list of ``config.num_partitions`` int64 tensors.

    Raises
    ------
    ValueError
        As :func:`partition_indices`.
    """
    labels_np = np.asarray(labels, dtype=np.int64)
    if num_classes is None:
        num_classes = int(labels_np.max()) + 1 if len(labels_np) else 1
    config.validate(num_classes, len(labels_np))
    partitioner = _build_partitioner(labels_np, num_classes, config)
    return [
        capped(_load_index(partitioner, p), config.examples_per_node, config.seed, p)
        for p in range(config.num_partitions)
    ]


@lru_cache(maxsize=8)
def _cached_partitioner(dataset: str, root: str, config: PartitionConfig):
    train, _ = load_dataset(dataset, root)
    partitioner = _build_partitioner(train.labels.numpy(), train.num_classes, config)
    # The row assignment is computed lazily on first use; do it here, once, so the
    # threads that share this cached partitioner only ever read it.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Classes: .* will NOT be used")
        _ = partitioner.num_partitions
    return partitioner


@lru_cache(maxsize=1024)
def _cached_index(
    dataset: str, root: str, config: PartitionConfig, partition_id: int
) -> torch.Tensor:
    index = _load_index(_cached_partitioner(dataset, root, config), partition_id)
    return capped(index, config.examples_per_node, config.seed, partition_id)


def capped(index: torch.Tensor, cap: int, seed: int, partition_id: int) -> torch.Tensor:
    """``index`` itself if ``cap`` is 0 or ``index`` has at most ``cap`` rows, else a
    random subset of ``cap`` of its rows (a permutation seeded by ``(seed,
    partition_id)``), in ascending order."""
    if not cap or len(index) <= cap:
        return index
    generator = torch.Generator().manual_seed(derive_seed(seed, 0xCA9, partition_id, bits=63))
    keep = torch.randperm(len(index), generator=generator)[:cap]
    return torch.sort(index[keep]).values


def load_partition(
    dataset: str,
    root: str | os.PathLike[str],
    config: PartitionConfig,
    partition_id: int,
) -> torch.Tensor:
    """Row indices of one node's partition of the training set of ``dataset``.

    Like :func:`partition_indices` on ``load_dataset(dataset, root)[0].labels``, but
    cached per process: the partitioner is built once per (dataset, root, config)
    and each partition's index once. Treat the returned tensor as read-only.

    Returns
    -------
    torch.Tensor
        ``torch.int64`` ``[M]`` indices into the training set.

    Raises
    ------
    ValueError
        Invalid config or partition id; see :func:`partition_indices`.
    FileNotFoundError
        Dataset files missing; see :func:`clients.datasets.load_dataset`.
    """
    train, _ = load_dataset(dataset, root)
    config.validate(train.num_classes, len(train))
    _check_partition_id(partition_id, config.num_partitions)
    return _cached_index(dataset, os.fspath(root), config, int(partition_id))
