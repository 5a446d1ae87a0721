"""D19. FSDP2: explicit prefetching and activation checkpointing (``ddp/fsdp_prefetch.py``).

The claims, on 2 ranks. Explicit forward prefetching moves all-gathers earlier and changes
nothing else: without it each Linear's forward issues one all-gather (its own), with it the
first Linear's forward issues two (its own and the next one's) and the last none: ``[1, 1,
1]`` becomes ``[2, 1, 0]``, as CommDebugMode's module tracker attributes them, and the
recorded order names the layers (each all-gather's size is its layer's): forward 0, gather
0, gather 1, forward 1, gather 2, forward 2 instead of each gather right after its forward
starts; the step's
collectives in all stay 6 all-gathers (3 layers, forward and backward) and 3
reduce-scatters; the parameters after the step are one process's float32 step.

Activation checkpointing trades memory for compute and changes nothing else: fewer elements
are saved for the backward (counted with ``saved_tensors_hooks``), exactly as many as one
process saves with the same layers checkpointed and no FSDP, and fewer than it saves
without; the recompute is seen (the backward runs Linears 1 and 0 forward again, in that
order); the collectives are the same; the step is the un-checkpointed step bit for bit (the
recompute runs the very same kernels on the very same inputs).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._composable import checkpoint

from tutorial_impl.ddp import fsdp_prefetch, toy

pytestmark = pytest.mark.warm_world

WORLD, ROWS = 2, 8
ATOL = 1e-6  # float32 sums in another order
COMMS = {"_allgather_base_": 6, "_reduce_scatter_base_": 3}  # 3 Linears: 2 gathers, 1 scatter


def one_process_step(x, y) -> dict[str, torch.Tensor]:
    model = toy.mlp(0)
    F.mse_loss(model(x), y).backward()
    toy.plain_sgd_step(model)
    return toy.parameters(model)


def one_process_saved(x, y, checkpointed: bool) -> int:
    """Elements autograd saves for one rank's share of the batch, in one process, no FSDP."""
    model = toy.mlp(0)
    for layer in fsdp_prefetch.linears(model)[:-1] if checkpointed else []:
        checkpoint(layer)
    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, id):
        F.mse_loss(model(toy.shard(x, 0, WORLD)), toy.shard(y, 0, WORLD))
    return sum(saved)


def gathered(layer: torch.nn.Linear) -> int:
    """Elements one all-gather of ``layer`` returns: every parameter's rows padded to a
    multiple of the world, as FSDP2 shards them, over all ranks."""
    return WORLD * sum(-(-len(p) // WORLD) * p[0].numel() for p in layer.parameters())


def three_steps(rank: int, size: int, x, y) -> tuple[dict, dict, dict]:
    """The same step three ways in one world: plain, prefetching, checkpointed."""
    return (
        fsdp_prefetch.step(rank, size, x, y),
        fsdp_prefetch.step(rank, size, x, y, prefetch=True),
        fsdp_prefetch.step(rank, size, x, y, checkpointed=True),
    )


def close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=ATOL, rtol=0, msg=name)


@pytest.mark.world_size(WORLD)
def test_prefetching_moves_gathers_and_checkpointing_saves_memory(run_ranks) -> None:
    x, y = toy.batch(ROWS)
    exact = one_process_step(x, y)
    saved_plain, saved_checkpointed = one_process_saved(x, y, False), one_process_saved(x, y, True)
    assert saved_checkpointed < saved_plain  # the reference itself shows the trade
    for rank, (plain, prefetched, checkpointed) in enumerate(run_ranks(three_steps, x, y)):
        # Prefetching: the next Linear's all-gather is issued in this one's forward.
        assert plain["gathers_in_forward"] == [1, 1, 1], rank
        assert prefetched["gathers_in_forward"] == [2, 1, 0], rank
        # Which gather: each Linear's own size, so the order names the layers.
        g = [("gather", gathered(layer)) for layer in fsdp_prefetch.linears(toy.mlp(0))]
        f = [("forward", i) for i in range(3)]
        assert plain["forward_order"] == [f[0], g[0], f[1], g[1], f[2], g[2]], rank
        assert prefetched["forward_order"] == [f[0], g[0], g[1], f[1], g[2], f[2]], rank
        # Checkpointed: the same forward, then the backward runs Linears 1 and 0 again.
        assert checkpointed["forward_order"] == plain["forward_order"] + [f[1], f[0]], rank
        # Checkpointing: less kept for the backward, as one process keeps.
        assert plain["saved"] == prefetched["saved"] == saved_plain, rank
        assert checkpointed["saved"] == saved_checkpointed, rank
        # Neither changes the collectives, nor the step.
        assert plain["comms"] == prefetched["comms"] == checkpointed["comms"] == COMMS, rank
        for seen in (plain, prefetched, checkpointed):
            close(seen["params"], exact)
        for name, tensor in plain["params"].items():
            assert torch.equal(checkpointed["params"][name], tensor), (rank, name)
