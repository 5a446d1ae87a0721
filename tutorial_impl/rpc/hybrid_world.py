"""The hybrid world: one rank layout, its names, and how a worker joins it and leaves it.

The DDP + RPC tutorial (``hybrid.py``) and the DDP + RPC benchmark (``bench/ddp_rpc_workers.py``)
share this layout, for ``T`` trainers and ``P`` parameter servers::

    rank 0 .. T-1      trainer{i}   a DDP replica of the dense part; runs the training loop
    rank T             master       puts the table on the servers, drives the trainers
    rank T+1 .. T+P    ps{j}        holds part of the embedding table, answers lookups

With the tutorial's T=2, P=1 that is trainers 0 and 1, master 2, parameter server 3. (PyTorch's
benchmark script put the master last; here both follow the tutorial.) Any configuration with
``trainers`` and ``parameter_servers`` attributes describes a world.

Trainers first join a gloo process group of the trainers only (for DDP), then everyone joins
one RPC world. Both rendezvous on the same store (rank 0's, or torchrun's agent store)
without colliding: the process group keeps its keys under ``default_pg/``, RPC under
``rpc_prefix_N/``.

Leaving is the delicate part. A graceful ``rpc.shutdown`` waits for every worker and settles
every RRef with its owner; with a dead worker it would retry for minutes. So the master
announces how training ended, and the others shut down gracefully only after a success
(``serve``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from tutorial_impl.rpc.workers import filter_expected_warnings  # torch 2.13's, for RPC

MASTER = "master"
RPC_THREADS = 16  # TensorPipe's own default for num_worker_threads


class Layout(Protocol):
    """What fixes a world's ranks: ``HybridConfig`` and the benchmark's ``BenchConfig``."""

    @property
    def trainers(self) -> int: ...

    @property
    def parameter_servers(self) -> int: ...


def check_layout(layout: Layout) -> None:
    """Refuse a world without a trainer or a parameter server, naming the option."""
    if layout.trainers < 1:
        raise ValueError(f"--trainers must be at least 1, got {layout.trainers}")
    if layout.parameter_servers < 1:
        raise ValueError(f"--parameter-servers must be at least 1, got {layout.parameter_servers}")


def world_size(layout: Layout) -> int:
    return layout.trainers + 1 + layout.parameter_servers


def master_rank(layout: Layout) -> int:
    return layout.trainers


def ps_rank(layout: Layout, j: int) -> int:
    return layout.trainers + 1 + j


def trainer_name(i: int) -> str:
    return f"trainer{i}"


def ps_name(j: int) -> str:
    return f"ps{j}"


def role_of(rank: int, layout: Layout) -> tuple[str, int]:
    """``("trainer", i)``, ``("master", 0)`` or ``("ps", j)`` for a rank of the world."""
    if not 0 <= rank < world_size(layout):
        raise ValueError(f"rank {rank} outside a world of {world_size(layout)}")
    if rank < layout.trainers:
        return "trainer", rank
    if rank == master_rank(layout):
        return MASTER, 0
    return "ps", rank - layout.trainers - 1


def worker_name(rank: int, layout: Layout) -> str:
    """The RPC name of a rank: ``trainer{i}``, ``master`` or ``ps{j}``."""
    role, i = role_of(rank, layout)
    if role == "trainer":
        return trainer_name(i)
    return ps_name(i) if role == "ps" else MASTER


def check_worker(name: str) -> rpc.WorkerInfo:
    """The RPC worker called ``name``, or a ValueError that lists the ones there are."""
    infos = rpc._get_current_rpc_agent().get_worker_infos()
    for info in infos:
        if info.name == name:
            return info
    known = ", ".join(sorted(i.name for i in infos))
    raise ValueError(f"unknown RPC worker {name!r}; this world has: {known}")


def trainer_device(i: int, device: str) -> torch.device:
    """CPU, or trainer i's own GPU (round-robin when there are fewer GPUs than trainers).

    Never two ranks on one GPU is this project's rule for the first tutorial's lessons
    (``select_gpu`` in ``tutorial_impl/dist_tuto/process.py``), not the tutorial's; it is
    there for NCCL: two ranks of one NCCL group on one device are refused ("Duplicate GPU
    detected") or, on some versions, hang. The trainers' group here is gloo, which
    moves CUDA tensors through host memory, so two trainers may share a GPU; they then only
    share its memory and compute (a laptop with one GPU still runs the CUDA path). With as
    many GPUs as trainers, each trainer's Linear is on a GPU of its own.
    """
    if device != "cuda":
        return torch.device("cpu")
    gpu = torch.device("cuda", i % torch.cuda.device_count())
    torch.cuda.set_device(gpu)  # DDP's buckets and the looked-up rows land here
    return gpu


# --- Joining and leaving ------------------------------------------------------------------


def rpc_init_method() -> str:
    """Where RPC meets: the store at MASTER_ADDR:MASTER_PORT, as ``env://`` would find it.

    ``TensorPipeRpcBackendOptions``'s default init method is ``env://`` itself, which reads
    these same two variables; the URL spells the address out so that errors and logs show
    which store RPC used. Under the harness (and our CLI, which runs the harness) rank 0
    hosts it, as torch's ``env://`` makes rank 0 do; under torchrun it is the agent's store
    (or, for a ``backend=None`` test, again rank 0's). RPC keeps its keys under
    a prefix of its own there, so it never collides with a process group on the same store.
    """
    return f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"


def join(rank: int, layout: Layout, rpc_timeout: float, rpc_threads: int = RPC_THREADS) -> str:
    """Join the trainers' process group (trainers only), then the RPC world; our name."""
    check_layout(layout)
    _outcome_known.clear()
    filter_expected_warnings()
    role, i = role_of(rank, layout)
    if role == "trainer":
        # WORLD_SIZE and RANK in the environment describe the whole RPC world: the DDP
        # group of the trainers is smaller, so rank and size are given explicitly.
        dist.init_process_group(
            "gloo",
            init_method=rpc_init_method(),
            rank=i,
            world_size=layout.trainers,
            timeout=timedelta(seconds=rpc_timeout),
        )
    name = worker_name(rank, layout)
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=rpc_init_method(), rpc_timeout=rpc_timeout, num_worker_threads=rpc_threads
    )
    rpc.init_rpc(name, rank=rank, world_size=world_size(layout), rpc_backend_options=options)
    return name


# How training ended, as the master announces it to every other worker (see serve).
_outcome: dict[str, bool] = {}
_outcome_known = threading.Event()


def _receive_outcome(ok: bool) -> None:
    """Runs on every worker but the master, called by the master over RPC."""
    _outcome["ok"] = ok
    _outcome_known.set()


def announce_outcome(ok: bool, rpc_timeout: float) -> None:
    """The master tells everyone else whether training succeeded (bounded, best effort)."""
    me = rpc.get_worker_info().name
    others = [i.name for i in rpc._get_current_rpc_agent().get_worker_infos() if i.name != me]
    futs = [rpc.rpc_async(n, _receive_outcome, args=(ok,), timeout=rpc_timeout) for n in others]
    for fut in futs:
        try:
            fut.wait()
        except RuntimeError:
            pass  # a dead worker cannot hear it; the others still must


def wait_for_outcome(timeout: float) -> bool:
    """Wait for the master's word; no word within ``timeout`` counts as failure."""
    return _outcome_known.wait(timeout) and _outcome["ok"]


def leave(rpc_timeout: float, graceful: bool = True) -> None:
    """Leave RPC and, on a trainer, the trainers' group.

    A graceful shutdown waits for every worker and settles every RRef with its owner: right
    when all went well, but with a dead worker it would retry messages to it for minutes.
    After a failure we therefore leave locally (``graceful=False``).
    """
    try:
        rpc.shutdown(graceful=graceful, timeout=rpc_timeout)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def serve(
    rank: int,
    layout: Layout,
    master: Callable[[], dict[str, Any]],
    *,
    rpc_timeout: float,
    train_timeout: float,
    rpc_threads: int = RPC_THREADS,
) -> dict[str, Any]:
    """One process of the world, from joining to leaving; only the master has work of its own.

    The master runs ``master()`` (which drives the trainers over RPC) and announces how it
    ended; trainers and servers answer RPCs until that word comes (at most ``train_timeout``
    plus one RPC timeout). The word decides how everyone leaves. Returns the process's name,
    pid and either the master's report or, elsewhere, ``training_ok``.
    """
    name = join(rank, layout, rpc_timeout, rpc_threads)
    result: dict[str, Any] = {"name": name, "pid": os.getpid()}
    ok = False
    try:
        if name == MASTER:
            try:
                result.update(master())
                ok = True
            finally:
                announce_outcome(ok, rpc_timeout)
        else:
            ok = wait_for_outcome(train_timeout + rpc_timeout)
            result["training_ok"] = ok
    finally:
        leave(rpc_timeout, graceful=ok)
    return result
