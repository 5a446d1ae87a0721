"""D3. Gradient accumulation: ``no_sync`` for k-1 micro-batches, then one synced backward.

A batch too large for memory is split into k micro-batches whose gradients add up in
``.grad`` before one optimizer step. Under DDP every backward all-reduces, so accumulating
naively pays k all-reduces for one step. Inside ``with ddp.no_sync():`` DDP's backward only
accumulates locally; the first backward *outside* it all-reduces the accumulated sum, once.

Two details make the result equal one step on the k-times-larger batch:

* each micro-batch's mean loss is divided by k, so the k gradients add up to the gradient
  of the mean over all k micro-batches (without it the step is k times too long);
* the synced backward must be the *last* one: gradients accumulated after it would stay
  local, and the ranks would step apart.

``accumulate`` records, with the comm hook of lesson D2, how many all-reduces each
micro-batch's backward made, and one gradient as it stood before the synced backward (the
ranks' values differ there: nothing was exchanged yet).

    python -m tutorial_impl.ddp.no_sync       # 2 local ranks; or under torchrun
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F

from tutorial_impl.ddp import toy
from tutorial_impl.ddp.buckets import watched_ddp
from tutorial_impl.dist_tuto.process import print_line

PRELOAD = ["torch._dynamo"]  # the first optimizer imports it: see equivalence.py


def accumulate(rank: int, size: int, x: torch.Tensor, y: torch.Tensor, k: int) -> dict:
    """One optimizer step from ``k`` micro-batches of this rank's share of ``(x, y)``.

    Returns the parameters after the step, the all-reduces each micro-batch's backward made,
    and the last layer's bias gradient just before the synced backward (local, unreduced).
    """
    xs, ys = toy.shard(x, rank, size), toy.shard(y, rank, size)
    model = toy.mlp(0)
    ddp, log = watched_ddp(model, bucket_cap_mb=None)
    optimizer = torch.optim.SGD(model.parameters(), lr=toy.LR)
    optimizer.zero_grad()
    calls_per_micro_batch = []
    local_grad = None
    for i, (mx, my) in enumerate(zip(xs.chunk(k), ys.chunk(k), strict=True)):
        last = i == k - 1
        if last and i:  # k-1 micro-batches in .grad, this rank's alone
            local_grad = model[-1].bias.grad.clone()
        before = len(log.calls)
        # ``no_sync`` for all but the last: their backward only adds into .grad.
        with nullcontext() if last else ddp.no_sync():
            (F.mse_loss(ddp(mx), my) / k).backward()
        calls_per_micro_batch.append(len(log.calls) - before)
    optimizer.step()
    return {
        "params": toy.parameters(model),
        "all_reduces": calls_per_micro_batch,
        "local_grad": local_grad,
    }


def demo(rank: int, size: int, k: int = 4) -> None:
    x, y = toy.batch(4 * k * size)
    result = accumulate(rank, size, x, y, k)
    print_line(
        f"rank {rank}: all_reduce calls per micro-batch {result['all_reduces']}; "
        f"last bias gradient before the sync {result['local_grad']}"
    )


def main(argv: list[str] | None = None) -> int:
    args = toy.demo_parser(
        __name__, "D3. Gradient accumulation with DDP's no_sync: all-reduces per micro-batch."
    ).parse_args(argv)
    return toy.main(demo, args.world_size, args.timeout, PRELOAD)


if __name__ == "__main__":
    toy.run_as_script(main)  # the package's copy of this module: see toy.py
