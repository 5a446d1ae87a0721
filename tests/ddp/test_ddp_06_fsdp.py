"""D6. FSDP2: one sharded step is one process's step (``tutorial_impl/ddp/fsdp.py``).

The claims: after ``fully_shard`` each rank holds, for every parameter, a ``DTensor`` placed
``Shard(0)`` whose local rows are exactly ``torch.chunk(whole, 2)[rank]`` (uneven when the
rows do not divide: the 3-row layer is 2 + 1); inside forward each layer sees its whole,
ordinary parameters; after forward it is sharded again; gradients come back sharded the same
way; and after one optimizer step the gathered parameters are those of one process stepping
on the whole batch, each rank still holding only its rows of them. The reference is that
one process, and the shards are cut here with ``torch.chunk``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

from tutorial_impl.ddp import fsdp, toy

pytestmark = pytest.mark.warm_world

WORLD, ROWS = 2, 16
ATOL = 1e-6  # float32 in another order: ~1e-8; one step moves the parameters ~1e-2


def one_process_step(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    model = toy.mlp(0, fsdp.SIZES)
    F.mse_loss(model(x), y).backward()
    toy.plain_sgd_step(model)
    return toy.parameters(model)


def test_fully_shard_holds_shards_gathers_for_forward_and_steps_like_one_process(
    run_ranks,
) -> None:
    x, y = toy.batch(ROWS, sizes=fsdp.SIZES)
    start = toy.parameters(toy.mlp(0, fsdp.SIZES))
    reference = one_process_step(x, y)
    assert max((reference[k] - start[k]).abs().max().item() for k in start) > 1000 * ATOL

    results = run_ranks(fsdp.one_step, x, y, world_size=WORLD)
    for rank, seen in enumerate(results):
        for name, whole in start.items():
            mine = whole.chunk(WORLD)[rank]  # the rows rank `rank` should hold
            where = f"rank {rank}, {name}"
            # Before: a Shard(0) DTensor of the whole shape, holding this rank's rows.
            for moment in ("before", "after_forward"):
                held = seen[moment][name]
                assert held["type"] == "DTensor", f"{where} {moment}: {held}"
                assert held["placements"] == (Shard(0),), where
                assert held["shape"] == tuple(whole.shape), where
                assert held["local_shape"] == tuple(mine.shape), where
            # During the layer's forward: an ordinary Parameter, whole.
            during = seen["during"][name]
            assert during["type"] == "Parameter" and during["placements"] is None, where
            assert during["local_shape"] == tuple(whole.shape), where
            assert seen["grads"][name] == ("DTensor", (Shard(0),)), where
            # After the step: the whole parameter is one process's, these rows are this
            # rank's share of it.
            diff = (seen["full"][name] - reference[name]).abs().max().item()
            assert diff <= ATOL, f"{where}: {diff:.3g} from the one-process step"
            torch.testing.assert_close(seen["local"][name], reference[name].chunk(WORLD)[rank])
    assert [results[r]["before"]["4.weight"]["local_shape"] for r in range(WORLD)] == [
        (2, 32),
        (1, 32),
    ]  # 3 rows over 2 ranks: torch.chunk's 2 + 1
    total = sum(t.numel() for t in start.values())
    assert sum(t.numel() for r in results for t in r["local"].values()) == total
