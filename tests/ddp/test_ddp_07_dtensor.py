"""D7. DeviceMesh and DTensor on a 2 x 2 mesh of 4 ranks (``tutorial_impl/ddp/dtensor.py``).

The claims: rank ``2i + j`` sits at mesh coordinate ``(i, j)``, its "dp" group is the ranks
that share its ``j`` and its "tp" group those that share its ``i``; ``Shard(d)`` on a mesh
dimension cuts tensor dim ``d`` like ``torch.chunk`` by that coordinate, ``Replicate()``
keeps it whole; the pieces come from rank 0's copy; ``redistribute`` gathers, swaps which
mesh dimension cuts which tensor dimension, and sums ``Partial`` addends over exactly the
mesh dimensions it reduces; a matmul of a row-sharded DTensor stays row-sharded and equals
the plain matmul. Every expectation is cut here from the whole tensor with ``torch.chunk``.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from tutorial_impl.ddp import dtensor

pytestmark = pytest.mark.warm_world


def block(t: torch.Tensor, rows: int | None, cols: int | None) -> torch.Tensor:
    """Chunk ``rows`` of 2 along dim 0 and chunk ``cols`` of 2 along dim 1 (None: whole)."""
    if rows is not None:
        t = t.chunk(2, dim=0)[rows]
    if cols is not None:
        t = t.chunk(2, dim=1)[cols]
    return t


@pytest.mark.world_size(4)
def test_shard_replicate_partial_and_redistribute_on_a_2x2_mesh(run_ranks) -> None:
    whole = torch.arange(32.0).reshape(4, 8)  # rank 0's copy; the others pass other values
    results = run_ranks(dtensor.tour)
    for rank, seen in enumerate(results):
        i, j = divmod(rank, 2)
        where = f"rank {rank} at ({i}, {j})"
        assert seen["coordinate"] == (i, j), where
        assert seen["groups"] == {"dp": [j, 2 + j], "tp": [2 * i, 2 * i + 1]}, where
        # distribute_tensor: the rows by i ("dp"), the columns by j ("tp"), of rank 0's copy.
        assert torch.equal(seen["shard_shard"], block(whole, i, j)), where
        assert torch.equal(seen["shard_replicate"], block(whole, i, None)), where
        assert torch.equal(seen["replicate"], whole), where
        # redistribute: gathered whole; swapped, "dp" now cuts the columns, "tp" the rows.
        assert torch.equal(seen["gathered"], whole), where
        assert torch.equal(seen["swapped"], block(whole, j, i)), where
        # Partial addends rank + 1: over both dims 1 + 2 + 3 + 4; over "dp" only, the two
        # ranks sharing this j, and the result is still Partial over "tp".
        assert torch.equal(seen["sum_all"], torch.full((2, 2), 10.0)), where
        placements, local = seen["sum_dp"]
        assert placements == (Replicate(), Partial()), where
        assert torch.equal(local, torch.full((2, 2), (j + 1.0) + (2 + j + 1.0))), where
        placements, product = seen["matmul"]
        assert placements == (Shard(0), Replicate()), where
        assert torch.equal(product, whole @ torch.ones(8, 3)), where
