"""D3. ``no_sync`` accumulation equals one step on the k-times batch (``ddp/no_sync.py``).

The claim: k micro-batches per rank, the first k-1 backwards inside ``ddp.no_sync()`` and
each loss divided by k, then one optimizer step, give the parameters of one step on the
whole batch (every rank's k micro-batches together), and cost one all-reduce, made by the
last backward. The reference is one process on the whole batch; the gradients a rank holds
before the synced backward are recomputed here from that rank's micro-batches alone.

Read in this order:

1. ``one_process_step`` and ``test_the_tolerance_can_tell_right_from_wrong``.
2. ``test_no_sync_accumulation_equals_one_big_step``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tutorial_impl.ddp import no_sync, toy

pytestmark = pytest.mark.warm_world

WORLD, K, MICRO = 2, 4, 2  # 2 ranks x 4 micro-batches x 2 rows = a global batch of 16
ATOL = 1e-6  # float32 sums in another order: ~1e-8 measured; one step moves ~1e-2


def one_process_step(x: torch.Tensor, y: torch.Tensor, lr: float = toy.LR) -> dict:
    """The reference: one process, one SGD step on all of ``(x, y)``."""
    model = toy.mlp(0)
    F.mse_loss(model(x), y).backward()
    toy.plain_sgd_step(model, lr)
    return toy.parameters(model)


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_the_tolerance_can_tell_right_from_wrong() -> None:
    """Forgetting the 1/k makes the step k times too long: far outside the tolerance.
    So does stepping on one rank's rows only."""
    x, y = toy.batch(WORLD * K * MICRO)
    reference = one_process_step(x, y)
    assert max_diff(reference, one_process_step(x, y, lr=K * toy.LR)) > 1000 * ATOL
    assert max_diff(reference, one_process_step(x[:8], y[:8])) > 100 * ATOL


def test_no_sync_accumulation_equals_one_big_step(run_ranks) -> None:
    """Both ranks end at the one-process step; only the last micro-batch all-reduced; and
    just before it each rank held its own, unreduced sum of k-1 micro-batch gradients."""
    x, y = toy.batch(WORLD * K * MICRO)
    reference = one_process_step(x, y)
    results = run_ranks(no_sync.accumulate, x, y, K, world_size=WORLD)
    for rank, result in enumerate(results):
        assert result["all_reduces"] == [0] * (K - 1) + [1], f"rank {rank}"
        diff = max_diff(result["params"], reference)
        assert diff <= ATOL, f"rank {rank} is {diff:.3g} away from the one-process step"
        # What this rank alone had accumulated: its first k-1 micro-batches, each loss / k.
        model = toy.mlp(0)
        xs, ys = toy.shard(x, rank, WORLD), toy.shard(y, rank, WORLD)
        for mx, my in list(zip(xs.chunk(K), ys.chunk(K), strict=True))[:-1]:
            (F.mse_loss(model(mx), my) / K).backward()
        torch.testing.assert_close(result["local_grad"], model[-1].bias.grad)
    assert not torch.allclose(results[0]["local_grad"], results[1]["local_grad"])
