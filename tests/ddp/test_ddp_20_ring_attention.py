"""D20. Context parallelism: ring attention (``ddp/ring_attention.py``).

The claims, in one world of 4 ranks holding rings of 2, 3 and 4 (groups of its first ranks):
each rank's output block is the block of ``F.scaled_dot_product_attention`` on the whole
sequence in this process, without and with the causal mask; every rank sent exactly
``N - 1`` K/V blocks, each one block (``SEQ / N`` positions) of K and V, to its right
neighbour, and received as many from its left; and the causal ring computed only the
blocks at and before the rank's own (rank r: r + 1 of them, its own first), while the
non-causal one used every block, its own first, then each from one more hop away.
"""

from __future__ import annotations

import re
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tutorial_impl.ddp import ring_attention as lesson

pytestmark = pytest.mark.warm_world

WORLD = 4
RINGS = (2, 3, 4)
ATOL = 1e-6  # float32, the softmax's sums taken in another order


def rings(rank: int, world_size: int) -> dict:
    """In the ranks: for each ring size n, ranks 0 .. n-1 attend causally and not, the
    p2p calls counted at ``torch.distributed`` (the calls the lesson makes)."""
    seen = {}
    for n in RINGS:
        group = dist.new_group(list(range(n)))  # every rank calls new_group, in the same order
        if rank < n:
            q, k, v = (lesson.block(t, rank, n) for t in lesson.data())
            for causal in (False, True):
                with (
                    mock.patch.object(dist, "isend", wraps=dist.isend) as isend,
                    mock.patch.object(dist, "irecv", wraps=dist.irecv) as irecv,
                ):
                    out, used = lesson.ring_attention(q, k, v, causal, group)
                seen[n, causal] = {
                    "out": out,
                    "used": used,
                    "sent": [(c.kwargs["group_dst"], c.args[0].shape) for c in isend.mock_calls],
                    "received": [
                        (c.kwargs["group_src"], c.args[0].shape) for c in irecv.mock_calls
                    ],
                }
        dist.destroy_process_group(group)
    return seen


def test_ring_attention_is_attention_over_the_whole_sequence(run_ranks) -> None:
    results = run_ranks(rings, world_size=WORLD)
    q, k, v = lesson.data()
    for n in RINGS:
        kv_block = (2, lesson.BATCH, lesson.HEADS, lesson.SEQ // n, lesson.HEAD_DIM)
        for causal in (False, True):
            whole = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            for rank in range(n):
                where = f"ring of {n}, causal={causal}, rank {rank}"
                seen = results[rank][n, causal]
                expected = lesson.block(whole, rank, n)
                torch.testing.assert_close(seen["out"], expected, atol=ATOL, rtol=0, msg=where)
                # N - 1 blocks out to the right and in from the left, never the whole K/V.
                right, left = (rank + 1) % n, (rank - 1) % n
                assert seen["sent"] == [(right, kv_block)] * (n - 1), where
                assert seen["received"] == [(left, kv_block)] * (n - 1), where
                # Its own block first, then one hop further each step; causal stops at 0.
                order = [(rank - step) % n for step in range(n)]
                assert seen["used"] == (order[: rank + 1] if causal else order), where
    for rank, seen in enumerate(results):  # a rank outside a ring took no part in it
        assert {n for n, _ in seen} == {n for n in RINGS if rank < n}, f"rank {rank}"


def test_the_demo_checks_itself_with_and_without_the_mask(run_ranks):
    """``python -m tutorial_impl.ddp.ring_attention``: every rank prints both runs, each with
    its error against one process's SDPA on the whole sequence, and both errors are tiny."""
    results = run_ranks(lesson.demo, world_size=2)
    for rank, printed in enumerate(results.outputs):
        lines = re.findall(rf"causal=\s*(True|False), rank {rank}: .* error (\S+)", printed)
        assert sorted(causal for causal, _ in lines) == ["False", "True"], printed
        assert all(float(error) <= ATOL for _, error in lines), printed
