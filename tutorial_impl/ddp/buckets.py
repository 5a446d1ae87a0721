"""D2. Buckets: how many all-reduces DDP makes, and why they start before backward ends.

``average_gradients`` waits for the whole backward pass, then all-reduces each gradient on
its own: one collective per tensor, none of them overlapping any computation. DDP does two
things instead:

* it packs gradients into **buckets** of about ``bucket_cap_mb`` MiB and all-reduces a
  bucket as one flat tensor: few large messages instead of many small ones;
* it fills the buckets in the order gradients become ready, roughly the *reverse* of
  ``model.parameters()`` (backward runs from the last layer to the first), and launches a
  bucket's all-reduce the moment its last gradient arrives, while autograd is still busy
  computing the gradients of earlier layers. Communication hides behind computation.

A **communication hook** (``DDP.register_comm_hook(state, hook)``) is called once per bucket
as ``hook(state, bucket)``, and must return a future of the reduced tensor. ``BucketLog``
wraps DDP's own default (``allreduce_hook``: divide by the group's size, all-reduce SUM)
and records every call: which parameters the bucket holds, and how many of the model's
gradients do not exist yet. Counting calls counts all-reduces honestly, because the hook is
the only thing that launches them. ``allreduce_hook``'s first argument is the group to
reduce over, and ``None`` means the *default* group (the world), not DDP's: a hook must
pass on the ``process_group`` its DDP was built with, or a DDP over a subgroup all-reduces
with every rank of the world (wrong sums, or a hang if the others never call it).

One thing the documentation does not say: in the *first* iteration DDP puts every parameter
in one bucket, because it does not trust ``model.parameters()`` to be the order backward
produces gradients in. It records the real order during that first backward and rebuilds
the buckets by ``bucket_cap_mb`` before the second. So the count follows ``bucket_cap_mb``
from the second iteration on. Two settings bucket from the start instead:
``find_unused_parameters=True``, and ``bucket_cap_mb_list=`` (a cap per bucket, the last
repeated): its first iteration's buckets are filled in ``model.parameters()`` order, the
first cap for the bucket of the *first* layers, and rebuilt in gradient order for the
second iteration, the first cap then for the *last* layers (measured in the lesson's test).

And one thing the default does that an explicit cap does not: with ``bucket_cap_mb=None``
the *first* bucket (the last layers' gradients, ready first) is capped at
``dist._DEFAULT_FIRST_BUCKET_BYTES``, 1 MiB, so its all-reduce starts early; every later
bucket at 25 MiB. An explicit ``bucket_cap_mb=25`` caps every bucket, the first included, at
25 MiB. The lesson's toy model (5.9 KB of gradients) fits one bucket either way; three
``Linear(512, 512)`` (``WIDE``: 1 MiB + 2 KiB a layer) make 2 buckets by default, 1 with an
explicit 25 (``torch/nn/parallel/distributed.py``, ``_BucketCapacityConfig``).

    python -m tutorial_impl.ddp.buckets       # 2 local ranks; or under torchrun
"""

# No ``from __future__ import annotations`` here: register_comm_hook inspects the hook's
# annotations and refuses the *string* "dist.GradBucket" where it expects the class.
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from tutorial_impl.ddp import toy
from tutorial_impl.dist_tuto.process import print_line

PRELOAD = ["torch._dynamo"]  # the first optimizer imports it: see equivalence.py
WIDE = (512, 512, 512, 512)  # toy.mlp's sizes for three Linear(512, 512): 1 MiB a weight


@dataclass
class BucketCall:
    """What one call of the hook saw: one bucket, about to be all-reduced."""

    iteration: int
    index: int  # the bucket's index (0 is the first to be reduced)
    names: list[str]  # the parameters whose gradients the bucket holds, in bucket order
    numel: int  # the flat bucket's length: the sum of its gradients' sizes
    missing: int  # how many of the model's gradients autograd had not produced yet


@dataclass
class BucketLog:
    """A comm hook's state: the model it watches, and every call so far."""

    model: nn.Module
    # DDP's own group (``ddp.process_group``): the one its all-reduces must run over.
    group: dist.ProcessGroup | None = None
    iteration: int = 0
    calls: list[BucketCall] = field(default_factory=list)
    # (iteration, parameter) each time autograd has written a gradient: the order backward
    # produces them in (recorded by a post-accumulate-grad hook on every parameter).
    ready: list[tuple[int, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.names = {p: name for name, p in self.model.named_parameters()}
        for p in self.model.parameters():
            p.register_post_accumulate_grad_hook(self._gradient_ready)

    def _gradient_ready(self, p: nn.Parameter) -> None:
        self.ready.append((self.iteration, self.names[p]))

    def ready_order(self) -> list[list[str]]:
        """Per iteration, the parameters in the order their gradients were written."""
        grouped: list[list[str]] = [[] for _ in range(self.iteration + 1)]
        for iteration, name in self.ready:
            grouped[iteration].append(name)
        return grouped

    def per_iteration(self) -> list[list[BucketCall]]:
        """The calls grouped by iteration (an iteration without any is an empty list)."""
        grouped: list[list[BucketCall]] = [[] for _ in range(self.iteration + 1)]
        for call in self.calls:
            grouped[call.iteration].append(call)
        return grouped


def logging_allreduce_hook(
    log: BucketLog, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Record the bucket, then do exactly what DDP would have done without a hook."""
    # With ``zero_grad(set_to_none=True)`` before backward, a gradient that is still None
    # is one autograd has not computed yet: this all-reduce starts before backward ends.
    missing = sum(p.grad is None for p in log.model.parameters())
    names = [log.names[p] for p in bucket.parameters()]
    numel = bucket.buffer().numel()
    log.calls.append(BucketCall(log.iteration, bucket.index(), names, numel, missing))
    # DDP's group, not None: None would be the default group, the whole world.
    return allreduce_hook(log.group, bucket)


# A cap in MiB for every bucket, None for DDP's default, or a tuple: ``bucket_cap_mb_list``.
Cap = float | None | tuple[float, ...]


def watched_ddp(
    model: nn.Module, bucket_cap_mb: Cap, process_group: dist.ProcessGroup | None = None
) -> tuple[DDP, BucketLog]:
    """``model`` in DDP over ``process_group`` (None: the world), buckets of ``bucket_cap_mb``
    MiB (a tuple: one cap per bucket), and the log of its buckets."""
    if isinstance(bucket_cap_mb, tuple):
        ddp = DDP(model, bucket_cap_mb_list=list(bucket_cap_mb), process_group=process_group)
    else:
        ddp = DDP(model, bucket_cap_mb=bucket_cap_mb, process_group=process_group)
    log = BucketLog(model, group=ddp.process_group)
    ddp.register_comm_hook(log, logging_allreduce_hook)  # before the first backward
    return ddp, log


def train(ddp: DDP, log: BucketLog, x: torch.Tensor, y: torch.Tensor, iterations: int) -> None:
    """``iterations`` SGD steps on the same batch, the log told which iteration is which."""
    optimizer = torch.optim.SGD(ddp.parameters(), lr=toy.LR)
    for i in range(iterations):
        log.iteration = i
        optimizer.zero_grad(set_to_none=True)  # None marks "not computed yet" (see the hook)
        F.mse_loss(ddp(x), y).backward()
        optimizer.step()


def watched_run(
    rank: int,
    size: int,
    cap_mb: Cap,
    iterations: int = 2,
    sizes: tuple[int, ...] = toy.SIZES,
) -> BucketLog:
    """Train a fresh DDP model (``toy.mlp`` of ``sizes``) ``iterations`` steps on this rank's
    share of the batch, with buckets of ``cap_mb`` MiB (``None``: DDP's default, 1 MiB for
    the first bucket and 25 MiB for the rest); the log of its buckets."""
    x, y = toy.batch(8 * size, sizes=sizes)
    ddp, log = watched_ddp(toy.mlp(0, sizes), cap_mb)
    train(ddp, log, toy.shard(x, rank, size), toy.shard(y, rank, size), iterations)
    return log


def buckets_by_cap(
    rank: int,
    size: int,
    caps_mb: list[Cap],
    iterations: int = 2,
    sizes: tuple[int, ...] = toy.SIZES,
) -> dict[Cap, list[list[BucketCall]]]:
    """For each cap, train a fresh DDP model (``toy.mlp`` of ``sizes``) ``iterations`` steps;
    the hook's calls per iteration."""
    runs = {cap: watched_run(rank, size, cap, iterations, sizes) for cap in caps_mb}
    return {cap: log.per_iteration() for cap, log in runs.items()}


def demo(rank: int, size: int) -> None:
    """Print the buckets of the first two iterations (rank 0 only): the toy model under three
    caps, then three ``Linear(512, 512)`` under the default and an explicit 25 MiB."""
    runs = [
        # default, 4 KiB, 1 byte; a list: 16 bytes for the first bucket, 4 KiB for the rest
        ("toy model", toy.SIZES, [None, 4096 / 2**20, 1 / 2**20, (16 / 2**20, 4096 / 2**20)]),
        ("3 x Linear(512, 512)", WIDE, [None, 25]),  # the default's 1 MiB first bucket
    ]
    for model, sizes, caps in runs:
        for cap, iterations in buckets_by_cap(rank, size, caps, sizes=sizes).items():
            if not rank:
                print_buckets(model, cap, iterations)


def print_buckets(model: str, cap: Cap, iterations: list[list[BucketCall]]) -> None:
    if isinstance(cap, tuple):
        label = "list " + ", ".join(f"{c * 2**20:g}" for c in cap) + " bytes"
    else:
        label = "default" if cap is None else f"{cap * 2**20:g} bytes"
    print_line(f"{model}, bucket_cap_mb = {label}:")
    for i, calls in enumerate(iterations):
        print_line(f"  iteration {i}: {len(calls)} all_reduce call(s)")
        for call in calls:
            print_line(
                f"    bucket {call.index}: {call.numel} floats {call.names}, "
                f"{call.missing} gradient(s) not computed yet"
            )


def main(argv: list[str] | None = None) -> int:
    args = toy.demo_parser(
        __name__, "D2. DDP's buckets under several bucket_cap_mb values, from a comm hook."
    ).parse_args(argv)
    return toy.main(demo, args.world_size, args.timeout, PRELOAD)


if __name__ == "__main__":
    toy.run_as_script(main)  # the package's copy of this module: see toy.py
