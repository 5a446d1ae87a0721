"""D12. One training step written with ``torch.accelerator`` (``ddp/accelerator.py``).

The claims: the backend for a device is a table, needing no such device (``cpu`` -> gloo,
``cuda`` -> nccl, ``xpu`` -> xccl); the lesson's device-agnostic DDP step, run here, picks
the CPU and gloo and takes one process's step on the whole batch; gloo refuses NCCL's
``PREMUL_SUM``; a rank whose ``LOCAL_RANK`` has no accelerator of its own is refused, not
wrapped onto another rank's (checked here with a pretended two-accelerator machine). On a
CUDA machine (``pytest -m dist_gpu``, skipped cleanly elsewhere) the same function picks
``cuda`` and NCCL, with no line changed, and takes the same step; ``PREMUL_SUM`` there is
``factor * sum`` in one collective; and DDP takes the bf16 compression hook a CPU-only
build refuses (lesson D14). The reference is one process on the CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tutorial_impl.ddp import accelerator, toy

pytestmark = pytest.mark.warm_world  # the GPU tests run fresh: the harness leases GPUs

ROWS = 16
ATOL = 1e-6  # float32 sums in another order on the CPU: ~1e-8
GPU_ATOL = 1e-5  # another device's kernels sum in another order again (no TF32: it is off)


def one_process_step(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    model = toy.mlp(0)
    F.mse_loss(model(x), y).backward()
    toy.plain_sgd_step(model)
    return toy.parameters(model)


def close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=name)


def step_and_premul(rank: int, size: int, x, y) -> dict:
    """In the ranks: the lesson's step, then whether this group takes PREMUL_SUM."""
    seen = {"step": accelerator.agnostic_step(rank, size, x, y)}
    try:
        seen["premul"] = accelerator.premul_sum(rank, size)
    except (RuntimeError, ValueError) as exc:
        seen["premul"] = str(exc)
    return seen


def test_the_backend_for_a_device_is_a_table() -> None:
    pairs = {d: dist.get_default_backend_for_device(d) for d in ("cpu", "cuda", "xpu")}
    assert pairs == {"cpu": "gloo", "cuda": "nccl", "xpu": "xccl"}


def test_the_device_agnostic_step_runs_on_cpu_with_gloo(run_ranks) -> None:
    x, y = toy.batch(ROWS)
    reference = one_process_step(x, y)
    for rank, seen in enumerate(run_ranks(step_and_premul, x, y, world_size=2)):
        step = seen["step"]
        assert (step["device"], step["backend"], step["default_backend"]) == (
            "cpu",
            "gloo",
            "gloo",
        ), rank
        close(step["params"], reference, ATOL)
        assert "PREMUL_SUM" in seen["premul"] and "Gloo" in seen["premul"], seen["premul"]


def test_more_ranks_than_accelerators_are_refused_not_wrapped(monkeypatch) -> None:
    """A pretend machine with 2 accelerators: local ranks 0 and 1 get devices 0 and 1, local
    rank 2 an error (``2 % 2`` would have given it rank 0's device, which NCCL refuses)."""
    chosen: list[int] = []
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 2)
    monkeypatch.setattr(torch.accelerator, "set_device_index", chosen.append)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    for local_rank in (0, 1):
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        assert accelerator.pick_device(7) == torch.device("cuda", local_rank)
    assert chosen == [0, 1]
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ValueError, match="local rank 2 needs its own accelerator.* has 2"):
        accelerator.pick_device(2)
    assert chosen == [0, 1]  # nothing was set for the refused rank


def bf16_hook_accepted(rank: int, size: int) -> str:
    """In the ranks: register torch's bf16 hook on a DDP model on this device's group."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    device = accelerator.pick_device(rank)
    ddp = DDP(toy.mlp(0).to(device), device_ids=[device.index])
    ddp.register_comm_hook(None, bf16_compress_hook)  # CPU-only build: "required CUDA 11+"
    return "accepted"


def on_gpus(rank: int, size: int, x, y) -> dict:
    return {**step_and_premul(rank, size, x, y), "bf16": bf16_hook_accepted(rank, size)}


def check_on_gpus(results: list[dict], x, y) -> None:
    reference = one_process_step(x, y)
    size = len(results)
    for rank, seen in enumerate(results):
        step = seen["step"]
        assert (step["device"], step["backend"], step["default_backend"]) == (
            "cuda",
            "nccl",
            "nccl",
        )
        close(step["params"], reference, GPU_ATOL)
        # PREMUL_SUM(0.5) over ranks holding rank + 1: 0.5 * (1 + ... + size).
        assert seen["premul"].tolist() == [0.5 * size * (size + 1) / 2], seen["premul"]
        assert seen["bf16"] == "accepted", rank


@pytest.mark.dist_gpu
@pytest.mark.dist_backend("nccl")
@pytest.mark.world_size(1)
def test_the_same_step_on_one_gpu_with_nccl(run_ranks) -> None:
    x, y = toy.batch(ROWS)
    check_on_gpus(run_ranks(on_gpus, x, y), x, y)


@pytest.mark.dist_gpu(2)
@pytest.mark.dist_backend("nccl")
@pytest.mark.world_size(2)
def test_the_same_step_on_two_gpus_with_nccl(run_ranks) -> None:
    x, y = toy.batch(ROWS)
    check_on_gpus(run_ranks(on_gpus, x, y), x, y)
