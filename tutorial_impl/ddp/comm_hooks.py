"""D14. Communication hooks: send less per bucket (fp16, bf16, PowerSGD), and what it costs.

Lesson D2 showed a *communication hook* is called once per bucket and returns a future of the
averaged bucket; DDP's default divides by the world size and all-reduces the float32 bucket.
A hook may send something smaller instead, as long as it returns a float32 bucket of the
same size. ``torch.distributed.algorithms.ddp_comm_hooks`` has three ideas:

* **fp16 / bf16 compression** (``fp16_compress_hook``, ``bf16_compress_hook``): cast the
  bucket to 16 bits, all-reduce that, cast back. Half the bytes on the wire; each gradient
  keeps 11 (fp16) or 8 (bf16) significant bits instead of 24, so the average is off by about
  one part in 2^11 or 2^8. fp16 has a narrow range: its smallest step is 2^-24 (~6e-8),
  so gradients below half of it (2^-25, ~3e-8) round to 0, and from 65520 up to infinity
  (65504 is its largest number); bf16 has float32's range and less precision.
* **PowerSGD** (``powerSGD_hook``, Vogels et al. 2019): approximate each gradient matrix
  ``M`` (n x m) by a product of two thin matrices, ``P`` (n x r) and ``Q`` (m x r), with one
  step of power iteration, and all-reduce ``P`` and ``Q``: ``(n + m) r`` numbers instead of
  ``n m``. The result ``P Pᵀ M`` is the projection of the averaged gradient onto the span of
  ``P``, so it loses exactly what lies outside; with *error feedback* that loss is added to
  the next step's gradient instead of forgotten. A tensor that would not shrink by at least
  ``min_compression_rate`` (a bias, say: n x 1) is all-reduced as it is. For its first
  ``start_powerSGD_iter`` iterations the hook all-reduces plainly, as DDP would.

The lesson counts what each hook sends, by wrapping ``torch.distributed.all_reduce`` while
backward runs (the hooks call it from Python, also in the callbacks of their futures), and
compares the averaged gradients each leaves in ``p.grad`` with the uncompressed ones, from
the same parameters and batches.

DDP refuses torch's ``bf16_compress_hook`` in a torch built without CUDA 11+ and NCCL 2.10+
(or XPU and XCCL), such as this CPU-only one ("BF16 all reduce communication hook required
CUDA 11+ and NCCL 2.10+"): it checks the build, not the group, and gloo on the CPU
all-reduces bfloat16 fine. ``cast_hook(torch.bfloat16)`` below is the same hook written
out (it is what torch's fp16 and bf16 hooks do, minus the ``torch.compile`` branch); on
GPUs, lesson D12's GPU test registers torch's own.

    python -m tutorial_impl.ddp.comm_hooks      # 2 local ranks; or torchrun --nproc-per-node=2
"""

# No ``from __future__ import annotations``: register_comm_hook inspects annotations (buckets.py).
import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from tutorial_impl.ddp import toy
from tutorial_impl.dist_tuto.process import print_line

PRELOAD = ["torch._dynamo"]
ITERATIONS = 3  # PowerSGD all-reduces plainly for start_powerSGD_iter = 2 iterations first


@dataclass(frozen=True)
class Sent:
    """One all-reduce a hook made: the tensor's dtype, its length, and its bytes."""

    dtype: torch.dtype
    numel: int
    nbytes: int


@contextlib.contextmanager
def counting_all_reduce() -> Iterator[list[Sent]]:
    """Record every ``dist.all_reduce`` made meanwhile, from any thread (for measuring only:
    the original is put back on the way out)."""
    sent: list[Sent] = []
    original = dist.all_reduce

    @functools.wraps(original)
    def recording(tensor, *args, **kwargs):
        sent.append(Sent(tensor.dtype, tensor.numel(), tensor.numel() * tensor.element_size()))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = recording
    try:
        yield sent
    finally:
        dist.all_reduce = original


def cast_hook(dtype: torch.dtype):
    """A compression hook: send the bucket as ``dtype``, averaged, and cast it back."""

    def hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        compressed = buffer.to(dtype).div_(dist.get_world_size())  # divide first: no overflow

        def decompress(fut: torch.futures.Future) -> torch.Tensor:
            return buffer.copy_(fut.value()[0])  # in place: no second float32 bucket

        return dist.all_reduce(compressed, async_op=True).get_future().then(decompress)

    return hook


def powersgd_state() -> powerSGD_hook.PowerSGDState:
    """Rank-1 PowerSGD with error feedback, compressing from iteration 2 on."""
    return powerSGD_hook.PowerSGDState(
        process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2
    )


def hooks() -> dict:
    """Each hook by name, with the state it is registered with (a PowerSGD state is fresh)."""
    return {
        "float32": (None, default_hooks.allreduce_hook),  # DDP's default, in Python
        "fp16": (None, default_hooks.fp16_compress_hook),
        "bf16": (None, cast_hook(torch.bfloat16)),
        "powerSGD": (powersgd_state(), powerSGD_hook.powerSGD_hook),
    }


def averaged_gradients(rank: int, size: int, x, y, name: str) -> dict:
    """``ITERATIONS`` backwards of a fresh ``toy.mlp(0)`` in DDP under hook ``name``, from
    the same parameters (no step: every iteration averages the same gradients); what the
    last one sent and the averaged gradients it left."""
    state, hook = hooks()[name]
    model = toy.mlp(0)
    ddp = DDP(model)
    ddp.register_comm_hook(state, hook)
    xs, ys = toy.shard(x, rank, size), toy.shard(y, rank, size)
    for _ in range(ITERATIONS):
        model.zero_grad()
        with counting_all_reduce() as sent:
            F.mse_loss(ddp(xs), ys).backward()  # DDP waits for the hook's future in here
    return {"sent": sent, "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def compare(rank: int, size: int, x, y) -> dict:
    """Every hook's last iteration, and DDP's answer to torch's bf16 hook on this group."""
    seen = {name: averaged_gradients(rank, size, x, y, name) for name in hooks()}
    try:
        DDP(toy.mlp(0)).register_comm_hook(None, default_hooks.bf16_compress_hook)
        seen["torch_bf16"] = "accepted"
    except TypeError as exc:  # CPU-only build: "BF16 all reduce ... hook required ..."
        seen["torch_bf16"] = str(exc)
    return seen


def demo(rank: int, size: int) -> None:
    x, y = toy.batch(8 * size)
    seen = compare(rank, size, x, y)
    exact = seen["float32"]["grads"]
    for name in hooks():
        grads = seen[name]["grads"]
        error = max(((grads[k] - exact[k]).norm() / exact[k].norm()).item() for k in exact)
        sent = sum(s.nbytes for s in seen[name]["sent"])
        line = f"{name:>8}: {sent:>5} bytes sent, worst relative error {error:.2g}"
        if rank == 0:
            print_line(line)


def main(argv: list[str] | None = None) -> int:
    args = toy.demo_parser(
        __name__, "D14. DDP communication hooks: fp16, bf16, PowerSGD: bytes sent and error."
    ).parse_args(argv)
    return toy.main(demo, args.world_size, args.timeout, PRELOAD)


if __name__ == "__main__":
    toy.run_as_script(main)  # the package's copy of this module: see toy.py
