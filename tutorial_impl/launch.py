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
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

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
        select_gpu(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group(backend, rank=rank, world_size=size)
    try:
        result = fn(rank, size)
        # Leave together: a rank that closes its connections while a peer still reads from
        # them can reset what the peer has not read yet. Only on success: after a failure
        # the peers may never arrive, and the launcher's deadline (or torchrun) ends them.
        dist.barrier()
        return result
    finally:
        # Forget the group. This does NOT always stop gloo's threads: see ``exit_process``.
        dist.destroy_process_group()


def select_gpu(local_rank: int) -> torch.device:
    """Make ``cuda:local_rank`` this process's GPU, or refuse if there is no such GPU.

    NCCL needs one GPU per rank on a node. Wrapping around (``local_rank % device_count``)
    would put two ranks on one GPU, which NCCL rejects later with "Duplicate GPU detected"
    (or, worse, some versions hang), so a node with too few GPUs gets a clear error now.
    """
    count = torch.cuda.device_count()
    if not 0 <= local_rank < count:
        raise ValueError(
            f"local rank {local_rank} needs its own GPU, but this node has {count} GPU(s): "
            f"start at most {count} NCCL ranks per node"
        )
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def exit_process(code: int) -> NoReturn:
    """End a worker that used a process group: flush its output, then ``os._exit(code)``.

    Why a distributed worker should not simply return from ``main``: returning starts the
    interpreter's shutdown (``Py_FinalizeEx``), and gloo's worker threads may still be
    running then. ``destroy_process_group`` removes the group from ``torch.distributed``'s
    tables, but the C++ group (and the threads it owns) lives on while *anything* still holds
    a reference to it: a ``Work`` object you kept, a DDP model, or a library imported after
    ``init_process_group`` (importing ``torch._dynamo``, which the first optimizer does,
    keeps the group alive: measured on torch 2.13). Such a thread, finishing the last
    collective, drops tensors that still have Python objects; that needs the GIL, and a
    thread asking for the GIL during finalization is made to exit, which in C++ ends in
    ``std::terminate``: "terminate called without an active exception", SIGABRT, after all
    the work was done (seen 2 runs in 15 under torchrun on a loaded 2-core machine). So a
    worker ends the way a forked child does, without finalization: nothing of gloo runs
    after its last line of output. ``tests/test_07_torchrun.py`` shows the threads outliving
    the group.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_main(main: Callable[[], int | None]) -> NoReturn:
    """Run a demo's ``main`` and exit with its status; a torchrun worker via ``exit_process``.

    Only a torchrun worker has joined a process group itself: our own launcher's parent never
    does (its ranks are forked children, which always end with ``os._exit``). In a worker,
    an exception or ``sys.exit`` (argparse's errors) still gives its traceback or message
    and its exit status, but without the interpreter's finalization.
    """
    if not under_torchrun():
        sys.exit(main())
    try:
        code = main() or 0
    except SystemExit as exc:  # argparse's usage errors, sys.exit(n)
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - report it, then exit without finalization
        traceback.print_exc()
        code = 1
    exit_process(code)


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
