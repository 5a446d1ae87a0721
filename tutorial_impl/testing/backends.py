"""Backends and devices: which backend a test asked for, whether this machine has it, which GPUs.

One module answers these questions for the plugin (skip at collection), the runners
(refuse before any rank starts) and the rank (pick its device), so the three never disagree:

* **Parsing.** A backend is ``"gloo"``, ``"nccl"``, ``"mpi"`` (any name in torch's
  ``dist.Backend.backend_list``, third-party backends included), a per-device form such as
  ``"cpu:gloo,cuda:nccl"``, or ``None`` for ranks that build their own groups.
* **Availability.** NCCL needs a torch built with it and one GPU per rank; MPI needs a torch
  built with it *and* ranks started by an MPI launcher: every forked rank that calls
  ``init_process_group("mpi")`` alone would be a world of one, so the harness refuses MPI
  above world size 1 unless this process itself was launched by ``mpirun``.
* **GPU leases.** Two xdist workers each running a GPU test would both put their rank 0 on
  GPU 0, the case NCCL rejects. So a GPU test *leases* the GPUs it needs for its duration
  (an ``flock`` per device, shared by every process of this user on this host) and its ranks
  see only those, through ``CUDA_VISIBLE_DEVICES``: rank r's ``cuda:r`` is then the r-th
  leased GPU. A test waits for free GPUs up to its deadline, then skips with the reason.

Importing this module does not import torch; the functions that need it import it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

# Variables set by MPI launchers (Open MPI, MPICH/Hydra, Intel MPI, Slurm's PMI) in each rank.
MPI_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")


def parts(backend: str) -> list[str]:
    """The backend names in ``backend``: ``"cpu:gloo,cuda:nccl"`` -> ``["gloo", "nccl"]``."""
    return [part.rsplit(":", 1)[-1].strip().lower() for part in backend.split(",")]


def uses_nccl(backend: str | None) -> bool:
    """True for ``"nccl"`` and for per-device forms that name it (``"cpu:gloo,cuda:nccl"``)."""
    return backend is not None and "nccl" in parts(backend)


def uses_mpi(backend: str | None) -> bool:
    return backend is not None and "mpi" in parts(backend)


def check(backend: object) -> None:
    """Raise a ValueError naming ``backend`` and what is accepted, unless torch knows it."""
    if backend is None:
        return
    if not isinstance(backend, str) or not backend.strip():
        raise ValueError(
            f"backend must be a string such as 'gloo', 'nccl' or 'cpu:gloo,cuda:nccl', or None "
            f"for ranks that set up their own groups; got {backend!r}"
        )
    if backend == "gloo":
        return
    import torch.distributed as dist

    # backend_list includes third-party backends registered with dist.Backend.register_backend.
    known = [b for b in dist.Backend.backend_list if b != "undefined"]
    unknown = [n for n in parts(backend) if n not in known]
    if unknown:
        raise ValueError(
            f"unknown backend {backend!r}; expected one of {', '.join(known)}, a per-device "
            "form such as 'cpu:gloo,cuda:nccl', or None for ranks that set up their own groups"
        )


def launched_by_mpi() -> bool:
    """True when this process was started by an MPI launcher (mpirun, mpiexec, srun)."""
    return any(name in os.environ for name in MPI_LAUNCHER_VARS)


def mpi_refusal(backend: str | None, world_size: int) -> str | None:
    """Why forked ranks cannot use MPI at this world size, or None."""
    if not uses_mpi(backend) or world_size <= 1 or launched_by_mpi():
        return None
    return (
        f"backend {backend!r} at world size {world_size}: MPI takes its ranks from the MPI "
        "launcher, so each forked rank would be a world of one. Use world size 1, or launch "
        "the processes with mpirun"
    )


def gpu_shortage(backend: str | None, world_size: int, gpus: int) -> str | None:
    """Why ``world_size`` ranks cannot each have a GPU of their own, or None if they can.

    NCCL needs one GPU per rank; two ranks on one GPU would not fail but silently share it
    (NCCL then refuses some collectives, and timings mean nothing), so the harness refuses.
    """
    if not uses_nccl(backend) or world_size <= gpus:
        return None
    return (
        f"backend {backend!r} needs one GPU per rank: world_size {world_size} but "
        f"{gpus} GPU(s) visible; lower the world size or run on a machine with more GPUs"
    )


def gpus_needed(backend: str | None, world_size: int, marked: int) -> int:
    """GPUs a test needs: its ``dist_gpu(n)``, and one per rank on NCCL."""
    return max(marked, world_size if uses_nccl(backend) else 0)


def why_not_here(backend: str | None, world_size: int, gpus: int) -> str | None:
    """The reason this machine cannot run the test, or None. Decided in the parent."""
    if backend in (None, "gloo") and not gpus:
        return None
    import torch
    import torch.distributed as dist

    if uses_nccl(backend) and not dist.is_nccl_available():
        return "NCCL is not available in this build of torch"
    if uses_mpi(backend) and not dist.is_mpi_available():
        return "MPI backend not available (torch was built without MPI)"
    if gpus:
        if not torch.cuda.is_available():
            return f"needs CUDA and {gpus} GPU(s); CUDA is not available"
        if torch.cuda.device_count() < gpus:
            return f"needs {gpus} GPUs, found {torch.cuda.device_count()}"
    return None


# --- GPU leases: no two concurrent tests on one GPU ------------------------------------------


def visible_gpus() -> list[str]:
    """This process's GPUs as ``CUDA_VISIBLE_DEVICES`` names them (indices or UUIDs)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def lease_dir() -> Path:
    """Where the lock files live: one per device, shared by this user's processes on this host."""
    path = Path(tempfile.gettempdir()) / f"tutorial_impl-gpu-leases-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


@contextlib.contextmanager
def lease(
    n: int, devices: list[str], timeout: float, directory: Path | None = None
) -> Iterator[list[str] | None]:
    """Hold ``n`` of ``devices`` for the block; yields them, or None if none freed in time.

    Each device is an exclusive ``flock`` on its own file, taken without blocking; a process
    that dies releases its locks with its file descriptors, so a crashed test leaks nothing.
    """
    directory = directory or lease_dir()
    deadline = time.monotonic() + timeout
    held: list[tuple[str, int]] = []
    try:
        while True:
            for device in devices:
                if len(held) == n:
                    break
                fd = os.open(directory / f"gpu-{device}.lock", os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                held.append((device, fd))
            if len(held) == n:
                yield [device for device, _ in held]
                return
            # Not enough free: give back what we hold (another test may need exactly those),
            # wait, try again. Holding a partial set while waiting could deadlock two tests.
            _unlock(held)
            held = []
            if time.monotonic() >= deadline:
                yield None
                return
            time.sleep(0.05)
    finally:
        _unlock(held)


def _unlock(held: list[tuple[str, int]]) -> None:
    for _, fd in held:
        os.close(fd)  # closing the descriptor releases its flock


def hold(stack: contextlib.ExitStack, n: int, timeout: float) -> str | None:
    """Lease ``n`` of this process's GPUs on ``stack`` and show only those to the test and
    its ranks (``CUDA_VISIBLE_DEVICES``, restored when ``stack`` closes); the reason, if none
    freed within ``timeout`` seconds."""
    devices = visible_gpus()
    leased = stack.enter_context(lease(n, devices, timeout))
    if leased is None:
        return (
            f"needs {n} GPU(s) of {len(devices)}, and other tests (other xdist workers) held "
            f"them for {timeout:g} s; run fewer workers (-n)"
        )
    previous = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(leased)
    stack.callback(_restore_env, "CUDA_VISIBLE_DEVICES", previous)
    return None


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
