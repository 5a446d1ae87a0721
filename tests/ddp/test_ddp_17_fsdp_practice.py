"""D17. FSDP2 in practice: bf16 mixed precision, HSDP on a 2 x 2 mesh (``ddp/fsdp_practice.py``).

The claims, on 4 ranks. Mixed precision (``param_dtype=bfloat16, reduce_dtype=float32``):
the first layer computes with a bfloat16 weight while the sharded master copy stays
float32; the gradient lands float32 and sharded; and the step is a bfloat16 step: off the
float32 step, relative to that step's size, by more than 2^-10 and less than 2^-3 (the
first layer's the most: 6% measured), tensor by tensor within a factor of 2 of what this
process's replay gives (each rank's quarter of the batch through a bfloat16 copy of the
model, the four gradients made float32 and averaged). Not the replay bit for bit: bfloat16
kernels may round differently (measured: up to 1.4e-4 apart, as much as bfloat16 moves some
tensors).

HSDP (``("replicate", "shard")``): each parameter is ``(Replicate(), Shard(0))``, rank
``(i, j)`` holds rows chunk ``j`` of 2, the same rows as ``(1 - i, j)``; per step each
layer is all-gathered twice (forward, backward) and reduce-scattered once inside a row, and
its shard all-reduced once across rows; the step is one process's float32 step on the whole
batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

from tutorial_impl.ddp import fsdp_practice, toy

pytestmark = pytest.mark.warm_world

WORLD, ROWS = 4, 16
ATOL = 1e-6  # float32 sums in another order
LAYERS = sum(isinstance(m, torch.nn.Linear) for m in toy.mlp(0))


def float32_step(x, y) -> dict[str, torch.Tensor]:
    model = toy.mlp(0)
    F.mse_loss(model(x), y).backward()
    toy.plain_sgd_step(model)
    return toy.parameters(model)


def bfloat16_replay(x, y) -> dict[str, torch.Tensor]:
    """What bf16 compute with float32 reduction should give: per rank, a bfloat16 copy on
    its quarter of the batch (the input cast too); the gradients as float32, averaged;
    the float32 parameters stepped with the average."""
    master = toy.mlp(0)
    grads = {name: torch.zeros_like(p) for name, p in master.named_parameters()}
    for rank in range(WORLD):
        copy = toy.mlp(0).to(torch.bfloat16)
        xs, ys = toy.shard(x, rank, WORLD), toy.shard(y, rank, WORLD)
        F.mse_loss(copy(xs.to(torch.bfloat16)), ys).backward()
        for name, p in copy.named_parameters():
            grads[name] += p.grad.float() / WORLD
    with torch.no_grad():
        for name, p in master.named_parameters():
            p -= toy.LR * grads[name]
    return toy.parameters(master)


def close(a: dict, b: dict, atol: float = ATOL) -> None:
    assert a.keys() == b.keys()
    for name in a:
        diff = (a[name] - b[name]).abs().max().item()
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=f"{name}: {diff}")


def relative_update_error(got: dict, exact: dict, start: dict) -> dict[str, float]:
    """Per tensor, how far the step taken is from the float32 step, relative to that step's
    size, in norm: |got - exact| / |exact - start|."""
    return {k: ((got[k] - exact[k]).norm() / (exact[k] - start[k]).norm()).item() for k in exact}


def test_bf16_compute_with_float32_reduction(run_ranks) -> None:
    x, y = toy.batch(ROWS)
    replay, exact = bfloat16_replay(x, y), float32_step(x, y)
    start = toy.parameters(toy.mlp(0))
    expected = relative_update_error(replay, exact, start)
    for rank, seen in enumerate(run_ranks(fsdp_practice.mixed_precision_step, x, y)):
        assert seen["computed_in"] == [torch.bfloat16], rank
        assert seen["param_dtype"] == torch.float32, rank
        assert seen["grad"] == (torch.float32, (Shard(0),)), rank
        # A bfloat16 step: off the float32 one by what the replay predicts, tensor by tensor.
        got = relative_update_error(seen["params"], exact, start)
        for name, error in got.items():
            assert 2**-10 < error < 2**-3, f"rank {rank}, {name}: {error:.3g}"
            assert 0.5 < error / expected[name] < 2, f"rank {rank}, {name}: {got} {expected}"


@pytest.mark.world_size(WORLD)
def test_hsdp_shards_within_a_row_and_replicates_across(run_ranks) -> None:
    x, y = toy.batch(ROWS)
    exact = float32_step(x, y)
    results = run_ranks(fsdp_practice.hsdp_step, x, y)
    for rank, seen in enumerate(results):
        i, j = divmod(rank, 2)  # ("replicate", "shard")
        assert seen["placements"] == (Replicate(), Shard(0)), rank
        assert torch.equal(seen["local"]["0.weight"], results[(1 - i) * 2 + j]["local"]["0.weight"])
        torch.testing.assert_close(
            seen["local"]["0.weight"], exact["0.weight"].chunk(2)[j], atol=ATOL, rtol=0
        )
        assert seen["comms"] == {
            "_allgather_base_": 2 * LAYERS,  # forward and backward, in the row
            "_reduce_scatter_base_": LAYERS,  # the gradients, in the row
            "allreduce_": LAYERS,  # the gradients' shards, across rows: DDP's part
        }, rank
        close(seen["params"], exact)
