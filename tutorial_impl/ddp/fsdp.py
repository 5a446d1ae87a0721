"""D6. FSDP2 (``fully_shard``): every rank holds a slice of each parameter, and steps it.

DDP keeps a whole copy of the model, its gradients and its optimizer state on every rank.
Fully Sharded Data Parallel keeps a *shard*: with N ranks, each parameter is cut along dim
0 into N pieces and rank r keeps piece r. The price is communication around every use:

* **before** (between steps): each parameter is a ``DTensor`` (lesson D7) with placement
  ``Shard(0)``: ``p.shape`` is the whole parameter's shape, ``p.to_local()`` the rows this
  rank holds. Rows split like ``torch.chunk``: a 3-row weight on 2 ranks is 2 + 1 rows.
* **during** forward (and backward) of a module that was given ``fully_shard``: its
  pre-forward hook all-gathers the shards and swaps in ordinary, whole ``nn.Parameter``s,
  so the layer's own ``forward`` computes as if nothing were sharded;
* **after** forward the whole parameters are freed again and gathered once more for
  backward (``reshard_after_forward=True``; the default, ``None``, means True for every
  module but the root, which keeps its whole parameters for the backward that follows at
  once: ``torch/distributed/fsdp/_fully_shard/_fully_shard.py``); backward *reduce-scatters* the
  gradients: each rank receives the average gradient of its own rows only, a ``DTensor``
  like its parameter. The optimizer then updates just those rows.

``fully_shard`` is applied to each layer, then to the root: a layer is one unit of
gather-and-free, so at most about one layer is whole at a time (the root takes whatever
parameters no layer claimed). ``full_tensor()`` gathers a whole parameter on demand, which
is how the test compares the result with one process's step.

    python -m tutorial_impl.ddp.fsdp         # 2 local ranks; or under torchrun
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from tutorial_impl.ddp import toy
from tutorial_impl.dist_tuto.process import print_line

PRELOAD = ["torch._dynamo"]  # the first optimizer imports it: see equivalence.py
SIZES = (8, 32, 32, 3)  # the last layer's 3 rows do not split evenly over 2 ranks


def describe(module: nn.Module) -> dict[str, dict]:
    """What this rank holds for each parameter of ``module``, right now."""
    held = {}
    for name, p in module.named_parameters():
        sharded = isinstance(p, DTensor)
        held[name] = {
            "type": type(p).__name__,
            "placements": p.placements if sharded else None,  # (Shard(dim=0),) under FSDP
            "shape": tuple(p.shape),  # a DTensor's shape is the whole parameter's
            "local_shape": tuple(p.to_local().shape) if sharded else tuple(p.shape),
        }
    return held


def shard(model: nn.Sequential, mesh) -> nn.Sequential:
    """``fully_shard`` each Linear layer, then the root (in place; returns ``model``)."""
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def one_step(rank: int, size: int, x: torch.Tensor, y: torch.Tensor) -> dict:
    """One SGD step of a sharded ``toy.mlp`` on this rank's share of ``(x, y)``; what the
    rank held before, during and after, and the parameters after the step."""
    # A 1-D mesh over every rank: FSDP's all-gathers and reduce-scatters run on it. On
    # the CPU the mesh's group is gloo's; on GPUs it would be NCCL's.
    mesh = init_device_mesh("cpu", (size,))
    model = shard(toy.mlp(0, SIZES), mesh)
    seen: dict[str, dict] = {"before": describe(model), "during": {}}
    for i, layer in enumerate(model):
        if isinstance(layer, nn.Linear):  # runs after FSDP's own pre-forward (the gather)
            layer.register_forward_pre_hook(
                lambda module, args, i=i: seen["during"].update(
                    {f"{i}.{n}": d for n, d in describe(module).items()}
                )
            )
    optimizer = torch.optim.SGD(model.parameters(), lr=toy.LR)
    xs, ys = toy.shard(x, rank, size), toy.shard(y, rank, size)
    loss = F.mse_loss(model(xs), ys)
    seen["after_forward"] = describe(model)
    loss.backward()
    seen["grads"] = {  # each rank holds the averaged gradient of its own rows only
        name: (type(p.grad).__name__, p.grad.placements) for name, p in model.named_parameters()
    }
    optimizer.step()
    seen["local"] = {name: p.to_local().detach().clone() for name, p in model.named_parameters()}
    seen["full"] = {name: p.full_tensor().detach() for name, p in model.named_parameters()}
    return seen


def demo(rank: int, size: int) -> None:
    x, y = toy.batch(8 * size, sizes=SIZES)
    seen = one_step(rank, size, x, y)
    for moment in ("before", "during", "after_forward"):
        for name, held in seen[moment].items():
            print_line(
                f"rank {rank} {moment:>13} {name:>9}: {held['type']:<9} "
                f"shape {held['shape']}, held here {held['local_shape']} {held['placements']}"
            )
    total = sum(t.numel() for t in seen["full"].values())
    mine = sum(t.numel() for t in seen["local"].values())
    print_line(f"rank {rank} keeps {mine} of the model's {total} numbers between steps")


def main(argv: list[str] | None = None) -> int:
    args = toy.demo_parser(
        __name__, "D6. FSDP2 fully_shard: what each rank holds before, during and after a step."
    ).parse_args(argv)
    return toy.main(demo, args.world_size, args.timeout, PRELOAD)


if __name__ == "__main__":
    toy.run_as_script(main)  # the package's copy of this module: see toy.py
