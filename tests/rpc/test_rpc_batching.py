"""Lesson 7, callee-side asynchrony: ``@rpc.functions.async_execution``.

The reference claims: a function decorated with ``async_execution`` returns a Future, and
RPC replies when that future completes, so the callee does not hold a thread while it waits
(its own example: a chained add through a nested RPC). Among its tutorials: batch RPC
processing, a parameter server that waits for a batch of trainers' updates.

One world of three workers (``batching_lesson``); worker1 has only two worker threads.
Read in order: the chained add; four chained calls parked at once on worker1's two threads (a
blocking function could not do that: two calls would hold both threads while they waited and
the other two could not even start); then the batch-updating parameter server, hosted by
worker0 for the trainers worker1 and worker2: nobody is answered before every trainer has
pushed, every trainer gets the same parameters, and the update is the average of the pushes,
checked against a hand-computed SGD step on closed-form gradients.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed.rpc as rpc

from tutorial_impl.rpc.batching import BatchUpdateParameterServer, async_add_chained, train_batch
from tutorial_impl.rpc.workers import init_worker, shutdown_worker

RPC_TIMEOUT = 10.0
PARKED = 4  # calls parked on worker1 at once, twice its two threads
LR, FEATURES, ROUNDS = 0.1, 3, 2
TRAINERS = ["worker1", "worker2"]


# --- Rank functions only these tests use ----------------------------------------------------

_meetings: dict[str, threading.Barrier] = {}
_meetings_lock = threading.Lock()


def meet(key: str, parties: int, timeout: float) -> bool:
    """On worker2: wait until ``parties`` requests have arrived here under the same key."""
    with _meetings_lock:
        barrier = _meetings.setdefault(key, threading.Barrier(parties, timeout=timeout))
    barrier.wait()
    return True


@rpc.functions.async_execution
def meet_without_blocking(key: str, timeout: float) -> torch.futures.Future[bool]:
    return rpc.rpc_async("worker2", meet, args=(key, PARKED, timeout))


def park(key: str) -> list[bool]:
    """Send PARKED calls to worker1 at once, each meeting the others on worker2."""
    args = (key, RPC_TIMEOUT)
    futures = [rpc.rpc_async("worker1", meet_without_blocking, args=args) for _ in range(PARKED)]
    return [fut.wait() for fut in futures]


def pushes_waiting(ps) -> int:
    """On the server: how many pushes of the current batch wait for their answer."""
    return ps.local_value().pending


def trainer(ps, x: torch.Tensor, y: torch.Tensor, after_others: int) -> dict:
    """``train_batch``, started only once ``after_others`` pushes wait on the server; notes
    how many it saw waiting, when it started, and when it got its answer."""
    deadline = time.monotonic() + RPC_TIMEOUT
    waiting = rpc.rpc_sync(ps.owner(), pushes_waiting, args=(ps,))
    while waiting < after_others and time.monotonic() < deadline:
        time.sleep(0.01)
        waiting = rpc.rpc_sync(ps.owner(), pushes_waiting, args=(ps,))
    started = time.monotonic()
    seen = train_batch(ps, x, y)
    return {**seen, "waiting": waiting, "started": started, "answered": time.monotonic()}


def batch_data() -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per round, per trainer: 5 samples of a linear regression problem."""
    g = torch.Generator().manual_seed(1)
    return [
        [(torch.randn(5, FEATURES, generator=g), torch.randn(5, 1, generator=g)) for _ in TRAINERS]
        for _ in range(ROUNDS)
    ]


def batching_lesson(rank: int, world_size: int) -> dict:
    init_worker(rank, world_size, RPC_TIMEOUT, num_worker_threads=2 if rank == 1 else 16)
    report: dict = {}
    if rank == 0:
        x, y, z = torch.ones(2), torch.full((2,), 2.0), torch.full((2,), 3.0)
        report["chained"] = rpc.rpc_sync("worker1", async_add_chained, args=("worker2", x, y, z))
        report["parked"] = park("parked")

        ps = rpc.RRef(BatchUpdateParameterServer(len(TRAINERS), FEATURES, lr=LR, seed=0))
        report["initial"] = ps.local_value().snapshot()
        report["rounds"] = []
        for r, data in enumerate(batch_data()):
            after_others = [0, 1 if r == 0 else 0]  # round 0: worker2 waits for worker1's push
            futures = [
                rpc.rpc_async(t, trainer, args=(ps, x, y, n))
                for t, (x, y), n in zip(TRAINERS, data, after_others, strict=True)
            ]
            report["rounds"].append([fut.wait() for fut in futures])
    shutdown_worker(RPC_TIMEOUT)
    return report


@pytest.fixture(scope="module")
def report(rpc_worlds) -> dict:
    return rpc_worlds.run(batching_lesson, world_size=3, backend=None, timeout=30)[0]


def test_the_chained_add(report):
    # worker1 returned a future of worker2's x + y, with + z attached: 1 + 2 + 3.
    assert torch.equal(report["chained"], torch.full((2,), 6.0))


def test_async_execution_does_not_hold_the_callees_threads(report):
    # Four calls met on worker2 while all four were pending on worker1, which has two
    # threads: none of them held a thread while it waited. (Had they, the barrier of four
    # would have broken after RPC_TIMEOUT and the calls failed.)
    assert report["parked"] == [True] * PARKED


def test_nobody_is_answered_before_every_trainer_has_pushed(report):
    early, late = report["rounds"][0]
    assert late["waiting"] == 1  # worker1's push was waiting when worker2 started...
    assert early["answered"] >= late["started"]  # ... and it was answered only after that


def test_every_trainer_receives_the_same_parameters(report):
    for trainers in report["rounds"]:
        first, second = (seen["after"] for seen in trainers)
        assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def mse_gradients(weight, bias, x, y) -> list[torch.Tensor]:
    """Closed form for mean((x @ W.T + b - y)^2): d/dW = 2/n r.T x, d/db = 2/n sum(r)."""
    residual = x @ weight.T + bias - y
    return [2 / len(x) * residual.T @ x, 2 / len(x) * residual.sum(0)]


def test_each_update_is_one_sgd_step_on_the_average_gradient(report):
    weight, bias = report["initial"]
    for data, trainers in zip(batch_data(), report["rounds"], strict=True):
        grads = [mse_gradients(weight, bias, x, y) for x, y in data]
        for (g_weight, g_bias), seen in zip(grads, trainers, strict=True):
            torch.testing.assert_close(seen["grads"][0], g_weight)  # what each trainer pushed
            torch.testing.assert_close(seen["grads"][1], g_bias)
        weight = weight - LR * (grads[0][0] + grads[1][0]) / 2
        bias = bias - LR * (grads[0][1] + grads[1][1]) / 2
        torch.testing.assert_close(trainers[0]["after"][0], weight)
        torch.testing.assert_close(trainers[0]["after"][1], bias)
