"""Joining and leaving an RPC world: ``init_rpc`` with TensorPipe options, and ``shutdown``.

Every process of the world calls ``init_rpc(name, rank, world_size, ...)`` once. That one call
starts the RPC agent, the RRef framework and distributed autograd. The reference's example::

    rpc.init_rpc("worker1", rank=0, world_size=2,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
                     num_worker_threads=8, rpc_timeout=20))

Here the names follow the reference (``worker0``, ``worker1``, ...), the backend is named
explicitly (``BackendType.TENSORPIPE``, the default and on torch 2.x the only one), and the
rendezvous is ``env://``: MASTER_ADDR and MASTER_PORT from the environment, which torchrun or
any launcher sets.

Leaving: a *graceful* ``rpc.shutdown()`` is a collective. It returns only once every worker
has called it and no worker has an RPC in flight any more, so work that was started with
``rpc_async`` and never waited for still finishes (``tests/rpc/test_rpc_calls.py`` shows
what it waits for).
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch.distributed.rpc as rpc

DEFAULT_RPC_TIMEOUT = 20.0  # seconds, as in the reference's example


def worker_name(rank: int) -> str:
    """The RPC name of a rank: ``worker0``, ``worker1``, ... as in the reference."""
    return f"worker{rank}"


def check_timeout(seconds: float, what: str = "rpc_timeout") -> float:
    """Refuse a timeout that would not bound a wait.

    torch reads 0 as "no timeout at all", and a per-call timeout of -1 as "unset: use the
    agent's default" (``rpc.constants.UNSET_RPC_TIMEOUT``); neither bounds a wait as someone
    who typed it as a deadline meant, so we say so up front.
    """
    if not seconds > 0:  # also catches NaN
        raise ValueError(f"{what} must be a positive number of seconds, got {seconds!r}")
    return float(seconds)


def rpc_options(
    rpc_timeout: float = DEFAULT_RPC_TIMEOUT,
    num_worker_threads: int = 16,
    device_maps: dict[str, dict[str, str]] | None = None,
) -> rpc.TensorPipeRpcBackendOptions:
    """TensorPipe options: the default timeout of every RPC, the size of the thread pool that
    runs the requests this worker receives (at most that many run at once), and where CUDA
    tensors sent to each callee land (``{"worker1": {"cuda:0": "cuda:1"}}``: this worker's
    cuda:0 arrives on worker1's cuda:1). Without a device map, TensorPipe sends CPU tensors
    only."""
    if num_worker_threads < 1:
        raise ValueError(f"num_worker_threads must be at least 1, got {num_worker_threads}")
    return rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=num_worker_threads,
        rpc_timeout=check_timeout(rpc_timeout),
        init_method="env://",
        device_maps=device_maps,
    )


def init_worker(
    rank: int,
    world_size: int,
    rpc_timeout: float = DEFAULT_RPC_TIMEOUT,
    num_worker_threads: int = 16,
    device_maps: dict[str, dict[str, str]] | None = None,
) -> str:
    """Join the RPC world as ``worker{rank}``; returns that name."""
    filter_expected_warnings()
    name = worker_name(rank)
    rpc.init_rpc(
        name,
        backend=rpc.BackendType.TENSORPIPE,
        rank=rank,
        world_size=world_size,
        rpc_backend_options=rpc_options(rpc_timeout, num_worker_threads, device_maps),
    )
    return name


def shutdown_worker(timeout: float = DEFAULT_RPC_TIMEOUT) -> None:
    """Leave gracefully, within ``timeout`` seconds. torch's default, 0, sets no deadline at
    all: a graceful shutdown then waits for as long as some worker has not called it."""
    rpc.shutdown(graceful=True, timeout=check_timeout(timeout, "shutdown timeout"))


# --- What a graceful shutdown waits for ---------------------------------------------------


def slow_work(seconds: float) -> float:
    """Work that takes a while on the callee; returns when it finished (``time.monotonic``)."""
    time.sleep(seconds)
    return time.monotonic()


def shutdown_with_work_in_flight(
    callee: str, seconds: float, timeout: float = DEFAULT_RPC_TIMEOUT
) -> dict[str, Any]:
    """Start ``slow_work`` on ``callee`` with ``rpc_async``, never wait for it, and leave.

    A graceful shutdown waits for it: when ``shutdown`` returns, the future is complete.
    """
    future = rpc.rpc_async(callee, slow_work, args=(seconds,))
    started = time.monotonic()
    shutdown_worker(timeout)
    return {
        "shutdown_started": started,
        "shutdown_returned": time.monotonic(),
        "future_done": future.done(),
        "work_finished": future.value(),
    }


# --- Expected warnings ----------------------------------------------------------------------

# Deprecation warnings torch 2.13 emits for this API (no longer actively developed: see
# "RPC today" in docs/course.md), each matched by its message, category and the torch module
# that issues it. ``init_rpc`` and ``shutdown`` use a gloo group internally, which warns;
# ``DistributedOptimizer`` builds TorchScript optimizers in RPC handler threads of whichever
# process owns parameters. ``catch_warnings`` around our own calls cannot catch warnings
# raised in those threads, so every process installs these.
EXPECTED_WARNINGS = (
    (
        r"You are using a Backend <class '.*ProcessGroupGloo'> as a ProcessGroup",
        UserWarning,
        r"torch\.distributed\.distributed_c10d",
    ),
    (r"`torch\.jit\.script` is deprecated", DeprecationWarning, r"torch\.jit\._script"),
)
# This one torch raises inside its own ``catch_warnings(); simplefilter("always")``, which
# overrides every filter; the only place left to drop it is where warnings are displayed.
FORCED_WARNING = "`TorchScript` support for functional optimizers is deprecated"


def filter_expected_warnings() -> None:
    for message, category, module in EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    show = warnings.showwarning
    if getattr(show, "drops", None) == FORCED_WARNING:
        return  # installed already

    def showwarning(message, category, *args, **kwargs):  # type: ignore[no-untyped-def]
        if not (category is DeprecationWarning and str(message).startswith(FORCED_WARNING)):
            show(message, category, *args, **kwargs)

    showwarning.drops = FORCED_WARNING  # type: ignore[attr-defined]
    warnings.showwarning = showwarning
