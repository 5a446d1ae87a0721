"""D8. Pipelining: a model split over 2 ranks, 4 micro-batches (``ddp/pipeline.py``).

The claims: each rank holds only its stage's layers; under both ``ScheduleGPipe`` and
``Schedule1F1B`` the last stage's merged output is the whole model's output on the whole
batch, its per-micro-batch losses are the whole model's losses on each quarter, every
stage's gradients are the one-process gradients of its layers (the schedule's 1/4 scaling
makes four micro-batch means one batch mean), and an SGD step lands on the one-process
step. And the schedules differ the way they claim: GPipe runs every forward before any
backward (4 micro-batches alive at once on each stage), 1F1B at most ``stages - index``.

The reference is the unsplit ``toy.mlp(0)`` in this process; micro-batches are cut here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tutorial_impl.ddp import toy

pytestmark = pytest.mark.warm_world  # as the other lessons: one world, checked between tests
WORLD, MICRO, ROWS = 2, 4, 8  # 2 stages, 4 micro-batches of 2 rows
ATOL = 1e-6


SCHEDULES = ["GPipe", "1F1B"]


def both_schedules(rank: int, size: int, x: torch.Tensor, y: torch.Tensor) -> dict:
    # Imported here, in the rank: torch.distributed.pipelining imports torch._dynamo, a
    # second of CPU in this test's own process, which needs nothing of it.
    from tutorial_impl.ddp import pipeline

    return {name: pipeline.run_schedule(rank, size, name, x, y, MICRO) for name in SCHEDULES}


def in_flight(events: list[str]) -> int:
    """The most forwards whose backward had not started, at any point of ``events``."""
    counts = [events[: i + 1].count("F") - events[: i + 1].count("B") for i in range(len(events))]
    return max(counts, default=0)


def test_two_stages_and_four_micro_batches_compute_what_one_process_does(run_ranks) -> None:
    x, y = toy.batch(ROWS)
    model = toy.mlp(0)
    output = model(x)
    F.mse_loss(output, y).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    micro_losses = [
        F.mse_loss(model(mx), my).detach()
        for mx, my in zip(x.chunk(MICRO), y.chunk(MICRO), strict=True)
    ]
    toy.plain_sgd_step(model)
    stepped = toy.parameters(model)
    layers = [["0.weight", "0.bias"], ["2.weight", "2.bias", "4.weight", "4.bias"]]

    results = run_ranks(both_schedules, x, y, world_size=WORLD)
    for name in SCHEDULES:
        last = results[-1][name]
        torch.testing.assert_close(last["output"], output.detach(), atol=ATOL, rtol=0)
        torch.testing.assert_close(torch.stack(last["losses"]), torch.stack(micro_losses))
        assert results[0][name]["output"] is None and results[0][name]["losses"] == []
        for rank in range(WORLD):
            result, where = results[rank][name], f"{name}, stage {rank}"
            assert sorted(result["grads"]) == sorted(layers[rank]), where  # only its layers
            for param in layers[rank]:
                torch.testing.assert_close(result["grads"][param], grads[param], atol=ATOL, rtol=0)
                torch.testing.assert_close(
                    result["params"][param], stepped[param], atol=ATOL, rtol=0
                )
            events = result["events"]
            assert events.count("F") == events.count("B") == MICRO, f"{where}: {events}"

    # GPipe: all forwards, then all backwards; 1F1B: at most (stages - index) alive.
    for rank, result in enumerate(results):
        assert result["GPipe"]["events"] == ["F"] * MICRO + ["B"] * MICRO
        assert in_flight(result["GPipe"]["events"]) == MICRO
        assert in_flight(result["1F1B"]["events"]) == WORLD - rank, result["1F1B"]
