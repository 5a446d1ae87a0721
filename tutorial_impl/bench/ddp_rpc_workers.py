"""The DDP + RPC benchmark: trainers, parameter servers and a master, timed epoch by epoch.

The topology of PyTorch's ``benchmark_ddp_rpc.py``: ranks ``0 .. T-1`` are trainers, the
next ``P`` ranks parameter servers, the last rank the master. The master builds an
``EmbeddingBag(300, 64, mode="sum")`` on *every* PS and starts ``_run_trainer`` on each
trainer. A trainer looks its batch up on every PS, concatenates the P results (width
``P * dim``) and feeds them to an MLP replicated with DDP; backward runs through dist
autograd (DDP all-reduces the MLP gradients, the embedding gradients go back to the PS) and
a ``DistributedOptimizer`` updates both. Each epoch (10 iterations) is timed; the warm-up
epochs are dropped.

What differs from the original, on purpose (its defects): the options travel to every
worker as arguments (the original set globals that ``mp.spawn``'s children never saw); any
trainer and PS counts and any embedding width work (the first layer takes ``P * dim``
inputs instead of asserting ``P * dim == 512``); the rendezvous is the harness's
parent-owned store instead of fixed ports 29500/29501; every RPC and collective has a
deadline; the throughput column is samples/s over all timed epochs (see ``stats.py``).

Run: ``python -m tutorial_impl bench ddp-rpc [--trainers 2 --parameter-servers 1 ...]``.
"""

from __future__ import annotations

import logging
import random
import sys
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

# DDP's constructor imports torch._dynamo (800 modules, ~4 s of CPU here). Importing it with
# this module puts it in the rank forkserver's preload: paid once, not once per trainer.
import torch._dynamo  # noqa: F401
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn, optim
from torch.distributed.nn import RemoteModule
from torch.distributed.rpc import RRef
from torch.nn.parallel import DistributedDataParallel as DDP

with warnings.catch_warnings():
    # Importing torch.distributed.optim (here or through hybrid) scripts its optimizers, and
    # torch 2.13 warns 67 times that torch.jit.script / jit.interface are deprecated.
    warnings.filterwarnings(
        "ignore",
        message="`torch.jit.(script|interface)` is deprecated",
        category=DeprecationWarning,
    )
    from torch.distributed.optim import DistributedOptimizer

    from tutorial_impl.rpc.hybrid import MASTER, filter_expected_warnings, ps_name, trainer_name
    from tutorial_impl.rpc.hybrid_world import rpc_init_method

# The original's MLP after the lookups; its first layer's input is P * dim (512 there).
HIDDEN = (256, 128, 64, 32)
NUM_CLASSES = 8
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
    rpc_threads: int = 16  # TensorPipe's num_worker_threads (its default) in every worker
    rpc_timeout: float = 60.0  # every single RPC and collective
    timeout: float = 600.0  # the whole run

    @property
    def world_size(self) -> int:
        return self.trainers + self.parameter_servers + 1

    def check(self) -> None:
        """Raise ``ValueError`` naming the first option that cannot work."""
        positive = (
            "trainers",
            "parameter_servers",
            "num_embeddings",
            "embedding_dim",
            "rpc_threads",
        )
        for name in (*positive, "epochs", "iterations"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        for name in ("indices", "bag_size"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} must satisfy 1 <= min <= max, got {low} {high}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device cuda needs a CUDA build of torch and a GPU; this has none")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}")
        if self.rpc_timeout <= 0 or self.timeout <= 0:
            raise ValueError("timeouts must be positive")


# Worker names are the tutorial's (trainer{i}, ps{j}, master; see hybrid.py). The rank
# layout is the benchmark's own: trainers, then parameter servers, then the master.
def worker_name(rank: int, cfg: BenchConfig) -> str:
    if rank < cfg.trainers:
        return trainer_name(rank)
    if rank < cfg.trainers + cfg.parameter_servers:
        return ps_name(rank - cfg.trainers)
    return MASTER


def _say(who: str, t0: float, text: str) -> None:
    """A progress line on stderr; the parent relays it while the workers run."""
    print(f"[{who} {time.time() - t0:6.1f}s] {text}", file=sys.stderr, flush=True)


def get_next_batch(
    rng: random.Random, cfg: BenchConfig, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One batch as in the original: random indices cut into bags of random sizes.

    Returns ``(indices, offsets, target)``; the batch size is the number of bags. Indices
    and offsets stay on the CPU because they travel to the parameter servers by RPC.
    """
    num_indices = rng.randint(*cfg.indices)
    indices = torch.tensor([rng.randrange(cfg.num_embeddings) for _ in range(num_indices)])
    offsets: list[int] = []
    start = 0
    while start < num_indices:
        offsets.append(start)
        start += rng.randint(*cfg.bag_size)
    target = torch.tensor([rng.randrange(NUM_CLASSES) for _ in offsets], device=device)
    return indices, torch.tensor(offsets), target


class HybridModel(nn.Module):
    """The benchmark's model: a lookup on every PS, concatenated, into a DDP-replicated MLP.

    The MLP keeps the original's sizes and its single ReLU (after the second layer); only
    the input width follows from the configuration, ``P * dim``, where the original
    hard-coded 512 and reshaped anything wider into extra rows (which no longer matched
    the targets).
    """

    def __init__(self, remote_embs: list[RemoteModule], cfg: BenchConfig, device: torch.device):
        super().__init__()
        self.remote_embs = remote_embs
        width = cfg.parameter_servers * cfg.embedding_dim
        h1, h2, h3, h4 = HIDDEN
        mlp = nn.Sequential(
            nn.Linear(width, h1),
            nn.Linear(h1, h2),
            nn.ReLU(),
            nn.Linear(h2, h3),
            nn.Linear(h3, h4),
            nn.Linear(h4, NUM_CLASSES),
        )
        ids = [device.index] if device.type == "cuda" else None
        self.ddp = DDP(mlp.to(device), device_ids=ids)
        self.device = device

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        # The lookups are independent: send them all, then wait (the original waited for
        # each before sending the next). Each RPC has the agent's rpc_timeout as deadline.
        futures = [emb.forward_async(indices, offsets) for emb in self.remote_embs]
        lookups = torch.cat([f.wait() for f in futures], dim=1)
        # Tables stay on the servers' CPU by choice (hybrid_model.HybridModel says why).
        return self.ddp(lookups.to(self.device))


def _run_trainer(
    remote_embs: list[RemoteModule], cfg: BenchConfig, index: int, t0: float
) -> dict[str, Any]:
    """Train for warm-up + timed epochs and report the timed epochs' seconds and samples."""
    device = torch.device("cpu")
    if cfg.device == "cuda":
        device = torch.device("cuda", index % torch.cuda.device_count())
        torch.cuda.set_device(device)
    torch.manual_seed(cfg.seed)  # DDP broadcasts trainer 0's weights anyway
    model = HybridModel(remote_embs, cfg, device)

    # DistributedOptimizer wants RRefs: the tables' parameters from every PS, and RRefs to
    # our own MLP parameters (model.parameters() would recurse into the RemoteModules).
    params = [p for emb in remote_embs for p in emb.remote_parameters()]
    params += [RRef(p) for p in model.ddp.parameters()]
    opt = DistributedOptimizer(OPTIMIZERS[cfg.optimizer], params, lr=LR)
    criterion = nn.CrossEntropyLoss()
    rng = random.Random(f"{cfg.seed}/{index}")  # a stream per trainer, not the global one

    me = trainer_name(index)
    ready = time.time()
    if index == 0:
        _say(me, t0, f"model ready; {cfg.warmup} warm-up + {cfg.epochs} timed epochs")
    seconds: list[float] = []
    samples: list[int] = []
    for epoch in range(cfg.warmup + cfg.epochs):
        start = time.perf_counter()
        count = 0
        for _ in range(cfg.iterations):
            indices, offsets, target = get_next_batch(rng, cfg, device)
            count += len(target)
            with dist_autograd.context() as context_id:
                loss = criterion(model(indices, offsets), target)
                dist_autograd.backward(context_id, [loss])
                opt.step(context_id)
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


def run_worker(rank: int, world_size: int, cfg: BenchConfig, t0: float) -> dict[str, Any] | None:
    """One process of the benchmark; ``cfg`` arrives as an argument, never as a global."""
    if world_size != cfg.world_size:
        raise ValueError(f"world size {world_size} != {cfg.world_size} workers in the config")
    logging.getLogger("torch.distributed.optim.optimizer").addFilter(
        _DropRecord(NO_TORCHSCRIPT_LOG)  # we chose it knowingly (see PlainSGD)
    )
    # A parameter server initialises its table itself (RemoteModule runs the constructor
    # there), so each process seeds its own generator.
    torch.manual_seed(cfg.seed * 1_000_003 + rank)
    name = worker_name(rank, cfg)
    if name != MASTER:  # the master says when everyone has joined
        _say(name, t0, "started; joining RPC")
    # torch 2.13's deprecation warnings on this path, filtered by message in this process
    # (they come from RPC threads too, where a catch_warnings here could not reach).
    filter_expected_warnings()
    if rank < cfg.trainers:
        # The trainers' own gloo group for DDP, before RPC, on the parent-owned store
        # (RPC keys have a prefix of their own there, so the two rendezvous never mix).
        dist.init_process_group(
            "gloo",
            init_method="env://",
            rank=rank,
            world_size=cfg.trainers,
            timeout=timedelta(seconds=cfg.rpc_timeout),
        )
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=rpc_init_method(),
        rpc_timeout=cfg.rpc_timeout,
        num_worker_threads=cfg.rpc_threads,
    )
    rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)
    result = None
    try:
        if name == MASTER:
            result = _run_master(cfg, t0)
    finally:
        # Graceful: waits until every worker gets here. The trainers and servers arrive at
        # once and wait for the master, which arrives after training: hence the run's deadline.
        rpc.shutdown(graceful=True, timeout=cfg.timeout)
        if dist.is_initialized():
            dist.destroy_process_group()
    return result


def _run_master(cfg: BenchConfig, t0: float) -> dict[str, Any]:
    _say(MASTER, t0, f"all {cfg.world_size} workers joined RPC")
    joined = time.time()
    remote_embs = [
        RemoteModule(
            f"{ps_name(j)}/cpu",
            nn.EmbeddingBag,
            args=(cfg.num_embeddings, cfg.embedding_dim),
            kwargs={"mode": "sum"},
        )
        for j in range(cfg.parameter_servers)
    ]
    futures = [
        rpc.rpc_async(
            trainer_name(i), _run_trainer, args=(remote_embs, cfg, i, t0), timeout=cfg.timeout
        )
        for i in range(cfg.trainers)
    ]
    reports = {f"Trainer{i}": f.wait() for i, f in enumerate(futures)}
    return {"joined": joined, "trainers": reports}
