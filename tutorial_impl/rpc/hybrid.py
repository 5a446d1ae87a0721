"""Combining DistributedDataParallel with the distributed RPC framework (the hybrid tutorial).

The tutorial's four processes: trainers 0 and 1, the master (rank 2) and the parameter server
(rank 3), generalised to T trainers and P servers (``hybrid_world`` holds the layout, joining
and leaving; ``hybrid_model`` the model; ``hybrid_data`` the batches). The master puts the
embedding table on the servers and runs ``_run_trainer`` on every trainer over RPC; each
trainer trains a ``HybridModel`` with distributed autograd and a ``DistributedOptimizer``.
The DDP + RPC benchmark (``bench/ddp_rpc_workers.py``) reuses the master's ``run_trainers``
and the trainer's ``distributed_optimizer`` and ``train_step``.

Every wait has a deadline: each RPC has ``rpc_timeout``, the master's call that runs a whole
training loop has ``train_timeout``, the trainers' collectives the group timeout, and
``rpc.shutdown`` at most ``rpc_timeout`` more.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn

from tutorial_impl.dist_tuto.process import print_line, under_torchrun
from tutorial_impl.rpc import hybrid_world as world
from tutorial_impl.rpc.hybrid_data import DATASETS, Batch, trainer_generator
from tutorial_impl.rpc.hybrid_model import (
    EMBEDDING_DIM,
    NUM_CLASSES,
    HybridModel,
    RemoteEmbeddingBag,
    create_remote_embedding,
)
from tutorial_impl.rpc.optimizer import DistributedOptimizer  # imported without its warnings


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
        return world.world_size(self)

    def check(self) -> None:
        """Refuse a configuration that cannot run, before any process waits for another."""
        world.check_layout(self)
        if self.parameter_servers > self.num_embeddings:
            raise ValueError(
                f"cannot split {self.num_embeddings} rows over "
                f"--parameter-servers {self.parameter_servers}"
            )
        if self.data not in DATASETS:
            raise ValueError(f"--data must be one of {', '.join(DATASETS)}, got {self.data!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda needs CUDA, which this machine does not have")
        if min(self.epochs, self.batches) < 0:
            raise ValueError("--epochs and --batches must be at least 0")
        if min(self.rpc_timeout, self.train_timeout) <= 0:
            raise ValueError("--rpc-timeout and --timeout must be positive")


# --- The master ------------------------------------------------------------------------


def create_embedding(
    config: HybridConfig, module_cls: type[nn.Module] = nn.EmbeddingBag, **kwargs: Any
) -> RemoteEmbeddingBag:
    """The tutorial's table, ``EmbeddingBag(100, 16, mode="sum")``, its rows on the servers.

    The master draws the whole table from ``seed`` (N(0, 1), EmbeddingBag's own init) and
    sends each server its rows: so the table is the same however it is split.
    """
    g = torch.Generator().manual_seed(config.seed)
    table = torch.randn(config.num_embeddings, EMBEDDING_DIM, generator=g)
    return create_remote_embedding(table, config.parameter_servers, "rows", module_cls, **kwargs)


def run_trainers(
    trainers: int,
    remote_emb_module: RemoteEmbeddingBag,
    trainer_fn: Callable[..., Any],
    args: tuple[Any, ...],
    timeout: float,
) -> dict[str, Any]:
    """Run ``trainer_fn(remote_emb_module, i, *args)`` on every trainer; their reports by name.

    All start at once (``rpc_async``); each wait is bounded by ``timeout``. Every failure is
    collected, so the error says which trainers failed and how, not just the first.
    """
    futs = {}
    for i in range(trainers):
        name = world.trainer_name(i)
        world.check_worker(name)
        futs[name] = rpc.rpc_async(
            name, trainer_fn, args=(remote_emb_module, i, *args), timeout=timeout
        )
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
    return reports


def run_master(
    config: HybridConfig, trainer_fn: Callable[..., Any] | None = None, **emb_kwargs: Any
) -> dict[str, Any]:
    """Create the table, train on every trainer, and report the table before and after."""
    remote_emb_module = create_embedding(config, **emb_kwargs)
    initial = remote_emb_module.weight()
    trainer_fn = trainer_fn or _run_trainer
    args = (config,)
    reports = run_trainers(
        config.trainers, remote_emb_module, trainer_fn, args, config.train_timeout
    )
    if config.verbose:
        print_line("Training complete")
    return {"trainers": reports, "initial_table": initial, "table": remote_emb_module.weight()}


# --- The trainers ----------------------------------------------------------------------


def distributed_optimizer(
    model: HybridModel, optimizer_cls: type[torch.optim.Optimizer], lr: float
) -> DistributedOptimizer:
    """An optimizer over RRefs of every parameter: the table's on the servers, the fc's here.

    ``model.parameters()`` cannot be used: a ``RemoteModule`` has no local parameters, and
    both its ``parameters()`` and the walk over it (``named_modules``) raise ValueError
    (test_hybrid_parity shows the messages). So the table's come as RRefs from
    ``remote_parameters()``, and our own fc's are wrapped in local RRefs.
    """
    rrefs = model.remote_emb_module.remote_parameters()
    rrefs += [rpc.RRef(param) for param in model.fc.parameters()]
    return DistributedOptimizer(optimizer_cls, rrefs, lr=lr)


def train_step(
    model: HybridModel, opt: DistributedOptimizer, criterion: nn.Module, batch: Batch
) -> torch.Tensor:
    """One iteration: forward, loss, distributed backward, optimizer step; returns the loss.

    Every iteration gets a fresh dist-autograd context that holds its own gradients (the
    fc's here, averaged by DDP; the table's on the servers), so there is nothing to zero.
    """
    indices, offsets, target = batch
    with dist_autograd.context() as context_id:
        output = model(indices, offsets)
        loss = criterion(output, target.to(model.device))
        dist_autograd.backward(context_id, [loss])
        opt.step(context_id)
    return loss


def _setup_trainer(
    remote_emb_module: RemoteEmbeddingBag, rank: int, config: HybridConfig
) -> tuple[HybridModel, DistributedOptimizer, nn.Module]:
    # Each trainer draws its own fc: DDP's broadcast at construction then makes every
    # replica trainer 0's (tests/rpc/test_hybrid_parity.py sees it happen).
    torch.manual_seed(config.seed + rank)
    dense = nn.Linear(EMBEDDING_DIM, NUM_CLASSES)
    model = HybridModel(remote_emb_module, dense, world.trainer_device(rank, config.device))
    opt = distributed_optimizer(model, torch.optim.SGD, config.lr)
    return model, opt, nn.CrossEntropyLoss()


def _run_trainer(
    remote_emb_module: RemoteEmbeddingBag, rank: int, config: HybridConfig
) -> dict[str, Any]:
    """The tutorial's training loop; runs on a trainer, called by the master over RPC."""
    model, opt, criterion = _setup_trainer(remote_emb_module, rank, config)
    batches = DATASETS[config.data]
    generator = trainer_generator(config.seed, rank)
    epoch_losses = []
    for epoch in range(config.epochs):
        losses = [
            train_step(model, opt, criterion, batch).item()
            for batch in batches(generator, config.batches, config.num_embeddings)
        ]
        epoch_losses.append(sum(losses) / max(len(losses), 1))
        if config.verbose:
            # One write per line: torchrun's workers share a pipe (see ``print_line``).
            print_line(f"Trainer {rank} - Epoch {epoch} - Loss: {epoch_losses[-1]:.4f}")
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

    As in the tutorial, only the master has work of its own (``run_master``): trainers and
    servers answer RPCs until it says how training ended (``hybrid_world.serve``).
    """
    if world_size != config.world_size:
        raise ValueError(
            f"{config.trainers} trainers + 1 master + {config.parameter_servers} parameter "
            f"servers need {config.world_size} processes, not {world_size}"
        )
    config.check()
    master = lambda: run_master(config, trainer_fn, **emb_kwargs)  # noqa: E731 - named
    return world.serve(
        rank, config, master, rpc_timeout=config.rpc_timeout, train_timeout=config.train_timeout
    )


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
    args = vars(build_parser().parse_args(argv))  # each option's dest is a config field,
    train_timeout = args.pop("timeout")  # but for --timeout's
    config = HybridConfig(**args, train_timeout=train_timeout)
    try:
        config.check()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if under_torchrun():
        run_worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), config)
        return 0

    from tutorial_impl.cli import RankError, failure_report, run_local  # the CLI's launcher

    start = time.perf_counter()
    deadline = config.train_timeout + 2 * config.rpc_timeout
    try:
        run_local(run_worker, config, world_size=config.world_size, timeout=deadline)
    except RankError as exc:
        print(f"error: {failure_report(exc, deadline, '--timeout')}", file=sys.stderr)
        return 1
    print(f"{config.world_size} processes, {time.perf_counter() - start:.1f} s")
    return 0
