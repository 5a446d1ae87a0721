"""D19. FSDP2 in practice, part two: explicit prefetching and activation checkpointing.

Lesson D6 sharded each ``Linear`` with ``fully_shard``: a layer's parameters are
all-gathered just before its forward (its pre-forward hook) and freed after it. Two settings
change *when* work happens, never *what* the step computes:

* **Explicit prefetching.** ``layer.set_modules_to_forward_prefetch([next_layer])`` makes
  ``layer``'s pre-forward also issue ``next_layer``'s all-gather, so on a GPU it overlaps
  ``layer``'s compute instead of waiting for ``next_layer``'s own hook;
  ``set_modules_to_backward_prefetch`` does the same in reverse for the backward. You see it
  inside ``layer``'s forward: ``next_layer.weight`` is already a whole tensor there, where
  without prefetching it is still a sharded ``DTensor``. The same all-gathers happen (the
  collective counts do not move), only earlier.
* **Activation checkpointing** (``torch.distributed._composable.checkpoint``, applied to a
  module before ``fully_shard``): the module keeps only its input for the backward and runs
  its forward once more there to rebuild what it dropped. Fewer tensors are saved for the
  backward (here: measured by ``saved_tensors_hooks``), the checkpointed layers run forward
  twice, and FSDP gathers their parameters for the backward as it always does, so again the
  collective counts do not move. Memory traded for compute, and the step is the same step.

    python -m tutorial_impl.ddp.fsdp_prefetch     # 2 local ranks; or torchrun --nproc-per-node=2
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import TorchDispatchMode

from tutorial_impl.ddp import toy
from tutorial_impl.ddp.fsdp_practice import counted
from tutorial_impl.dist_tuto.process import print_line

PRELOAD = ["torch._dynamo"]


def linears(model: nn.Sequential) -> list[nn.Linear]:
    return [m for m in model if isinstance(m, nn.Linear)]


def shard(model: nn.Sequential, mesh, prefetch: bool, checkpointed: bool) -> nn.Sequential:
    """``fully_shard`` each Linear, then the root (as D6). ``checkpointed``: every Linear but
    the last is checkpointed first (its recompute then sits inside FSDP's hooks, which gather
    its parameters for it). ``prefetch``: each Linear prefetches the next one's all-gather in
    the forward, and the previous one's in the backward."""
    # The root returns a copy of its output, as D17's ``shard`` does and for its reason.
    model.register_forward_hook(lambda module, args, output: output.clone())
    layers = linears(model)
    for layer in layers[:-1] if checkpointed else []:
        checkpoint(layer)
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if prefetch:
        for layer, after in zip(layers, layers[1:], strict=False):
            layer.set_modules_to_forward_prefetch([after])
            after.set_modules_to_backward_prefetch([layer])
    return model


def gathers_in_forward(comms: CommDebugMode, model: nn.Sequential) -> list[int]:
    """Per Linear, the all-gathers issued while its forward ran (its pre-forward hook
    included), as CommDebugMode's module tracker attributed them."""
    found = []
    for name, layer in model.named_children():
        if isinstance(layer, nn.Linear):
            ops = comms.comm_module_counts.get(f"{type(model).__name__}.{name}", {})
            found.append(
                sum(n for op, n in ops.get("forward", {}).items() if "allgather" in str(op))
            )
    return found


class ForwardOrder(TorchDispatchMode):
    """The forward in order: ``("forward", i)`` as Linear ``i``'s forward starts (before
    FSDP's own pre-forward hook), ``("gather", n)`` for each all-gather, ``n`` the elements
    it gathers (each Linear's are a different number: which layer it was)."""

    def __init__(self, layers: list[nn.Linear]) -> None:
        super().__init__()
        self.events: list[tuple[str, int]] = []
        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(self.starting(i), prepend=True)

    def starting(self, i: int):
        return lambda module, args: self.events.append(("forward", i))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "allgather" in str(func):
            self.events.append(("gather", args[0].numel()))  # the gathered output
        return func(*args, **(kwargs or {}))


def step(rank: int, size: int, x, y, prefetch: bool = False, checkpointed: bool = False) -> dict:
    """One SGD step of ``toy.mlp(0)`` under FSDP2 on this rank's share of ``(x, y)``: the
    all-gathers each Linear's forward issued, the collectives in all, the elements of the
    tensors saved for the backward, and the whole parameters after the step."""
    model = shard(toy.mlp(0), init_device_mesh("cpu", (size,)), prefetch, checkpointed)
    saved: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:  # what autograd keeps for the backward
        saved.append(tensor.numel())
        return tensor

    order = ForwardOrder(linears(model))
    with CommDebugMode() as comms:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), order:
            loss = F.mse_loss(model(toy.shard(x, rank, size)), toy.shard(y, rank, size))
        loss.backward()
    toy.plain_sgd_step(model)
    return {
        "gathers_in_forward": gathers_in_forward(comms, model),
        "forward_order": order.events,
        "comms": counted(comms),
        "saved": sum(saved),
        "params": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()},
    }


def demo(rank: int, size: int) -> None:
    x, y = toy.batch(4 * size)
    for prefetch, checkpointed in ((False, False), (True, False), (False, True)):
        seen = step(rank, size, x, y, prefetch, checkpointed)
        print_line(
            f"rank {rank} prefetch={prefetch} checkpointed={checkpointed}: all-gathers in each "
            f"Linear's forward {seen['gathers_in_forward']}, {seen['saved']} elements saved "
            f"for the backward, {seen['comms']}; in order: {seen['forward_order']}"
        )


def main(argv: list[str] | None = None) -> int:
    args = toy.demo_parser(
        __name__, "D19. FSDP2: explicit prefetching and activation checkpointing."
    ).parse_args(argv)
    return toy.main(demo, args.world_size, args.timeout, PRELOAD)


if __name__ == "__main__":
    toy.run_as_script(main)  # the package's copy of this module: see toy.py
