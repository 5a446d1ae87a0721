"""D5. Uneven inputs: a bare DDP loop blocks; ``Join`` lets every rank finish.

The tutorial's partitioning (``tutorial_impl/dist_tuto/partition.py``) cuts every rank's
data to the same number of batches, and ``DistributedSampler`` pads (lesson D4), for one
reason: every backward of a DDP model is a collective. A rank with one batch more than the
others calls an all-reduce that nobody answers, and waits. By default it waits for the
process group's timeout, then fails: ``init_process_group``'s default is 30 minutes for gloo
and 10 for NCCL (tests/dist_tuto/test_08_failure.py measures the same end on gloo).

``train_without_join`` shows that block without waiting 30 minutes: its DDP model talks
over a group made with a short ``timeout``, so the extra batch's all-reduce fails after
``deadline`` seconds with gloo's "Timed out waiting". Every wait in this module has a
deadline; a lesson about hanging must not hang.

``train_with_join`` wraps the same loop in ``Join([ddp])``. A rank that runs out of batches
*joins*: from then on, each time the others run an iteration, it shadows their collectives
(it all-reduces zeros for their gradient buckets), so they never wait for it. When the last
rank joins, DDP broadcasts that rank's parameters to all (the others stopped stepping), so
every rank ends with the same model. What the shadowed steps compute:

* ``divide_by_initial_world_size=True`` (the default): the gradient is the sum over the
  ranks still training, divided by the *initial* world size: the joined ranks count as
  zeros, and the late steps are shorter;
* ``divide_by_initial_world_size=False``: divided by the number of ranks still training: a
  plain mean over the batches that exist.

    python -m tutorial_impl.ddp.join         # 2 local ranks; or under torchrun
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from tutorial_impl.ddp import toy
from tutorial_impl.dist_tuto.process import print_line

PRELOAD = ["torch._dynamo"]  # the first optimizer imports it: see equivalence.py
Batches = list[tuple[torch.Tensor, torch.Tensor]]


def sgd_loop(ddp: DDP, batches: Batches) -> int:
    """The plain training loop; returns the number of steps taken."""
    optimizer = torch.optim.SGD(ddp.parameters(), lr=toy.LR)
    for x, y in batches:
        optimizer.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        optimizer.step()
    return len(batches)


def train_with_join(
    rank: int, size: int, batches: list[Batches], divide_by_initial_world_size: bool = True
) -> dict:
    """Rank ``r`` trains on ``batches[r]`` (their numbers differ), inside ``Join``."""
    model = toy.mlp(0)
    ddp = DDP(model)
    with Join([ddp], divide_by_initial_world_size=divide_by_initial_world_size):
        steps = sgd_loop(ddp, batches[rank])
    return {"steps": steps, "params": toy.parameters(model)}


def train_without_join(rank: int, size: int, batches: list[Batches], deadline: float) -> dict:
    """The same loop without ``Join``, its DDP on a group whose collectives give up after
    ``deadline`` seconds. Returns the steps completed, and the error (with how long the
    failing step waited) of a rank whose all-reduce nobody answered."""
    group = dist.new_group(timeout=timedelta(seconds=deadline))
    try:
        ddp = DDP(toy.mlp(0), process_group=group)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=toy.LR)
        done, error, waited = 0, None, 0.0
        for x, y in batches[rank]:
            started = time.monotonic()
            try:
                optimizer.zero_grad()
                F.mse_loss(ddp(x), y).backward()  # the all-reduce nobody answers is in here
            except RuntimeError as exc:
                error, waited = str(exc), time.monotonic() - started
                break
            optimizer.step()
            done += 1
        del ddp, optimizer  # DDP holds the group; let it go before the group is destroyed
        # Leave together, with a deadline too: the rank that finished early must not tear
        # the group down while its peer still waits in it.
        dist.monitored_barrier(timeout=timedelta(seconds=deadline + 30))
    finally:
        dist.destroy_process_group(group)
    return {"steps": done, "error": error, "waited": waited}


def uneven_batches(steps: list[int], rows: int = 4) -> list[Batches]:
    """Rank ``r`` gets ``steps[r]`` batches of ``rows`` rows, all different data."""
    return [[toy.batch(rows, seed=100 * r + i) for i in range(n)] for r, n in enumerate(steps)]


def demo(rank: int, size: int, deadline: float = 1.0) -> None:
    batches = uneven_batches([2 + r for r in range(size)])  # rank r: 2 + r batches
    bare = train_without_join(rank, size, batches, deadline)
    if bare["error"]:
        print_line(
            f"rank {rank}, no Join: step {bare['steps']} gave up after {bare['waited']:.2f} s: "
            f"{bare['error'].splitlines()[0]}"
        )
    else:
        print_line(f"rank {rank}, no Join: all {bare['steps']} steps done")
    joined = train_with_join(rank, size, batches)
    first = joined["params"]["4.bias"].tolist()
    print_line(f"rank {rank}, Join: {joined['steps']} steps, then last bias {first}")


def main(argv: list[str] | None = None) -> int:
    args = toy.demo_parser(
        __name__,
        "D5. Uneven inputs: a bare DDP loop blocks (seen with a short deadline); "
        "Join lets every rank finish.",
    ).parse_args(argv)
    return toy.main(demo, args.world_size, args.timeout, PRELOAD)


if __name__ == "__main__":
    toy.run_as_script(main)  # the package's copy of this module: see toy.py
