"""2. Point-to-point communication: one process sends, one receives.

    python -m tutorial_impl p2p [--world-size N] [--backend gloo] [--mode blocking|nonblocking]

The tutorial's ``run`` functions are written for two ranks: rank 0 sends a tensor holding 1.0
and rank 1 receives it. Here rank 0 sends to *every* other rank, one after the other, so the
same code makes sense for any world size of two or more; with two ranks it is exactly the
tutorial's program and prints exactly its lines::

    Rank  0  has data  tensor(1.)
    Rank  1  has data  tensor(1.)
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from tutorial_impl.dist_tuto.process import print_line, rank_device, run_main, under_torchrun


def run_blocking(rank: int, size: int) -> torch.Tensor:
    """2.1 Blocking: ``send`` returns when the data is out, ``recv`` when it has arrived."""
    tensor = torch.zeros(1, device=rank_device())
    if rank == 0:
        tensor += 1
        # Send the tensor to every other process (the tutorial: to process 1).
        for dst in range(1, size):
            dist.send(tensor=tensor, dst=dst)
    else:
        # Receive tensor from process 0; the zeros were only a buffer of the right size.
        dist.recv(tensor=tensor, src=0)
    print_line("Rank ", rank, " has data ", tensor[0].cpu())
    return tensor.cpu()


def run_nonblocking(rank: int, size: int) -> torch.Tensor:
    """2.2 Non-blocking: ``isend``/``irecv`` return at once; ``wait()`` finishes the transfer.

    Until ``wait()`` returns, the sender must not modify its tensor and the receiver must not
    read its own: the transfer may still be in progress.
    """
    tensor = torch.zeros(1, device=rank_device())
    if rank == 0:
        tensor += 1
        reqs = [dist.isend(tensor=tensor, dst=dst) for dst in range(1, size)]
        print("Rank 0 started sending")
    else:
        reqs = [dist.irecv(tensor=tensor, src=0)]
        print(f"Rank {rank} started receiving")
    for req in reqs:
        req.wait()
    print_line("Rank ", rank, " has data ", tensor[0].cpu())
    return tensor.cpu()


MODES = {"blocking": run_blocking, "nonblocking": run_nonblocking}


def main(argv: list[str] | None = None) -> int:
    from tutorial_impl import cli  # the CLI's launcher, not the tutorial's

    parser = argparse.ArgumentParser(
        prog="python -m tutorial_impl p2p",
        description="2. point-to-point: rank 0 sends a tensor holding 1.0 to every other rank",
    )
    cli.add_launch_arguments(parser)
    parser.add_argument(
        "--mode",
        choices=[*MODES, "both"],
        default="both",
        help="2.1 blocking send/recv, 2.2 isend/irecv + wait, or both (default)",
    )
    args = cli.parse_launch_args(parser, argv, min_world_size=2)
    modes = list(MODES) if args.mode == "both" else [args.mode]

    def demo() -> None:
        for mode in modes:
            if os.environ.get("RANK", "0") == "0" or not under_torchrun():
                print(f"--- {mode} ---", flush=True)
            cli.launch(MODES[mode], args.world_size, args.backend, args.timeout)

    return cli.exit_status(demo)


if __name__ == "__main__":
    run_main(main)
