"""D8. Pipeline parallelism: the model split across ranks, fed micro-batches by a schedule.

The DDP + RPC tutorial names two reasons to combine data and model parallelism and builds
the first (a parameter server); its "case 2" is the PipeDream idea: *pipeline stages of the
model across multiple workers*. ``torch.distributed.pipelining`` is that idea as a library,
with plain point-to-point sends between stages instead of RPC:

* each rank holds one **stage**, a consecutive slice of the model's layers (here rank 0 the
  first ``Linear`` and its ReLU, rank 1 the rest), wrapped in a ``PipelineStage``;
* the batch is cut into **micro-batches**; stage 0 computes micro-batch 1 while stage 1
  computes micro-batch 0, so the stages work at the same time instead of in turn;
* a **schedule** orders each stage's forwards and backwards and the sends of activations
  (forward) and their gradients (backward) between neighbours. ``ScheduleGPipe`` runs every
  forward, then every backward: each stage keeps all its micro-batches' activations alive
  at once. ``Schedule1F1B`` starts backward as soon as the last stage can, then alternates
  one forward and one backward: stage ``i`` of ``n`` holds at most ``n - i`` micro-batches
  (itself and the stages after it), whatever the number of micro-batches.

The loss is computed on the last stage, per micro-batch (``loss_fn``); ``scale_grads=True``
(the default) divides the accumulated gradients by the number of micro-batches, so with
equal micro-batches and a mean loss the gradients are those of the whole batch's mean loss:
one process's gradients. ``step`` returns the merged output on the last stage.

``run_schedule`` records, on each stage, the order of its forwards (``F``) and backwards
(``B``), from a forward hook and a hook on each forward's output gradient.

    python -m tutorial_impl.ddp.pipeline     # 2 local ranks; or under torchrun
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from tutorial_impl.ddp import toy
from tutorial_impl.dist_tuto.process import print_line

PRELOAD = ["torch._dynamo", "torch.distributed.pipelining"]
SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}
SPLIT = 2  # stage 0: model[:2] (Linear, ReLU); stage 1: model[2:] (Linear, ReLU, Linear)


def stage_module(model: nn.Sequential, stage: int, num_stages: int) -> nn.Sequential:
    """The layers stage ``stage`` of 2 holds: the same split on every rank and in tests."""
    if num_stages != 2:
        raise ValueError(f"this lesson splits the model in 2 stages, not {num_stages}")
    return model[:SPLIT] if stage == 0 else model[SPLIT:]


def record_order(module: nn.Module, events: list[str]) -> None:
    """Append ``F`` to ``events`` at each forward of ``module``, ``B`` when the gradient of
    that forward's output arrives (the start of its backward on this stage)."""

    def on_forward(mod: nn.Module, args: tuple, output: torch.Tensor) -> None:
        events.append("F")
        if output.requires_grad:
            output.register_hook(lambda grad: events.append("B"))

    module.register_forward_hook(on_forward)


def run_schedule(
    rank: int, size: int, schedule: str, x: torch.Tensor, y: torch.Tensor, n_microbatches: int
) -> dict:
    """One training step of ``toy.mlp(0)`` split over ``size`` ranks under ``schedule``."""
    part = stage_module(toy.mlp(0), rank, size)
    events: list[str] = []
    record_order(part, events)
    stage = PipelineStage(part, stage_index=rank, num_stages=size, device=torch.device("cpu"))
    loss_fn = nn.MSELoss()
    pipe = SCHEDULES[schedule](stage, n_microbatches=n_microbatches, loss_fn=loss_fn)
    optimizer = torch.optim.SGD(part.parameters(), lr=toy.LR)

    def step() -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        optimizer.zero_grad()
        events.clear()
        output, losses = None, []
        if rank == 0:
            pipe.step(x)  # the first stage feeds the whole batch; the schedule cuts it
        elif rank == size - 1:
            output = pipe.step(target=y, losses=losses)  # the last stage gets the targets
        else:
            pipe.step()
        return output, losses

    # A schedule's first step learns the shapes stages exchange by a trial forward (and
    # backward) of one micro-batch; a rehearsal without an optimizer step keeps that
    # trial out of the order recorded below, and leaves the parameters as they were.
    step()
    output, losses = step()
    grads = {name: p.grad.clone() for name, p in part.named_parameters()}
    optimizer.step()
    return {
        "events": events,
        "output": None if output is None else output.detach(),
        "losses": [loss.detach() for loss in losses],
        "grads": grads,
        "params": toy.parameters(part),
    }


def in_flight(events: list[str]) -> int:
    """The most micro-batches whose forward had run and backward not yet started."""
    alive = most = 0
    for event in events:
        alive += 1 if event == "F" else -1
        most = max(most, alive)
    return most


def demo(rank: int, size: int, n_microbatches: int = 4) -> None:
    x, y = toy.batch(2 * n_microbatches)
    for name in SCHEDULES:
        result = run_schedule(rank, size, name, x, y, n_microbatches)
        order = " ".join(result["events"])
        line = f"{name:>5}, stage {rank}: {order}  (at most {in_flight(result['events'])} alive)"
        if result["losses"]:
            line += f", micro-batch losses {[round(v.item(), 4) for v in result['losses']]}"
        print_line(line)


def main(argv: list[str] | None = None) -> int:
    args = toy.demo_parser(
        __name__,
        "D8. A model split over 2 ranks, 4 micro-batches, GPipe and 1F1B.",
        world_size=None,
    ).parse_args(argv)
    return toy.main(demo, 2, args.timeout, PRELOAD)


if __name__ == "__main__":
    toy.run_as_script(main)  # the package's copy of this module: see toy.py
