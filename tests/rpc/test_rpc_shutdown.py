"""Lesson 8, clean shutdown: what a graceful ``rpc.shutdown()`` waits for.

The reference: ``shutdown(graceful=True)`` blocks until all local and remote RPC processes
reach it and wait for all outstanding work to complete. So a worker can start work with
``rpc_async``, never wait for it, and still leave safely.

One world of three workers (``shutdown_lesson``). worker0 starts 0.3 s of work on worker1
without waiting for it and shuts down at once; worker2 is busy with 0.3 s of its own before it
calls shutdown. Times are ``time.monotonic()``, one clock for every process on a machine.
The claims are orderings of events, which a slow machine cannot reverse; their premises
(worker0 called shutdown before the others were done) have 0.3 s of slack.
"""

from __future__ import annotations

import time

import pytest

from tutorial_impl.rpc.workers import init_worker, shutdown_with_work_in_flight, shutdown_worker
from tutorial_impl.testing import run_ranks

RPC_TIMEOUT = 10.0
WORK = 0.3


def shutdown_lesson(rank: int, world_size: int) -> dict:
    init_worker(rank, world_size, RPC_TIMEOUT)
    if rank == 0:
        return shutdown_with_work_in_flight("worker1", WORK, RPC_TIMEOUT)
    if rank == 2:
        time.sleep(WORK)  # worker2's own work, before it is ready to leave
    arrived = time.monotonic()
    shutdown_worker(RPC_TIMEOUT)
    return {"arrived": arrived, "left": time.monotonic()}


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    return run_ranks(shutdown_lesson, world_size=3, backend=None, timeout=30)


def test_shutdown_waits_for_work_still_in_flight(reports):
    worker0 = reports[0]
    assert worker0["shutdown_started"] < worker0["work_finished"]  # left before it was done
    assert worker0["shutdown_returned"] >= worker0["work_finished"]  # but returned after
    assert worker0["future_done"] is True


def test_shutdown_waits_for_every_worker_to_call_it(reports):
    worker0, _, worker2 = reports
    assert worker0["shutdown_started"] < worker2["arrived"]
    assert worker0["shutdown_returned"] >= worker2["arrived"]
