"""D15. The tutorial's "case 2": pipeline stages, each replicated with DDP, on a 2 x 2 mesh.

The DDP + RPC tutorial's second case combines model and data parallelism the PipeDream way:
cut the model into pipeline stages (lesson D8), and run several copies of the pipeline, each
on its own share of the batch, the copies of one stage keeping their gradients in step
with DDP. Four ranks as a 2 x 2 mesh ``("dp", "pp")`` (lesson D7's layout, other names):

* rank ``2i + j`` holds stage ``j`` of pipeline ``i``. Its "pp" group, ``[2i, 2i + 1]``, is
  its pipeline: activations go forward and their gradients back along it (``PipelineStage``
  takes it as ``group``). Its "dp" group, ``[j, 2 + j]``, is every copy of its stage: DDP
  all-reduces that stage's gradients over it (``DDP(..., process_group=...)``);
* pipeline ``i`` takes rows chunk ``i`` of the batch, cut into micro-batches by its schedule.

Two things make the two kinds of parallelism fit. The schedule runs one backward per
micro-batch; DDP would all-reduce after each. ``PipelineStage`` knows DDP: it runs every
backward but the last inside ``no_sync`` (lesson D3), so each stage all-reduces once a step.
And the averages compose: the schedule divides by the number of micro-batches
(``scale_grads``), DDP by the number of copies, so with equal shares and a mean loss the
gradient is the whole batch's mean: every stage takes one process's step on its layers.

One torch 2.13 trap, measured: the schedule's first step runs a trial forward through the
stage (to learn the shapes it exchanges) *outside* ``no_sync``, so DDP prepares a
synchronised backward and the first micro-batch's backward all-reduces too (two all-reduces
in the first step; harmless, averaging is linear), and DDP then records every parameter
twice for its bucket rebuild: the second step's forward fails with "INTERNAL ASSERT FAILED
... rebuilt parameter indices size is not same as original model parameters size".
``find_unused_parameters=True`` turns DDP's bucket rebuild off, and every step is right.

    python -m tutorial_impl.ddp.pipeline_ddp    # 4 local ranks; or torchrun --nproc-per-node=4
"""

# No ``from __future__ import annotations``: register_comm_hook inspects annotations.
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.nn.parallel import DistributedDataParallel as DDP

from tutorial_impl.ddp import toy
from tutorial_impl.ddp.dtensor import MESH_SHAPE, destroy_mesh_groups
from tutorial_impl.ddp.pipeline import record_order, stage_module
from tutorial_impl.dist_tuto.process import print_line

PRELOAD = ["torch._dynamo", "torch.distributed.pipelining"]
DIMS = ("dp", "pp")  # rank 2i + j: pipeline i, stage j
MICRO = 2  # micro-batches a pipeline cuts its share into


def replicated_pipeline_step(rank: int, size: int, x: torch.Tensor, y: torch.Tensor) -> dict:
    """One SGD step: stage ``j`` of pipeline ``i`` on rows chunk ``i``, in DDP over the
    copies of stage ``j``. Returns the groups, this stage's all-reduces per backward, the
    order of its forwards and backwards, and its parameters after the step."""
    if size != 4:
        raise ValueError(f"the 2 x 2 mesh needs 4 ranks, not {size}")
    mesh = init_device_mesh("cpu", MESH_SHAPE, mesh_dim_names=DIMS)
    try:
        pipeline, stage_index = mesh.get_coordinate()
        part = stage_module(toy.mlp(0), stage_index, 2)
        events: list[str] = []
        record_order(part, events)
        # find_unused_parameters: no parameter is unused, but it keeps DDP from rebuilding its
        # buckets after the first step, which the schedule's trial forward breaks (below).
        replicas = DDP(
            part, process_group=mesh.get_group("dp"), find_unused_parameters=True
        )  # the copies of this stage
        reduces = Reduces(mesh.get_group("dp"))
        replicas.register_comm_hook(reduces, count_then_allreduce)
        stage = PipelineStage(
            replicas, stage_index, 2, torch.device("cpu"), group=mesh.get_group("pp")
        )
        schedule = ScheduleGPipe(stage, n_microbatches=MICRO, loss_fn=nn.MSELoss())
        optimizer = torch.optim.SGD(part.parameters(), lr=toy.LR)
        xs, ys = toy.shard(x, pipeline, 2), toy.shard(y, pipeline, 2)  # this pipeline's rows

        def step() -> None:
            optimizer.zero_grad()
            events.clear()
            reduces.count = 0
            if stage_index == 0:
                schedule.step(xs)
            else:
                schedule.step(target=ys)

        # As in lesson D8: the first step also runs a trial micro-batch to learn the shapes;
        # rehearse it, then count and step the second.
        step()
        step()
        optimizer.step()
        return {
            "coordinate": (pipeline, stage_index),
            "groups": {d: dist.get_process_group_ranks(mesh.get_group(d)) for d in DIMS},
            "all_reduces": reduces.count,
            "events": events,
            "params": toy.parameters(part),
        }
    finally:
        destroy_mesh_groups(mesh)


@dataclass
class Reduces:
    """A comm hook's state: the group the stage's copies share, and the all-reduces so far."""

    group: dist.ProcessGroup
    count: int = 0


def count_then_allreduce(state: Reduces, bucket: dist.GradBucket):
    """Lesson D2's idea: count the buckets DDP all-reduces, then do what DDP does, over the
    stage's copies. (``allreduce_hook(None, ...)`` would use the *default* group, all four
    ranks, where the other stage never joins: a hang.)"""
    state.count += 1
    return allreduce_hook(state.group, bucket)


def demo(rank: int, size: int) -> None:
    x, y = toy.batch(8)
    seen = replicated_pipeline_step(rank, size, x, y)
    print_line(
        f"rank {rank}: pipeline {seen['coordinate'][0]}, stage {seen['coordinate'][1]}, "
        f"groups {seen['groups']}, {' '.join(seen['events'])}, "
        f"{seen['all_reduces']} all-reduce(s) for {len(seen['params'])} parameters"
    )


def main(argv: list[str] | None = None) -> int:
    args = toy.demo_parser(
        __name__, "D15. Two pipelines of 2 stages, each stage replicated with DDP.", world_size=None
    ).parse_args(argv)
    return toy.main(demo, 4, args.timeout, PRELOAD)


if __name__ == "__main__":
    toy.run_as_script(main)  # the package's copy of this module: see toy.py
