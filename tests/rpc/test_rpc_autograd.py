"""Lesson 3, distributed autograd: one backward pass through a forward that crossed workers.

The reference claims: distributed autograd stitches together the local autograd engines of
all workers of the forward pass and reaches out to them in the backward pass, including
through nested calls, so user code never moves gradients itself. ``dist_autograd.context``
scopes one pass, ``backward(context_id, [loss])`` runs it, ``get_gradients(context_id)``
returns the gradients of that context on that worker.

One world of three workers (``autograd_lesson``). Every gradient is compared with the same
computation done by plain, single-process autograd (``local_grads``). Read in order: the
design note's example, the nested chain worker0 -> worker1 -> worker2 with a weight on each
callee, then where gradients are kept: in the context (accumulating there), not in ``.grad``,
and separately for two contexts open at the same time.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

from tutorial_impl.rpc.autograd import (
    chain_backward,
    design_note_example,
    local_backward_misses_remote_weights,
    scale_and_pass,
    set_weight,
    weight_grad_attribute,
)
from tutorial_impl.rpc.workers import init_worker, shutdown_worker

RPC_TIMEOUT = 10.0
CHAIN = ["worker1", "worker2"]
SCALES = (1.0, -3.0)  # the two concurrent contexts


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    names = ("t1", "t2", "t4", "x", "worker1", "worker2")
    shapes = ((3, 3), (3, 3), (3, 3), (4,), (), ())
    return {n: torch.randn(s, generator=g) for n, s in zip(names, shapes, strict=True)}


def autograd_lesson(rank: int, world_size: int) -> dict:
    init_worker(rank, world_size, RPC_TIMEOUT)
    report: dict = {}
    if rank == 0:
        inputs = _inputs()
        t1, t2, t4, x = (inputs[n].clone().requires_grad_(True) for n in ("t1", "t2", "t4", "x"))
        report["design_note"] = design_note_example("worker1", t1, t2, t4)

        for worker in CHAIN:
            rpc.rpc_sync(worker, set_weight, args=(inputs[worker],))
        report["chain"] = chain_backward(x, CHAIN)
        report["dot_grad"] = {
            "t1": t1.grad,
            "x": x.grad,
            **{w: rpc.rpc_sync(w, weight_grad_attribute) for w in CHAIN},
        }

        # Two backward passes in one context: the gradients add up in the context.
        with dist_autograd.context() as context_id:
            loss = rpc.rpc_sync(CHAIN[0], scale_and_pass, args=(x, CHAIN[1:])).sum()
            dist_autograd.backward(context_id, [loss], retain_graph=True)
            dist_autograd.backward(context_id, [loss])
            report["twice"] = dist_autograd.get_gradients(context_id)[x]

        # Two contexts open at once, in two threads, over the same x and the same weights.
        both_forward = threading.Barrier(len(SCALES), timeout=RPC_TIMEOUT)
        concurrent: dict[float, dict] = {}

        def step(scale: float) -> None:
            concurrent[scale] = chain_backward(x, CHAIN, scale, meet=both_forward)

        threads = [threading.Thread(target=step, args=(s,)) for s in SCALES]
        for t in threads:
            t.start()
        for t in threads:
            t.join(RPC_TIMEOUT)
        report["concurrent"] = concurrent

        # The negative control: no context, a local backward (the tutorial's warning).
        fresh_x = inputs["x"].clone().requires_grad_(True)
        report["local_only"] = local_backward_misses_remote_weights(fresh_x, CHAIN)
    shutdown_worker(RPC_TIMEOUT)
    return report


@pytest.fixture(scope="module")
def report(rpc_worlds) -> dict:
    return rpc_worlds.run(autograd_lesson, world_size=3, backend=None, timeout=30)[0]


def local_grads(scale: float = 1.0) -> dict[str, torch.Tensor]:
    """The chain computed in one process with plain autograd: the reference."""
    leaves = {n: v.clone().requires_grad_(True) for n, v in _inputs().items()}
    out = leaves["x"]
    for worker in CHAIN:
        out = torch.tanh(out * leaves[worker])
    (scale * out.sum()).backward()
    return {n: leaves[n].grad for n in ("x", *CHAIN)}


def test_the_design_note_example_matches_local_autograd(report):
    # t3 = t1 + t2 on worker1, t5 = t3 * t4 here, loss = t5.sum().
    leaves = {n: v.clone().requires_grad_(True) for n, v in _inputs().items()}
    ((leaves["t1"] + leaves["t2"]) * leaves["t4"]).sum().backward()
    for name in ("t1", "t2", "t4"):
        torch.testing.assert_close(report["design_note"][name], leaves[name].grad)


def test_a_nested_chain_sends_each_gradient_to_its_owner(report):
    # worker0 -> worker1 -> worker2: x here, one weight on each callee. The gradient of each
    # weight was read on the worker that owns it, from the same context.
    expected = local_grads()
    for name in ("x", *CHAIN):
        torch.testing.assert_close(report["chain"][name], expected[name])


def test_gradients_live_in_the_context_not_in_dot_grad(report):
    assert report["dot_grad"] == {"t1": None, "x": None, "worker1": None, "worker2": None}


def test_gradients_accumulate_within_a_context(report):
    torch.testing.assert_close(report["twice"], 2 * local_grads()["x"])


def test_two_concurrent_contexts_do_not_mix(report):
    # Both forward passes were recorded before either backward ran (a barrier), over the
    # same tensors; each context still holds exactly its own loss's gradients.
    assert sorted(report["concurrent"]) == sorted(SCALES)
    for scale in SCALES:
        expected = local_grads(scale)
        for name in ("x", *CHAIN):
            torch.testing.assert_close(report["concurrent"][scale][name], expected[name])


def test_a_local_backward_never_reaches_the_remote_weights(report):
    """Without a distributed autograd context the RPC's result has no history: the local
    ``backward`` gives the local factor its gradient (the output, since d(out*local)/dlocal
    = out) and stops there. ``x`` and every remote weight get nothing at all: an optimizer
    would never train the table on the parameter server. Hence "always use distributed
    autograd when combining DDP and RPC"."""
    seen = report["local_only"]
    assert seen["out_has_history"] is False
    assert seen["local_grad"] is not None and seen["local_grad"].abs().sum() > 0
    assert seen["x_grad"] is None
    for worker in CHAIN:
        assert seen[worker] is None, worker
    # ...where the same forward inside a context reached every one of them (chain test).
    assert all(report["chain"][w].abs().sum() > 0 for w in CHAIN)
