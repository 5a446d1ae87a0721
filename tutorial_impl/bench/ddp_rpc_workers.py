"""The DDP + RPC benchmark's workers: the hybrid tutorial's world, sized up and timed.

PyTorch's ``benchmark_ddp_rpc.py`` is the hybrid tutorial at another size, and here it runs on
the tutorial's own code: the rank layout, names, joining and leaving (``rpc/hybrid_world.py``:
trainers ``0 .. T-1``, master ``T``, parameter servers ``T+1 ..``), the model
(``rpc/hybrid_model.py``), the batches (``rpc/hybrid_data.py``), the master's ``run_trainers``
and the trainer's ``distributed_optimizer`` and ``train_step`` (``rpc/hybrid.py``). Its sizes
are the original's: an ``EmbeddingBag(300, 64, mode="sum")`` on *every* server, the P lookups
side by side (a table split by columns, ``P * dim`` wide), then a DDP-replicated MLP
``P*dim -> 256 -> 128 -> 64 -> 32 -> 8``.

What is the benchmark's own is here: its options (``BenchConfig``), the choice of optimizer
and of RPC threads, the warm-up and the timing of each epoch, and the progress lines.

What differs from the original, on purpose (its defects): the options travel to every worker
as arguments (the original set globals that ``mp.spawn``'s children never saw); any trainer and
PS counts and any embedding width work (the first layer takes ``P * dim`` inputs instead of
asserting ``P * dim == 512``); the rendezvous is the harness's parent-owned store instead of
fixed ports 29500/29501; every RPC and collective has a deadline; the throughput column is
samples/s over all timed epochs (see ``stats.py``).

Run: ``python -m tutorial_impl bench ddp-rpc [--trainers 2 --parameter-servers 1 ...]``.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

# DDP's constructor imports torch._dynamo (800 modules, ~4 s of CPU here). Importing it with
# this module puts it in the rank forkserver's preload: paid once, not once per trainer.
import torch._dynamo  # noqa: F401
from torch import nn, optim

from tutorial_impl.rpc import hybrid_world as world
from tutorial_impl.rpc.hybrid import distributed_optimizer, run_trainers, train_step
from tutorial_impl.rpc.hybrid_data import get_next_batch, trainer_generator
from tutorial_impl.rpc.hybrid_model import (
    NUM_CLASSES,
    HybridModel,
    RemoteEmbeddingBag,
    create_remote_embedding,
    mlp,
)

LR = 0.05


class PlainSGD(optim.SGD):
    """``optim.SGD`` under a name ``DistributedOptimizer`` does not map to TorchScript.

    Given ``optim.SGD`` itself (the original, and our default), ``DistributedOptimizer``
    compiles a TorchScript functional SGD on every parameter's owner, once per trainer:
    72 compilations for 8 trainers and 8 servers, a few seconds of start-up on 2 cores, with
    a TorchScript path that torch 2.13 deprecates. ``--optimizer python`` measures the
    same arithmetic through the plain optimizer instead.
    """


OPTIMIZERS = {"python": PlainSGD, "torchscript": optim.SGD}
# DistributedOptimizer logs this (once per trainer) when given a non-TorchScript optimizer.
NO_TORCHSCRIPT_LOG = "Creating the optimizer %s without TorchScript support"
# The option of each field whose name is not simply --field-name.
FLAGS = {"indices": "--batch-indices"}


def flag(field: str) -> str:
    """The command-line option that sets a ``BenchConfig`` field."""
    return FLAGS.get(field, "--" + field.replace("_", "-"))


class _DropRecord(logging.Filter):
    def __init__(self, msg: str) -> None:
        super().__init__()
        self.msg = msg

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.msg)


@dataclass(frozen=True)
class BenchConfig:
    """Every option of the benchmark; one copy is pickled to each worker."""

    trainers: int = 8
    parameter_servers: int = 8
    num_embeddings: int = 300
    embedding_dim: int = 64
    warmup: int = 5
    epochs: int = 100
    iterations: int = 10  # batches an epoch
    indices: tuple[int, int] = (20, 50)  # indices in a batch: uniform in [min, max]
    bag_size: tuple[int, int] = (1, 10)  # indices in one bag: uniform in [min, max]
    seed: int = 0
    device: str = "cpu"
    optimizer: str = "torchscript"  # a key of OPTIMIZERS
    rpc_threads: int = world.RPC_THREADS  # TensorPipe's num_worker_threads in every worker
    rpc_timeout: float = 60.0  # every single RPC and collective
    timeout: float = 600.0  # the whole run

    @property
    def world_size(self) -> int:
        return world.world_size(self)

    def check(self) -> None:
        """Raise ``ValueError`` naming the option of the first value that cannot work."""
        world.check_layout(self)
        for name in ("num_embeddings", "embedding_dim", "rpc_threads", "epochs", "iterations"):
            if getattr(self, name) < 1:
                raise ValueError(f"{flag(name)} must be at least 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"{flag('warmup')} must be at least 0, got {self.warmup}")
        for name in ("indices", "bag_size"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(
                    f"{flag(name)} MIN MAX must satisfy 1 <= MIN <= MAX, got {low} {high}"
                )
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda needs a CUDA build of torch and a GPU; this has none")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}")
        for name in ("rpc_timeout", "timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{flag(name)} must be positive, got {getattr(self, name)}")


def _say(who: str, t0: float, text: str) -> None:
    """A progress line on stderr; the parent relays it while the workers run."""
    print(f"[{who} {time.time() - t0:6.1f}s] {text}", file=sys.stderr, flush=True)


def _run_trainer(
    remote_emb_module: RemoteEmbeddingBag, index: int, cfg: BenchConfig, t0: float
) -> dict[str, Any]:
    """Train for warm-up + timed epochs and report the timed epochs' seconds and samples."""
    device = world.trainer_device(index, cfg.device)
    torch.manual_seed(cfg.seed)  # the MLP's init; DDP broadcasts trainer 0's anyway
    dense = mlp(cfg.parameter_servers * cfg.embedding_dim)
    model = HybridModel(remote_emb_module, dense, device)
    opt = distributed_optimizer(model, OPTIMIZERS[cfg.optimizer], LR)
    criterion = nn.CrossEntropyLoss()
    generator = trainer_generator(cfg.seed, index)  # a stream per trainer

    me = world.trainer_name(index)
    ready = time.time()
    if index == 0:
        _say(me, t0, f"model ready; {cfg.warmup} warm-up + {cfg.epochs} timed epochs")
    seconds: list[float] = []
    samples: list[int] = []
    for epoch in range(cfg.warmup + cfg.epochs):
        start = time.perf_counter()
        count = 0
        for batch in get_next_batch(
            generator, cfg.iterations, cfg.num_embeddings, NUM_CLASSES, cfg.indices, cfg.bag_size
        ):
            count += len(batch[2])  # a sample is a bag, with its label
            train_step(model, opt, criterion, batch)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        if epoch >= cfg.warmup:
            seconds.append(elapsed)
            samples.append(count)
        if index == 0:
            timed = epoch - cfg.warmup
            if timed < 0:
                _say(me, t0, f"warm-up epoch {epoch + 1}/{cfg.warmup}: {elapsed:.3f} s")
            elif (timed + 1) % max(1, cfg.epochs // 5) == 0:
                _say(me, t0, f"timed epoch {timed + 1}/{cfg.epochs}: {elapsed:.3f} s")
    return {"seconds": seconds, "samples": samples, "ready": ready, "done": time.time()}


def _run_master(cfg: BenchConfig, t0: float) -> dict[str, Any]:
    _say(world.MASTER, t0, f"all {cfg.world_size} workers joined RPC")
    joined = time.time()
    # One EmbeddingBag(num_embeddings, dim) per server: a table P * dim wide, split by columns.
    g = torch.Generator().manual_seed(cfg.seed)
    table = torch.randn(cfg.num_embeddings, cfg.parameter_servers * cfg.embedding_dim, generator=g)
    remote_emb_module = create_remote_embedding(table, cfg.parameter_servers, "columns")
    reports = run_trainers(cfg.trainers, remote_emb_module, _run_trainer, (cfg, t0), cfg.timeout)
    trainers = {f"Trainer{i}": reports[world.trainer_name(i)] for i in range(cfg.trainers)}
    return {"joined": joined, "trainers": trainers}


def run_worker(rank: int, world_size: int, cfg: BenchConfig, t0: float) -> dict[str, Any]:
    """One process of the benchmark; ``cfg`` arrives as an argument, never as a global."""
    if world_size != cfg.world_size:
        raise ValueError(f"world size {world_size} != {cfg.world_size} workers in the config")
    logging.getLogger("torch.distributed.optim.optimizer").addFilter(
        _DropRecord(NO_TORCHSCRIPT_LOG)  # we chose it knowingly (see PlainSGD)
    )
    name = world.worker_name(rank, cfg)
    if name != world.MASTER:  # the master says when everyone has joined
        _say(name, t0, "started; joining RPC")
    return world.serve(
        rank,
        cfg,
        lambda: _run_master(cfg, t0),
        rpc_timeout=cfg.rpc_timeout,
        train_timeout=cfg.timeout,
        rpc_threads=cfg.rpc_threads,
    )
