"""D1. DDP takes the step ``average_gradients`` takes (``tutorial_impl/ddp/equivalence.py``).

The claim: wrapping a model in ``DistributedDataParallel`` and stepping gives every rank the
parameters the tutorial's hand-written ``average_gradients`` gives, and both are the step one
process takes on the whole global batch. The reference is that one process, written out
below with no ``torch.distributed`` at all; the guard test shows the tolerance can tell a
right step from a wrong one.

Read in this order:

1. ``one_process_step`` and ``test_the_tolerance_can_tell_right_from_wrong``.
2. ``test_ddp_equals_hand_averaged_gradients``: both ways, on two ranks, against it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tutorial_impl.ddp import equivalence, toy

pytestmark = pytest.mark.warm_world

WORLD = 2
ROWS = 16  # the global batch: 8 rows a rank
# Float32 sums in another order (two means of 8 against one mean of 16) differ in the last
# bits, ~1e-8 here; one step moves the parameters by ~1e-2 (checked below).
ATOL = 1e-6


def one_process_step(x: torch.Tensor, y: torch.Tensor, seed: int = 0) -> dict[str, torch.Tensor]:
    """The reference: one process, the whole global batch, one SGD step."""
    model = toy.mlp(seed)
    F.mse_loss(model(x), y).backward()
    toy.plain_sgd_step(model)
    return toy.parameters(model)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_the_tolerance_can_tell_right_from_wrong() -> None:
    """The step is ~1e4 times the tolerance, and a rank that skipped the averaging (a step on
    its own 8 rows) lands ~1e3 tolerances away: neither could pass for the reference."""
    x, y = toy.batch(ROWS)
    reference = one_process_step(x, y)
    assert max_diff(reference, toy.parameters(toy.mlp(0))) > 1000 * ATOL
    assert max_diff(reference, one_process_step(x[:8], y[:8])) > 100 * ATOL


def test_ddp_equals_hand_averaged_gradients(run_ranks) -> None:
    """After one step, DDP's parameters are average_gradients' parameters, bit for bit.

    Each rank built its DDP replica from a different seed: DDP's constructor must have made
    every rank start from rank 0's weights. Then both ways must agree bitwise (with two
    ranks, DDP's divide-then-sum and the tutorial's sum-then-divide are the same arithmetic:
    halving is exact) and both must be the one-process step on all 16 rows.
    """
    x, y = toy.batch(ROWS)
    reference = one_process_step(x, y)
    rank0_start = toy.parameters(toy.mlp(0))
    results = run_ranks(equivalence.one_step_both_ways, x, y, world_size=WORLD)
    for rank, result in enumerate(results):
        # The broadcast: rank 1 built mlp(1) and now holds mlp(0), exactly.
        for name, start in result["ddp_start"].items():
            assert torch.equal(start, rank0_start[name]), f"rank {rank}: {name} not rank 0's"
        for name in reference:
            assert torch.equal(result["ddp"][name], result["hand"][name]), (
                f"rank {rank}: {name} differs between DDP and average_gradients"
            )
        diff = max_diff(result["ddp"], reference)
        assert diff <= ATOL, f"rank {rank} is {diff:.3g} away from the one-process step"
