"""D18. Pipeline schedules: interleaving shrinks the bubble (``ddp/pipeline_schedules.py``).

The claims, on 2 ranks, 4 micro-batches, four Linear layers: under ``Schedule1F1B`` (one
stage of two layers a rank) and ``ScheduleInterleaved1F1B`` (four stages of one layer, rank
r holding stages r and r + 2), every rank runs one forward and one backward of each
micro-batch on each of its stages, and the step is one process's step on the whole batch.
The bubble of the order each rank recorded, replayed with one unit an action, is the
closed form: ``(p - 1) / (m + p - 1) = 1/5`` for 1F1B and ``(p - 1) / (v m + p - 1) = 1/9``
with ``v = 2`` stages a rank. The replay itself is checked first on orders written by hand.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tutorial_impl.ddp import pipeline_schedules as lesson
from tutorial_impl.ddp import toy

pytestmark = pytest.mark.warm_world

P, M = 2, 4  # ranks, micro-batches
ATOL = 1e-6


def order(text: str) -> list[lesson.Action]:
    """``"F0.1 B0.1"`` -> ``[(0, "F", 1), (0, "B", 1)]``: stage 0, micro-batch 1."""
    return [(int(a[1]), a[0], int(a[3])) for a in text.split()]


def test_the_bubble_replay_on_hand_written_orders() -> None:
    gpipe = [
        order("F0.0 F0.1 F0.2 F0.3 B0.0 B0.1 B0.2 B0.3"),
        order("F1.0 F1.1 F1.2 F1.3 B1.0 B1.1 B1.2 B1.3"),
    ]
    assert lesson.bubble(gpipe, 2) == pytest.approx((P - 1) / (M + P - 1))
    serial = [order("F0.0 B0.0"), order("F1.0 B1.0")]  # one micro-batch: half the time idle
    assert lesson.bubble(serial, 2) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="wait on each other"):
        lesson.bubble([order("B0.0 F0.0"), order("F1.0 B1.0")], 2)


def both_schedules(rank: int, size: int, x, y) -> dict:
    """In the ranks: one step under each schedule, from the same parameters."""
    return {s: lesson.run_schedule(rank, size, s, x, y, M) for s in ("1F1B", "Interleaved1F1B")}


def test_interleaving_shrinks_the_bubble(run_ranks) -> None:
    x, y = toy.batch(2 * M, sizes=lesson.SIZES)
    model = toy.mlp(0, lesson.SIZES)
    F.mse_loss(model(x), y).backward()  # micro-batches of equal size: the mean's gradient
    toy.plain_sgd_step(model)
    reference = toy.parameters(model)
    results = run_ranks(both_schedules, x, y, world_size=P)
    for schedule, stages, expected in (
        ("1F1B", P, (P - 1) / (M + P - 1)),
        ("Interleaved1F1B", lesson.STAGES, (P - 1) / (lesson.STAGES // P * M + P - 1)),
    ):
        orders = [seen[schedule]["actions"] for seen in results]
        for rank, actions in enumerate(orders):
            mine = lesson.stages_of(rank, P, schedule)
            everything = {(s, k, m) for s in mine for k in "FB" for m in range(M)}
            assert sorted(actions) == sorted(everything), f"{schedule}, rank {rank}: {actions}"
        assert lesson.bubble(orders, stages) == pytest.approx(expected), schedule
        params = {n: t for seen in results for n, t in seen[schedule]["params"].items()}
        assert params.keys() == reference.keys(), schedule
        for name, value in reference.items():
            torch.testing.assert_close(params[name], value, atol=ATOL, rtol=0, msg=name)
