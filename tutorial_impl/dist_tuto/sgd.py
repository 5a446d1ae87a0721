"""4.3-4.4 Distributed synchronous SGD: ``average_gradients`` and the training loop ``run``.

Every rank starts from the same model (same seed), trains on its own partition, and before
each optimizer step replaces its gradients with the average over all ranks. So every rank
takes the *same* step and the replicas never drift apart: data parallelism, the thing
``DistributedDataParallel`` does for you (overlapping the all-reduces with the backward pass).

    python -m tutorial_impl train                         # 2 ranks, synthetic data, gloo
    python -m tutorial_impl train --data ~/mnist --epochs 10
    torchrun --nproc_per_node=2 -m tutorial_impl train    # one rank per torchrun worker
"""

from __future__ import annotations

import argparse
import hashlib
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

from tutorial_impl.dist_tuto.data import get_dataset
from tutorial_impl.dist_tuto.model import Net
from tutorial_impl.dist_tuto.partition import GLOBAL_BATCH, batch_sizes, partition_dataset
from tutorial_impl.dist_tuto.process import print_line, rank_device, run_main, under_torchrun

LR, MOMENTUM = 0.01, 0.5


def average_gradients(model: nn.Module) -> None:
    """Replace every gradient by its mean over all ranks: all_reduce SUM, then divide."""
    size = float(dist.get_world_size())
    for param in model.parameters():
        dist.all_reduce(param.grad.data, op=dist.ReduceOp.SUM)
        param.grad.data /= size


def train_step(
    model: nn.Module,
    optimizer: optim.Optimizer,
    data: torch.Tensor,
    target: torch.Tensor,
    loss_weight: float = 1.0,
    sync: bool = True,
) -> float:
    """One synchronous SGD step; returns this rank's (unweighted) mean loss.

    ``loss_weight`` is ``bsz * size / global_batch`` (see partition.py): 1.0 when the global
    batch splits evenly. ``sync=False`` for a DDP model, which averages during backward.
    """
    optimizer.zero_grad()
    output = model(data)
    loss = F.nll_loss(output, target)
    (loss * loss_weight if loss_weight != 1.0 else loss).backward()
    if sync:
        average_gradients(model)
    optimizer.step()
    return loss.item()


def parameter_digest(model: nn.Module) -> str:
    """sha256 of every parameter's bytes: equal digests mean bitwise-identical replicas."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 3
    samples: int | None = None  # None: 4096 synthetic samples, or all of MNIST
    data_path: str | None = None
    global_batch: int = GLOBAL_BATCH


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)  # this rank's mean loss per epoch
    digest: str = ""


def run(rank: int, size: int, config: TrainConfig = TrainConfig()) -> TrainResult:
    """The tutorial's training loop, on this rank's partition of the data."""
    torch.manual_seed(1234)
    device = rank_device()
    dataset = get_dataset(config.data_path, config.samples)
    train_set, bsz = partition_dataset(dataset, config.global_batch)
    loss_weight = bsz * size / config.global_batch
    model = Net().to(device)
    optimizer = optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)

    num_batches = len(train_set)  # the tutorial's ceil(len(partition) / bsz): full batches here
    if rank == 0:
        split = " + ".join(map(str, batch_sizes(config.global_batch, size)))
        source = config.data_path or "synthetic data"
        print(
            f"{len(dataset)} samples of {source}, {size} ranks on {device.type}, "
            f"global batch {config.global_batch} = {split}, {num_batches} steps an epoch"
        )
    result = TrainResult()
    for epoch in range(config.epochs):
        epoch_loss = 0.0
        for data, target in train_set:
            data, target = data.to(device), target.to(device)
            epoch_loss += train_step(model, optimizer, data, target, loss_weight)
        print_line("Rank ", dist.get_rank(), ", epoch ", epoch, ": ", epoch_loss / num_batches)
        result.losses.append(epoch_loss / num_batches)
    result.digest = parameter_digest(model)
    # Synchronous SGD keeps the replicas bitwise identical: every rank prints the same digest.
    print_line("Rank ", dist.get_rank(), " parameters sha256 ", result.digest[:16])
    return result


def main(argv: list[str] | None = None) -> int:
    from tutorial_impl import cli  # the CLI's launcher, not the tutorial's

    parser = argparse.ArgumentParser(
        prog="python -m tutorial_impl train",
        description="4. Distributed synchronous SGD (Net, SGD lr 0.01 momentum 0.5, global "
        "batch 128) on synthetic MNIST-shaped data, or on MNIST IDX files with --data.",
    )
    cli.add_launch_arguments(parser)
    parser.add_argument("--epochs", type=int, default=3, help="epochs (default 3)")
    parser.add_argument(
        "--samples",
        type=int,
        default=None,
        help="dataset size (default: 4096 synthetic samples, or all of MNIST with --data)",
    )
    parser.add_argument("--data", default=None, help="directory holding the MNIST IDX files")
    parser.add_argument("--batch-size", type=int, default=GLOBAL_BATCH, help="global batch")
    args = parser.parse_args(argv)
    if args.epochs < 1:
        parser.error(f"--epochs must be at least 1, got {args.epochs}")
    config = TrainConfig(args.epochs, args.samples, args.data, args.batch_size)
    if not under_torchrun():
        # Check the data against the world size here, once, for a clear message before any
        # rank starts (under torchrun each rank checks for itself in partition_dataset).
        try:
            cli.check_backend(args.backend, args.world_size)
            dataset = get_dataset(config.data_path, config.samples)
            partition_dataset(dataset, config.global_batch, rank=0, size=args.world_size)
        except (ValueError, FileNotFoundError) as exc:
            parser.error(str(exc))
    # Every rank's first optimizer imports torch._dynamo (~1.3 s of CPU): preload it.
    demo = partial(run, config=config)
    results = cli.launch(demo, args.world_size, args.backend, args.timeout, ["torch._dynamo"])
    if len(results) > 1:
        same = len({r.digest for r in results}) == 1
        print(
            f"parameters identical on all {len(results)} ranks: {'yes' if same else 'NO'} "
            f"(sha256 {results[0].digest[:12]})"
        )
        return 0 if same else 1
    return 0


if __name__ == "__main__":
    run_main(main)
