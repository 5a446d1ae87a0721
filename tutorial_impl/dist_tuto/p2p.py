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
import time

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


def run_send_waits_for_recv(
    rank: int, size: int, delay: float = 0.1
) -> list[tuple[float, float]] | float:
    """2.1, seen on a clock: a gloo ``send`` returns only after its receiver called ``recv``.

    Rank 0 sends to each receiver in turn and returns, per receiver, when its ``send`` was
    called and when it returned. Just before each ``send`` it posts a note on another tag
    (an ``isend``, which waits for nobody): the receiver waits for the note, so it knows the
    ``send`` has been called, sleeps ``delay`` seconds more (a late receiver, however late
    its process started), notes when it calls ``recv`` (``time.monotonic()``, one clock for
    every process of a machine) and returns that time. With gloo every send returns after its
    receiver's ``recv`` began, whatever the size, one float included: gloo's TCP transport
    sends no data ahead. A ``send`` only announces itself; the data leaves when the receiver
    answers that its ``recv`` is posted, and ``send`` returns once it has left. (MPI may copy
    a small message into a buffer and return at once; NCCL's ``send`` returns as soon as it
    is queued on the GPU's stream. "Blocking" promises only that the tensor may be reused
    when ``send`` returns.)
    """
    data, note = 0, 1  # tags: the payload and "my send is called"
    tensor = torch.zeros(1, device=rank_device())
    if rank == 0:
        times = []
        for dst in range(1, size):
            called = time.monotonic()
            noted = dist.isend(torch.ones(1, device=rank_device()), dst=dst, tag=note)
            dist.send(tensor=tensor, dst=dst, tag=data)
            times.append((called, time.monotonic()))
            noted.wait()
        return times
    dist.recv(torch.zeros(1, device=rank_device()), src=0, tag=note)
    time.sleep(delay)  # a late receiver: rank 0 is already in its send
    entered = time.monotonic()
    dist.recv(tensor=tensor, src=0, tag=data)
    return entered


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


def run_send_buffer_reuse(rank: int, size: int, refill_before_wait: bool = False) -> list[float]:
    """2.3 The sender's half of the rule: do not touch a tensor you ``isend`` before ``wait()``.

    ``isend`` does not copy the tensor: gloo sends straight from its memory once the receiver
    has posted a matching receive, which may be long after ``isend`` returned. Rank 0 sends
    1.0, then 2.0, through one buffer; rank 1 is slow, and posts its first receive only
    after rank 0 has told it (a small message on another tag) that it has moved on.

    Kept, the rule gives rank 1 ``[1.0, 2.0]``: the buffer is refilled only after ``wait()``
    says the first transfer is over. Broken (``refill_before_wait=True``), rank 1 receives
    ``[2.0, 2.0]``: the first message left the buffer after the refill. No race decides
    this; the receiver's order does. (Another transport may send eagerly, and then the
    mistake corrupts only sometimes, which is worse. ``tensor.clone()`` before refilling is
    the other correct fix.) Rank 0 returns what it meant to send.
    """
    buffer = torch.zeros(1, device=rank_device())
    moved_on = torch.zeros(1, device=rank_device())
    if rank == 0:
        buffer.fill_(1.0)
        request = dist.isend(tensor=buffer, dst=1)
        if refill_before_wait:
            buffer.fill_(2.0)  # the mistake: the first send has not happened yet
        dist.send(tensor=moved_on, dst=1, tag=1)  # "I have moved on"
        request.wait()  # from here on, the buffer is ours again
        buffer.fill_(2.0)
        dist.isend(tensor=buffer, dst=1).wait()
        return [1.0, 2.0]
    received = []
    if rank == 1:
        dist.recv(tensor=moved_on, src=0, tag=1)  # a slow receiver: posts only now
        for _ in range(2):
            dist.recv(tensor=buffer, src=0)
            received.append(buffer.item())
    return received


def run_ring_exchange(rank: int, size: int) -> list[float]:
    """Every rank sends to its right neighbour and receives from its left, in one batch.

    Written as two blocking calls, ``send`` then ``recv``, this ring would stall on gloo: every
    rank would sit in ``send`` waiting for its neighbour's ``recv``, which comes only after
    that neighbour's own ``send`` (``run_send_waits_for_recv`` shows why), until the group's
    timeout (30 minutes by default) ends it: "Timed out waiting ...ms for send operation to
    complete", or on a rank a moment behind, the connection its timed-out peer dropped
    (measured in tests/dist_tuto/test_08_failure.py). With
    ``batch_isend_irecv`` the sends and receives of the list are posted together, so their
    order in the list does not matter; here every rank lists its send first. On NCCL the
    batch becomes one NCCL group of operations (``ncclGroupStart``/``ncclGroupEnd``), which
    is how NCCL wants a rank's sends and receives issued together, and the current GPU must be
    this rank's own (``select_gpu``). Returns what arrived from the left: ``rank - 1``'s value.
    """
    device = rank_device()
    mine = torch.full((2,), float(rank), device=device)
    from_left = torch.full((2,), -1.0, device=device)
    ops = [
        dist.P2POp(dist.isend, mine, (rank + 1) % size),
        dist.P2POp(dist.irecv, from_left, (rank - 1) % size),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return from_left.cpu().tolist()


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
