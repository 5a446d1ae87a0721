"""D16. Tensor parallelism for a transformer block: heads split, sequence split, loss split.

Lesson D10 cut an MLP Megatron's way: the first layer column-wise, the second row-wise,
one all-reduce between. A transformer block is two such pairs, and the same cut applies:

* **attention, heads column-wise**: ``wq``, ``wk``, ``wv`` are ``ColwiseParallel``, so each
  rank computes *whole heads*, ``heads / N`` of them (a head is a contiguous slice of the
  output features): attention itself needs no communication. ``wo`` is ``RowwiseParallel``:
  each rank's heads give a partial sum of the output, and the ranks add them;
* **the MLP**: ``w1`` column-wise, ``w2`` row-wise, as in D10.

**Sequence parallelism** (``SequenceParallel``) removes what D10 left replicated. Between
the pairs, LayerNorm and the residual stream are elementwise along the sequence, so each
rank can hold *its rows of the sequence* (``Shard(1)``) instead of all of them. The
all-reduce that ended a row-wise layer becomes a **reduce-scatter** (each rank keeps only
its rows of the sum: ``output_layouts=Shard(1)``), and the next column-wise layer, which
needs the whole sequence, starts with an **all-gather** (``PrepareModuleInput``: from
``Shard(1)`` to ``Replicate()``). An all-reduce *is* a reduce-scatter then an all-gather,
so this costs no more bytes, and the norms' activations take 1/N of the memory.

**Loss parallelism** (``loss_parallel``): the output layer is column-wise over the
vocabulary and keeps its logits sharded (``Shard(-1)``, ``use_local_output=False``); under
``loss_parallel()`` cross-entropy is computed on the shards (each rank its vocabulary
slice's max, sum of exponentials and target logit, combined by all-reduces of one number a
row) instead of gathering a (batch, sequence, vocabulary) tensor on every rank. Its
backward must run inside the same context.

``CommDebugMode`` counts what DTensor runs: ``tp_block_step`` counts forward (up to the
logits), the loss, backward and the SGD step separately; the test derives the counts from
the plan and checks the whole step against one process. One count surprises: backward
runs no all-reduce for the norms' weights. Their gradients come back ``Partial(sum)``, each
rank's holding only its sequence rows' share; DTensor adds them (one all-reduce per norm
parameter) where they are first used, in the optimizer's step.

(Counting a model whose input is token ids makes torch warn "Full backward hook is firing
when gradients are computed with respect to module outputs since no inputs require
gradients": ``CommDebugMode`` tracks modules with backward hooks, and the embedding's input
needs no gradient. The course's tests name that warning as expected: ``tests/ddp/conftest.py``.)

    python -m tutorial_impl.ddp.tp_transformer     # 2 local ranks; or torchrun --nproc-per-node=2
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from tutorial_impl.ddp import toy
from tutorial_impl.ddp.dtensor import destroy_mesh_groups
from tutorial_impl.dist_tuto.process import print_line

PRELOAD = ["torch._dynamo"]
DIM, HEADS, VOCAB, SEQ, BATCH = 16, 4, 32, 8, 2


class Attention(nn.Module):
    """Causal self-attention; the number of heads follows from ``wq``'s output width, so
    the same code runs whole (4 heads) or column-wise split (4 / N heads a rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in "qkvo")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        head_dim = DIM // HEADS

        def heads(t: torch.Tensor) -> torch.Tensor:  # (b, s, h * d) -> (b, h, s, d)
            return t.view(batch, seq, -1, head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            heads(self.wq(x)), heads(self.wk(x)), heads(self.wv(x)), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.relu(self.w1(x)))


class Block(nn.Module):
    """Embedding, one pre-norm transformer block, a final norm and the output layer."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.attention_norm, self.attention = nn.LayerNorm(DIM), Attention()
        self.ffn_norm, self.feed_forward = nn.LayerNorm(DIM), FeedForward()
        self.norm, self.output = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.attention(self.attention_norm(h))
        h = h + self.feed_forward(self.ffn_norm(h))
        return self.output(self.norm(h))


# The plan, module by module: between the pairs the activations are Shard(1) (sequence).
PLAN = {
    # Vocabulary rows split; each rank's lookups are partial: reduce-scattered to Shard(1).
    "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    "attention_norm": SequenceParallel(),
    "attention": PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
    ),
    "attention.wq": ColwiseParallel(),
    "attention.wk": ColwiseParallel(),
    "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    "ffn_norm": SequenceParallel(),
    "feed_forward": PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
    ),
    "feed_forward.w1": ColwiseParallel(),
    "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    "norm": SequenceParallel(),
    # The vocabulary split, the logits kept sharded for loss_parallel.
    "output": ColwiseParallel(
        input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
    ),
}


def data(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token labels, (BATCH, SEQ) each, from their own generator."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def counted(mode: CommDebugMode) -> dict[str, int]:
    return {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}


def whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def tp_block_step(mesh: DeviceMesh, tokens: torch.Tensor, labels: torch.Tensor) -> dict:
    """``Block`` split over ``mesh`` with ``PLAN``: one forward, loss, backward and SGD step,
    each counted; the placements, the logits, the loss and the stepped parameters (whole)."""
    model = parallelize_module(Block(), mesh, PLAN)
    with CommDebugMode() as forward:
        logits = model(tokens)
    with loss_parallel():  # the loss and its backward, on the vocabulary shards
        with CommDebugMode() as in_loss:
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))
        with CommDebugMode() as backward:
            loss.backward()
    seen = {
        "placements": {n: tuple(p.placements) for n, p in model.named_parameters()},
        "grad_placements": {n: tuple(p.grad.placements) for n, p in model.named_parameters()},
        "logits": (tuple(logits.placements), whole(logits)),
        "loss": whole(loss),
        "forward": counted(forward),
        "loss_comms": counted(in_loss),
        "backward": counted(backward),
    }
    # The norms' gradients are Partial: each rank's is its own rows' share of the sum.
    # DTensor sums them where they are used: here, in the SGD step.
    with CommDebugMode() as step:
        toy.plain_sgd_step(model)
    return {
        **seen,
        "step": counted(step),
        "params": {n: whole(p) for n, p in model.named_parameters()},
    }


def tensor_parallel_block(rank: int, size: int, tokens, labels) -> dict:
    """``tp_block_step`` over a 1-D mesh of every rank."""
    if HEADS % size or SEQ % size or VOCAB % size:
        raise ValueError(f"{size} ranks must divide {HEADS} heads, {SEQ} positions, {VOCAB} ids")
    mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("tp",))
    try:
        return tp_block_step(mesh, tokens, labels)
    finally:
        destroy_mesh_groups(mesh)


def demo(rank: int, size: int) -> None:
    tokens, labels = data()
    seen = tensor_parallel_block(rank, size, tokens, labels)
    print_line(f"rank {rank}: loss {seen['loss'].item():.6f}, logits {seen['logits'][0]}")
    print_line(f"rank {rank}: forward {seen['forward']}, loss {seen['loss_comms']}")
    print_line(f"rank {rank}: backward {seen['backward']}")


def main(argv: list[str] | None = None) -> int:
    args = toy.demo_parser(
        __name__, "D16. Tensor parallelism for a transformer block: heads, sequence, loss."
    ).parse_args(argv)
    return toy.main(demo, args.world_size, args.timeout, PRELOAD)


if __name__ == "__main__":
    toy.run_as_script(main)  # the package's copy of this module: see toy.py
