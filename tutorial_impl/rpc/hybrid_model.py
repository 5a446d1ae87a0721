"""The hybrid model: an embedding table on parameter servers, a dense part replicated by DDP.

``HybridModel`` is the tutorial's: the *sparse* part is an ``EmbeddingBag`` held by parameter
servers and reached through RPC, the *dense* part a module every trainer holds a replica of,
kept in sync by ``DistributedDataParallel``. Two sizes of it are in use:

* the tutorial: ``EmbeddingBag(100, 16)``, its rows split over the servers, then ``Linear(16, 8)``;
* the DDP + RPC benchmark: one ``EmbeddingBag(300, 64)`` per server, the P lookups side by side
  (``P * 64`` wide), then an MLP ``P*64 -> 256 -> 128 -> 64 -> 32 -> 8`` (``mlp``).

Both are one table split over servers (``RemoteEmbeddingBag``): by rows (the tutorial) or by
columns (the benchmark). With ``mode="sum"`` a bag's embedding is the sum of its rows, so a
row split is looked up shard by shard and the partial sums added: each shard sees the indices
in its rows (renumbered from 0) and every bag, and a bag with no row there gives zeros. A
column split sends every shard the whole batch and puts the answers side by side.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn
from torch.distributed.nn import RemoteModule
from torch.nn.parallel import DistributedDataParallel as DDP

from tutorial_impl.rpc.hybrid_world import check_worker, ps_name

# The tutorial's sizes: EmbeddingBag(100, 16, mode="sum") and Linear(16, 8).
NUM_EMBEDDINGS = 100
EMBEDDING_DIM = 16
NUM_CLASSES = 8
# The benchmark's MLP after the lookups (PyTorch's benchmark_ddp_rpc.py).
HIDDEN = (256, 128, 64, 32)
SPLITS = ("rows", "columns")


def shard_bounds(size: int, num_shards: int) -> list[tuple[int, int]]:
    """Ranges ``[start, end)`` of each shard of ``size`` rows (or columns), sizes within one."""
    if num_shards < 1:
        raise ValueError(f"--parameter-servers must be at least 1, got {num_shards}")
    if num_shards > size:
        raise ValueError(f"cannot split {size} rows over {num_shards} servers")
    sizes = [len(part) for part in torch.arange(size).tensor_split(num_shards)]
    starts = [sum(sizes[:i]) for i in range(num_shards)]
    return [(s, s + n) for s, n in zip(starts, sizes, strict=True)]


def split_bags(
    indices: torch.Tensor, offsets: torch.Tensor, start: int, end: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The part of the bags that rows ``[start, end)`` hold, renumbered from ``start``.

    Every bag is kept (possibly empty), so the shard's output has one row per bag and the
    shards' outputs can simply be added.
    """
    mine = (indices >= start) & (indices < end)
    # The new offset of bag b is the number of this shard's indices before its old offset.
    before = torch.cat([torch.zeros(1, dtype=torch.long), mine.long().cumsum(0)])
    return indices[mine] - start, before[offsets]


def check_bags(indices: torch.Tensor, offsets: torch.Tensor, num_embeddings: int) -> None:
    """Refuse input an ``EmbeddingBag`` lookup would reject (or a shard would silently drop)."""
    if indices.dim() != 1 or offsets.dim() != 1:
        raise ValueError("indices and offsets must be 1-D tensors")
    if len(indices) and (int(indices.min()) < 0 or int(indices.max()) >= num_embeddings):
        bad = indices[(indices < 0) | (indices >= num_embeddings)]
        raise IndexError(
            f"embedding indices must lie in [0, {num_embeddings}); got {bad.tolist()[:5]}"
        )
    if len(offsets) == 0 or int(offsets[0]) != 0:
        raise ValueError("offsets must start with 0 (one offset per bag)")


class RemoteEmbeddingBag(nn.Module):
    """A ``mode="sum"`` table split by ``rows`` or ``columns`` over ``RemoteModule`` shards.

    Its shards are submodules, as the tutorial's ``RemoteModule`` is one of ``HybridModel``:
    so ``model.parameters()`` raises, exactly as the tutorial warns, because a
    ``RemoteModule`` has no local parameters; ``remote_parameters()`` (RRefs) reaches them.
    It pickles as its ``RemoteModule`` handles, so the master can send it to the trainers.
    """

    def __init__(
        self,
        shards: Sequence[nn.Module],
        bounds: Sequence[tuple[int, int]],
        split: str,
        num_embeddings: int,
    ) -> None:
        super().__init__()
        if len(shards) != len(bounds) or split not in SPLITS:
            raise ValueError(f"one range per shard, split by one of {SPLITS}")
        self.shards = nn.ModuleList(shards)  # RemoteModule(EmbeddingBag) on each server
        self.bounds = list(bounds)
        self.split = split
        self.num_embeddings = num_embeddings

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        # Checked here, on the trainer: a row split would drop a stray index silently.
        check_bags(indices, offsets, self.num_embeddings)
        if self.split == "rows":
            requests = [split_bags(indices, offsets, start, end) for start, end in self.bounds]
        else:
            requests = [(indices, offsets)] * len(self.shards)
        # Ask every server at once; each answer is recorded by dist autograd, so the
        # backward pass sends each shard the gradient of its own part.
        futures = [s.forward_async(*r) for s, r in zip(self.shards, requests, strict=True)]
        parts = []
        for shard, future in zip(self.shards, futures, strict=True):
            try:
                parts.append(future.wait())  # bounded by the RPC timeout
            except RuntimeError as exc:
                where = shard.module_rref.owner().name
                raise RuntimeError(
                    f"embedding lookup on parameter server {where} failed: {exc}"
                ) from exc
        if len(parts) == 1:
            return parts[0]
        return torch.stack(parts).sum(0) if self.split == "rows" else torch.cat(parts, dim=1)

    def remote_parameters(self) -> list[rpc.RRef]:
        return [p for shard in self.shards for p in shard.remote_parameters()]

    def _gather(self, fn: object, *args: object) -> torch.Tensor:
        parts = [
            rpc.rpc_sync(s.module_rref.owner(), fn, (s.module_rref, *args)) for s in self.shards
        ]
        return torch.cat(parts, dim=0 if self.split == "rows" else 1)

    def weight(self) -> torch.Tensor:
        """A copy of the whole table, assembled from the servers (for checks and tests)."""
        return self._gather(_weight)

    def gradient(self, context_id: int) -> torch.Tensor:
        """The table's gradient in a dist-autograd context, assembled from the servers."""
        return self._gather(_gradient, context_id)


def _weight(module_rref: rpc.RRef) -> torch.Tensor:
    return module_rref.local_value().weight.detach().clone()


def _gradient(module_rref: rpc.RRef, context_id: int) -> torch.Tensor:
    # Runs on the server: gradients in a dist-autograd context live where the tensor lives.
    weight = module_rref.local_value().weight
    return dist_autograd.get_gradients(context_id).get(weight, torch.zeros_like(weight))


def create_remote_embedding(
    table: torch.Tensor,
    parameter_servers: int,
    split: str = "rows",
    module_cls: type[nn.Module] = nn.EmbeddingBag,
    **kwargs: object,
) -> RemoteEmbeddingBag:
    """Put ``table``'s rows (or columns) on the parameter servers, one ``RemoteModule`` each.

    The caller draws the whole table, so it is the same however it is split; each server's
    ``EmbeddingBag`` starts from its part (``_weight``). Runs on the master.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    axis = 0 if split == "rows" else 1
    bounds = shard_bounds(table.shape[axis], parameter_servers)
    shards = []
    for j, (start, end) in enumerate(bounds):
        check_worker(ps_name(j))
        part = table[start:end] if axis == 0 else table[:, start:end]
        shards.append(
            RemoteModule(
                f"{ps_name(j)}/cpu",
                module_cls,
                args=part.shape,
                kwargs={"mode": "sum", "_weight": part.clone(), **kwargs},
            )
        )
    return RemoteEmbeddingBag(shards, bounds, split, table.shape[0])


def mlp(width: int, hidden: Sequence[int] = HIDDEN, classes: int = NUM_CLASSES) -> nn.Sequential:
    """The benchmark's dense part, with the original's single ReLU (after the second layer)."""
    sizes = [width, *hidden, classes]
    layers: list[nn.Module] = [nn.Linear(a, b) for a, b in zip(sizes, sizes[1:], strict=False)]
    layers.insert(2, nn.ReLU())
    return nn.Sequential(*layers)


class HybridModel(nn.Module):
    """The tutorial's model: remote embedding lookup, then a DDP-replicated dense part.

    ``dense`` is the tutorial's ``Linear(16, 8)`` or the benchmark's ``mlp``; DDP keeps the
    trainers' replicas equal. The embedding stays on its server's CPU by choice. RPC can carry
    CUDA tensors once TensorPipe is given device maps (beta), but the RPC reference lists
    RRefs and distributed autograd among what is not yet supported with CUDA tensors (it
    names RemoteModule too, which torch 2.13 does place on ``cuda:N``:
    ``tests/rpc/test_rpc_gpu.py``), and a CPU table needs no device map agreed between every
    trainer and server. So
    lookups cross RPC as CPU tensors and only the looked-up rows move to the trainer's
    ``device``; the trainer's own ``fc`` parameters (on its GPU with ``--device cuda``) are
    wrapped in *local* RRefs, which the distributed optimizer steps where they are.
    """

    def __init__(
        self, remote_emb_module: RemoteEmbeddingBag, dense: nn.Module, device: torch.device
    ) -> None:
        super().__init__()
        self.remote_emb_module = remote_emb_module
        device_ids = [device] if device.type == "cuda" else None
        self.fc = DDP(dense.to(device), device_ids=device_ids)
        self.device = device

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        # indices and offsets stay on the CPU, as the official tutorial keeps them: the table
        # lives on the parameter server's CPU, and RPC sends CPU tensors only unless a device
        # map says otherwise. (A version of the tutorial moves them to cuda:rank before this
        # call; that fails there. Here the correction is deliberate.) Only the looked-up rows
        # move to this trainer's device, for the Linear.
        emb_lookup = self.remote_emb_module.forward(indices, offsets)
        return self.fc(emb_lookup.to(self.device))
