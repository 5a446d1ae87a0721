"""The model of the DDP + RPC tutorial: a remote embedding table and a replicated dense layer.

``HybridModel`` is the tutorial's: the *sparse* part is an ``EmbeddingBag`` held by a
parameter server and reached through RPC, the *dense* part is an ``nn.Linear`` that every
trainer holds a replica of, kept in sync by ``DistributedDataParallel``.

We generalise one thing: the table may be split by rows over several parameter servers
(``ShardedEmbeddingBag``). With ``mode="sum"`` a bag's embedding is the sum of its rows, so
the lookup can be done shard by shard and the partial sums added: every shard sees the
indices that fall in its rows (renumbered from 0) and the same bags, and a bag with no row
on that shard contributes zeros. With one shard this is exactly the tutorial's lookup.

The batch generators take an explicit ``torch.Generator``, so a test (or the benchmark) can
regenerate the very batches a trainer used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

# The tutorial's sizes: EmbeddingBag(100, 16, mode="sum") and Linear(16, 8).
NUM_EMBEDDINGS = 100
EMBEDDING_DIM = 16
NUM_CLASSES = 8

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # indices, offsets, target


def trainer_generator(seed: int, trainer: int) -> torch.Generator:
    """The random stream of one trainer's batches: distinct per trainer, fixed by ``seed``."""
    return torch.Generator().manual_seed(seed * 1_000_003 + trainer)


def _random_bags(g: torch.Generator, num_embeddings: int) -> tuple[torch.Tensor, torch.Tensor]:
    # As in the tutorial: 20-50 indices, a new bag every 1-10 indices.
    num_indices = int(torch.randint(20, 51, (1,), generator=g))
    indices = torch.randint(0, num_embeddings, (num_indices,), generator=g)
    offsets = []
    start = 0
    while start < num_indices:
        offsets.append(start)
        start += int(torch.randint(1, 11, (1,), generator=g))
    return indices, torch.tensor(offsets, dtype=torch.long)


def get_next_batch(
    generator: torch.Generator,
    num_batches: int = 10,
    num_embeddings: int = NUM_EMBEDDINGS,
    num_classes: int = NUM_CLASSES,
) -> Iterator[Batch]:
    """The tutorial's batches: random bags of random rows with random labels (CPU tensors)."""
    for _ in range(num_batches):
        indices, offsets = _random_bags(generator, num_embeddings)
        target = torch.randint(0, num_classes, (len(offsets),), generator=generator)
        yield indices, offsets, target


def get_learnable_batch(
    generator: torch.Generator,
    num_batches: int = 10,
    num_embeddings: int = NUM_EMBEDDINGS,
    num_classes: int = NUM_CLASSES,
) -> Iterator[Batch]:
    """Bags shaped like the tutorial's, but a bag of class ``c`` only holds rows of block ``c``.

    The rows are split into ``num_classes`` blocks; the label is then recoverable from the
    bag's embedding, so training must lower the loss (random labels cannot be learnt).
    """
    block = num_embeddings // num_classes
    for _ in range(num_batches):
        indices, offsets = _random_bags(generator, num_embeddings)
        target = torch.randint(0, num_classes, (len(offsets),), generator=generator)
        bag_of_index = torch.bucketize(torch.arange(len(indices)), offsets, right=True) - 1
        rows = torch.randint(0, block, (len(indices),), generator=generator)
        yield target[bag_of_index] * block + rows, offsets, target


DATASETS: dict[str, Callable[..., Iterator[Batch]]] = {
    "tutorial": get_next_batch,  # random labels, as in the tutorial
    "learnable": get_learnable_batch,  # labels a linear model can learn
}


def shard_bounds(num_embeddings: int, num_shards: int) -> list[tuple[int, int]]:
    """Row ranges ``[start, end)`` of each shard, sizes differing by at most one."""
    if num_shards < 1:
        raise ValueError(f"need at least one parameter server, got {num_shards}")
    if num_shards > num_embeddings:
        raise ValueError(f"cannot split {num_embeddings} rows over {num_shards} servers")
    sizes = [len(part) for part in torch.arange(num_embeddings).tensor_split(num_shards)]
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


class ShardedEmbeddingBag:
    """A ``mode="sum"`` embedding table split by rows over ``RemoteModule`` shards.

    Deliberately not an ``nn.Module``: its parameters live on the servers, and
    ``remote_parameters()`` (RRefs) is the only way to reach them, as with ``RemoteModule``.
    It pickles as a list of ``RemoteModule`` handles, so the master can send it to trainers.
    """

    def __init__(self, shards: Sequence[nn.Module], bounds: Sequence[tuple[int, int]]) -> None:
        if len(shards) != len(bounds):
            raise ValueError("one row range per shard")
        self.shards = list(shards)  # RemoteModule(EmbeddingBag) on each parameter server
        self.bounds = list(bounds)
        self.num_embeddings = bounds[-1][1]

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        check_bags(indices, offsets, self.num_embeddings)
        # Ask every server at once; each answer is recorded by dist autograd, so the
        # backward pass sends each shard the gradient of its own partial sum.
        futures = [
            shard.forward_async(*split_bags(indices, offsets, start, end))
            for shard, (start, end) in zip(self.shards, self.bounds, strict=True)
        ]
        parts = []
        for shard, future in zip(self.shards, futures, strict=True):
            try:
                parts.append(future.wait())  # bounded by the RPC timeout
            except RuntimeError as exc:
                where = shard.module_rref.owner().name
                raise RuntimeError(
                    f"embedding lookup on parameter server {where} failed: {exc}"
                ) from exc
        return torch.stack(parts).sum(0) if len(parts) > 1 else parts[0]

    __call__ = forward

    def remote_parameters(self) -> list[rpc.RRef]:
        return [p for shard in self.shards for p in shard.remote_parameters()]

    def weight(self) -> torch.Tensor:
        """A copy of the whole table, assembled from the servers (for checks and tests)."""
        return torch.cat(
            [rpc.rpc_sync(s.module_rref.owner(), _weight, (s.module_rref,)) for s in self.shards]
        )

    def gradient(self, context_id: int) -> torch.Tensor:
        """The table's gradient in a dist-autograd context, assembled from the servers."""
        return torch.cat(
            [
                rpc.rpc_sync(s.module_rref.owner(), _gradient, (s.module_rref, context_id))
                for s in self.shards
            ]
        )


def _weight(module_rref: rpc.RRef) -> torch.Tensor:
    return module_rref.local_value().weight.detach().clone()


def _gradient(module_rref: rpc.RRef, context_id: int) -> torch.Tensor:
    # Runs on the server: gradients in a dist-autograd context live where the tensor lives.
    weight = module_rref.local_value().weight
    return dist_autograd.get_gradients(context_id).get(weight, torch.zeros_like(weight))


class HybridModel(nn.Module):
    """The tutorial's model: remote embedding lookup, then a DDP-replicated ``Linear(16, 8)``.

    The embedding stays on its server's CPU by choice. RPC can carry CUDA tensors once
    TensorPipe is given device maps (beta), but the RPC reference lists RRefs, RemoteModule and
    distributed autograd among what is not yet supported with CUDA tensors, and a CPU table
    needs no device map agreed between every trainer and server. So lookups cross RPC as CPU
    tensors and only the looked-up rows move to the trainer's ``device``; the trainer's own
    ``fc`` parameters (on its GPU with ``--device cuda``) are wrapped in *local* RRefs, which
    the distributed optimizer steps where they are, without sending them anywhere.
    """

    def __init__(self, remote_emb_module: ShardedEmbeddingBag, device: torch.device) -> None:
        super().__init__()
        self.remote_emb_module = remote_emb_module  # not a submodule: see remote_parameters()
        device_ids = [device] if device.type == "cuda" else None
        self.fc = DDP(nn.Linear(EMBEDDING_DIM, NUM_CLASSES).to(device), device_ids=device_ids)
        self.device = device

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        emb_lookup = self.remote_emb_module.forward(indices, offsets)
        return self.fc(emb_lookup.to(self.device))
