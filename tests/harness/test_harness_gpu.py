"""The harness's NCCL path, on real GPUs (skipped at collection time on a CPU machine).

Run with ``pytest -m dist_gpu`` on a CUDA machine (the gpu CI workflow does). The forkserver
never touches CUDA, so every rank may initialise it after the fork.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


def all_reduce_cuda(rank: int, world_size: int) -> tuple[float, int, str]:
    """NCCL: each rank reduces a tensor on its own GPU (the harness chose it before init)."""
    device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(t)
    return t.item(), device.index, dist.get_backend()


@pytest.mark.dist_gpu
@pytest.mark.dist_backend("nccl")
@pytest.mark.world_size(1)
def test_nccl_group_of_one(run_ranks):
    """Even one GPU proves the path: device chosen, NCCL group joined, CUDA all_reduce."""
    assert run_ranks(all_reduce_cuda) == [(1.0, 0, "nccl")]


@pytest.mark.dist_gpu(2)
@pytest.mark.dist_backend("nccl")
@pytest.mark.world_size(2)
def test_nccl_ranks_get_one_gpu_each(run_ranks):
    """Rank r runs on GPU r, and the sum over both GPUs reaches both ranks."""
    assert run_ranks(all_reduce_cuda) == [(3.0, 0, "nccl"), (3.0, 1, "nccl")]


def cuda_tensors(rank: int, world_size: int) -> dict[str, object]:
    t = torch.full((2,), float(rank), device="cuda")
    return {"tensor": t, "nested": [t * 2, (t + 1,)]}


@pytest.mark.dist_gpu
@pytest.mark.dist_backend("nccl")
@pytest.mark.world_size(1)
def test_returned_cuda_tensors_arrive_on_the_cpu(run_ranks):
    """The rank's GPU is its own: every returned tensor, however nested, comes back on CPU."""
    (result,) = run_ranks(cuda_tensors)
    tensors = [result["tensor"], result["nested"][0], result["nested"][1][0]]
    assert [t.device.type for t in tensors] == ["cpu"] * 3
    assert [t.tolist() for t in tensors] == [[0.0, 0.0], [0.0, 0.0], [1.0, 1.0]]
