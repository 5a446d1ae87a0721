"""The hybrid model's pieces, without RPC: the tutorial's batches and the split table's lookup.

What the tutorial claims: a batch is 20 to 50 random rows of the 100-row table, cut into bags
that start every 1 to 10 indices, each bag with one of 8 labels; the table answers a bag with
the sum of its rows (``EmbeddingBag(mode="sum")``). The benchmark puts one such table on each
parameter server and sets the two ranges with ``--batch-indices`` and ``--bag-size``.

What this module proves, in reading order: the batches have exactly that shape (and the
learnable variant's labels can be read off its rows); a table split over servers, by rows as
in the tutorial or by columns as in the benchmark, looks up what the whole table would. The
shards here are local stand-ins, so every check runs in this process; the real ``RemoteModule``
shards are exercised by ``test_hybrid_parity.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tutorial_impl.rpc.hybrid_data import get_learnable_batch, get_next_batch, trainer_generator
from tutorial_impl.rpc.hybrid_model import RemoteEmbeddingBag, shard_bounds

TOL = {"rtol": 1e-5, "atol": 1e-6}
SEED = 1234


def test_the_tutorials_batches_have_the_tutorials_shape():
    """Checked on 200 batches against the tutorial's loop (``while start < num_indices:
    offsets.append(start); start += randint(1, 10)``): bags start at 0, every bag but the
    last holds 1 to 10 indices, the last one too, and there is one label in [0, 8) a bag."""
    sizes_seen = set()
    for indices, offsets, target in get_next_batch(trainer_generator(SEED, 0), 200):
        assert 20 <= len(indices) <= 50
        assert int(indices.min()) >= 0 and int(indices.max()) < 100
        bags = torch.cat([offsets, torch.tensor([len(indices)])]).diff()
        assert offsets[0] == 0 and bool(((bags >= 1) & (bags <= 10)).all())
        assert len(target) == len(offsets) and 0 <= int(target.min()) <= int(target.max()) < 8
        sizes_seen.update(bags[:-1].tolist())
    assert sizes_seen == set(range(1, 11))  # a range, not a constant


def test_a_learnable_batch_holds_the_rows_of_its_label():
    """Rows 0-11 belong to class 0, 12-23 to class 1, ... (100 // 8 = 12 rows a class)."""
    for indices, offsets, target in get_learnable_batch(trainer_generator(SEED, 0), 20):
        bag_of_index = torch.bucketize(torch.arange(len(indices)), offsets, right=True) - 1
        assert torch.equal(indices // 12, target[bag_of_index])


class LocalShard(nn.Module):
    """A stand-in for ``RemoteModule(EmbeddingBag)``: answers ``forward_async`` here, at once."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag.from_pretrained(weight, mode="sum")

    def forward_async(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(self.bag(indices, offsets))
        return future


@pytest.mark.parametrize("servers", [1, 2, 3, 7])
@pytest.mark.parametrize("split", ["rows", "columns"])
def test_a_split_table_looks_up_what_the_whole_table_would(split, servers):
    """The lookup of ``RemoteEmbeddingBag``, without RPC: split by rows (the tutorial's
    table over P servers), each shard sees only its rows, renumbered, and the same bags, and
    the partial sums add up; split by columns (the benchmark's table per server), every
    shard sees the whole batch and the answers stand side by side. Either way: the lookup
    of the whole table. The bags include one with a single row and rows at both ends of the
    table, so some row shards see empty bags (which must contribute zeros)."""
    table = torch.randn(100, 14, generator=torch.Generator().manual_seed(SEED))
    indices = torch.tensor([0, 99, 5, 50, 50, 33, 34, 66, 67, 12])
    offsets = torch.tensor([0, 2, 3, 6, 9])  # bags: [0, 99] [5] [50, 50, 33] [34, 66, 67] [12]
    whole = F.embedding_bag(indices, table, offsets, mode="sum")

    bounds = shard_bounds(table.shape[0 if split == "rows" else 1], servers)
    sizes = [end - start for start, end in bounds]
    assert bounds[0][0] == 0 and bounds[-1][1] in table.shape and max(sizes) - min(sizes) <= 1
    parts = [table[s:e] if split == "rows" else table[:, s:e] for s, e in bounds]
    split_table = RemoteEmbeddingBag([LocalShard(p) for p in parts], bounds, split, 100)
    torch.testing.assert_close(split_table(indices, offsets), whole, **TOL)
