"""D18. Pipeline schedules beyond 1F1B: interleaving shrinks the bubble, zero bubble fills it.

Lesson D8 ran one stage per rank. A pipeline of ``p`` ranks fed ``m`` micro-batches idles
at its ends: the last rank waits for the first micro-batch to cross every stage, the first
rank waits for the last backward to come back. With forward and backward of a stage taking
one unit each, 1F1B (and GPipe) keep each rank busy ``2m`` units out of ``2(m + p - 1)``:
the **bubble** is ``(p - 1) / (m + p - 1)``.

``ScheduleInterleaved1F1B`` (Megatron-LM's interleaving) cuts the model into ``v * p``
smaller stages and gives each rank ``v`` of them, round robin: with 2 ranks and 4 stages,
rank 0 holds stages 0 and 2, rank 1 stages 1 and 3. A unit of work is now a smaller stage,
so the fill and drain at the ends take ``v`` times less of the step: the bubble becomes
``(p - 1) / (v m + p - 1)``. The price is more messages (every stage boundary crosses
ranks), and ``m`` must be a multiple of ``p``.

**Zero bubble** (``ScheduleInterleavedZeroBubble``, the paper's ZB-1P; same stages) cuts
each backward in two: **B**, the gradient of the stage's *input*, which the previous stage
is waiting for, and **W**, the gradient of its *weights*, which nobody waits for. B goes
first, so the gradient travels back as fast as possible, and the W's are put off to fill
the gaps, the drain among them. With F, B and W one unit each, a rank is busy ``3 v m``
units and idle only during the fill: rank r cannot start before r forwards have crossed,
and the bubble is ``(p - 1) / (3 v m + p - 1)``. (Replayed in the same units, interleaved
1F1B's order, each backward as its B then its W, idles in the fill and the drain: ``2(p -
1) / (3 v m + 2(p - 1))``.) The stage's own methods record these actions: autograd's hook
on a stage's output no longer marks B once backward is split (for the first stage, whose
input needs no gradient, it fires in W; for the last, in both).

The lesson records, on every rank, the order in which its stages ran forwards and
backwards (hooks, as in D8; zero bubble's, its stages' methods), and ``bubble`` measures
the bubble of that recorded order: replayed (``replay``) with one unit a stage's forward or
backward, each action starting once this rank is free and its inputs exist (the previous
stage's forward, the next stage's backward). ``python -m tutorial_impl pictures`` draws the
replays (``docs/images/pipeline_schedules.png``).

    python -m tutorial_impl.ddp.pipeline_schedules     # 2 local ranks
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tutorial_impl.ddp import toy
from tutorial_impl.dist_tuto.process import print_line

PRELOAD = ["torch._dynamo", "torch.distributed.pipelining"]
SIZES = (8, 16, 16, 16, 4)  # four Linear layers: four stages of one layer (and its ReLU)
STAGES = 4
Action = tuple[int, str, int]  # (stage, "F" or "B", micro-batch)


def stage_module(model: nn.Sequential, stage: int) -> nn.Sequential:
    """Stage ``stage`` of 4: Linear ``stage`` and the ReLU after it (the last has none)."""
    return model[2 * stage : 2 * stage + 2]


def stages_of(rank: int, size: int, schedule: str) -> list[int]:
    """1F1B: rank r holds layers 2r and 2r + 1 as one stage (numbered r: one of ``size``,
    so 2 ranks). Interleaved and zero bubble: rank r holds stages r, r + size, ... (round
    robin)."""
    if schedule == "1F1B":
        return [rank]
    return list(range(rank, STAGES, size))


def record(module: nn.Module, stage: int, actions: list[Action]) -> None:
    """Append ``(stage, "F", k)`` at the k-th forward of ``module`` (counted in
    ``actions``) and ``(stage, "B", k)`` when the gradient of that forward's output arrives."""

    def on_forward(mod: nn.Module, args: tuple, output: torch.Tensor) -> None:
        k = sum(1 for a in actions if a[:2] == (stage, "F"))  # since ``actions`` was cleared
        actions.append((stage, "F", k))
        if output.requires_grad:
            output.register_hook(lambda grad: actions.append((stage, "B", k)))

    module.register_forward_hook(on_forward)


def record_split(stage, actions: list[Action]) -> None:
    """Zero bubble's actions, where the schedule calls them: ``forward_one_chunk`` (F),
    ``backward_one_chunk`` (B: the input's gradient) and ``backward_weight_one_chunk`` (W),
    each called with the micro-batch's number first."""
    for kind, name in (
        ("F", "forward_one_chunk"),
        ("B", "backward_one_chunk"),
        ("W", "backward_weight_one_chunk"),
    ):
        method = getattr(stage, name)

        def recorded(mb: int, *args, _kind=kind, _method=method, **kwargs):
            actions.append((stage.stage_index, _kind, mb))
            return _method(mb, *args, **kwargs)

        setattr(stage, name, recorded)  # on this object only: the class stays as it was


def build(rank: int, size: int, schedule: str, model, actions: list[Action], m: int):
    """This rank's parts of ``model`` (by stage) and the schedule that runs them on ``m``
    micro-batches."""
    # Imported here: torch.distributed.pipelining imports torch._dynamo (~1 s of CPU), which
    # a process that only measures bubbles (the test's) does not need.
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B
    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble

    cpu = torch.device("cpu")
    if schedule == "1F1B":  # one stage per rank: layers 2r and 2r + 1 (a slice keeps names)
        part = model[4 * rank : 4 * rank + 4]
        record(part, rank, actions)
        stage = PipelineStage(part, rank, size, cpu)
        return {rank: part}, Schedule1F1B(stage, n_microbatches=m, loss_fn=nn.MSELoss())
    parts = {s: stage_module(model, s) for s in stages_of(rank, size, schedule)}
    stages = [PipelineStage(p, s, STAGES, cpu) for s, p in parts.items()]
    if schedule == "Interleaved1F1B":
        for s, part in parts.items():
            record(part, s, actions)
        return parts, ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=nn.MSELoss())
    for stage in stages:  # "InterleavedZeroBubble"
        record_split(stage, actions)
    return parts, ScheduleInterleavedZeroBubble(stages, n_microbatches=m, loss_fn=nn.MSELoss())


def run_schedule(rank: int, size: int, schedule: str, x, y, n_microbatches: int) -> dict:
    """One training step of ``toy.mlp(0, SIZES)`` under ``schedule`` on ``size`` ranks:
    the order of this rank's actions, and its stages' parameters after an SGD step."""
    model = toy.mlp(0, SIZES)
    actions: list[Action] = []
    parts, pipe = build(rank, size, schedule, model, actions, n_microbatches)

    def step() -> None:
        for part in parts.values():
            part.zero_grad()
        actions.clear()
        if rank == 0:
            pipe.step(x)  # rank 0 holds the first stage
        elif rank == size - 1:
            pipe.step(target=y)  # the last rank holds the last stage
        else:
            pipe.step()

    step()  # the rehearsal: a schedule's first step runs a trial micro-batch (see D8)
    step()
    for part in parts.values():
        toy.plain_sgd_step(part)
    params = {n: p.detach().clone() for part in parts.values() for n, p in part.named_parameters()}
    return {"actions": list(actions), "params": params}


def replay(orders: list[list[Action]], stages: int) -> list[list[int]]:
    """When each recorded action starts, replayed with one time unit per action: an action
    starts when its rank is free and its input exists (``F`` of stage s needs ``F`` of
    s - 1; ``B`` of s needs ``B`` of s + 1, or for the last stage its own ``F``; ``W``, zero
    bubble's weight gradient, needs its own ``B``). One list of start times per rank, in
    the rank's order."""
    done: dict[Action, int] = {}
    free = [0] * len(orders)
    starts: list[list[int]] = [[] for _ in orders]
    while any(len(starts[r]) < len(order) for r, order in enumerate(orders)):
        progressed = False
        for r, order in enumerate(orders):
            if len(starts[r]) == len(order):
                continue
            stage, kind, mb = order[len(starts[r])]
            if kind == "F":
                needs = (stage - 1, "F", mb) if stage else None
            elif kind == "W":
                needs = (stage, "B", mb)
            else:
                needs = (stage + 1, "B", mb) if stage < stages - 1 else (stage, "F", mb)
            if needs is not None and needs not in done:
                continue
            start = max(free[r], done[needs] if needs else 0)
            done[order[len(starts[r])]] = free[r] = start + 1
            starts[r].append(start)
            progressed = True
        if not progressed:
            raise ValueError("the recorded orders wait on each other: not one pipeline step")
    return starts


def bubble(orders: list[list[Action]], stages: int) -> float:
    """The idle fraction of the recorded per-rank orders, replayed (``replay``):
    1 - busy units / (ranks x the replay's length)."""
    ends = [start + 1 for starts in replay(orders, stages) for start in starts]
    return 1 - len(ends) / (len(orders) * max(ends))


def demo(rank: int, size: int, n_microbatches: int = 4) -> None:
    x, y = toy.batch(2 * n_microbatches, sizes=SIZES)
    for schedule in ("1F1B", "Interleaved1F1B", "InterleavedZeroBubble"):
        actions = run_schedule(rank, size, schedule, x, y, n_microbatches)["actions"]
        print_line(
            f"{schedule:>21}, rank {rank}: " + " ".join(f"{k}{s}.{m}" for s, k, m in actions)
        )


def main(argv: list[str] | None = None) -> int:
    args = toy.demo_parser(
        __name__, "D18. 1F1B, interleaved 1F1B, zero bubble on 2 ranks: the order each ran.", None
    ).parse_args(argv)
    return toy.main(demo, 2, args.timeout, PRELOAD)


if __name__ == "__main__":
    toy.run_as_script(main)  # the package's copy of this module: see toy.py
