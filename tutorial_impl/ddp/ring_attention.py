"""D20. Context parallelism: ring attention, the sequence split over the ranks.

Data, tensor and pipeline parallelism split the batch, the layers' widths and the layers.
None of them helps when one *sequence* is too long: attention compares every position
with every other, and its keys and values grow with the sequence. **Context parallelism**
splits the sequence itself: rank r holds block r of the positions, its rows of Q, K and V.
Its queries still need every key, so the K/V blocks travel around a ring (each rank sends
to ``rank + 1`` and receives from ``rank - 1``, as in T6's ring all-reduce): after
``N - 1`` steps every rank has seen every block, and each block was sent ``N - 1`` times.

* **Memory.** A rank holds its own Q block, the K/V block it is using and the one arriving:
  never the whole K/V, and never the whole ``(sequence x sequence)`` score matrix, only one
  block of it at a time.
* **Overlap.** A step starts passing its block on (``isend``/``irecv``) *before* computing
  with it, and waits for the transfer only after: on a GPU the exchange runs while the
  matrix products do (here, on gloo, the transfer runs in gloo's threads meanwhile).
* **Online softmax.** A query row's softmax needs the maximum and the sum over *all* its
  keys, which no step has. Flash attention's trick keeps, per row, the running maximum
  ``m``, the running sum ``l`` of ``exp(score - m)`` and the unnormalised output ``acc``;
  when a block raises the maximum to ``m'``, everything kept so far is multiplied by
  ``exp(m - m')``, which turns ``exp(s - m)`` into ``exp(s - m')``. At the end,
  ``acc / l`` is exactly softmax(scores) @ V, in any order of the blocks.
* **Causal.** Position i sees positions up to i. For rank r, blocks after its own hold only
  future positions (skipped, though still passed on: later ranks need them), its own block
  is the diagonal (masked to its lower triangle) and earlier blocks are seen whole. Rank 0
  then computes one block and rank N - 1 all N: production rings balance the load by giving
  each rank a block from each end of the sequence (torch's ``context_parallel`` does so).

The backward pass (not taught here) is another ring: dK and dV travel with the blocks.

**torch's own, on the CPU.** ``torch.distributed.tensor.experimental.context_parallel``
(torch 2.13) does this for ``F.scaled_dot_product_attention`` by dispatching its CUDA
kernels (flash, efficient, cuDNN). On the CPU over gloo (2 ranks, Q, K, V of shape
(1, 2, 8, 4), sequence dimension 2, whole-sequence buffers given to the context manager),
the causal call fails: ``NotImplementedError: Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
registered.``; the non-causal call returned a local (1, 2, 4, 4) block in the first run
(not checked against the whole sequence) and hung inside the call in the runs after it
(three of them seen hanging: one killed after 120 s, two whose stacks faulthandler dumped
after 25 s in the call). So this lesson writes the ring out.

    python -m tutorial_impl.ddp.ring_attention     # 2 local ranks; --world-size 4
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tutorial_impl.ddp import toy
from tutorial_impl.dist_tuto.process import print_line

PRELOAD: list[str] = []  # plain torch.distributed: nothing beyond what every rank loads
BATCH, HEADS, SEQ, HEAD_DIM = 2, 2, 12, 4  # 12 positions: blocks of 6, 4 or 3 on 2, 3, 4 ranks
State = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (acc, row maximum m, row sum l)


def data(seed: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q, K, V of the whole sequence, (BATCH, HEADS, SEQ, HEAD_DIM), from their own generator."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, generator=g) for _ in "qkv")


def block(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous block of positions (dimension 2, the sequence)."""
    if t.shape[2] % size:
        raise ValueError(f"{t.shape[2]} positions do not split evenly over {size} ranks")
    return t.chunk(size, dim=2)[rank].contiguous()


def empty_state(q: torch.Tensor) -> State:
    """Nothing seen yet: acc 0, m = -inf, l = 0 (one m and one l per query row)."""
    rows = q.shape[:-1] + (1,)
    return torch.zeros_like(q), torch.full(rows, float("-inf")), torch.zeros(rows)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: State, mask=None) -> State:
    """Fold one K/V block into the running state (the online softmax).

    ``mask`` (True = may attend) must leave each row at least one key over the blocks
    seen so far, or its maximum stays -inf and ``exp(m - m')`` is nan: the ring starts
    with the rank's own block, whose diagonal is always visible."""
    acc, row_max, row_sum = state
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5  # the scale SDPA uses
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    new_max = torch.maximum(row_max, scores.amax(dim=-1, keepdim=True))
    rescale = torch.exp(row_max - new_max)  # what was exp(s - m) becomes exp(s - m')
    p = torch.exp(scores - new_max)  # this block's terms, already on the new scale
    return acc * rescale + p @ v, new_max, row_sum * rescale + p.sum(dim=-1, keepdim=True)


def ring_attention(q, k, v, causal: bool = False, group=None) -> tuple[torch.Tensor, list[int]]:
    """Attention of this rank's Q block over the whole sequence, whose K/V blocks are
    spread over the ranks of ``group`` (one each, in rank order). Returns the output block
    and the ranks whose K/V blocks were used, in the order they were."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    right, left = (rank + 1) % size, (rank - 1) % size
    kv = torch.stack([k, v])  # one message a step, not two
    diagonal = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
    state, used = empty_state(q), []
    for step in range(size):
        source = (rank - step) % size  # whose block ``kv`` is: it came ``step`` hops
        if step < size - 1:  # pass it on first, so the transfer overlaps the compute below
            incoming = torch.empty_like(kv)
            requests = [
                dist.isend(kv, group=group, group_dst=right),  # kv is only read until wait()
                dist.irecv(incoming, group=group, group_src=left),
            ]
        if not causal or source < rank:  # all of these keys are visible
            state = attend(q, kv[0], kv[1], state)
            used.append(source)
        elif source == rank:  # the diagonal block: position i sees positions up to i
            state = attend(q, kv[0], kv[1], state, mask=diagonal)
            used.append(source)
        # else: a later block, all future positions: nothing to compute, only to pass on
        if step < size - 1:
            for request in requests:
                request.wait()
            kv = incoming  # the block just used may be dropped: its send has finished
    acc, _, row_sum = state
    return acc / row_sum, used


def ring_attention_block(rank: int, size: int, causal: bool = False) -> tuple[torch.Tensor, list]:
    """``data()`` split over the default group, and this rank's ring attention."""
    q, k, v = (block(t, rank, size) for t in data())
    return ring_attention(q, k, v, causal)


def demo(rank: int, size: int) -> None:
    for causal in (False, True):
        out, used = ring_attention_block(rank, size, causal)
        # The demo checks itself against one process's SDPA on the whole sequence.
        whole = F.scaled_dot_product_attention(*data(), is_causal=causal)
        error = (out - block(whole, rank, size)).abs().max().item()
        print_line(f"causal={causal!s:>5}, rank {rank}: K/V of ranks {used}, error {error:.1e}")


def main(argv: list[str] | None = None) -> int:
    args = toy.demo_parser(
        __name__, "D20. Ring attention: the sequence split over the ranks, K/V passed around."
    ).parse_args(argv)
    return toy.main(demo, args.world_size, args.timeout, PRELOAD)


if __name__ == "__main__":
    toy.run_as_script(main)  # the package's copy of this module: see toy.py
