"""The hybrid world: its configuration, its roles and names, how a worker joins and leaves.

Roles, for ``T`` trainers and ``P`` parameter servers (the tutorial has T=2, P=1)::

    rank 0 .. T-1    trainer{i}   DDP(Linear) replica, runs the training loop
    rank T           master       creates the table on the servers, drives the trainers
    rank T+1 ..      ps{j}        holds rows of the EmbeddingBag, answers lookups

Trainers first join a gloo process group of the trainers only (for DDP), then everyone
joins one RPC world. Both rendezvous on the same store (the harness's, or torchrun's agent
store) without colliding: the process group keeps its keys under ``default_pg/``, RPC under
``rpc_prefix_N/``.

Leaving is the delicate part. A graceful ``rpc.shutdown`` waits for every worker and settles
every RRef with its owner; with a dead worker it would retry for minutes. So the master
announces how training ended, and the others shut down gracefully only after a success.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from tutorial_impl.rpc.hybrid_model import DATASETS, shard_bounds
from tutorial_impl.rpc.workers import filter_expected_warnings  # torch 2.13's, for RPC


def rpc_init_method() -> str:
    """Where RPC meets: the store at MASTER_ADDR:MASTER_PORT, as ``env://`` would find it.

    ``TensorPipeRpcBackendOptions`` takes a URL, not ``env://``. Under torchrun (and our
    CLI, which sets the same environment) this is the agent's store; RPC keeps its keys under
    a prefix of its own there, so it never collides with a process group on the same store.
    """
    return f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"


@dataclass(frozen=True)
class HybridConfig:
    """Everything every process of the world must agree on; sent to each one as is."""

    trainers: int = 2
    parameter_servers: int = 1
    epochs: int = 3
    batches: int = 10  # per epoch
    seed: int = 0
    device: str = "cpu"  # "cuda": each trainer's fc on its own GPU
    lr: float = 0.05
    num_embeddings: int = 100
    data: str = "tutorial"  # a key of DATASETS
    rpc_timeout: float = 30.0  # seconds, for every RPC and the trainers' collectives
    train_timeout: float = 300.0  # seconds, for the master's wait on a whole training loop
    verbose: bool = True

    @property
    def world_size(self) -> int:
        return self.trainers + 1 + self.parameter_servers

    def check(self) -> None:
        """Refuse a configuration that cannot run, before any process waits for another."""
        if self.trainers < 1:
            raise ValueError(f"need at least one trainer, got --trainers {self.trainers}")
        if self.parameter_servers < 1:
            raise ValueError(f"need at least one parameter server, got {self.parameter_servers}")
        shard_bounds(self.num_embeddings, self.parameter_servers)
        if self.data not in DATASETS:
            raise ValueError(f"unknown data {self.data!r}; choose one of {', '.join(DATASETS)}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda needs CUDA, which this machine does not have")
        if min(self.epochs, self.batches) < 0 or min(self.rpc_timeout, self.train_timeout) <= 0:
            raise ValueError("epochs and batches must be >= 0 and timeouts positive")


# --- Roles and names -------------------------------------------------------------------


def trainer_name(i: int) -> str:
    return f"trainer{i}"


def ps_name(j: int) -> str:
    return f"ps{j}"


MASTER = "master"


def role_of(rank: int, config: HybridConfig) -> tuple[str, int]:
    """``("trainer", i)``, ``("master", 0)`` or ``("ps", j)`` for a rank of the world."""
    if not 0 <= rank < config.world_size:
        raise ValueError(f"rank {rank} outside a world of {config.world_size}")
    if rank < config.trainers:
        return "trainer", rank
    if rank == config.trainers:
        return "master", 0
    return "ps", rank - config.trainers - 1


def worker_name(rank: int, config: HybridConfig) -> str:
    """The RPC name of a rank: ``trainer{i}``, ``master`` or ``ps{j}``."""
    role, i = role_of(rank, config)
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


def trainer_device(i: int, config: HybridConfig) -> torch.device:
    """CPU, or trainer i's own GPU (round-robin when there are fewer GPUs than trainers)."""
    if config.device == "cuda":
        return torch.device("cuda", i % torch.cuda.device_count())
    return torch.device("cpu")


def init_worker(rank: int, config: HybridConfig) -> str:
    """Join the trainers' process group (trainers only), then the RPC world."""
    config.check()
    _outcome_known.clear()
    filter_expected_warnings()
    role, i = role_of(rank, config)
    if role == "trainer":
        # WORLD_SIZE and RANK in the environment describe the whole RPC world: the DDP
        # group of the trainers is smaller, so rank and size are given explicitly.
        dist.init_process_group(
            "gloo",
            init_method=rpc_init_method(),
            rank=i,
            world_size=config.trainers,
            timeout=timedelta(seconds=config.rpc_timeout),
        )
    name = worker_name(rank, config)
    rpc.init_rpc(
        name,
        rank=rank,
        world_size=config.world_size,
        rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
            init_method=rpc_init_method(), rpc_timeout=config.rpc_timeout
        ),
    )
    return name


# How training ended, as the master announces it to every other worker (see run_worker).
_outcome: dict[str, bool] = {}
_outcome_known = threading.Event()


def _receive_outcome(ok: bool) -> None:
    """Runs on every worker but the master, called by the master over RPC."""
    _outcome["ok"] = ok
    _outcome_known.set()


def announce_outcome(config: HybridConfig, ok: bool) -> None:
    """The master tells everyone else whether training succeeded (bounded, best effort)."""
    me = rpc.get_worker_info().name
    others = [i.name for i in rpc._get_current_rpc_agent().get_worker_infos() if i.name != me]
    futs = [
        rpc.rpc_async(name, _receive_outcome, args=(ok,), timeout=config.rpc_timeout)
        for name in others
    ]
    for fut in futs:
        try:
            fut.wait()
        except RuntimeError:
            pass  # a dead worker cannot hear it; the others still must


def wait_for_outcome(config: HybridConfig) -> bool:
    """Wait for the master's word; no word within the training deadline counts as failure."""
    return _outcome_known.wait(config.train_timeout + config.rpc_timeout) and _outcome["ok"]


def shutdown_worker(config: HybridConfig, graceful: bool = True) -> None:
    """Leave RPC and, on a trainer, the trainers' group.

    A graceful shutdown waits for every worker and settles every RRef with its owner: right
    when all went well, but with a dead worker it would retry messages to it for minutes.
    After a failure we therefore leave locally (``graceful=False``).
    """
    try:
        rpc.shutdown(graceful=graceful, timeout=config.rpc_timeout)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
