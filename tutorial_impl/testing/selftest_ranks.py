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


def all_reduce_value(rank: int, world_size: int, base: int) -> int:
    """Every rank contributes ``base + rank``; the sum tells the parent which group ran."""
    t = torch.tensor([base + rank], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t.item())


def all_reduce_cuda(rank: int, world_size: int) -> tuple[float, int, str]:
    """NCCL: each rank reduces a tensor on its own GPU (the harness chose it before init)."""
    device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(t)
    return t.item(), device.index, dist.get_backend()


def echo(rank: int, world_size: int, *args: object, **kwargs: object) -> tuple:
    """Return what the rank received, to prove arguments travel to every rank intact."""
    print(f"rank {rank} got {len(args)} args")
    return rank, world_size, args, kwargs


def init_itself(rank: int, world_size: int, how: str) -> dict[str, object]:
    """``backend=None``: no group yet; join one through the rendezvous env, as under torchrun."""
    from datetime import timedelta

    from tutorial_impl.testing.rendezvous import init_method_url

    had_group = dist.is_initialized()
    dist.init_process_group(
        "gloo",
        init_method=init_method_url(how),
        rank=int(os.environ["RANK"]),  # tcp:// wants them spelled out; the harness set both
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timedelta(seconds=30),
    )
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return {
        "had_group": had_group,
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "sum": t.item(),
        "agent_store": os.environ.get("TORCHELASTIC_USE_AGENT_STORE"),
    }


def getenv(rank: int, world_size: int, name: str) -> str | None:
    return os.environ.get(name)


def report_env(rank: int, world_size: int) -> dict[str, object]:
    """What the rank sees of its world: group state, env vars, threads."""
    return {
        "rank": dist.get_rank() if dist.is_initialized() else None,
        "world_size": dist.get_world_size() if dist.is_initialized() else None,
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "env_rank": os.environ.get("RANK"),
        "threads": torch.get_num_threads(),
        "pid": os.getpid(),
        "frozen_objects": __import__("gc").get_freeze_count(),
    }


def fail_on(rank: int, world_size: int, bad_rank: int, pid_dir: str | None = None) -> None:
    """``bad_rank`` raises; every other rank waits in a collective that can never finish."""
    write_pid(pid_dir, rank)
    print(f"rank {rank} is about to {'fail' if rank == bad_rank else 'wait'}")
    dist.barrier()  # every rank has printed its line before anyone fails
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
        if pid_dir is not None:  # when it died, to measure how soon the parent noticed
            with open(os.path.join(pid_dir, f"rank{rank}.killed_at"), "w") as f:
                f.write(repr(time.time()))
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


def family_then_hang(rank: int, world_size: int, pid_dir: str) -> None:
    """Record this rank, its parent (the forkserver) and a grandchild, then hang.

    For the tests that interrupt or kill the pytest run itself: every recorded process must
    be gone shortly afterwards, including the forkserver and the rank's own child.
    """
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    proctable.record(pid_dir, f"grandchild{rank}", child.pid)
    proctable.record(pid_dir, "forkserver", os.getppid())
    write_pid(pid_dir, rank)  # last: once all rank files exist, every record is written
    _sleep_forever()


def unpicklable_result(rank: int, world_size: int):
    return lambda: rank
