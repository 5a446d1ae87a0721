"""DistributedOptimizer: one ``step`` that updates parameters living on several workers.

After a distributed backward pass the gradients are scattered: each parameter's gradient sits
in the autograd context *on the worker that owns the parameter*. ``DistributedOptimizer``
takes a local optimizer class (``torch.optim.SGD``, ``torch.optim.Adagrad``, ...) and a list
of parameter RRefs, builds one instance of that optimizer on each distinct owner, and
``step(context_id)`` runs them all, each with the gradients of that context.

The reference's example, made small: ``a`` lives on one worker, ``b`` on another, the loss is
computed here from copies (``to_here`` inside the context records the transfer, so the
gradients flow back to the owners).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

with warnings.catch_warnings():
    # Importing the distributed optimizer compiles its functional optimizers with
    # TorchScript, and torch 2.13 warns once per compiled function that TorchScript is
    # deprecated. Nothing else happens in this block.
    warnings.filterwarnings(
        "ignore",
        message=r"`torch\.jit\.(script|interface)` is deprecated",
        category=DeprecationWarning,
    )
    from torch.distributed.optim import DistributedOptimizer


def parameter(values: list[float]) -> torch.Tensor:
    """A leaf tensor that requires grad, created on whichever worker runs this."""
    return torch.tensor(values, requires_grad=True)


def product_loss(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``sum(a * b) + sum(a * a)``: d/da = b + 2a, d/db = a."""
    return (a * b).sum() + (a * a).sum()


def distributed_step(
    params: list[rpc.RRef[torch.Tensor]],
    optimizer_class: type[torch.optim.Optimizer],
    loss_of: Callable[..., torch.Tensor] = product_loss,
    **optimizer_args: Any,
) -> DistributedOptimizer:
    """One forward, one distributed backward and one ``step`` over parameters held as RRefs."""
    with dist_autograd.context() as context_id:
        loss = loss_of(*[p.to_here() for p in params])
        dist_autograd.backward(context_id, [loss])
        optimizer = DistributedOptimizer(optimizer_class, params, **optimizer_args)
        optimizer.step(context_id)
    return optimizer


def optimizer_owners(optimizer: DistributedOptimizer) -> list[str]:
    """Where the local optimizers live: one per distinct owner of the parameters."""
    return sorted(local.owner_name() for local in optimizer.remote_optimizers)
