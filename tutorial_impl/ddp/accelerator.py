"""D12. Device-agnostic code with ``torch.accelerator``: one training step for CPU, CUDA, XPU...

The tutorials write ``cuda`` where they mean "the accelerator": ``torch.cuda.set_device``,
``device_ids=[rank]``, ``backend="nccl"``. A script written that way cannot run on a laptop,
on Intel GPUs (XPU) or on Apple's (MPS). ``torch.accelerator`` names the accelerator without
naming its kind:

* ``torch.accelerator.is_available()`` / ``current_accelerator()``: whether this build and
  machine have one, and which (``device(type='cuda')``, ``'xpu'``, ...; ``None`` on a CPU-only
  machine: the code falls back to ``cpu``);
* ``device_count()``, ``set_device_index(i)``, ``synchronize()``: what ``torch.cuda`` offered,
  for whatever the accelerator is;
* ``dist.get_default_backend_for_device(device)`` picks the collective library for it:
  ``gloo`` for ``cpu``, ``nccl`` for ``cuda``, ``xccl`` for ``xpu`` (Intel's). Asking costs
  nothing and needs no such device: the mapping is a table.

``pick_device`` and ``agnostic_step`` below are the whole pattern: pick this rank's device
(``LOCAL_RANK``, which torchrun sets, is the index on this machine; a machine with fewer
accelerators than ranks is refused, as ``select_gpu`` in ``dist_tuto/process.py`` refuses
it: wrapping around with ``LOCAL_RANK % device_count()`` would put two ranks on one GPU,
which NCCL rejects later as "Duplicate GPU detected"), move the model and the batch there,
wrap in DDP with ``device_ids`` only when there is an accelerator, step. The same lines run
here on CPU with gloo, and on GPUs with NCCL (``tests/ddp/test_ddp_12_accelerator.py`` has
both; the GPU tests skip cleanly without CUDA).

What NCCL does that gloo does not (each part of the GPU tests):

* **device_id**: an NCCL group is bound to one GPU per rank (``init_process_group(...,
  device_id=device)`` connects at once); gloo needs no device;
* **``ReduceOp.PREMUL_SUM``**: multiply by a factor, then sum, in one collective (how a
  gradient is averaged without a separate division); gloo refuses it;
* **the bf16 compression hook** of DDP (lesson D14): DDP refuses torch's
  ``bf16_compress_hook`` unless torch was built with CUDA 11+ and NCCL 2.10+ (or XPU and
  XCCL): this CPU-only build refuses it, whatever the group.

    python -m tutorial_impl.ddp.accelerator     # 2 local ranks; or torchrun --nproc-per-node=2
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from tutorial_impl.ddp import toy
from tutorial_impl.dist_tuto.process import print_line

PRELOAD = ["torch._dynamo"]  # the first optimizer imports it: see equivalence.py


def pick_device(rank: int) -> torch.device:
    """This rank's device: its accelerator (by ``LOCAL_RANK``, the index on this machine),
    or the CPU when there is none. One accelerator per rank: a ``LOCAL_RANK`` with no
    accelerator of its own is a ``ValueError`` now, not a shared GPU later."""
    if not torch.accelerator.is_available():
        return torch.device("cpu")
    index, count = int(os.environ.get("LOCAL_RANK", rank)), torch.accelerator.device_count()
    if not 0 <= index < count:
        raise ValueError(
            f"local rank {index} needs its own accelerator, but this machine has {count}: "
            f"start at most {count} ranks per machine"
        )
    torch.accelerator.set_device_index(index)  # what torch.cuda.set_device(index) did
    return torch.device(torch.accelerator.current_accelerator().type, index)


def agnostic_step(rank: int, size: int, x: torch.Tensor, y: torch.Tensor) -> dict:
    """One DDP SGD step on this rank's share of ``(x, y)``, on whatever device this is."""
    device = pick_device(rank)
    model = toy.mlp(0).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type != "cpu" else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=toy.LR)
    xs, ys = toy.shard(x, rank, size).to(device), toy.shard(y, rank, size).to(device)
    F.mse_loss(ddp(xs), ys).backward()
    optimizer.step()  # on an accelerator this only queues the work...
    return {
        "device": device.type,
        "backend": dist.get_backend(),  # what the group runs on
        "default_backend": dist.get_default_backend_for_device(device),  # what it should
        # ...and copying to the CPU waits for it (``torch.accelerator.synchronize()`` would
        # wait without a copy: what a timer around the step needs).
        "params": {n: p.detach().cpu() for n, p in model.named_parameters()},
    }


def premul_sum(rank: int, size: int, factor: float = 0.5) -> torch.Tensor:
    """All-reduce ``rank + 1`` with ``PREMUL_SUM(factor)``: ``factor * sum`` in one collective.
    NCCL only: gloo raises ``Cannot use ReduceOp.PREMUL_SUM with Gloo``."""
    device = pick_device(rank)
    t = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(factor))
    return t.cpu()


def demo(rank: int, size: int) -> None:
    x, y = toy.batch(8 * size)
    seen = agnostic_step(rank, size, x, y)
    print_line(
        f"rank {rank}: stepped on {seen['device']} over {seen['backend']} "
        f"(the default for {seen['device']}: {seen['default_backend']})"
    )


def main(argv: list[str] | None = None) -> int:
    args = toy.demo_parser(
        __name__, "D12. One DDP step written with torch.accelerator: CPU here, GPUs elsewhere."
    ).parse_args(argv)
    # The backend follows the device: gloo on a CPU-only machine, nccl with CUDA GPUs.
    accelerator = torch.accelerator.current_accelerator()
    backend = dist.get_default_backend_for_device(accelerator or torch.device("cpu"))
    from tutorial_impl import cli  # the CLI's launcher, not the lesson's

    return cli.exit_status(
        lambda: cli.launch(demo, args.world_size, backend, args.timeout, PRELOAD)
    )


if __name__ == "__main__":
    toy.run_as_script(main)  # the package's copy of this module: see toy.py
