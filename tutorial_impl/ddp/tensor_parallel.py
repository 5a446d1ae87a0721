"""D10. Tensor parallelism: one layer's matrix cut across ranks; then FSDP2 + TP on a 2 x 2 mesh.

FSDP (lesson D6) cuts every parameter but gathers it whole before using it: each rank still
computes the whole layer, on its own rows of the batch. **Tensor parallelism** (TP) never
gathers the weights: each rank computes *part of the layer* on the *whole* batch. For a
two-layer MLP ``Linear(8, 32) -> ReLU -> Linear(32, 4)`` (Megatron-LM's split):

* the first layer is cut **column-wise** (``ColwiseParallel``): with N ranks each holds 32/N
  of the 32 output features, i.e. rows ``32/N`` of the ``(32, 8)`` weight (``Shard(0)``) and
  of the bias. Its input is replicated, its output is this rank's 32/N hidden features
  (``Shard(-1)``). The ReLU is elementwise, so it runs on those features as they are;
* the second layer is cut **row-wise** (``RowwiseParallel``): it holds the matching 32/N
  *input* features, columns of the ``(4, 32)`` weight (``Shard(1)``), and computes a partial
  sum of the output over its features. One **all-reduce** adds the N partial sums; the bias
  (``Replicate()``, whole on every rank) is added once.

So forward costs exactly one all-reduce, of the output (batch x 4 floats), whatever the
hidden width. Backward mirrors it: the row-wise layer's gradient needs no communication, and
the column-wise layer's input gradient is a partial sum again, all-reduced if, and only if,
something before the block needs it (here ``x.requires_grad``). ``CommDebugMode`` (from
``torch.distributed.tensor.debug``) counts the collectives DTensor runs; the lesson counts
forward and backward separately. The optimizer steps each rank's shard: every rank ends with
its piece of the step one process would take.

**2-D**: on a 2 x 2 ``DeviceMesh`` ``("dp", "tp")`` (lesson D7) TP runs inside each row of the
mesh (``mesh["tp"]``) and FSDP2 across the rows (``mesh["dp"]``): each "dp" half of the world
gets half the batch; within it, the two "tp" ranks split each layer; and FSDP shards what
TP left along dim 0 once more. Order matters: ``parallelize_module`` first, then
``fully_shard`` on the 1-D "dp" sub-mesh. A weight then carries two placements, one per mesh
dimension.

**A view must not leave an FSDP2 module.** ``RowwiseParallel`` hands back its output as
``to_local()`` of a DTensor: a *view* of the DTensor's local tensor. FSDP2 hooks its
pre-backward step (which all-gathers the parameters again for backward) onto the tensor its
module returns; an in-place op on a view (``out += y``) replaces that tensor's autograd
node and the hook with it, silently: no all-gather, a failing or wrong backward. torch warns
("FSDP2-wrapped module returned a view tensor") whether or not an in-place op follows. The
2-D step therefore returns a copy: a forward hook, registered before ``fully_shard`` so it
runs before FSDP's, clones the output (batch x 4 floats). In your own model, return a fresh
tensor from the root (``out.clone()``, or an out-of-place op last).

    python -m tutorial_impl.ddp.tensor_parallel     # 4 local ranks; or torchrun --nproc-per-node=4
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from tutorial_impl.ddp import toy
from tutorial_impl.ddp.dtensor import MESH_DIMS, MESH_SHAPE, destroy_mesh_groups
from tutorial_impl.dist_tuto.process import print_line

PRELOAD = ["torch._dynamo"]  # the first optimizer imports it: see equivalence.py
SIZES = (8, 32, 4)  # Linear(8, 32) -> ReLU -> Linear(32, 4): "0" and "2" in the Sequential
PLAN = {"0": ColwiseParallel(), "2": RowwiseParallel()}  # the Megatron split


def held(model: nn.Module) -> dict[str, tuple]:
    """For each parameter: (placements, the whole shape, the shape this rank holds)."""
    return {
        name: (tuple(p.placements), tuple(p.shape), tuple(p.to_local().shape))
        for name, p in model.named_parameters()
        if isinstance(p, DTensor)
    }


def counted(mode: CommDebugMode) -> dict[str, int]:
    """``CommDebugMode``'s counts, by name (``all_reduce``, ``all_gather_into_tensor``...)."""
    return {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}


def tp_step(mesh: DeviceMesh, x: torch.Tensor, y: torch.Tensor) -> dict:
    """One SGD step of ``toy.mlp(0, SIZES)`` split over ``mesh`` with ``PLAN``: what the rank
    held, the collectives forward and backward ran, the output, the input's gradient, and
    the whole parameters after the step."""
    model = parallelize_module(toy.mlp(0, SIZES), mesh, PLAN)
    optimizer = torch.optim.SGD(model.parameters(), lr=toy.LR)
    x = x.clone().requires_grad_(True)  # as if a layer before this block needed its gradient
    with CommDebugMode() as forward:
        output = model(x)  # a plain tensor: RowwiseParallel's output is replicated, then local
        loss = F.mse_loss(output, y)
    with CommDebugMode() as backward:
        loss.backward()
    optimizer.step()
    return {
        "held": held(model),
        "forward": counted(forward),
        "backward": counted(backward),
        "output": output.detach(),
        "x_grad": x.grad.clone(),
        "params": {n: p.full_tensor().detach() for n, p in model.named_parameters()},
    }


def fsdp_tp_step(mesh: DeviceMesh, x: torch.Tensor, y: torch.Tensor) -> dict:
    """One SGD step with TP over ``mesh["tp"]`` and FSDP2 over ``mesh["dp"]``: each "dp"
    coordinate trains on its half of the batch."""
    model = parallelize_module(toy.mlp(0, SIZES), mesh["tp"], PLAN)
    # RowwiseParallel's output is a view (``to_local()``); FSDP2 must be handed a tensor of
    # its own to hook its pre-backward on (see the module's docstring). Registered before
    # ``fully_shard``, this hook runs before FSDP's own post-forward hook.
    model.register_forward_hook(lambda module, args, output: output.clone())
    fully_shard(model, mesh=mesh["dp"])  # after TP: FSDP shards the TP shards once more
    optimizer = torch.optim.SGD(model.parameters(), lr=toy.LR)
    dp_index, dp_size = mesh.get_local_rank("dp"), mesh.size(0)
    before = held(model)
    locals_before = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    F.mse_loss(model(toy.shard(x, dp_index, dp_size)), toy.shard(y, dp_index, dp_size)).backward()
    optimizer.step()
    return {
        "held": before,
        "local": locals_before,  # this rank's numbers of each (unstepped) parameter
        "params": {n: p.full_tensor().detach() for n, p in model.named_parameters()},
    }


def check_world(size: int) -> None:
    if size != 4:
        raise ValueError(f"this lesson's 2 x 2 mesh needs 4 ranks, not {size}")


def tensor_parallel_step(rank: int, size: int, x: torch.Tensor, y: torch.Tensor) -> dict:
    """``tp_step`` over a 1-D mesh of every rank (its group is the world's own)."""
    check_world(size)
    mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("tp",))
    try:
        return tp_step(mesh, x, y)
    finally:
        destroy_mesh_groups(mesh)


def two_d_step(rank: int, size: int, x: torch.Tensor, y: torch.Tensor) -> dict:
    """``fsdp_tp_step`` on the 2 x 2 mesh ``("dp", "tp")`` of lesson D7."""
    check_world(size)
    mesh = init_device_mesh("cpu", MESH_SHAPE, mesh_dim_names=MESH_DIMS)
    try:
        return fsdp_tp_step(mesh, x, y)
    finally:
        destroy_mesh_groups(mesh)


def demo(rank: int, size: int) -> None:
    x, y = toy.batch(8, sizes=SIZES)
    seen = {"tp": tensor_parallel_step(rank, size, x, y), "fsdp_tp": two_d_step(rank, size, x, y)}
    for lesson in ("tp", "fsdp_tp"):
        for name, (placements, shape, local) in seen[lesson]["held"].items():
            print_line(f"rank {rank} {lesson:>7} {name:>8}: {shape} -> {local} {placements}")
    tp = seen["tp"]
    print_line(f"rank {rank} TP forward ran {tp['forward']}, backward {tp['backward']}")


def main(argv: list[str] | None = None) -> int:
    args = toy.demo_parser(
        __name__,
        "D10. Tensor parallelism (column- then row-wise) on 4 ranks; FSDP2 + TP on a 2 x 2 mesh.",
        world_size=None,
    ).parse_args(argv)
    return toy.main(demo, 4, args.timeout, PRELOAD)


if __name__ == "__main__":
    toy.run_as_script(main)  # the package's copy of this module: see toy.py
