"""Callee-side asynchrony: ``@rpc.functions.async_execution``, and batched updates with it.

A plain RPC target holds one of the callee's worker threads until it returns. A function
decorated with ``@rpc.functions.async_execution`` returns a ``Future`` instead, and RPC
replies when that future completes; the thread is free in between. Two uses:

* **Chaining** (the reference's example, ``async_add_chained``): the callee starts a nested
  RPC and returns its future, with ``.then`` adding the last term, instead of blocking on it.
* **Batch processing** (the reference's tutorial "Implementing batch RPC processing"): a
  parameter server that answers N trainers' gradient pushes only once all N have arrived.
  Every push gets the same future; the N-th push applies one averaged update and completes
  it, so all N trainers receive the same new parameters.

As a static method, ``@staticmethod`` goes above ``@rpc.functions.async_execution``.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed.rpc as rpc


@rpc.functions.async_execution
def async_add_chained(to: str, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> Any:
    """``x + y`` computed on worker ``to``, then ``+ z`` here, without blocking a thread."""
    return rpc.rpc_async(to, torch.add, args=(x, y)).then(lambda fut: fut.wait() + z)


class BatchUpdateParameterServer:
    """A linear model ``x @ weight.T + bias`` on the parameter server, updated once per batch
    of N trainer pushes. Its parameters start as ``torch.randn`` of a seeded generator."""

    def __init__(self, trainers: int, in_features: int, lr: float, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.params = [torch.randn(1, in_features, generator=g), torch.randn(1, generator=g)]
        self.grad_sums = [torch.zeros_like(p) for p in self.params]  # this batch's pushes
        self.trainers = trainers
        self.lr = lr
        self.lock = threading.Lock()
        self.pending = 0
        self.updated = torch.futures.Future()  # completed by the batch's last push

    def snapshot(self) -> list[torch.Tensor]:
        return [p.clone() for p in self.params]

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch(
        ps: rpc.RRef[BatchUpdateParameterServer], grads: list[torch.Tensor]
    ) -> torch.futures.Future[list[torch.Tensor]]:
        """A trainer's push: add its gradients; the N-th push of a batch steps and answers all."""
        self = ps.local_value()
        with self.lock:
            for grad_sum, g in zip(self.grad_sums, grads, strict=True):
                grad_sum += g
            self.pending += 1
            future = self.updated
            if self.pending == self.trainers:
                # One plain SGD step on the average of the N pushes.
                for p, grad_sum in zip(self.params, self.grad_sums, strict=True):
                    p -= self.lr * grad_sum / self.trainers
                    grad_sum.zero_()
                self.pending = 0
                # A snapshot, not the live parameters: the reply is serialized later, maybe
                # after the next batch has already changed them.
                future.set_result(self.snapshot())
                self.updated = torch.futures.Future()
        return future


def local_gradients(
    params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor
) -> list[torch.Tensor]:
    """A trainer's gradient of the mean squared error of the linear model ``params`` on (x, y)."""
    weight, bias = (p.detach().clone().requires_grad_(True) for p in params)
    loss = ((x @ weight.T + bias - y) ** 2).mean()
    loss.backward()
    return [weight.grad, bias.grad]


def train_batch(
    ps: rpc.RRef[BatchUpdateParameterServer], x: torch.Tensor, y: torch.Tensor
) -> dict[str, Any]:
    """Runs on a trainer: fetch the parameters, compute gradients, push, get the new ones."""
    before = ps.rpc_sync().snapshot()
    grads = local_gradients(before, x, y)
    after = rpc.rpc_sync(ps.owner(), BatchUpdateParameterServer.update_and_fetch, args=(ps, grads))
    return {"before": before, "grads": grads, "after": after}
