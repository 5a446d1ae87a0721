"""4.1-4.2 Partitioning the dataset: every rank must be able to compute its share *alone*.

The tutorial's ``DataPartitioner`` shuffles the indices with a fixed seed and cuts them into
fractions (0.7, 0.2, 0.1 in its example; ``1 / size`` each for training), and
``partition_dataset`` gives each rank its part and a batch of ``128 / size``. There is no
communication: each rank builds the same partitioner and ``use``-s its own slice. That only
works if the shuffle is deterministic for a seed and the slices are disjoint (no sample
trained twice per epoch) and cover the data. These tests check exactly that, against an
independent re-derivation with ``random.Random`` and set arithmetic; no rank process starts.

Read in this order: the shuffle, the partitions, reading through a ``Partition``, bad sizes;
then ``partition_dataset`` (batch sizes, steps per epoch) and its clear errors.
"""

from __future__ import annotations

import itertools
from random import Random

import pytest
import torch
from torch.utils.data import TensorDataset

from tutorial_impl.dist_tuto.partition import (
    DataPartitioner,
    Partition,
    batch_sizes,
    partition_dataset,
)

N = 1000


def _partition_sets(partitioner: DataPartitioner) -> list[set[int]]:
    return [set(p) for p in partitioner.partitions]


def test_shuffle_is_the_tutorials_and_deterministic_for_a_seed() -> None:
    """Same seed, same partitions, on every rank; the shuffle is ``Random(seed).shuffle``."""
    a = DataPartitioner(range(N), seed=1234)
    b = DataPartitioner(range(N), seed=1234)
    assert a.partitions == b.partitions
    # Re-derive the tutorial's recipe by hand: shuffle 0..N-1, cut 70% / 20% / 10%.
    expected = list(range(N))
    Random(1234).shuffle(expected)
    assert a.partitions == [expected[:700], expected[700:900], expected[900:]]
    # And the seed matters: another seed gives another split.
    assert DataPartitioner(range(N), seed=4321).partitions != a.partitions


@pytest.mark.parametrize(
    "sizes",
    [(0.7, 0.2, 0.1), (0.5, 0.5), (0.25,) * 4, (1.0,), (0.1,) * 10],
    ids=lambda s: "+".join(map(str, s)) if len(set(s)) > 1 else f"{len(s)}x{s[0]}",
)
def test_partitions_are_disjoint_covering_and_sized_as_requested(
    sizes: tuple[float, ...],
) -> None:
    parts = _partition_sets(DataPartitioner(range(N), sizes))
    # sizes as requested: floor(frac * N), which is exact for these fractions of 1000
    assert [len(p) for p in parts] == [round(f * N) for f in sizes]
    # disjoint: no index in two partitions
    for p, q in itertools.combinations(parts, 2):
        assert not p & q
    # covering: the fractions sum to 1, so together they hold every index exactly once
    assert set().union(*parts) == set(range(N))


def test_sizes_that_do_not_sum_to_one_leave_the_rest_unused() -> None:
    parts = _partition_sets(DataPartitioner(range(N), (0.3, 0.3)))
    assert [len(p) for p in parts] == [300, 300]
    assert not parts[0] & parts[1]


def test_floating_point_fractions_are_not_floored_one_short() -> None:
    """``int(0.29 * 100)`` is 28 (0.29 * 100 == 28.999999999999996); we want 29."""
    assert int(0.29 * 100) == 28  # the pitfall, so this test keeps meaning something
    parts = DataPartitioner(range(100), (0.29, 0.71)).partitions
    assert [len(p) for p in parts] == [29, 71]


def test_partition_reads_through_its_index() -> None:
    data = [f"sample-{i}" for i in range(N)]
    partitioner = DataPartitioner(data, (0.5, 0.5))
    part = partitioner.use(1)
    assert isinstance(part, Partition)
    assert len(part) == 500
    assert [part[i] for i in range(len(part))] == [data[j] for j in partitioner.partitions[1]]


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ((0.5, -0.1), r"sizes\[1\] = -0.1"),
        ((0.7, 0.4), r"sum to 1\.1 > 1"),
        ((float("nan"),), r"sizes\[0\] = nan"),
        ((), r"sizes is empty"),
    ],
    ids=["negative", "sum-above-1", "nan", "empty"],
)
def test_bad_sizes_raise_value_error_naming_the_problem(
    sizes: tuple[float, ...], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        DataPartitioner(range(N), sizes)


def test_use_of_a_partition_that_does_not_exist() -> None:
    with pytest.raises(IndexError, match="partition 3 out of range: 3 exist"):
        DataPartitioner(range(N)).use(3)


# --- partition_dataset: the global batch of 128 over `size` ranks --------------------------


@pytest.mark.parametrize("size", range(1, 9))
def test_global_batch_of_128_splits_into_integer_batches(size: int) -> None:
    bszs = batch_sizes(128, size)
    assert len(bszs) == size
    assert sum(bszs) == 128  # the global batch stays honest, even for 3, 5, 6 or 7 ranks
    assert max(bszs) - min(bszs) <= 1


@pytest.mark.parametrize("size", [2, 3, 4])
def test_partition_dataset_gives_each_rank_its_batch_and_the_same_number_of_steps(
    size: int,
) -> None:
    """Each step, the ranks together see 128 distinct samples; all ranks take equal steps."""
    dataset = TensorDataset(torch.arange(N))
    loaders = [partition_dataset(dataset, 128, rank=r, size=size) for r in range(size)]
    assert [bsz for _, bsz in loaders] == batch_sizes(128, size)
    steps = [[batch[0] for batch in loader] for loader, _ in loaders]
    # Equal step counts: a rank with one batch more would wait in its extra all_reduce until
    # the group's timeout (30 minutes by default), then fail.
    assert len({len(s) for s in steps}) == 1
    assert len(steps[0]) == N // 128
    for step in zip(*steps, strict=True):
        assert [len(b) for b in step] == batch_sizes(128, size)
        assert len(set(torch.cat(step).tolist())) == 128  # no sample twice in a global batch
    seen = [torch.cat(s).tolist() for s in steps]
    for a, b in itertools.combinations(seen, 2):
        assert not set(a) & set(b)  # the ranks' partitions are disjoint


def test_world_size_larger_than_the_dataset_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"world size 4 is larger than the dataset \(3 samples\)"):
        partition_dataset(TensorDataset(torch.arange(3)), rank=0, size=4)


def test_dataset_smaller_than_one_global_batch_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="smaller than one global batch of 128"):
        partition_dataset(TensorDataset(torch.arange(100)), rank=0, size=2)


def test_global_batch_smaller_than_the_world_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="global batch of 2 cannot give each of 4 ranks"):
        partition_dataset(TensorDataset(torch.arange(100)), global_batch=2, rank=0, size=4)


def test_rank_outside_the_world_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="rank 2 is outside a world of size 2"):
        partition_dataset(TensorDataset(torch.arange(N)), rank=2, size=2)
