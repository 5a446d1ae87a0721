"""D10. Tensor parallelism, then FSDP2 + TP on a 2 x 2 mesh (``ddp/tensor_parallel.py``).

The claims, on 4 ranks: with ``ColwiseParallel`` then ``RowwiseParallel`` each rank holds a
quarter of the first weight's rows (and bias) and a quarter of the second weight's columns,
the last bias whole; forward runs exactly one all-reduce and backward one (the input's
gradient, because the input asked for one); and the output, the input's gradient and the
parameters after one SGD step are one process's. On the 2 x 2 mesh, TP inside each "dp"
row and FSDP2 across them, each rank holds the rows FSDP cut from its TP shard (the
column-wise weight: rows chunk ``j`` of 2, then chunk ``i`` of that; the row-wise weight:
columns chunk ``j``, rows chunk ``i``), and one step on each "dp" half of the batch is one
process's step on the whole batch. The reference is the unsplit model in this process;
the shards are cut here with ``torch.chunk``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

from tutorial_impl.ddp import tensor_parallel, toy

pytestmark = pytest.mark.warm_world

WORLD, ROWS = 4, 8
ATOL = 1e-6  # float32 sums in another order: ~1e-8; one step moves the parameters ~1e-2


def one_process(x: torch.Tensor, y: torch.Tensor) -> dict:
    """The reference: the whole model, the whole batch, one plain SGD step."""
    model = toy.mlp(0, tensor_parallel.SIZES)
    x = x.clone().requires_grad_(True)
    output = model(x)
    F.mse_loss(output, y).backward()
    toy.plain_sgd_step(model)
    return {"output": output.detach(), "x_grad": x.grad, "params": toy.parameters(model)}


def test_tensor_parallel_mlp_equals_one_process(run_ranks) -> None:
    x, y = toy.batch(ROWS, sizes=tensor_parallel.SIZES)
    reference = one_process(x, y)
    start = toy.parameters(toy.mlp(0, tensor_parallel.SIZES))
    assert max((reference["params"][k] - start[k]).abs().max() for k in start) > 1000 * ATOL

    results = run_ranks(tensor_parallel.tensor_parallel_step, x, y, world_size=WORLD)
    for rank, seen in enumerate(results):
        where = f"rank {rank}"
        # What each rank holds: a quarter of the hidden features, whichever way they are cut.
        assert seen["held"] == {
            "0.weight": ((Shard(0),), (32, 8), (8, 8)),  # column-wise: output rows
            "0.bias": ((Shard(0),), (32,), (8,)),
            "2.weight": ((Shard(1),), (4, 32), (4, 8)),  # row-wise: input columns
            "2.bias": ((Replicate(),), (4,), (4,)),  # added once, after the sum
        }, where
        # Which collective joins them: one all-reduce each way, nothing else.
        assert seen["forward"] == {"all_reduce": 1}, where
        assert seen["backward"] == {"all_reduce": 1}, where
        torch.testing.assert_close(seen["output"], reference["output"], atol=ATOL, rtol=0)
        torch.testing.assert_close(seen["x_grad"], reference["x_grad"], atol=ATOL, rtol=0)
        for name, value in reference["params"].items():
            torch.testing.assert_close(seen["params"][name], value, atol=ATOL, rtol=0)


def test_fsdp2_and_tensor_parallel_on_a_2x2_mesh_equal_one_process(run_ranks) -> None:
    x, y = toy.batch(ROWS, sizes=tensor_parallel.SIZES)
    reference = one_process(x, y)["params"]
    start = toy.parameters(toy.mlp(0, tensor_parallel.SIZES))
    results = run_ranks(tensor_parallel.two_d_step, x, y, world_size=WORLD)
    for rank, seen in enumerate(results):
        i, j = divmod(rank, 2)  # ("dp", "tp") coordinate, as in lesson D7
        where = f"rank {rank} at ({i}, {j})"
        # TP cuts first (by j), FSDP cuts what TP left along dim 0 (by i).
        expected = {
            "0.weight": start["0.weight"].chunk(2)[j].chunk(2)[i],
            "0.bias": start["0.bias"].chunk(2)[j].chunk(2)[i],
            "2.weight": start["2.weight"].chunk(2, dim=1)[j].chunk(2)[i],
            "2.bias": start["2.bias"].chunk(2)[i],
        }
        for name, local in expected.items():
            assert torch.equal(seen["local"][name], local), f"{where}, {name}"
            assert seen["held"][name][1:] == (tuple(start[name].shape), tuple(local.shape))
        assert seen["held"]["2.weight"][0] == (Shard(0), Shard(1)), where
        for name, value in reference.items():
            torch.testing.assert_close(seen["params"][name], value, atol=ATOL, rtol=0)
