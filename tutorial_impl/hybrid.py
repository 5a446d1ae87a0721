"""Combining DistributedDataParallel with the distributed RPC framework (the hybrid tutorial).

Roles, for ``T`` trainers and ``P`` parameter servers (the tutorial has T=2, P=1)::

    rank 0 .. T-1    trainer{i}   DDP(Linear) replica, runs the training loop
    rank T           master       creates the table on the servers, drives the trainers
    rank T+1 ..      ps{j}        holds rows of the EmbeddingBag, answers lookups

Trainers first join a gloo process group of the trainers only (for DDP), then everyone
joins one RPC world. Both rendezvous on the same store (the harness's, or torchrun's agent
store) without colliding, because RPC keeps its keys under a prefix of its own.

Every wait has a deadline: each RPC has ``rpc_timeout``, the master's call that runs a
whole training loop has ``train_timeout``, the trainers' collectives the group timeout,
and the final ``rpc.shutdown`` waits at most ``rpc_timeout`` for the others.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn
from torch.distributed.nn import RemoteModule

from tutorial_impl.hybrid_model import (
    EMBEDDING_DIM,
    Batch,
    HybridModel,
    ShardedEmbeddingBag,
    get_learnable_batch,
    get_next_batch,
    shard_bounds,
    trainer_generator,
)
from tutorial_impl.launch import under_torchrun
from tutorial_impl.testing.rendezvous import rpc_init_method

with warnings.catch_warnings():
    # Importing the distributed optimizer compiles its functional optimizers with
    # TorchScript, and torch 2.13 warns once per compiled function that TorchScript is
    # deprecated. Nothing else happens in this block.
    warnings.filterwarnings(
        "ignore",
        message=r"`torch\.jit\.(script|interface)` is deprecated",
        category=DeprecationWarning,
    )
    from torch.distributed.optim import DistributedOptimizer

DATASETS: dict[str, Callable[..., Iterator[Batch]]] = {
    "tutorial": get_next_batch,  # random labels, as in the tutorial
    "learnable": get_learnable_batch,  # labels a linear model can learn
}


@dataclass(frozen=True)
class HybridConfig:
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
    role, i = role_of(rank, config)
    return {"trainer": trainer_name, "ps": ps_name}.get(role, lambda _: MASTER)(i)


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


# --- The master ------------------------------------------------------------------------


def create_embedding(
    config: HybridConfig, module_cls: type[nn.Module] = nn.EmbeddingBag, **kwargs: Any
) -> ShardedEmbeddingBag:
    """Put the table's rows on the parameter servers, as ``RemoteModule(EmbeddingBag)``s.

    The master draws the whole table from ``seed`` (N(0, 1), EmbeddingBag's own init) and
    sends each server its rows: so the table is the same however it is sharded.
    """
    g = torch.Generator().manual_seed(config.seed)
    table = torch.randn(config.num_embeddings, EMBEDDING_DIM, generator=g)
    bounds = shard_bounds(config.num_embeddings, config.parameter_servers)
    shards = []
    for j, (start, end) in enumerate(bounds):
        check_worker(ps_name(j))
        shards.append(
            RemoteModule(
                f"{ps_name(j)}/cpu",
                module_cls,
                args=(end - start, EMBEDDING_DIM),
                kwargs={"mode": "sum", "_weight": table[start:end].clone(), **kwargs},
            )
        )
    return ShardedEmbeddingBag(shards, bounds)


def run_master(
    config: HybridConfig, trainer_fn: Callable[..., Any] | None = None, **emb_kwargs: Any
) -> dict[str, Any]:
    """Create the table, run ``trainer_fn`` on every trainer, wait for all of them."""
    trainer_fn = trainer_fn or _run_trainer
    remote_emb_module = create_embedding(config, **emb_kwargs)
    initial = remote_emb_module.weight()
    futs = {}
    for i in range(config.trainers):
        name = trainer_name(i)
        check_worker(name)
        futs[name] = rpc.rpc_async(
            name, trainer_fn, args=(remote_emb_module, i, config), timeout=config.train_timeout
        )
    # Wait for every trainer (each wait bounded by train_timeout) and report every failure.
    reports, failures = {}, []
    for name, fut in futs.items():
        try:
            reports[name] = fut.wait()
        except RuntimeError as exc:
            # A remote error arrives as text: where it happened, the error, the remote
            # traceback. Keep the first two lines here; the master's log has the rest.
            print(f"{name} failed: {exc}", file=sys.stderr, flush=True)
            failures.append(f"{name} failed: " + " ".join(str(exc).splitlines()[:2]))
    if failures:
        raise RuntimeError("training failed:\n" + "\n".join(failures))
    if config.verbose:
        print("Training complete", flush=True)
    return {"trainers": reports, "initial_table": initial, "table": remote_emb_module.weight()}


# --- The trainers ----------------------------------------------------------------------


def _setup_trainer(
    remote_emb_module: ShardedEmbeddingBag, rank: int, config: HybridConfig
) -> tuple[HybridModel, DistributedOptimizer, nn.Module]:
    torch.manual_seed(config.seed)  # the fc's init; DDP then broadcasts trainer 0's anyway
    model = HybridModel(remote_emb_module, trainer_device(rank, config))
    # RRefs of every parameter: the table's on the servers, plus our own fc's. We cannot
    # use model.parameters(): the table's parameters are only reachable as RRefs.
    model_parameter_rrefs = remote_emb_module.remote_parameters()
    for param in model.fc.parameters():
        model_parameter_rrefs.append(rpc.RRef(param))
    opt = DistributedOptimizer(torch.optim.SGD, model_parameter_rrefs, lr=config.lr)
    return model, opt, nn.CrossEntropyLoss()


def _run_trainer(
    remote_emb_module: ShardedEmbeddingBag, rank: int, config: HybridConfig
) -> dict[str, Any]:
    """The tutorial's training loop; runs on a trainer, called by the master over RPC."""
    model, opt, criterion = _setup_trainer(remote_emb_module, rank, config)
    batches = DATASETS[config.data]
    generator = trainer_generator(config.seed, rank)
    epoch_losses = []
    for epoch in range(config.epochs):
        losses = []
        for indices, offsets, target in batches(generator, config.batches, config.num_embeddings):
            # Every iteration gets a fresh context that holds its own gradients, so there
            # is nothing to zero.
            with dist_autograd.context() as context_id:
                output = model(indices, offsets)
                loss = criterion(output, target.to(model.device))
                dist_autograd.backward(context_id, [loss])
                opt.step(context_id)
            losses.append(loss.item())
        epoch_losses.append(sum(losses) / max(len(losses), 1))
        if config.verbose:
            print(f"Trainer {rank} - Epoch {epoch} - Loss: {epoch_losses[-1]:.4f}", flush=True)
    return {"losses": epoch_losses, "device": str(model.device)}


# --- Every worker ----------------------------------------------------------------------


# Deprecation warnings torch 2.13 emits for this (maintenance-mode) API, each matched by its
# message, category and the torch module that issues it. ``catch_warnings`` around our calls
# cannot catch them: DDP warns from the RPC thread that runs ``_run_trainer``, and
# ``DistributedOptimizer`` builds its TorchScript optimizers in RPC handler threads of
# whichever process owns parameters (the servers too). So every process installs these.
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


def run_worker(
    rank: int,
    world_size: int,
    config: HybridConfig,
    trainer_fn: Callable[..., Any] | None = None,
    **emb_kwargs: Any,
) -> dict[str, Any]:
    """One process of the hybrid world; the master's result holds every trainer's report.

    As in the tutorial, only the master has work of its own: trainers and servers answer
    RPCs until the master says how training ended. That word decides how they leave.
    """
    if world_size != config.world_size:
        raise ValueError(
            f"{config.trainers} trainers + 1 master + {config.parameter_servers} parameter "
            f"servers need {config.world_size} processes, not {world_size}"
        )
    name = init_worker(rank, config)
    result: dict[str, Any] = {"name": name, "pid": os.getpid()}
    ok = False
    try:
        if name == MASTER:
            try:
                result.update(run_master(config, trainer_fn, **emb_kwargs))
                ok = True
            finally:
                announce_outcome(config, ok)
        else:
            ok = wait_for_outcome(config)
            result["training_ok"] = ok
    finally:
        shutdown_worker(config, graceful=ok)
    return result


# --- Command line ----------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tutorial_impl hybrid",
        description="DDP + RPC: trainers with a DDP Linear, an EmbeddingBag on parameter servers",
    )
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--parameter-servers", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batches", type=int, default=10, help="batches per epoch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--data", choices=tuple(DATASETS), default="tutorial")
    parser.add_argument("--rpc-timeout", type=float, default=30.0, help="seconds per RPC")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole run")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = HybridConfig(
        trainers=args.trainers,
        parameter_servers=args.parameter_servers,
        epochs=args.epochs,
        batches=args.batches,
        seed=args.seed,
        device=args.device,
        data=args.data,
        rpc_timeout=args.rpc_timeout,
        train_timeout=args.timeout,
    )
    try:
        config.check()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if under_torchrun():
        run_worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), config)
        return 0

    from tutorial_impl.testing.supervisor import RankError, run_ranks

    start = time.perf_counter()
    try:
        run_ranks(
            run_worker,
            config,
            world_size=config.world_size,
            backend=None,
            timeout=args.timeout + 2 * args.rpc_timeout,
            stream=sys.stdout,
            stream_prefix=False,
        )
    except RankError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{config.world_size} processes, {time.perf_counter() - start:.1f} s")
    return 0
