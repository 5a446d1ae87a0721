"""D4. ``DistributedSampler``: each rank's share of the data, per epoch, and its padding.

The tutorial's ``DataPartitioner`` (``tutorial_impl/dist_tuto/partition.py``) shuffles once
with a fixed seed and cuts the data into fixed slices. ``DistributedSampler`` is the library's
version, used as a ``DataLoader``'s ``sampler``, with three behaviours worth knowing:

* **Shards.** Every rank shuffles the *same* permutation (same ``seed`` on every rank: no
  communication) and takes every ``world_size``-th index starting at its rank. The shards
  are disjoint and together cover the dataset.
* **Epochs.** Every epoch (every ``iter`` over the sampler) shuffles again, drawing the
  permutation from a generator seeded with ``seed + epoch``. Call ``sampler.set_epoch(e)``
  before each epoch: without it ``epoch`` stays 0, so each epoch reshuffles to the very same
  order.
* **Padding.** Every rank must yield the same number of samples, or the ranks take different
  numbers of steps and one waits in an all-reduce until the process group's timeout (30
  minutes by default on gloo; lesson D5). When the dataset does not divide by the world size,
  the sampler *repeats* indices from the start of the permutation until it does. So a padded
  sample is seen twice per epoch: it counts twice in any average over the epoch (a loss, an
  accuracy, a gradient). ``drop_last=True`` drops the tail instead: then some samples are not
  seen at all in that epoch.

``epoch_shards`` records what a rank is given each epoch, and the average of a value over
the epoch, all-reduced the way a validation loop would (sum and count over every rank).

    python -m tutorial_impl.ddp.sampler       # 2 local ranks; or under torchrun
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from tutorial_impl.ddp import toy
from tutorial_impl.dist_tuto.process import print_line


def dataset(n: int) -> TensorDataset:
    """``n`` samples ``(index, value)`` with value ``2.0 ** index``: every value differs
    from the mean, so any sample counted twice (or skipped) moves the mean."""
    index = torch.arange(n)
    return TensorDataset(index, 2.0 ** index.double())


def global_mean(values: list[torch.Tensor]) -> float:
    """The mean over every rank's samples: all-reduce the sum and the count, then divide."""
    local = torch.cat(values) if values else torch.zeros(0, dtype=torch.float64)
    totals = torch.tensor([local.sum().item(), float(len(local))], dtype=torch.float64)
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


def epoch_shards(
    rank: int,
    size: int,
    n: int,
    epochs: int = 2,
    drop_last: bool = False,
    set_epoch: bool = True,
    seed: int = 0,
) -> list[dict]:
    """Iterate ``epochs`` epochs of a ``DataLoader`` over this rank's shard of
    ``dataset(n)``; for each, the indices this rank got (in order) and the global mean."""
    data = dataset(n)
    # num_replicas and rank default to the process group's: the sampler asks dist itself.
    sampler = DistributedSampler(data, shuffle=True, seed=seed, drop_last=drop_last)
    loader = DataLoader(data, batch_size=2, sampler=sampler)
    found = []
    for epoch in range(epochs):
        if set_epoch:
            sampler.set_epoch(epoch)  # a new permutation this epoch; forget it and see
        indices, values = [], []
        for index, value in loader:
            indices += index.tolist()
            values.append(value)
        found.append({"indices": indices, "mean": global_mean(values)})
    return found


def demo(rank: int, size: int, n: int = 7) -> None:
    true_mean = dataset(n).tensors[1].mean().item()
    for label, kwargs in [
        ("set_epoch", {}),
        ("no set_epoch", {"set_epoch": False}),
        ("drop_last", {"drop_last": True}),
    ]:
        for epoch, found in enumerate(epoch_shards(rank, size, n, **kwargs)):
            print_line(
                f"{label:>12}, epoch {epoch}, rank {rank}: indices {found['indices']}, "
                f"mean {found['mean']:.4f} (the data's: {true_mean:.4f})"
            )


def main(argv: list[str] | None = None) -> int:
    from tutorial_impl import cli  # the CLI's launcher, not the lesson's

    parser = argparse.ArgumentParser(
        prog="python -m tutorial_impl.ddp.sampler",
        description="D4. DistributedSampler: shards per epoch, padding and drop_last.",
    )
    parser.add_argument("--world-size", type=int, default=2, help="number of ranks")
    parser.add_argument("--samples", type=int, default=7, help="dataset size (default 7)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds for the run")
    args = parser.parse_args(argv)
    run = partial(demo, n=args.samples)  # a partial of a module's function pickles; a closure not
    return cli.exit_status(lambda: cli.launch(run, args.world_size, "gloo", args.timeout))


if __name__ == "__main__":
    toy.run_as_script(main)  # the package's copy of this module: see toy.py
