"""The command line's own machinery: starting a section's ranks on this machine, and options.

``python -m tutorial_impl <section>`` runs a section's demo on N local ranks. The tutorial
starts its ranks with ``mp.Process`` and the spawn start method (``dist_tuto/run.py``), which
costs a fresh interpreter, and ``import torch``, per rank: seconds. The CLI starts them the way
the test suite does, through the harness (``tutorial_impl.testing.run_ranks``): forked from a
warm server in milliseconds, on a rendezvous store the parent owns (no port to fight over),
with a deadline, and with a failed rank's traceback in the report. Under ``torchrun`` the
agent has started this process already, and ``launch`` runs just its rank.

Tutorial modules import this module only inside their ``main``: their rank functions never
depend on the harness, so a learner can copy them into a script of their own.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from tutorial_impl.dist_tuto.process import init_process, under_torchrun
from tutorial_impl.testing import RankError, RankTimeout, run_ranks
from tutorial_impl.testing.forkserver.server import add_preload

BACKENDS = ("gloo", "nccl", "mpi")


def check_backend(backend: str, world_size: int) -> None:
    """Refuse, with a clear message, a backend this machine cannot run."""
    if backend == "xccl":  # a real backend (Intel GPUs), named, with why it does not run here
        why = (
            "the demos place tensors on the CPU or on CUDA GPUs only"
            if dist.is_xccl_available()
            else "this torch has no XCCL (dist.is_xccl_available() is False)"
        )
        raise ValueError(f"backend 'xccl' (Intel GPUs) is not one the demos run: {why}")
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
    preload: Sequence[str] = (),
) -> list[Any]:
    """Run ``fn(rank, size)`` on ``world_size`` local ranks and print their output live.

    Returns each rank's return value. Under torchrun, runs only this process's rank.
    ``preload`` names modules every rank will import anyway: the server the local ranks are
    forked from imports them once instead (``torch._dynamo``, ~1.3 s of CPU, for example).
    """
    if under_torchrun():
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        check_backend(backend, size)
        return [init_process(rank, size, fn, backend)]
    if world_size < 1:
        raise ValueError(f"--world-size must be at least 1, got {world_size}")
    check_backend(backend, world_size)
    add_preload(list(preload))
    # The ranks get only the rendezvous environment, and init_process does the
    # init_process_group call itself, as in the tutorial.
    return run_local(init_process, fn, backend, world_size=world_size, timeout=timeout)


def run_local(fn: Callable[..., Any], *args: Any, world_size: int, timeout: float) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local ranks, output live.

    Each rank starts with torchrun's environment (MASTER_ADDR/PORT of a store our parent
    hosts, RANK, WORLD_SIZE, LOCAL_RANK) and no process group: ``fn`` joins what it needs.
    """
    return list(
        run_ranks(
            fn,
            *args,
            world_size=world_size,
            backend=None,
            timeout=timeout,
            stream=sys.stdout,
            stream_prefix=False,
        )
    )


def failure_report(exc: RankError, seconds: float, flag: str) -> str:
    """A failed run's report for someone at the command line: the exception's own report,
    and for a deadline, which of the command's options set it (``flag``)."""
    if not isinstance(exc, RankTimeout):
        return str(exc)
    return (
        f"still running when the deadline of {seconds:g} s passed (it follows {flag}; "
        f"give the run more time with {flag} SECONDS)\n{exc}"
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
