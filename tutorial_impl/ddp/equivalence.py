"""D1. DDP is the tutorial's ``average_gradients``, done for you during backward.

Section 4.4 of the tutorial (``tutorial_impl/dist_tuto/sgd.py``) averages gradients by hand:
after ``backward`` every rank all-reduces every gradient and divides by the world size, then
steps. ``DistributedDataParallel`` promises the same step with two differences a learner can
see and one they cannot:

* **The starting point.** DDP's constructor broadcasts rank 0's parameters and buffers to
  every rank. The hand-written loop relies on every rank seeding identically; forget that
  and the replicas train apart from the first step. ``one_step_both_ways`` builds its DDP
  copy from a *different* seed on every rank to show the broadcast.
* **The arithmetic.** DDP's default communication hook divides each gradient by the world
  size *before* the all-reduce; ``average_gradients`` sums and then divides. With two ranks,
  dividing by 2 is exact in floating point, so both give bitwise the same gradients.
* **The timing** (invisible in the result): DDP all-reduces buckets of gradients while
  backward is still running; that is lesson D2, ``buckets.py``.

    python -m tutorial_impl.ddp.equivalence       # 2 local ranks; or under torchrun
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from tutorial_impl.ddp import toy
from tutorial_impl.dist_tuto.process import print_line
from tutorial_impl.dist_tuto.sgd import average_gradients

# Every rank's first optimizer imports torch._dynamo (~1.3 s of CPU): the server the local
# ranks are forked from imports it once instead.
PRELOAD = ["torch._dynamo"]


def sgd_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, sync_by_hand: bool) -> None:
    """One plain SGD step on this rank's batch, the gradient averaged by hand or by DDP."""
    optimizer = torch.optim.SGD(model.parameters(), lr=toy.LR)
    optimizer.zero_grad()
    F.mse_loss(model(x), y).backward()  # a DDP model has all-reduced by the time this returns
    if sync_by_hand:
        average_gradients(model)  # the tutorial's way: after backward, one all_reduce per tensor
    optimizer.step()


def one_step_both_ways(
    rank: int, size: int, x: torch.Tensor, y: torch.Tensor, seed: int = 0
) -> dict[str, dict[str, torch.Tensor]]:
    """Take one step on this rank's share of the global batch ``(x, y)``, twice over.

    ``hand``: the tutorial's model, seeded identically on every rank, averaged by hand.
    ``ddp``: built from ``seed + rank`` (every rank different!) and wrapped in DDP, whose
    constructor replaces every rank's parameters with rank 0's. Returns the parameters
    before the step (``ddp_start``, as DDP left them) and after it (``hand``, ``ddp``).
    """
    xs, ys = toy.shard(x, rank, size), toy.shard(y, rank, size)

    hand = toy.mlp(seed)
    sgd_step(hand, xs, ys, sync_by_hand=True)

    local = toy.mlp(seed + rank)  # a replica that disagrees with the others...
    ddp = DDP(local)  # ...until DDP broadcasts rank 0's parameters
    start = toy.parameters(local)
    sgd_step(ddp, xs, ys, sync_by_hand=False)
    return {"hand": toy.parameters(hand), "ddp_start": start, "ddp": toy.parameters(local)}


def demo(rank: int, size: int) -> float:
    """Print how far apart the two ways end up on this rank; return it (0.0: not one bit)."""
    x, y = toy.batch(16 * size)
    result = one_step_both_ways(rank, size, x, y)
    diff = max((result["hand"][k] - result["ddp"][k]).abs().max().item() for k in result["hand"])
    print_line(f"rank {rank}: DDP and average_gradients differ by {diff:.3g} after one step")
    return diff


def main(argv: list[str] | None = None) -> int:
    from tutorial_impl import cli  # the CLI's launcher, not the lesson's

    parser = argparse.ArgumentParser(
        prog="python -m tutorial_impl.ddp.equivalence",
        description="D1. One SGD step with DDP and with the tutorial's average_gradients.",
    )
    parser.add_argument("--world-size", type=int, default=2, help="number of ranks")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds for the run")
    args = parser.parse_args(argv)
    diffs: list[float] = []
    status = cli.exit_status(
        lambda: diffs.extend(cli.launch(demo, args.world_size, "gloo", args.timeout, PRELOAD))
    )
    # Bitwise equal with 2 (or 4) ranks, where dividing by the world size is exact; with 3,
    # a/3 + b/3 + c/3 and (a + b + c)/3 may differ in the last bit.
    return status or (0 if max(diffs) <= 1e-6 else 1)


if __name__ == "__main__":
    toy.run_as_script(main)  # the package's copy of this module: see toy.py
