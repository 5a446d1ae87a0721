"""1. and 5.1 One rank's life: join the group, run, leave, end (``init_process`` grown up).

``run.py`` is the tutorial's template as it wrote it. The demos of every section run their
rank functions through the ``init_process`` below instead, which keeps the tutorial's shape
with four changes, each for a reason a learner will meet sooner or later:

* the address is a *default* (``setdefault``), so whoever starts the ranks can give a
  better one: ``torchrun``'s agent, or our CLI, whose parent owns the rendezvous store on a
  port the kernel picked, so two demos never fight over 29500;
* with NCCL each rank first takes *its own* GPU (``select_gpu``), as section 5.1 says, and
  binds its group to it (``device_id``);
* the ranks leave the group together (``barrier``, then ``destroy_process_group``);
* a torchrun worker ends without interpreter finalization (``exit_process``, ``run_main``).

The CLI's way of starting N local ranks lives in ``tutorial_impl/cli.py``.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.distributed as dist


def init_process(rank: int, size: int, fn: Callable[[int, int], Any], backend: str = "gloo") -> Any:
    """Initialize the distributed environment, run ``fn(rank, size)``, leave the group."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    device_id = None
    if backend == "nccl":
        # One GPU per rank, chosen before NCCL initialises (5.1: "Set device"), and the group
        # bound to it: with ``device_id`` NCCL connects now, not at the first collective, and
        # ``barrier`` knows which GPU to use instead of guessing (and warning that it did).
        device_id = select_gpu(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group(backend, rank=rank, world_size=size, device_id=device_id)
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
    collective, drops tensors that still have Python objects; that needs the GIL, and what
    happens to a thread asking for the GIL during finalization depends on the Python version.
    Up to 3.13 it is made to exit (``PyThread_exit_thread``), which in C++ ends in
    ``std::terminate``: "terminate called without an active exception", SIGABRT, after all
    the work was done (seen 2 runs in 15 under torchrun on a loaded 2-core machine). From
    3.14 it hangs instead (``PyThread_hang_thread``; CPython gh-87135, "Hang non-main threads
    that attempt to acquire the GIL during finalization"): the process exits once
    finalization is done, unless a later stage of it waits on something the hung thread
    holds, and then it deadlocks. So a worker ends the way a forked child does, without
    finalization, on every version: nothing of gloo runs after its last line of output.
    ``tests/dist_tuto/test_07_torchrun.py`` shows the threads outliving the group.
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
