"""D5. Uneven inputs: a bare loop blocks, ``Join`` finishes (``tutorial_impl/ddp/join.py``).

The claims: without ``Join``, the rank with more batches waits in an all-reduce nobody
answers (here until its group's short deadline, then gloo's "Timed out"); with ``Join`` every
rank finishes, all with the same parameters, and those are the parameters of an
independent computation, written below with plain autograd: at each step, sum the
gradients of the ranks that still have a batch, divide by the initial world size (the
default) or by the number of ranks still training, take an SGD step.

Rank 0 has 2 batches, rank 1 has 4: two of rank 1's steps happen after rank 0 has joined.
One test, one world: ``uneven_both_ways`` runs the bare loop, then both kinds of ``Join``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tutorial_impl.ddp import join, toy

pytestmark = pytest.mark.warm_world

WORLD = 2
STEPS = [2, 4]  # batches per rank
# How long the extra all-reduce may wait before gloo gives up: long enough that two ranks
# running the same tiny steps never drift that far apart, short enough to be cheap (the
# wait is idle time, not CPU).
DEADLINE = 1.0
ATOL = 1e-6


def uneven_both_ways(rank: int, size: int, batches: list, deadline: float) -> dict:
    return {
        "bare": join.train_without_join(rank, size, batches, deadline),
        "initial": join.train_with_join(rank, size, batches, True),
        "active": join.train_with_join(rank, size, batches, False),
    }


def reference(batches: list, divide_by_initial_world_size: bool) -> dict[str, torch.Tensor]:
    """One process replaying the ranks' steps: no DDP, no Join, no torch.distributed."""
    model = toy.mlp(0)
    for step in range(max(STEPS)):
        active = [r for r in range(WORLD) if step < len(batches[r])]
        model.zero_grad()
        for r in active:  # .grad accumulates the sum over the ranks that still train
            x, y = batches[r][step]
            F.mse_loss(model(x), y).backward()
        divisor = WORLD if divide_by_initial_world_size else len(active)
        for p in model.parameters():
            p.grad /= divisor
        toy.plain_sgd_step(model)
    return toy.parameters(model)


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_join_finishes_uneven_ranks_where_a_bare_loop_blocks(run_ranks) -> None:
    batches = join.uneven_batches(STEPS)
    results = run_ranks(uneven_both_ways, batches, DEADLINE, world_size=WORLD)

    # Without Join: rank 0 took its 2 steps and left; rank 1 took the 2 steps both ranks
    # had, then its third step's all-reduce waited the whole deadline and timed out.
    bare = [r["bare"] for r in results]
    assert bare[0] == {"steps": 2, "error": None, "waited": 0.0}
    assert bare[1]["steps"] == 2, f"rank 1 should stop at its third step: {bare[1]}"
    assert "Timed out" in (bare[1]["error"] or "no error"), bare[1]
    assert DEADLINE * 0.9 <= bare[1]["waited"] < DEADLINE + 5, bare[1]["waited"]

    # With Join: each rank took all its steps, and all end with the reference's parameters.
    for mode, initial in (("initial", True), ("active", False)):
        expected = reference(batches, divide_by_initial_world_size=initial)
        for rank, result in enumerate(results):
            assert result[mode]["steps"] == STEPS[rank]
            diff = max_diff(result[mode]["params"], expected)
            assert diff <= ATOL, f"{mode}, rank {rank}: {diff:.3g} from the reference"
    # The two divisors give different models, so the comparison above tells them apart.
    assert max_diff(reference(batches, True), reference(batches, False)) > 100 * ATOL
