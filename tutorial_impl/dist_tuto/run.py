#!/usr/bin/env python
"""1. Setup: the tutorial's ``run.py``, as it wrote it, with 2.1's ``run`` filled in.

    python -m tutorial_impl.dist_tuto.run        # two processes; rank 1 prints tensor(1.)

This is how the tutorial starts N processes: ``mp.Process`` with the *spawn* start method,
one fresh interpreter per rank, each of which imports torch (seconds), sets the rendezvous
address, joins the group and runs ``run``. Read it first; everything else builds on it.

What the rest of the repository does differently, and where:

* ``process.py`` keeps this ``init_process`` and grows it: one GPU per rank under NCCL,
  leaving the group together, and ending a worker without a crash at exit.
* ``tutorial_impl/cli.py`` (``python -m tutorial_impl <section>``) and the test suite start
  the ranks through the test harness instead: forked from a server that has imported torch
  already (milliseconds, not seconds), on a rendezvous store the parent owns.

One line differs from the tutorial: the address is set with ``setdefault``, so whoever
starts this script may pass a free port (the test of this file does); the tutorial's
``127.0.0.1:29500`` stays the default.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank, size):
    tensor = torch.zeros(1)
    if rank == 0:
        tensor += 1
        # Send the tensor to process 1
        dist.send(tensor=tensor, dst=1)
    else:
        # Receive tensor from process 0
        dist.recv(tensor=tensor, src=0)
    print("Rank ", rank, " has data ", tensor[0])


def init_process(rank, size, fn, backend="gloo"):
    """Initialize the distributed environment."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # the tutorial: os.environ[...] = ...
    os.environ.setdefault("MASTER_PORT", "29500")
    dist.init_process_group(backend, rank=rank, world_size=size)
    fn(rank, size)
    # The tutorial ends here, leaving the group to the interpreter's exit. Usually fine;
    # process.exit_process explains the rare crash at exit this can cause, and the cure.


if __name__ == "__main__":
    world_size = 2
    processes = []
    if "google.colab" in sys.modules:
        print("Running in Google Colab")
        # As the tutorial writes it, this line does nothing: get_context returns a spawn
        # context and the result is dropped, so mp.Process below uses Colab's default start
        # method (fork). Colab cannot set_start_method a second time; to really spawn there,
        # use the context: ctx = mp.get_context("spawn"); ctx.Process(...).
        mp.get_context("spawn")
    else:
        mp.set_start_method("spawn")
    for rank in range(world_size):
        p = mp.Process(target=init_process, args=(rank, world_size, run))
        p.start()
        processes.append(p)

    for p in processes:
        p.join()
