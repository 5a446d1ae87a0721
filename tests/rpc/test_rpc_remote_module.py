"""Lesson 5, RemoteModule: a module on another worker, used through a local handle.

The reference claims: ``RemoteModule`` creates an ``nn.Module`` on a remote worker; the local
handle invokes it like a regular module (each call an RPC), or asynchronously with
``forward_async``; ``remote_parameters`` and ``get_module_rref`` reach its parameters and the
module itself. And the DDP + RPC tutorial adds: ``parameters()`` cannot be used on it.

One world of two workers (``remote_module_lesson``): worker0 drives ``remote_module_tour``
on a ``SeededLinear(3, 2)`` owned by worker1. The reference values are plain arithmetic on
the module's weights, which the seed determines: ``x @ W.T + b`` for the forward pass, and for
one SGD step on ``loss = sum(outputs)``, ``W -= lr * (column sums of x)``, ``b -= lr * batch``.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.nn import RemoteModule

from tutorial_impl.rpc.remote_module import SeededLinear, remote_module_tour
from tutorial_impl.rpc.workers import init_worker, shutdown_worker

RPC_TIMEOUT = 10.0
LR = 0.1
X = torch.arange(12, dtype=torch.float32).reshape(4, 3) / 10


def remote_module_lesson(rank: int, world_size: int) -> dict:
    init_worker(rank, world_size, RPC_TIMEOUT)
    report: dict = {}
    if rank == 0:
        report = remote_module_tour("worker1", X, lr=LR)
        # The DDP + RPC tutorial's spelling: a worker name and no "/<device>".
        bare = RemoteModule("worker1", SeededLinear, args=(3, 2, 0))
        report["bare_name_device"] = bare.device
        report["bare_name_on_owner"] = [p.rpc_sync().get_device() for p in bare.remote_parameters()]
    shutdown_worker(RPC_TIMEOUT)
    return report


@pytest.fixture(scope="module")
def report(rpc_worlds) -> dict:
    return rpc_worlds.run(remote_module_lesson, world_size=2, backend=None, timeout=30)[0]


def seeded_weights() -> tuple[torch.Tensor, torch.Tensor]:
    """What ``SeededLinear(3, 2, seed=0)`` holds: randn of a generator seeded with 0."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 3, generator=g), torch.randn(2, generator=g)


def test_forward_runs_on_the_owner(report):
    weight, bias = seeded_weights()
    torch.testing.assert_close(report["forward"], X @ weight.T + bias)


def test_forward_async_returns_a_future_of_the_same_output(report):
    torch.testing.assert_close(report["forward_async"], report["forward"])


def test_get_module_rref_points_at_the_module_on_its_owner(report):
    assert report["module_owner"] == "worker1"
    copy = report["module_copy"]  # what to_here() brought back: a copy of the module
    assert isinstance(copy, SeededLinear)
    weight, bias = seeded_weights()
    assert torch.equal(copy.weight.detach(), weight) and torch.equal(copy.bias.detach(), bias)


def test_remote_parameters_are_rrefs_to_the_owners_parameters(report):
    weight, bias = seeded_weights()
    before = report["parameters_before"]
    assert torch.equal(before[0], weight) and torch.equal(before[1], bias)


def test_a_worker_name_without_a_device_means_its_cpu(report):
    """``RemoteModule("ps", ...)``, as the DDP + RPC tutorial writes it, needs no "/cpu":
    torch/distributed/remote_device.py parses a lone worker name as "<name>/cpu"."""
    assert report["bare_name_device"] == "cpu"
    assert report["bare_name_on_owner"] == [-1, -1]  # get_device() of a CPU tensor, on worker1


def test_parameters_is_refused_with_a_pointer_to_remote_parameters(report):
    assert report["parameters_error"] == (
        "Method ``parameters`` not supported for RemoteModule. "
        "Please use ``remote_parameters`` instead."
    )


def test_one_distributed_sgd_step_through_remote_parameters(report):
    weight, bias = seeded_weights()
    # d(sum of outputs)/dW[j, k] = sum_i x[i, k] for every output j; d/db[j] = batch size.
    grad_weight = X.sum(0).expand(2, 3)
    grad_bias = torch.full((2,), float(len(X)))
    after = report["parameters_after"]
    torch.testing.assert_close(after[0], weight - LR * grad_weight)
    torch.testing.assert_close(after[1], bias - LR * grad_bias)
