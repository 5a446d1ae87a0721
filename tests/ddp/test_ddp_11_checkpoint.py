"""D11. Distributed checkpointing: saved at world 4, loaded at 2 and at 1 (``ddp/checkpoint.py``).

The claims: four FSDP2 ranks save a model and its optimizer after one step of SGD with
momentum, each rank its own rows (``.metadata`` lists four chunks of 8 rows for a 32-row
weight, and for its momentum buffer); two ranks load it, each now holding 16 rows, with the
parameters and momentum buffers of that step; one process with no process group loads it
into an unsharded model the same way; and the second step taken from either is the second
step of one process training on the whole batch, which it would not be without the momentum
buffers. ``async_save`` returns before its files are written (shown on 2 ranks by starting
rank 1's save only once rank 0's has returned: rank 0's writer needs rank 1's save plan
before anyone writes, so on return there is no file yet, and both are there after
``result()``), the ranks take another step at once, and the checkpoint still holds the
first step's values.

The reference is SGD with momentum written out below, on the unsplit model, in this process.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict

from tutorial_impl.ddp import checkpoint, toy

pytestmark = pytest.mark.warm_world

ROWS = 16
ATOL = 1e-6  # float32 sums in another order: ~1e-8; a step moves the parameters ~1e-2


def momentum_steps(x, y, steps: int, reset_momentum_at: int | None = None) -> list[dict]:
    """SGD with momentum, written out (``torch.optim.SGD``'s rule: the first buffer is the
    gradient, then ``b = 0.9 b + g``; ``p -= lr b``): after each step, params and buffers."""
    model = toy.mlp(0)
    buffers: dict[str, torch.Tensor] = {}
    seen = []
    for i in range(steps):
        model.zero_grad()
        F.mse_loss(model(x), y).backward()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name not in buffers or i == reset_momentum_at:
                    buffers[name] = p.grad.clone()
                else:
                    buffers[name] = checkpoint.MOMENTUM * buffers[name] + p.grad
                p -= toy.LR * buffers[name]
        seen.append({"params": toy.parameters(model), "momentum": dict(buffers)})
    return seen


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=ATOL, rtol=0, msg=name)


def load_both(rank: int, size: int, x, y, directory: str) -> dict:
    """In the ranks: the lesson's load and step, from the synchronous and the async save."""
    return {
        name: checkpoint.load_and_step(rank, size, x, y, os.path.join(directory, name))
        for name in ("sync", "async")
    }


def load_without_a_group(rank: int, size: int, x, y, directory: str) -> dict:
    assert not torch.distributed.is_initialized()  # backend=None: no process group at all
    return checkpoint.load_in_one_process(x, y, os.path.join(directory, "sync"))


def files(directory: str) -> list[str]:
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


def async_save_one_rank_first(rank: int, size: int, directory: str) -> dict:
    """In the ranks: rank 0 calls ``async_save`` and looks at the directory when it returns;
    only then (a barrier) does rank 1 call it. Rank 0's writer thread waits for rank 1's
    plan before any file is written, so a synchronous save would never have returned."""
    model, optimizer = checkpoint.sharded(size)
    model_state, optim_state = get_state_dict(model, optimizer)
    state, target = {"model": model_state, "optim": optim_state}, os.path.join(directory, "late")
    writer_group = dist.new_group(backend="gloo")
    seen: dict = {}
    try:
        if rank == 0:
            future = dcp.async_save(state, checkpoint_id=target, process_group=writer_group)
            seen = {"at_return": files(target), "done_at_return": future.done()}
        dist.barrier()  # rank 0 has returned from async_save
        if rank != 0:
            future = dcp.async_save(state, checkpoint_id=target, process_group=writer_group)
        future.result(timeout=60)
        dist.barrier()  # every rank's files are written
        seen["after_result"] = files(target)
    finally:
        dist.destroy_process_group(writer_group)
    return seen


def at_world_2(rank: int, size: int, x, y, directory: str) -> tuple[dict, dict]:
    """The two things the test asks of world 2, in one world: load and step from both saves,
    then save late on one rank (the same ranks, so torch's lazy imports are paid once)."""
    return load_both(rank, size, x, y, directory), async_save_one_rank_first(rank, size, directory)


def test_a_checkpoint_saved_at_world_4_loads_at_world_2_and_1(run_ranks, tmp_path) -> None:
    x, y = toy.batch(ROWS)
    first, second = momentum_steps(x, y, 2)
    forgetful = momentum_steps(x, y, 2, reset_momentum_at=1)[1]["params"]
    assert max((forgetful[k] - second["params"][k]).abs().max() for k in forgetful) > 1000 * ATOL
    directory = str(tmp_path)

    saved = run_ranks(checkpoint.save_after_one_step, x, y, directory, world_size=4)
    for rank, seen in enumerate(saved):
        assert seen["held"]["0.weight"] == (8, 8), rank  # a quarter of 32 rows
        close(seen["after_one"], first["params"])
        close(seen["after_two"], second["params"])  # training went on during async_save
    rows_of_8 = [((r, 0), (8, 8)) for r in (0, 8, 16, 24)]
    for key in ("model.0.weight", "optim.state.0.weight.momentum_buffer"):
        assert checkpoint.chunks(os.path.join(directory, "sync"), key) == rows_of_8, key

    at_2 = run_ranks(at_world_2, x, y, directory, world_size=2)
    loaded, late = [both for both, _ in at_2], [seen for _, seen in at_2]
    for rank, both in enumerate(loaded):
        for name, seen in both.items():
            where = f"world 2, rank {rank}, {name}"
            assert seen["held"]["0.weight"] == (16, 8), where  # resharded: half of 32 rows
            close(seen["loaded"], first["params"])  # async too: the values of the call
            close(seen["momentum"], first["momentum"])
            close(seen["after_two"], second["params"])
    assert late[0]["at_return"] == [] and not late[0]["done_at_return"], late[0]
    assert late[0]["after_result"] == [".metadata", "__0_0.distcp", "__1_0.distcp"], late[0]

    (alone,) = run_ranks(load_without_a_group, x, y, directory, world_size=1, backend=None)
    close(alone["loaded"], first["params"])
    close(alone["momentum"], first["momentum"])
    close(alone["after_two"], second["params"])
