"""D17. FSDP2 in practice: mixed precision, and HSDP on a 2 x 2 mesh.

Lesson D6 sharded a float32 model over every rank. Two settings change that in practice:

* **``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``**:
  the sharded parameters stay float32 (the optimizer's master copy), but FSDP casts them to
  bfloat16 before the all-gather, so the gather moves half the bytes and forward and
  backward compute in bfloat16; the gradients are reduced in float32 (``reduce_dtype``:
  summing many bfloat16 gradients would lose bits) and land float32 in the sharded
  ``.grad``. The step is a bfloat16 step: close to the float32 one, not equal.
* **HSDP** (hybrid sharding): ``fully_shard`` on a 2-D mesh ``("replicate", "shard")``
  shards each parameter within a row of the mesh, like D6, and *replicates* the shards
  across rows, like DDP. Rank ``(i, j)`` holds chunk ``j``; ranks ``(0, j)`` and ``(1, j)``
  hold the same rows. Gathers stay inside a row (on GPUs: inside a node, on its fast
  links), and only the gradients' shards cross rows, all-reduced as DDP's are. The
  placements say it: ``(Replicate(), Shard(0))``, one per mesh dimension.

    python -m tutorial_impl.ddp.fsdp_practice     # 4 local ranks; or torchrun --nproc-per-node=4
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.debug import CommDebugMode

from tutorial_impl.ddp import toy
from tutorial_impl.ddp.dtensor import destroy_mesh_groups
from tutorial_impl.dist_tuto.process import print_line

PRELOAD = ["torch._dynamo"]
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
HSDP_DIMS = ("replicate", "shard")


def shard(model: nn.Sequential, mesh: DeviceMesh, policy: MixedPrecisionPolicy) -> nn.Module:
    """``fully_shard`` each Linear, then the root, with ``policy`` (as D6's ``shard``).

    The root returns a copy of its output, as D10's 2-D step does, and for the same reason:
    in bfloat16 on the CPU the last Linear's output is a view, and FSDP2 hooks its
    pre-backward onto the tensor its module returns (a view loses the hook to an in-place
    op; torch warns either way). The hook is registered first, so it runs before FSDP's."""
    model.register_forward_hook(lambda module, args, output: output.clone())
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def counted(mode: CommDebugMode) -> dict[str, int]:
    return {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}


def sharded_step(
    mesh: DeviceMesh, index: int, parts: int, x, y, policy: MixedPrecisionPolicy
) -> dict:
    """One SGD step of ``toy.mlp(0)`` under FSDP2 on ``mesh`` with ``policy``, on part
    ``index`` of ``parts`` of the batch: the dtypes a layer computed in, the gradients'
    dtype and placements, the collectives, and the whole parameters after the step."""
    model = shard(toy.mlp(0), mesh, policy)
    computed_in: list[torch.dtype] = []
    model[0].register_forward_pre_hook(lambda m, args: computed_in.append(m.weight.dtype))
    with CommDebugMode() as comms:
        F.mse_loss(model(toy.shard(x, index, parts)), toy.shard(y, index, parts)).backward()
    toy.plain_sgd_step(model)
    return {
        "computed_in": computed_in,
        "param_dtype": model[0].weight.dtype,  # the sharded master copy
        "grad": (model[0].weight.grad.dtype, tuple(model[0].weight.grad.placements)),
        "placements": tuple(model[0].weight.placements),
        "local": {n: p.to_local().detach().clone() for n, p in model.named_parameters()},
        "comms": counted(comms),
        "params": {n: p.full_tensor().detach().float() for n, p in model.named_parameters()},
    }


def mixed_precision_step(rank: int, size: int, x, y) -> dict:
    """``sharded_step`` in bfloat16 with float32 reduction, over every rank."""
    mesh = init_device_mesh("cpu", (size,))
    return sharded_step(mesh, rank, size, x, y, BF16)


def hsdp_step(rank: int, size: int, x, y) -> dict:
    """``sharded_step`` in float32 on a 2 x 2 mesh: shard within a row, replicate across
    rows; every rank trains on its own quarter of the batch."""
    if size != 4:
        raise ValueError(f"this lesson's 2 x 2 mesh needs 4 ranks, not {size}")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=HSDP_DIMS)
    try:
        return sharded_step(mesh, rank, size, x, y, MixedPrecisionPolicy())
    finally:
        destroy_mesh_groups(mesh)


def demo(rank: int, size: int) -> None:
    x, y = toy.batch(4 * size)
    mixed, hybrid = mixed_precision_step(rank, size, x, y), hsdp_step(rank, size, x, y)
    print_line(
        f"rank {rank} bf16: computed in {mixed['computed_in']}, master {mixed['param_dtype']}, "
        f"gradient {mixed['grad']}, {mixed['comms']}"
    )
    print_line(f"rank {rank} HSDP: {hybrid['placements']}, {hybrid['comms']}")


def main(argv: list[str] | None = None) -> int:
    args = toy.demo_parser(
        __name__, "D17. FSDP2 in practice: bf16 mixed precision, HSDP on a 2 x 2 mesh.", None
    ).parse_args(argv)
    return toy.main(demo, 4, args.timeout, PRELOAD)


if __name__ == "__main__":
    toy.run_as_script(main)  # the package's copy of this module: see toy.py
