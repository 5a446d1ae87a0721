"""D15. The tutorial's "case 2": pipeline stages replicated with DDP (``ddp/pipeline_ddp.py``).

The claims, on 4 ranks as a 2 x 2 mesh ``("dp", "pp")``: rank ``2i + j`` is stage ``j`` of
pipeline ``i``, its pipeline the ranks ``[2i, 2i + 1]`` and the copies of its stage
``[j, 2 + j]``; each stage holds only its layers, runs both micro-batches' forwards and then
their backwards (GPipe), and all-reduces its gradients once a step, not once a
micro-batch; and after one step every copy of every stage holds one process's step on the
whole batch for its layers. The reference is the unsplit ``toy.mlp(0)`` in this process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tutorial_impl.ddp import toy

pytestmark = pytest.mark.warm_world

WORLD, ROWS = 4, 8  # 2 pipelines, each 4 rows in 2 micro-batches of 2
ATOL = 1e-6
LAYERS = [["0.weight", "0.bias"], ["2.weight", "2.bias", "4.weight", "4.bias"]]


def step_in_ranks(rank: int, size: int, x, y) -> dict:
    # Imported in the ranks: torch.distributed.pipelining imports torch._dynamo, a second
    # of CPU in this test's own process, which needs nothing of it (as in lesson D8).
    from tutorial_impl.ddp import pipeline_ddp

    groups = len(dist.distributed_c10d._world.pg_map)  # the process groups that exist
    seen = pipeline_ddp.replicated_pipeline_step(rank, size, x, y)
    return {**seen, "groups_left": len(dist.distributed_c10d._world.pg_map) - groups}


def test_pipeline_stages_replicated_with_ddp_equal_one_process(run_ranks) -> None:
    x, y = toy.batch(ROWS)
    model = toy.mlp(0)
    start = toy.parameters(model)
    F.mse_loss(model(x), y).backward()
    toy.plain_sgd_step(model)
    stepped = toy.parameters(model)
    assert max((stepped[k] - start[k]).abs().max() for k in start) > 1000 * ATOL

    for rank, seen in enumerate(run_ranks(step_in_ranks, x, y, world_size=WORLD)):
        i, j = divmod(rank, 2)
        where = f"rank {rank}: pipeline {i}, stage {j}"
        assert seen["coordinate"] == (i, j), where
        assert seen["groups"] == {"dp": [j, 2 + j], "pp": [2 * i, 2 * i + 1]}, where
        assert sorted(seen["params"]) == sorted(LAYERS[j]), where
        assert seen["events"] == ["F", "F", "B", "B"], f"{where}: {seen['events']}"
        assert seen["groups_left"] == 0, f"{where}: the mesh's groups were not destroyed"
        assert seen["all_reduces"] == 1, f"{where}: {seen['all_reduces']} all-reduces"
        for name in LAYERS[j]:
            torch.testing.assert_close(seen["params"][name], stepped[name], atol=ATOL, rtol=0)
