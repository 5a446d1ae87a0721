"""D21. A stuck collective, on NCCL and on gloo: what ends it, and what a job sets for it.

A collective that some rank never joins does not fail by itself: its peers wait. What ends
the wait differs by backend, and a job on GPUs must know which.

* **gloo** (the CPU here) runs the collective in the thread that called it, and raises there
  once the group's timeout has passed (``init_process_group(timeout=...)``,
  ``new_group(timeout=...)``; lesson T8).
* **NCCL** returns at once: the collective is queued on a CUDA stream, and ``wait()`` only makes
  the current stream wait for NCCL's. So no Python thread sees the hang. Each NCCL group has a
  *watchdog* thread that polls its collectives; one that runs past the group's timeout makes
  it abort the communicator (``ncclCommAbort``) and, with ``TORCH_NCCL_ASYNC_ERROR_HANDLING``
  at 3 (``SkipCleanUp``, the default), end the process: a rank never goes on with a
  communicator in an unknown state. Its launcher sees the exit and stops or restarts the job
  (lesson T8, torchrun's restarts). ``NCCL_ENV`` lists what the watchdog reads, by the names
  in torch's own ``ProcessGroupNCCL.hpp``.

Two calls bound a wait, on either backend:

1. ``work.wait(timeout)`` on a collective started with ``async_op=True``: at most ``timeout``.
   On gloo it raises ("Operation timed out!") and the collective goes on: a later ``wait()``
   returns when the late rank arrives, with the right result (``bounded_wait``). On NCCL the
   header says it "will block the CPU thread until the NCCL work is completed or timed out",
   raising at the timeout (``TORCH_NCCL_BLOCKING_WAIT=1`` makes every ``wait()`` do that).
2. ``group.abort()``: on NCCL it aborts the communicator ("similar to ncclCommAbort"), ending
   what is in flight; the group is unusable after it (destroy it, make a new one: how torchft
   recovers without restarting). The base ``Backend.abort`` does nothing "if the backend
   [does not support] it", and gloo's does not in torch 2.13: it returns at once and the
   collective in flight still ends at the group's timeout (``abort_in_flight``, measured).

    python -m tutorial_impl.ddp.nccl_practice     # 2 local ranks (gloo)
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from tutorial_impl.ddp import toy
from tutorial_impl.dist_tuto.process import print_line, rank_device

# What the NCCL watchdog reads from the environment, and what each does.
NCCL_ENV = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "after a collective timed out or failed: 0 nothing, "
    "1 abort the communicator and end the process, 2 abort only, 3 end the process without "
    "cleaning up (the default)",
    "TORCH_NCCL_BLOCKING_WAIT": "1: every wait() blocks the CPU until the collective ends or "
    "times out, and raises then",
    "TORCH_NCCL_ENABLE_MONITORING": "1: a second thread ends the process when the watchdog "
    "itself stops beating (a CUDA or NCCL call that hangs)",
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "how long that thread waits for the watchdog's beat",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1: at a timeout, the flight recorder's records are written "
    "(with the monitoring thread on and a trace buffer, TORCH_FR_BUFFER_SIZE > 0)",
    "TORCH_NCCL_PROPAGATE_ERROR": "1: a rank's NCCL error is told to the other ranks through "
    "the store, so that they stop too",
}
# ``TORCH_NCCL_ASYNC_ERROR_HANDLING``'s values: torch's ``ErrorHandlingMode``.
ERROR_HANDLING = {"NoHandling": 0, "TearDown": 1, "CleanUpOnly": 2, "SkipCleanUp": 3}


def bounded_wait(rank: int, size: int, timeout: float = 0.4, late: float = 1.5) -> dict:
    """One all_reduce of ones; the last rank joins ``late`` seconds after rank 0 started it
    (rank 0 tells it when, with a note sent first). Rank 0 waits at most ``timeout`` for the
    all_reduce, then waits again until it ends. Every rank returns the sum; rank 0 also what
    the bounded wait raised, when it gave up and when the collective ended (seconds from just
    before its note, so that the late rank joins ``late`` seconds after that at the earliest)."""
    tensor = torch.ones(1, device=rank_device())
    note = torch.zeros(1, device=rank_device())
    start = time.monotonic()
    if rank == size - 1:
        dist.recv(note, src=0)  # rank 0 is about to start the all_reduce
        time.sleep(late)  # the late rank
    elif rank == 0:
        dist.send(note, dst=size - 1)  # its lateness counts from after ``start``
    work = dist.all_reduce(tensor, async_op=True)
    if rank != 0:
        work.wait()
        return {"sum": tensor.item()}
    try:
        work.wait(timedelta(seconds=timeout))
        raised = None
    except RuntimeError as exc:  # the collective did not end within ``timeout``
        raised = str(exc)
    gave_up = time.monotonic() - start
    work.wait()  # it went on all the same: it ends when the late rank joins
    return {"raised": raised, "gave_up": gave_up, "ended": time.monotonic() - start,
            "sum": tensor.item()}  # fmt: skip


def abort_in_flight(rank: int, size: int, abort_after: float = 0.3, timeout: float = 1.5) -> dict:
    """An all_reduce on a new group (timeout ``timeout``) that only rank 0 enters; every rank
    aborts the group after ``abort_after`` seconds, from a thread of its own (a watchdog of
    the job's). Every rank returns when its abort returned; rank 0 also when, and how, its
    collective ended. Then the group is destroyed, as an aborted group must be."""
    group = dist.new_group(list(range(size)), timeout=timedelta(seconds=timeout))
    dist.barrier()  # every rank has the group before rank 0 uses it
    start = time.monotonic()
    aborted: list[float] = []

    def watchdog() -> None:
        time.sleep(abort_after)
        group.abort()
        aborted.append(time.monotonic() - start)

    thread = threading.Thread(target=watchdog, name="watchdog")
    thread.start()
    ended = error = None
    if rank == 0:
        try:
            dist.all_reduce(torch.ones(1, device=rank_device()), group=group)
        except RuntimeError as exc:
            error = str(exc)
        ended = time.monotonic() - start
    thread.join()
    # The others keep the group until rank 0's collective has ended: destroying it closes
    # their connections, and that would end rank 0's wait too ("Connection closed by peer",
    # as a crashed peer does), which is not what this measures.
    dist.barrier()
    dist.destroy_process_group(group)
    return {"aborted": aborted[0], "ended": ended, "error": error}


def demo(rank: int, size: int) -> None:
    waited = bounded_wait(rank, size)
    if rank == 0:
        gave_up, ended, total = waited["gave_up"], waited["ended"], waited["sum"]
        print_line(f"wait(0.4 s) gave up after {gave_up:.2f} s: {waited['raised']}; "
                   f"the all_reduce ended after {ended:.2f} s, sum {total:g}")  # fmt: skip
    stuck = abort_in_flight(rank, size)
    if rank == 0:
        aborted, ended = stuck["aborted"], stuck["ended"]
        print_line(f"{dist.get_backend()}: abort() returned after {aborted:.2f} s; "
                   f"the all_reduce ended after {ended:.2f} s")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = toy.demo_parser(
        __name__, "D21. A stuck collective: a bounded wait, an abort, the group's timeout."
    ).parse_args(argv)
    return toy.main(demo, args.world_size, args.timeout)


if __name__ == "__main__":
    toy.run_as_script(main)  # the package's copy of this module: see toy.py
