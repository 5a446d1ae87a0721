"""Combining DistributedDataParallel with the distributed RPC framework (the hybrid tutorial).

The tutorial's four processes: trainers 0 and 1, the master (rank 2) and the parameter
server (rank 3), generalised to T trainers and P servers (see ``hybrid_world`` for roles,
joining and leaving, ``hybrid_model`` for the model). The master creates the embedding table
on the servers and runs ``_run_trainer`` on every trainer over RPC; each trainer trains a
``HybridModel`` with distributed autograd and a ``DistributedOptimizer``.

Every wait has a deadline: each RPC has ``rpc_timeout``, the master's call that runs a
whole training loop has ``train_timeout``, the trainers' collectives the group timeout,
and ``rpc.shutdown`` at most ``rpc_timeout`` more.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn
from torch.distributed.nn import RemoteModule

from tutorial_impl.dist_tuto.process import under_torchrun
from tutorial_impl.rpc.hybrid_model import (
    DATASETS,
    EMBEDDING_DIM,
    HybridModel,
    ShardedEmbeddingBag,
    shard_bounds,
    trainer_generator,
)
from tutorial_impl.rpc.hybrid_world import (  # noqa: F401 - re-exported: one import for users
    MASTER,
    HybridConfig,
    announce_outcome,
    check_worker,
    filter_expected_warnings,
    init_worker,
    ps_name,
    role_of,
    shutdown_worker,
    trainer_device,
    trainer_name,
    wait_for_outcome,
    worker_name,
)
from tutorial_impl.rpc.optimizer import DistributedOptimizer  # imported without its warnings

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

    from tutorial_impl.cli import RankError, run_local  # the CLI's launcher

    start = time.perf_counter()
    try:
        run_local(
            run_worker,
            config,
            world_size=config.world_size,
            timeout=args.timeout + 2 * args.rpc_timeout,
        )
    except RankError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{config.world_size} processes, {time.perf_counter() - start:.1f} s")
    return 0
