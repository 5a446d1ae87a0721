"""Rank functions the harness tests itself with: one for each way a rank can end.

They live in the package, not in ``tests/``, because a rank finds its function by importing
its module, and test files are not importable modules.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from tutorial_impl.testing import proctable


def write_pid(pid_dir: str | None, rank: int) -> None:
    """Record this rank in the process table check (see ``proctable``), if asked to."""
    if pid_dir is not None:
        proctable.record_self(pid_dir, f"rank{rank}")


def all_reduce_rank(rank: int, world_size: int, pid_dir: str | None = None) -> float:
    """The smallest useful group: every rank contributes rank + 1; returns the sum."""
    write_pid(pid_dir, rank)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def report_env(rank: int, world_size: int) -> dict[str, object]:
    """What the rank sees of its world: group state, env vars, threads."""
    return {
        "rank": dist.get_rank() if dist.is_initialized() else None,
        "world_size": dist.get_world_size() if dist.is_initialized() else None,
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "env_rank": os.environ.get("RANK"),
        "threads": torch.get_num_threads(),
        "pid": os.getpid(),
    }


def fail_on(rank: int, world_size: int, bad_rank: int, pid_dir: str | None = None) -> None:
    """``bad_rank`` raises; every other rank waits in a collective that can never finish."""
    write_pid(pid_dir, rank)
    print(f"rank {rank} is about to {'fail' if rank == bad_rank else 'wait'}")
    if rank == bad_rank:
        raise ValueError(f"boom from rank {rank}")
    dist.barrier()


def skip_on(rank: int, world_size: int, skip_rank: int) -> None:
    import pytest

    if rank == skip_rank:
        pytest.skip("this rank has no work here")
    dist.barrier()


def hang_on(rank: int, world_size: int, hang_rank: int, pid_dir: str | None = None) -> None:
    """``hang_rank`` sleeps (a stand-in for a missing send); the others block in a barrier."""
    write_pid(pid_dir, rank)
    if rank == hang_rank:
        _sleep_forever()
    dist.barrier()


def _sleep_forever() -> None:
    while True:
        time.sleep(0.05)


def hang_all(rank: int, world_size: int, pid_dir: str | None = None) -> None:
    write_pid(pid_dir, rank)
    _sleep_forever()


def kill_self_on(rank: int, world_size: int, bad_rank: int, pid_dir: str | None = None) -> None:
    """``bad_rank`` dies by SIGKILL, as the OOM killer would do it."""
    import signal

    write_pid(pid_dir, rank)
    if rank == bad_rank:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def exit_on(rank: int, world_size: int, bad_rank: int, code: int, pid_dir: str | None = None):
    """``bad_rank`` leaves with ``os._exit(code)``: no exception, no result."""
    write_pid(pid_dir, rank)
    if rank == bad_rank:
        os._exit(code)
    dist.barrier()


def spawn_child_and_hang(rank: int, world_size: int, pid_dir: str) -> None:
    """Start a grandchild process, record its pid, then hang: the harness must kill both."""
    import subprocess
    import sys

    write_pid(pid_dir, rank)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    proctable.record(pid_dir, f"grandchild{rank}", child.pid)
    _sleep_forever()


def unpicklable_result(rank: int, world_size: int):
    return lambda: rank
