"""Distributed autograd: a forward pass that crosses workers, one backward pass over all of them.

Inside ``with dist_autograd.context() as context_id:`` every tensor that requires grad and
travels over RPC is recorded (a *send* function on the sender, a *recv* function on the
receiver). ``dist_autograd.backward(context_id, [loss])`` then runs the local autograd engines
of every worker the forward pass touched, in the right order, sending gradients back across
the same RPC edges. The gradients land in the *context*, per worker:
``dist_autograd.get_gradients(context_id)`` on a worker returns ``{tensor: gradient}`` for
that worker's leaf tensors. ``tensor.grad`` is never written, so two contexts (two training
steps, two threads) never mix their gradients.

The design note's first example (``design_note_example``): ``t3 = t1 + t2`` computed on
another worker, ``t5 = t3 * t4`` here, ``loss = t5.sum()``. The nested one (``chain_backward``):
worker A calls B, which calls C, each multiplying by a weight it owns.

Why the DDP + RPC tutorial says *always* use distributed autograd with RPC
(``local_backward_misses_remote_weights``): outside a context, what comes back from an RPC is
a plain tensor with no history, so a local ``loss.backward()`` stops at the RPC boundary. The
local inputs get their gradients; the remote worker's weight gets nothing, in no context and
no ``.grad``, and an optimizer would silently never train it.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc


def design_note_forward(
    callee: str, t1: torch.Tensor, t2: torch.Tensor, t4: torch.Tensor
) -> torch.Tensor:
    """The design note's forward, inside a context: ``t3 = t1 + t2`` on ``callee``, then
    ``loss = (t3 * t4).sum()`` here. (``rpc/autograd_graph.py`` records the graph it builds.)"""
    t3 = rpc.rpc_sync(callee, torch.add, args=(t1, t2))
    t5 = torch.mul(t3, t4)
    return t5.sum()


def design_note_example(
    callee: str, t1: torch.Tensor, t2: torch.Tensor, t4: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The design note's forward (``t1 + t2`` on ``callee``), backward, and the gradients."""
    with dist_autograd.context() as context_id:
        loss = design_note_forward(callee, t1, t2, t4)
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)
        return {"t1": grads[t1], "t2": grads[t2], "t4": grads[t4]}


# --- A chain of workers, each with a weight of its own -----------------------------------

_weight: dict[str, torch.Tensor] = {}  # this worker's own parameter, under "w"


def set_weight(value: torch.Tensor) -> None:
    """Give this worker a leaf parameter (runs on the worker that will own it)."""
    _weight["w"] = value.detach().clone().requires_grad_(True)


def weight_gradient(context_id: int) -> torch.Tensor:
    """This worker's share of a distributed backward: the gradient of its weight."""
    return dist_autograd.get_gradients(context_id)[_weight["w"]]


def weight_grad_attribute() -> torch.Tensor | None:
    """``.grad`` of this worker's weight; distributed autograd leaves it alone."""
    return _weight["w"].grad


def scale_and_pass(x: torch.Tensor, rest: list[str]) -> torch.Tensor:
    """Multiply by this worker's weight, squash, and hand the result to the next worker."""
    y = torch.tanh(x * _weight["w"])
    if rest:
        return rpc.rpc_sync(rest[0], scale_and_pass, args=(y, rest[1:]))
    return y


def chain_backward(
    x: torch.Tensor, chain: list[str], scale: float = 1.0, meet: threading.Barrier | None = None
) -> dict[str, torch.Tensor]:
    """Forward through ``chain`` (A -> B -> C ...), ``loss = scale * out.sum()``, backward.

    Returns the gradient of ``x`` (here) and of each chain worker's weight (there), all read
    from this one context. ``meet``, if given, is waited on between forward and backward,
    so that several threads can hold their contexts open at the same time.
    """
    with dist_autograd.context() as context_id:
        out = rpc.rpc_sync(chain[0], scale_and_pass, args=(x, chain[1:]))
        loss = scale * out.sum()
        if meet is not None:
            meet.wait()
        dist_autograd.backward(context_id, [loss])
        grads = {"x": dist_autograd.get_gradients(context_id)[x]}
        for worker in chain:
            grads[worker] = rpc.rpc_sync(worker, weight_gradient, args=(context_id,))
    return grads


def local_backward_misses_remote_weights(x: torch.Tensor, chain: list[str]) -> dict[str, object]:
    """The negative control: the same forward as ``chain_backward`` with no context, and a
    local ``loss.backward()``. Returns what reached ``x`` and the chain's weights."""
    local = torch.ones_like(x, requires_grad=True)  # something here that does require grad
    out = rpc.rpc_sync(chain[0], scale_and_pass, args=(x, chain[1:]))
    loss = (out * local).sum()
    loss.backward()  # the mistake: local autograd only
    return {
        "out_has_history": out.grad_fn is not None,
        "x_grad": x.grad,
        "local_grad": local.grad,
        **{worker: rpc.rpc_sync(worker, weight_grad_attribute) for worker in chain},
    }
