"""Lesson 4, DistributedOptimizer: one ``step`` updates parameters on several workers.

The reference claims: the distributed optimizer takes a local optimizer class (SGD, Adagrad,
...) and a list of parameter RRefs, creates one local optimizer on each distinct owner, and
``step(context_id)`` updates every parameter with the gradients of that context.

One world of three workers (``optimizer_lesson``): ``a`` lives on worker1, ``b`` on worker2,
worker0 computes ``loss = sum(a * b) + sum(a * a)`` from copies and steps once. The gradients
are closed-form (dL/da = b + 2a, dL/db = a), and so are the updates, written out by hand
below for SGD and for Adagrad.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.rpc as rpc

from tutorial_impl.rpc.optimizer import distributed_step, optimizer_owners, parameter
from tutorial_impl.rpc.workers import init_worker, shutdown_worker

RPC_TIMEOUT = 10.0
A, B = [1.0, -2.0, 0.5], [0.5, 3.0, -2.0]
LR = 0.1
OPTIMIZERS = {"SGD": torch.optim.SGD, "Adagrad": torch.optim.Adagrad}


def optimizer_lesson(rank: int, world_size: int) -> dict:
    init_worker(rank, world_size, RPC_TIMEOUT)
    report: dict = {}
    if rank == 0:
        for name, optimizer_class in OPTIMIZERS.items():
            a = rpc.remote("worker1", parameter, args=(A,))
            b = rpc.remote("worker2", parameter, args=(B,))
            optimizer = distributed_step([a, b], optimizer_class, lr=LR)
            report[name] = {
                "a": a.to_here().detach(),  # read back from the owners after the step
                "b": b.to_here().detach(),
                "owners": optimizer_owners(optimizer),
            }
    shutdown_worker(RPC_TIMEOUT)
    return report


@pytest.fixture(scope="module")
def report(rpc_worlds) -> dict:
    return rpc_worlds.run(optimizer_lesson, world_size=3, backend=None, timeout=30)[0]


def closed_form_gradients() -> tuple[torch.Tensor, torch.Tensor]:
    a, b = torch.tensor(A), torch.tensor(B)
    return b + 2 * a, a


def test_one_local_optimizer_per_owner(report):
    for name in OPTIMIZERS:
        assert report[name]["owners"] == ["worker1", "worker2"]


def test_sgd_step_on_two_owners(report):
    grad_a, grad_b = closed_form_gradients()
    # SGD: p <- p - lr * grad
    torch.testing.assert_close(report["SGD"]["a"], torch.tensor(A) - LR * grad_a)
    torch.testing.assert_close(report["SGD"]["b"], torch.tensor(B) - LR * grad_b)


def test_adagrad_step_on_two_owners(report):
    grad_a, grad_b = closed_form_gradients()
    # Adagrad, first step from a zero accumulator: sum = grad^2, p <- p - lr * grad /
    # (sqrt(sum) + eps), eps = 1e-10 (torch's default).
    for name, start, grad in (("a", A, grad_a), ("b", B, grad_b)):
        expected = torch.tensor(start) - LR * grad / (grad.abs() + 1e-10)
        torch.testing.assert_close(report["Adagrad"][name], expected)
