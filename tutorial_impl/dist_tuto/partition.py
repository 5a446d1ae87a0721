"""4.1-4.2 Dataset partitioning: ``Partition``, ``DataPartitioner`` and ``partition_dataset``.

Every rank builds the *same* ``DataPartitioner`` (same data, same seed, so the same shuffle)
and then ``use``-s only its own slice. No communication is needed to agree on who trains on
what, which is the whole trick of the tutorial's data parallelism.

Two things the tutorial leaves implicit are made explicit here:

* **The global batch stays 128.** The tutorial gives each rank ``128 // size`` samples, which
  is 126 for 3 ranks. We split 128 into integer per-rank batches that differ by at most one
  (3 ranks: 43, 43, 42) and give each rank a partition proportional to its batch. Uneven
  batches mean the plain average of the ranks' mean losses would overweight the small batch,
  so ``sgd.run`` scales each rank's loss by ``bsz * size / 128`` (exactly 1.0 when the split
  is even): after ``average_gradients`` every rank holds the gradient of the mean loss over
  all 128 samples, the same as one process training on the whole global batch.
* **Every rank takes the same number of steps.** A rank that ran one batch more than the
  others would wait in its extra ``all_reduce`` until the process group's timeout (30
  minutes by default on gloo), then fail (tests/dist_tuto/test_08_failure.py, with 1.5 s).
  Each rank's partition is cut to ``steps * bsz`` samples, with ``steps`` computed
  identically on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from random import Random
from typing import Any

import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

GLOBAL_BATCH = 128
# Fractions like [0.7, 0.2, 0.1] add up to 0.9999999999999999 in floating point, and others to
# 1.0000000000000002; both mean "all of it".
_SUM_TOLERANCE = 1e-9


class Partition(Dataset):
    """A view of ``data`` restricted to the positions in ``index``."""

    def __init__(self, data: Any, index: Sequence[int]) -> None:
        self.data = data
        self.index = index

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, index: int) -> Any:
        data_idx = self.index[index]
        return self.data[data_idx]


def _check_sizes(sizes: Sequence[float]) -> None:
    if len(sizes) == 0:
        raise ValueError("sizes is empty: give at least one partition fraction")
    for i, frac in enumerate(sizes):
        if not math.isfinite(frac) or frac < 0:
            raise ValueError(f"sizes[{i}] = {frac!r}: partition fractions must be >= 0")
    total = math.fsum(sizes)
    if total > 1 + _SUM_TOLERANCE:
        raise ValueError(f"sizes sum to {total:.6g} > 1: the partitions would need more data")


class DataPartitioner:
    """Shuffle the indices of ``data`` with ``seed`` and cut them into fractions ``sizes``.

    Partition ``i`` holds ``floor(sizes[i] * len(data))`` indices; partitions are disjoint,
    and cover the data exactly when the fractions sum to 1 and divide its length.
    """

    def __init__(
        self, data: Any, sizes: Sequence[float] = (0.7, 0.2, 0.1), seed: int = 1234
    ) -> None:
        _check_sizes(sizes)
        self.data = data
        self.partitions: list[list[int]] = []
        rng = Random()
        rng.seed(seed)
        data_len = len(data)
        indexes = [x for x in range(0, data_len)]
        rng.shuffle(indexes)

        for frac in sizes:
            # The tutorial's int(frac * data_len), but robust to 0.29 * 100 == 28.999999999999996.
            part_len = math.floor(frac * data_len + _SUM_TOLERANCE)
            self.partitions.append(indexes[0:part_len])
            indexes = indexes[part_len:]

    def use(self, partition: int) -> Partition:
        if not 0 <= partition < len(self.partitions):
            raise IndexError(f"partition {partition} out of range: {len(self.partitions)} exist")
        return Partition(self.data, self.partitions[partition])


def batch_sizes(global_batch: int, size: int) -> list[int]:
    """Split ``global_batch`` into ``size`` integer batches that differ by at most one."""
    if size < 1:
        raise ValueError(f"world size must be at least 1, got {size}")
    if global_batch < size:
        raise ValueError(
            f"a global batch of {global_batch} cannot give each of {size} ranks a sample"
        )
    base, extra = divmod(global_batch, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def partition_dataset(
    dataset: Any,
    global_batch: int = GLOBAL_BATCH,
    rank: int | None = None,
    size: int | None = None,
    seed: int = 1234,
    shuffle: bool = True,
) -> tuple[DataLoader, int]:
    """This rank's ``DataLoader`` over its partition of ``dataset``, and its batch size.

    ``rank`` and ``size`` default to the current process group's, as in the tutorial. Every
    rank's loader yields the same number of full batches (see the module docstring).
    """
    size = dist.get_world_size() if size is None else size
    rank = dist.get_rank() if rank is None else rank
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside a world of size {size}")
    data_len = len(dataset)
    if size > data_len:
        raise ValueError(
            f"world size {size} is larger than the dataset ({data_len} samples): "
            "every rank needs at least one sample"
        )
    bszs = batch_sizes(global_batch, size)
    partitioner = DataPartitioner(dataset, [b / global_batch for b in bszs], seed)
    steps = min(len(part) // b for part, b in zip(partitioner.partitions, bszs, strict=True))
    if steps == 0:
        raise ValueError(
            f"the dataset ({data_len} samples) is smaller than one global batch of "
            f"{global_batch}; use more data or a smaller global batch"
        )
    bsz = bszs[rank]
    partition = Partition(dataset, partitioner.partitions[rank][: steps * bsz])
    train_set = DataLoader(partition, batch_size=bsz, shuffle=shuffle)
    return train_set, bsz
