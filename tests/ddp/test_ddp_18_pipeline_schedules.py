"""D18. Pipeline schedules: interleaving shrinks the bubble, zero bubble fills its drain
(``ddp/pipeline_schedules.py``).

The claims, on 2 ranks, 4 micro-batches, four Linear layers: under ``Schedule1F1B`` (one
stage of two layers a rank) and ``ScheduleInterleaved1F1B`` (four stages of one layer, rank
r holding stages r and r + 2), every rank runs one forward and one backward of each
micro-batch on each of its stages, and the step is one process's step on the whole batch.
The bubble of the order each rank recorded, replayed with one unit an action, is the
closed form: ``(p - 1) / (m + p - 1) = 1/5`` for 1F1B and ``(p - 1) / (v m + p - 1) = 1/9``
with ``v = 2`` stages a rank. Under ``ScheduleInterleavedZeroBubble`` (the same four
stages) every rank runs each micro-batch's F, B (input gradient) and W (weight gradient)
once on each of its stages, the step is again one process's, and the bubble, F, B and W one
unit each, is the fill alone: ``(p - 1) / (3 v m + p - 1) = 1/25``, where interleaved
1F1B's order, each backward replayed as B then W, gives ``2(p - 1) / (3 v m + 2(p - 1)) =
1/13``. The replay itself is checked first on orders written by hand.
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
    # A weight gradient waits for its own stage's input gradient, not for anyone else.
    split = [order("F0.0 B0.0 W0.0"), order("F1.0 B1.0 W1.0")]  # B0.0 waits for B1.0 (ends at 3)
    assert lesson.replay(split, 2) == [[0, 3, 4], [1, 2, 3]]  # W1.0 runs while B0.0 does
    assert lesson.bubble(split, 2) == pytest.approx(1 - 6 / (2 * 5))  # W0.0 ends at 5
    with pytest.raises(ValueError, match="wait on each other"):
        lesson.bubble([order("F0.0 W0.0 B0.0"), order("F1.0 B1.0 W1.0")], 2)


SCHEDULES = ("1F1B", "Interleaved1F1B", "InterleavedZeroBubble")


def every_schedule(rank: int, size: int, x, y) -> dict:
    """In the ranks: one step under each schedule, from the same parameters."""
    return {s: lesson.run_schedule(rank, size, s, x, y, M) for s in SCHEDULES}


def as_b_then_w(actions: list[lesson.Action]) -> list[lesson.Action]:
    """A whole backward replayed as zero bubble's two halves, back to back."""
    halves = {"F": ("F",), "B": ("B", "W")}
    return [(s, half, m) for s, k, m in actions for half in halves[k]]


def test_interleaving_shrinks_the_bubble(run_ranks) -> None:
    x, y = toy.batch(2 * M, sizes=lesson.SIZES)
    model = toy.mlp(0, lesson.SIZES)
    F.mse_loss(model(x), y).backward()  # micro-batches of equal size: the mean's gradient
    toy.plain_sgd_step(model)
    reference = toy.parameters(model)
    results = run_ranks(every_schedule, x, y, world_size=P)
    v = lesson.STAGES // P
    for schedule, stages, expected in (
        ("1F1B", P, (P - 1) / (M + P - 1)),
        ("Interleaved1F1B", lesson.STAGES, (P - 1) / (v * M + P - 1)),
        ("InterleavedZeroBubble", lesson.STAGES, (P - 1) / (3 * v * M + P - 1)),
    ):
        orders = [seen[schedule]["actions"] for seen in results]
        kinds = "FBW" if "ZeroBubble" in schedule else "FB"
        for rank, actions in enumerate(orders):
            mine = lesson.stages_of(rank, P, schedule)
            everything = {(s, k, m) for s in mine for k in kinds for m in range(M)}
            assert sorted(actions) == sorted(everything), f"{schedule}, rank {rank}: {actions}"
        assert lesson.bubble(orders, stages) == pytest.approx(expected), schedule
        params = {n: t for seen in results for n, t in seen[schedule]["params"].items()}
        assert params.keys() == reference.keys(), schedule
        for name, value in reference.items():
            torch.testing.assert_close(params[name], value, atol=ATOL, rtol=0, msg=name)
    # In zero bubble's units, interleaved 1F1B idles in the fill and in the drain.
    interleaved = [as_b_then_w(seen["Interleaved1F1B"]["actions"]) for seen in results]
    assert lesson.bubble(interleaved, lesson.STAGES) == pytest.approx(
        2 * (P - 1) / (3 * v * M + 2 * (P - 1))
    )
