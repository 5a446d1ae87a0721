"""D4. ``DistributedSampler``: shards, epochs, padding (``tutorial_impl/ddp/sampler.py``).

The claims: the ranks' shards are disjoint and cover the data; every epoch reshuffles, from
a generator seeded with ``seed + epoch`` (so ``set_epoch`` changes the shards, without it
every epoch repeats the first, and seed 1 at epoch 0 is seed 0 at epoch 1); when the data
does not divide by the world size the sampler pads with repeats, so an epoch's average
counts the repeated samples twice, and ``drop_last=True`` instead leaves samples out. Every
expectation is computed here from the dataset's values and the indices the ranks report: a
set union, a multiset, a numpy mean. Sums of powers of two are exact in float64, so means
compare exactly.

One test, one world: ``every_case`` runs the lesson's ``epoch_shards`` for each case.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from tutorial_impl.ddp import sampler

pytestmark = pytest.mark.warm_world

WORLD = 2
CASES = {
    "even": {"n": 8},  # 8 = 2 x 4: no padding
    "padded": {"n": 7},  # 7 -> 8: one index repeated
    "no_set_epoch": {"n": 8, "set_epoch": False},
    "seed_1": {"n": 8, "seed": 1, "epochs": 1},  # seed + epoch: 1 + 0, as 0 + 1
    "drop_last": {"n": 7, "drop_last": True},  # 7 -> 6: one index dropped
}


def every_case(rank: int, size: int, cases: dict[str, dict]) -> dict[str, list[dict]]:
    return {name: sampler.epoch_shards(rank, size, **kwargs) for name, kwargs in cases.items()}


def values(n: int) -> np.ndarray:
    return 2.0 ** np.arange(n)  # the lesson's dataset, rebuilt independently


def documented_shards(n: int, seed: int, epoch: int) -> list[list[int]]:
    """What the documentation says a rank gets: a permutation of ``n`` drawn from a
    generator seeded with ``seed + epoch``, every ``WORLD``-th index from the rank's own."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    return [order[rank::WORLD] for rank in range(WORLD)]


def test_shards_epochs_and_what_padding_does_to_an_average(run_ranks) -> None:
    results = run_ranks(every_case, CASES, world_size=WORLD)

    def epoch(case: str, e: int) -> tuple[list[list[int]], list[float]]:
        """Every rank's indices and every rank's all-reduced mean, in epoch ``e``."""
        return ([r[case][e]["indices"] for r in results], [r[case][e]["mean"] for r in results])

    # Even: each rank 4 samples, disjoint, together all 8; the mean is the data's mean.
    for e in (0, 1):
        shards, means = epoch("even", e)
        assert [len(s) for s in shards] == [4, 4]
        assert not set(shards[0]) & set(shards[1]), "the shards overlap"
        assert sorted(shards[0] + shards[1]) == list(range(8)), "the shards miss a sample"
        assert means == [values(8).mean()] * WORLD

    # set_epoch: a different shuffle each epoch; without it, epoch 1 repeats epoch 0.
    assert epoch("even", 0)[0] != epoch("even", 1)[0]
    assert {frozenset(s) for s in epoch("even", 0)[0]} != {
        frozenset(s) for s in epoch("even", 1)[0]
    }, "set_epoch must change which samples a rank gets, not only their order"
    assert epoch("no_set_epoch", 0)[0] == epoch("no_set_epoch", 1)[0]
    assert epoch("no_set_epoch", 0)[0] == epoch("even", 0)[0]  # the same seed + epoch 0
    # Each epoch's order is the permutation of seed + epoch: with set_epoch, epoch e's; without
    # it, epoch 0's again; and a sampler of seed 1 starts where seed 0's second epoch is.
    for e in (0, 1):
        assert epoch("even", e)[0] == documented_shards(8, seed=0, epoch=e)
        assert epoch("no_set_epoch", e)[0] == documented_shards(8, seed=0, epoch=0)
    assert epoch("seed_1", 0)[0] == epoch("even", 1)[0]

    # Padded: 7 samples, 2 ranks: 4 each, so one sample is seen twice in the epoch.
    for e in (0, 1):
        shards, means = epoch("padded", e)
        assert [len(s) for s in shards] == [4, 4]
        seen = Counter(shards[0] + shards[1])
        assert sorted(seen) == list(range(7)), "padding must still cover every sample"
        twice = [i for i, count in seen.items() if count == 2]
        assert len(twice) == 1 and sum(seen.values()) == 8
        # The epoch's mean is the mean over the 8 slots, the repeat counted twice...
        counted = values(7)[list(seen.elements())]
        assert means == [counted.mean()] * WORLD
        assert means[0] == (values(7).sum() + values(7)[twice[0]]) / 8
        # ...which is not the data's mean.
        assert means[0] != values(7).mean()

    # drop_last: 3 each, disjoint, and one of the 7 samples is not seen this epoch.
    for e in (0, 1):
        shards, means = epoch("drop_last", e)
        assert [len(s) for s in shards] == [3, 3]
        seen = set(shards[0]) | set(shards[1])
        assert len(seen) == 6 and seen < set(range(7))
        assert means == [values(7)[sorted(seen)].mean()] * WORLD
        assert means[0] != values(7).mean()
