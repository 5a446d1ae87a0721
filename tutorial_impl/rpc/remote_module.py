"""RemoteModule: an ``nn.Module`` that lives on another worker, called like a local one.

``RemoteModule("worker1/cpu", nn.Linear, args=(3, 2))`` builds the module on worker1 and
returns a local handle. ``handle(x)`` (``forward``) runs the module on its owner through
``rpc_sync``; ``forward_async(x)`` returns a Future instead. ``get_module_rref()`` is the RRef
to the module itself, ``remote_parameters()`` a list of RRefs to its parameters: what a
``DistributedOptimizer`` needs to train it.

The handle deliberately has no ``parameters()``: they would have to be local tensors, and the
parameters exist only on the owner. Calling it raises a ValueError that points to
``remote_parameters``. (The reference warns that RemoteModule does not support CUDA; torch
2.13 documents ``"worker1/cuda:0"`` placements, CPU inputs moved to that GPU before
``forward``, and ``tests/rpc/test_rpc_gpu.py`` runs one. The lessons here stay on ``cpu``.)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
from torch import nn
from torch.distributed.nn import RemoteModule

from tutorial_impl.rpc.optimizer import DistributedOptimizer


class SeededLinear(nn.Linear):
    """``nn.Linear`` whose weight and bias come from a seeded generator, wherever it is built."""

    def __init__(self, in_features: int, out_features: int, seed: int) -> None:
        super().__init__(in_features, out_features)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.weight.copy_(torch.randn(out_features, in_features, generator=g))
            self.bias.copy_(torch.randn(out_features, generator=g))


def remote_linear(owner: str, in_features: int, out_features: int, seed: int) -> RemoteModule:
    return RemoteModule(f"{owner}/cpu", SeededLinear, args=(in_features, out_features, seed))


def remote_module_tour(owner: str, x: torch.Tensor, lr: float = 0.1) -> dict[str, Any]:
    """Every way to use a RemoteModule, then one SGD step on it through its RRefs."""
    module = remote_linear(owner, x.shape[1], 2, seed=0)
    seen: dict[str, Any] = {
        "forward": module(x),  # runs on ``owner``
        "forward_async": module.forward_async(x).wait(),
        "module_owner": module.get_module_rref().owner_name(),
        "module_copy": module.get_module_rref().to_here(),  # a copy of the module, made here
        "parameters_before": [p.to_here() for p in module.remote_parameters()],
    }
    try:
        module.parameters()
        seen["parameters_error"] = None
    except ValueError as exc:
        seen["parameters_error"] = str(exc)
    # Training goes through the RRefs: loss = sum of the outputs, one SGD step on the owner.
    with dist_autograd.context() as context_id:
        loss = module(x).sum()
        dist_autograd.backward(context_id, [loss])
        optimizer = DistributedOptimizer(torch.optim.SGD, module.remote_parameters(), lr=lr)
        optimizer.step(context_id)
    seen["parameters_after"] = [p.to_here() for p in module.remote_parameters()]
    return seen
