"""1. Setup and 5.2 initialization methods: how N processes find each other.

    python -m tutorial_impl setup [--world-size N] [--backend gloo] [--init-method env|tcp|file]

``dist.init_process_group`` needs a *rendezvous*: a place where every rank can publish its
address and read the others'. The tutorial names three ways to give it one:

* ``env://`` (the default): read ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK`` and ``WORLD_SIZE``
  from the environment. This is what ``torchrun`` sets up, and what ``init_process`` uses.
* ``tcp://ADDR:PORT``: the same store, named in the URL; rank and world size are arguments.
* ``file:///path``: a file on a filesystem every rank can reach (with ``fcntl`` locking). It
  must not exist beforehand, or hold keys from an earlier group: use a fresh name each time.

Each rank here joins a group with the chosen method, proves the group works with one
all-reduce, and leaves.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist

from tutorial_impl.dist_tuto.process import rank_device, run_main, select_gpu, under_torchrun

INIT_METHODS = ("env", "tcp", "file")


def init_method_url(kind: str, shared_dir: str) -> str:
    """The ``init_method`` of 5.2 for ``kind``: ``env://``, ``tcp://ADDR:PORT`` or ``file://``.

    ``tcp://`` names the same address and port ``env://`` would read. ``file://`` names a file
    in ``shared_dir``, a directory every rank can reach that is fresh for this group: the
    file must not hold keys of an earlier group.
    """
    if kind == "env":
        return "env://"
    if kind == "tcp":
        return f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    if kind == "file":
        return "file://" + os.path.join(shared_dir, "rendezvous")
    raise ValueError(f"unknown init method {kind!r}; choose one of {', '.join(INIT_METHODS)}")


def run(rank: int, size: int) -> dict[str, object]:
    """The template's ``run`` ("to be implemented later"): report the group we are in."""
    total = torch.tensor([rank + 1.0], device=rank_device())
    dist.all_reduce(total)  # 1 + 2 + ... + size, if every rank really is in the group
    print(
        f"Rank {rank} of {size} is in a {dist.get_backend()} group; sum of rank+1: {total.item():g}"
    )
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "sum": total.item(),
    }


def join_with(
    rank: int, size: int, kind: str, shared_dir: str, backend: str = "gloo"
) -> dict[str, object]:
    """Join a process group through ``kind`` (env, tcp or file), run ``run``, leave."""
    url = init_method_url(kind, shared_dir)
    print(f"Rank {rank} joins through {url}")
    if backend == "nccl":
        select_gpu(int(os.environ.get("LOCAL_RANK", rank)))
    if kind == "env":
        # Everything comes from the environment: RANK and WORLD_SIZE too.
        dist.init_process_group(backend, init_method=url, timeout=timedelta(seconds=60))
    else:
        dist.init_process_group(
            backend, init_method=url, rank=rank, world_size=size, timeout=timedelta(seconds=60)
        )
    try:
        return {**run(rank, size), "init_method": url}
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    from tutorial_impl import cli  # the CLI's launcher, not the tutorial's

    parser = argparse.ArgumentParser(
        prog="python -m tutorial_impl setup",
        description="1. the run template and 5.2 init methods: every rank joins a group "
        "(env://, tcp:// or file://) and proves it with one all_reduce",
    )
    cli.add_launch_arguments(parser)
    parser.add_argument("--init-method", choices=INIT_METHODS, default="env")
    args = cli.parse_launch_args(parser, argv)
    if under_torchrun():
        # torchrun started us: one rank here, the others elsewhere, all with the same
        # environment. A file:// rendezvous needs a fresh file that every rank sees, which
        # torchrun has no way to hand out, so only env:// and tcp:// make sense here.
        if args.init_method == "file":
            parser.error("under torchrun use --init-method env or tcp (file:// needs a fresh file)")
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        join_with(rank, size, args.init_method, tempfile.gettempdir(), args.backend)
        return 0
    with tempfile.TemporaryDirectory(prefix="rendezvous-") as shared_dir:
        return cli.exit_status(
            lambda: cli.run_local(
                join_with,
                args.init_method,
                shared_dir,
                args.backend,
                world_size=args.world_size,
                timeout=args.timeout,
            )
        )


if __name__ == "__main__":
    run_main(main)
