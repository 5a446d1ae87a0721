"""3. Collective communication: every process of a group takes part.

    python -m tutorial_impl collectives [--world-size N] [--backend gloo]

``run`` is the tutorial's 3.1 all-reduce over ``new_group([0, 1])``; with two ranks it prints
``Rank  0  has data  tensor(2.)``. ``tour`` then calls each collective of 3.2 once (plus
``reduce_scatter``) and prints what every rank holds afterwards. ``run_barrier`` is the
lesson of ``barrier``: after it, every rank has done what it did before it.
``run_async_all_reduce`` is ``async_op=True`` and what ``wait()`` means on gloo and on NCCL.

Backends do not all support every ``ReduceOp``. ``all_reduce`` here checks the op against the
backend and the dtype *before* any communication, so an unsupported combination raises the
same ``ValueError``, naming the op, the dtype and the backend, on every rank, before any data
moves. gloo alone does not hang either: it too gives every rank the same verdict
(``gloo_verdicts`` in tests/dist_tuto/test_03_collectives.py), but in its own words, and for
AVG on integers only after the data moved: the tensor is left holding the sum.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist

from tutorial_impl.dist_tuto.process import print_line, rank_device, run_main

ReduceOp = dist.ReduceOp

# The tutorial's list, in its order.
TUTORIAL_OPS = ("SUM", "PRODUCT", "MAX", "MIN", "BAND", "BOR", "BXOR", "PREMUL_SUM")
BITWISE_OPS = ("BAND", "BOR", "BXOR")
# What each backend implements. gloo (CPU): measured, and re-checked by the tests against gloo
# itself; NCCL (CUDA): from the NCCL documentation (no bitwise reductions).
SUPPORTED_OPS = {
    "gloo": ("SUM", "PRODUCT", "MIN", "MAX", "AVG", *BITWISE_OPS),
    "nccl": ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "PREMUL_SUM"),
}


def op_name(op: object) -> str:
    """'SUM' for ``ReduceOp.SUM`` (or for the RedOpType the enum members really are)."""
    return str(op).rsplit(".", 1)[-1]


def check_op(op: object, dtype: torch.dtype, backend: str) -> None:
    """Raise ``ValueError`` naming the op, dtype and backend if the reduction cannot run."""
    name = op_name(op)
    supported = SUPPORTED_OPS.get(backend)
    if supported is not None and name not in supported:
        hint = " (it is NCCL-only)" if name == "PREMUL_SUM" else ""
        raise ValueError(
            f"ReduceOp.{name} is not supported by the {backend} backend{hint}; "
            f"{backend} supports {', '.join(supported)}"
        )
    if name in BITWISE_OPS and (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"ReduceOp.{name} needs an integer or bool tensor, got {dtype}")
    if name == "PREMUL_SUM" and not dtype.is_floating_point:
        # NCCL builds the op for half, bfloat16, float and double only (a TypeError otherwise).
        raise ValueError(f"ReduceOp.PREMUL_SUM needs a floating-point tensor, got {dtype}")
    if name == "AVG" and backend == "gloo" and not dtype.is_floating_point:
        raise ValueError(f"ReduceOp.AVG on gloo needs a floating-point tensor, got {dtype}")
    if name == "AVG" and dtype == torch.bool:
        # NCCL averages integers, but refuses bools (a TypeError from inside the call).
        raise ValueError(f"ReduceOp.AVG cannot average a bool tensor ({backend})")
    if dtype.is_floating_point and dtype.itemsize == 1:
        # float8 (e4m3, e5m2, ...): neither gloo ("Invalid scalar type") nor NCCL reduces it.
        raise ValueError(
            f"ReduceOp.{name} on {dtype}: {backend} cannot reduce 8-bit floats; reduce a "
            "wider copy (tensor.to(torch.bfloat16)) and convert the result back"
        )


def all_reduce(
    tensor: torch.Tensor,
    op: object = ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    premul_factor: float | None = None,
) -> None:
    """``dist.all_reduce`` with the op checked first; PREMUL_SUM takes ``premul_factor``.

    PREMUL_SUM multiplies every input by a factor before summing; torch builds that op with
    ``_make_nccl_premul_sum``, the only constructor it offers (NCCL only).
    """
    check_op(op, tensor.dtype, dist.get_backend(group))
    if op_name(op) == "PREMUL_SUM":
        if premul_factor is None:
            raise ValueError("ReduceOp.PREMUL_SUM needs premul_factor (the factor to multiply by)")
        op = dist._make_nccl_premul_sum(premul_factor)
    dist.all_reduce(tensor, op=op, group=group)


def run(rank: int, size: int) -> torch.Tensor:
    """3.1 The tutorial's all-reduce over a group of ranks 0 and 1.

    ``new_group`` is a collective itself: *every* rank must call it, members or not. A rank
    outside the group gets a placeholder and skips the all-reduce, keeping its ones.
    """
    group = dist.new_group([0, 1])
    tensor = torch.ones(1, device=rank_device())
    if rank in (0, 1):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        print_line("Rank ", rank, " has data ", tensor[0].cpu())
    else:
        print_line("Rank ", rank, " has data ", tensor[0].cpu(), " (not in the group)")
    return tensor.cpu()


def rank_tensor(rank: int, n: int = 3) -> torch.Tensor:
    """A tensor that says who made it: ``[100*rank, 100*rank + 1, ...]``."""
    return torch.arange(n, dtype=torch.float32) + 100 * rank


def tour(rank: int, size: int, verbose: bool = True) -> dict[str, object]:
    """3.2 Every collective once; returns what this rank holds after each one."""
    device = rank_device()
    src = size - 1  # the sender of one-to-all collectives: not rank 0, so the choice matters
    out: dict[str, object] = {}

    t = rank_tensor(rank).to(device)
    dist.broadcast(t, src=src)  # src's tensor, copied to everyone
    out["broadcast"] = t

    t = rank_tensor(rank).to(device)
    dist.reduce(t, dst=src, op=ReduceOp.SUM)  # the sum lands on dst only
    out["reduce"] = t if rank == src else None

    t = torch.zeros(2, device=device)
    chunks = [torch.full((2,), 10.0 * i + 1, device=device) for i in range(size)]
    dist.scatter(t, scatter_list=chunks if rank == src else None, src=src)  # entry i to rank i
    out["scatter"] = t

    t = rank_tensor(rank).to(device)
    gathered = [torch.zeros_like(t) for _ in range(size)] if rank == src else None
    dist.gather(t, gather_list=gathered, dst=src)  # everyone's tensor, collected on dst
    out["gather"] = torch.stack(gathered) if gathered is not None else None

    t = rank_tensor(rank).to(device)
    everyone = [torch.zeros_like(t) for _ in range(size)]
    dist.all_gather(everyone, t)  # everyone's tensor, collected everywhere
    out["all_gather"] = torch.stack(everyone)

    # all_to_all: rank r sends its j-th tensor to rank j, and receives rank j's r-th tensor.
    sends = [torch.tensor([100.0 * rank + j], device=device) for j in range(size)]
    recvs = [torch.zeros(1, device=device) for _ in range(size)]
    dist.all_to_all(recvs, sends)
    out["all_to_all"] = torch.cat(recvs)

    # reduce_scatter: the sum over ranks of everyone's j-th tensor lands on rank j.
    pieces = [rank_tensor(rank).to(device) + j for j in range(size)]
    t = torch.zeros(3, device=device)
    dist.reduce_scatter(t, pieces, op=ReduceOp.SUM)
    out["reduce_scatter"] = t

    out = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in out.items()}
    if verbose:
        for name, value in out.items():
            if value is not None:
                print(f"Rank  {rank}  {name}: {value.tolist()}")
    return out


def run_barrier(rank: int, size: int, directory: str) -> list[str]:
    """``barrier``: no rank leaves it before every rank has reached it.

    So after it, every rank has done what it did before it. Each rank sleeps a little (rank
    0 longest), leaves a file in ``directory`` (shared by the ranks), then waits at the
    barrier. Whoever leaves the barrier finds every rank's file already there, even the
    slowest one's: the barrier waited for it. Without the barrier, rank ``size - 1`` would
    look at once and find only its own file.
    """
    time.sleep(0.1 * (size - 1 - rank))
    with open(os.path.join(directory, f"arrived-{rank}"), "w") as f:
        f.write(str(rank))
    dist.barrier()
    return sorted(os.listdir(directory))


def run_async_all_reduce(rank: int, size: int) -> list[float]:
    """``all_reduce(async_op=True)``: start it, ``wait()``, and only then use the tensor.

    The rule is the same on every backend; what ``wait()`` waits for is not. On gloo the
    collective runs on gloo's threads, and ``wait()`` blocks the CPU until the sum is in the
    tensor. On NCCL the collective is queued on NCCL's own CUDA stream and the CPU never waits
    for it: ``wait()`` makes this rank's current stream wait for NCCL's, so the GPU work queued
    after it (the doubling here) runs after the sum has arrived; skip it and the doubling may
    run while the sum is still on its way. Reading a CUDA tensor on the CPU (``.cpu()``,
    ``.item()``, ``.tolist()``) waits for the work queued before it on the current stream.
    Every rank returns ``2 * (1 + 2 + ... + size)``, four times.
    """
    tensor = torch.full((4,), float(rank + 1), device=rank_device())
    work = dist.all_reduce(tensor, async_op=True)
    # Here the CPU is free to do work that does not touch ``tensor``.
    work.wait()
    tensor.mul_(2)
    return tensor.cpu().tolist()


def demo(rank: int, size: int) -> None:
    """What ``python -m tutorial_impl collectives`` runs on every rank."""
    run(rank, size)
    dist.barrier()  # keep the tutorial's lines apart from the tour's
    tour(rank, size)
    # The barrier lesson needs a directory all ranks share: rank 0 makes one, and tells.
    where = [tempfile.mkdtemp(prefix="barrier-") if rank == 0 else None]
    dist.broadcast_object_list(where, src=0)
    seen = run_barrier(rank, size, where[0])
    print(f"Rank  {rank}  after the barrier sees {len(seen)} of {size} arrivals")
    dist.barrier()  # everyone has looked: rank 0 may clean up
    if rank == 0:
        shutil.rmtree(where[0], ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    from tutorial_impl import cli  # the CLI's launcher, not the tutorial's

    parser = argparse.ArgumentParser(
        prog="python -m tutorial_impl collectives",
        description="3. collectives: the tutorial's all_reduce over new_group([0, 1]), "
        "then broadcast, reduce, scatter, gather, all_gather, all_to_all, reduce_scatter, barrier",
    )
    cli.add_launch_arguments(parser)
    args = cli.parse_launch_args(parser, argv, min_world_size=2)
    return cli.exit_status(lambda: cli.launch(demo, args.world_size, args.backend, args.timeout))


if __name__ == "__main__":
    run_main(main)
