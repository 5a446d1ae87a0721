"""The tutorial's run template: ``init_process`` and starting N local ranks.

The tutorial's ``run.py`` sets ``MASTER_ADDR``/``MASTER_PORT`` itself and starts the ranks
with ``mp.Process``. We keep ``init_process`` exactly as the tutorial has it, with one change:
the address is a *default* (``setdefault``), so whoever starts the ranks can give a better
one. Our launcher does, through the test harness: its parent process owns the rendezvous
store on a port the kernel picked, so two demos (or two test runs) never fight over 29500.
Under ``torchrun`` the environment already holds RANK, WORLD_SIZE and the agent's store, and
``launch`` simply runs this process's rank.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tutorial_impl.testing import RankError, run_ranks

BACKENDS = ("gloo", "nccl", "mpi")


def init_process(rank: int, size: int, fn: Callable[[int, int], Any], backend: str = "gloo") -> Any:
    """Initialize the distributed environment, run ``fn(rank, size)``, leave the group."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    if backend == "nccl":
        # One GPU per rank, chosen before NCCL initialises (5.1: "Set device").
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    dist.init_process_group(backend, rank=rank, world_size=size)
    try:
        result = fn(rank, size)
        # Leave together. A rank that tears down its connections while a peer is still
        # finishing with them can make gloo abort the process on its way out (seen as SIGABRT,
        # "terminate called without an active exception", in 1 of ~10 torchrun runs here).
        # Only on success: after a failure the peers may never arrive, and the launcher's
        # deadline (or torchrun) ends them instead.
        dist.barrier()
        return result
    finally:
        dist.destroy_process_group()


def rank_device() -> torch.device:
    """Where this rank's tensors live: its GPU under NCCL (which moves CUDA tensors only),
    else the CPU. Gloo and MPI work on CPU tensors."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def print_line(*values: object) -> None:
    """The tutorial's ``print('Rank ', rank, ' has data ', tensor[0])``, as one write.

    ``print`` with several arguments writes them one by one, so two ranks that share a
    terminal or a pipe (every torchrun worker does) can interleave inside a line:
    ``Rank Rank   01  has data ...``. Joining first makes each line a single write, which a
    pipe delivers whole. The text is exactly what the tutorial's print produces.
    """
    sys.stdout.write(" ".join(map(str, values)) + "\n")
    sys.stdout.flush()


def under_torchrun() -> bool:
    """True when this process is one rank that torchrun (torch.distributed.run) started."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


def check_backend(backend: str, world_size: int) -> None:
    """Refuse, with a clear message, a backend this machine cannot run."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "mpi" and not dist.is_mpi_available():
        raise ValueError("backend 'mpi' needs a torch built with MPI; this one is not")
    if backend == "nccl":
        if not dist.is_nccl_available() or not torch.cuda.is_available():
            raise ValueError("backend 'nccl' needs CUDA GPUs and a CUDA build of torch")
        if torch.cuda.device_count() < world_size and not under_torchrun():
            raise ValueError(
                f"backend 'nccl' needs one GPU per rank: {world_size} ranks, "
                f"{torch.cuda.device_count()} GPUs"
            )


def launch(
    fn: Callable[[int, int], Any],
    world_size: int = 2,
    backend: str = "gloo",
    timeout: float = 300.0,
) -> list[Any]:
    """Run ``fn(rank, size)`` on ``world_size`` local ranks and print their output live.

    Returns each rank's return value. Under torchrun, runs only this process's rank.
    """
    if under_torchrun():
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        check_backend(backend, size)
        return [init_process(rank, size, fn, backend)]
    if world_size < 1:
        raise ValueError(f"--world-size must be at least 1, got {world_size}")
    check_backend(backend, world_size)
    # backend=None: the ranks get only the rendezvous environment, and init_process does
    # the init_process_group call itself, as in the tutorial.
    return list(
        run_ranks(
            init_process,
            fn,
            backend,
            world_size=world_size,
            backend=None,
            timeout=timeout,
            stream=sys.stdout,
            stream_prefix=False,
        )
    )


def exit_status(demo: Callable[[], object]) -> int:
    """Run a section's demo for the CLI: a failed rank becomes its report and exit status 1.

    The report (the rank, its traceback, every rank's output) is already readable, so the
    command prints it instead of a second traceback of the launcher itself.
    """
    try:
        demo()
    except RankError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


def add_launch_arguments(parser: argparse.ArgumentParser, world_size: int = 2) -> None:
    """The options every tutorial section's demo takes."""
    parser.add_argument("--world-size", type=int, default=world_size, help="number of ranks")
    parser.add_argument("--backend", default="gloo", help=f"one of {', '.join(BACKENDS)}")
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds before the ranks are stopped"
    )


def parse_launch_args(
    parser: argparse.ArgumentParser, argv: list[str] | None, min_world_size: int = 1
) -> argparse.Namespace:
    """Parse ``argv`` and refuse a bad world size or backend with a clear usage error.

    Done here, in the parent, so the user reads one line instead of a traceback per rank.
    Under torchrun the world size comes from torchrun, so only the backend is checked.
    """
    args = parser.parse_args(argv)
    world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.world_size
    if world_size < min_world_size:
        parser.error(f"--world-size must be at least {min_world_size}, got {world_size}")
    try:
        check_backend(args.backend, world_size)
    except ValueError as exc:
        parser.error(str(exc))
    return args
