"""Lesson 1, the three calls (``rpc_sync``, ``rpc_async``, ``remote``), and lesson 8, shutdown.

The reference claims: ``rpc_sync`` blocks and returns the value; ``rpc_async`` returns a
future to wait on when the value is needed; ``remote`` runs the function on the callee and
returns a reference (RRef) to the result, which stays there. ``remote`` is the right call
when the caller creates something for *others* to use: the driver creates an embedding table
on the parameter server and hands the trainer a reference, never fetching the table itself.
The same part of the reference ends with ``shutdown(graceful=True)``, which blocks until every
worker has reached it and all outstanding work is complete, so a worker can start work with
``rpc_async``, never wait for it, and still leave safely.

This module runs one world of three workers (``calls_lesson``): worker0 makes every call,
worker1 and worker2 serve. Read the tests in order: the three calls (``rpc_sync`` sits out
0.1 s of work on worker1; ``rpc_async`` returns while worker1 still waits for worker0's
go-ahead), then the driver / parameter server / trainer story and why ``rpc_sync`` would be
the wrong call for it, then names and ids, a call to a worker that does not exist, and last
how the world ends: worker0 tells worker2 to start 0.2 s of work of its own, starts 0.2 s of
work on worker1 without waiting for it, and shuts down at once; worker2 calls shutdown when
its work is done. The timing claims are orderings of ``time.monotonic()`` (one clock for
every process of a machine), which a slow machine cannot reverse; the shutdown claims'
premises (worker0 called shutdown before the others were done) have 0.2 s of slack.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed.rpc as rpc
from torch import nn

from tutorial_impl.rpc.calls import (
    driver,
    make_table,
    profiled_call,
    three_calls,
    what_arrives,
    when_each_call_returns,
)
from tutorial_impl.rpc.workers import init_worker, shutdown_with_work_in_flight, shutdown_worker

RPC_TIMEOUT = 10.0  # far above any healthy call here, even on a loaded machine
INDICES, OFFSETS = torch.tensor([4, 0, 9, 4, 1]), torch.tensor([0, 2])  # bags {4, 0}, {9, 4, 1}
SEED = 3
WORK = 0.2  # seconds of work in flight, or still to do, when worker0 shuts down
CALLEE_WORK = 0.1  # seconds of work on worker1 that rpc_sync must wait for


_start_own_work = threading.Event()


def start_own_work() -> None:
    """Called on worker2 by worker0, just before worker0 shuts down."""
    _start_own_work.set()


def calls_lesson(rank: int, world_size: int) -> dict:
    """Every worker: join, report who it is. worker0: make the calls. Everyone: leave."""
    init_worker(rank, world_size, RPC_TIMEOUT)
    me = rpc.get_worker_info()
    report: dict = {"name": me.name, "id": me.id}
    if rank == 0:
        seen = three_calls("worker1", "worker2")
        rref = seen.pop("remote")
        report["three_calls"] = seen
        report["remote_is_rref"] = isinstance(rref, rpc.PyRRef)  # the base class of rpc.RRef
        report["remote_owner"] = rref.owner_name()
        report["worker2_id"] = rpc.get_worker_info("worker2").id
        report["who_waits"] = when_each_call_returns("worker1", CALLEE_WORK)

        story = driver("worker1", "worker2", INDICES, OFFSETS, seed=SEED)
        table = story.pop("table")
        report["story"] = {**story, "driver_is_owner": table.is_owner()}
        # The wrong call for the job: rpc_sync brings the whole table back to the driver.
        report["fetched"] = rpc.rpc_sync("worker1", make_table, args=(10, 3, SEED))
        report["arrived"] = what_arrives("worker1")
        report["profiled"] = profiled_call("worker1")

        start = time.monotonic()
        try:
            rpc.rpc_sync("ps7", torch.add, args=(torch.ones(1), 1))
        except RuntimeError as exc:
            report["unknown_worker"] = (str(exc), time.monotonic() - start)
        rpc.rpc_sync("worker2", start_own_work)
        report["shutdown"] = shutdown_with_work_in_flight("worker1", WORK, RPC_TIMEOUT)
        return report
    if rank == 2:
        _start_own_work.wait(RPC_TIMEOUT)
        time.sleep(WORK)  # worker2's own work, before it is ready to leave
    report["arrived"] = time.monotonic()
    shutdown_worker(RPC_TIMEOUT)
    return report


@pytest.fixture(scope="module")
def reports(rpc_worlds) -> list[dict]:
    return rpc_worlds.run(calls_lesson, world_size=3, backend=None, timeout=30)


def test_rpc_sync_blocks_and_returns_the_value(reports):
    # torch.add(ones(2), 3) ran on worker1; the tensor came back.
    assert torch.equal(reports[0]["three_calls"]["rpc_sync"], torch.full((2,), 4.0))
    # It blocks: worker1's work (0.1 s of sleep) ended before worker0's rpc_sync returned,
    # on one clock for both processes; so worker0 sat in rpc_sync for at least those 0.1 s.
    sync = reports[0]["who_waits"]["rpc_sync"]
    assert sync["called"] < sync["work_ended"] <= sync["returned"]
    assert sync["returned"] - sync["called"] >= CALLEE_WORK


def test_rpc_async_returns_before_the_callee_is_done(reports):
    """worker1's ``add_when_told`` waits for worker0's go-ahead, which worker0 sends only
    after its ``rpc_async`` returned and it looked at the future: not done. Had ``rpc_async``
    blocked, worker0 could never have sent it (the run would have hit its deadline)."""
    seen = reports[0]["who_waits"]["rpc_async"]
    assert seen["done_when_returned"] is False
    assert torch.equal(seen["value"], torch.full((2,), 4.0))  # ones(2) + 3, after the go-ahead


def test_rpc_async_returns_futures_that_collect_all_waits_for(reports):
    # Two calls in flight at once, on two workers (+1 on worker1, +2 on worker2).
    values = reports[0]["three_calls"]["rpc_async"]
    assert [v.tolist() for v in values] == [[2.0, 2.0], [3.0, 3.0]]


def test_remote_returns_a_reference_to_a_value_left_on_the_callee(reports):
    report = reports[0]
    assert report["remote_is_rref"]
    assert report["remote_owner"] == "worker1"
    # The value is there, and can be fetched on request.
    assert torch.equal(report["three_calls"]["remote_value"], torch.full((2,), 4.0))


def test_the_driver_creates_the_table_on_the_ps_and_shares_only_a_reference(reports):
    story = reports[0]["story"]
    assert story["table_owner"] == "worker1"  # created there by remote()
    assert story["driver_is_owner"] is False  # the driver holds a reference, not the table
    assert story["trainer"] == "worker2"
    # The trainer's bags are sums of the table's rows; rebuild the rows from the seed.
    rows = torch.randn(10, 3, generator=torch.Generator().manual_seed(SEED))
    expected = torch.stack([rows[4] + rows[0], rows[9] + rows[4] + rows[1]])
    torch.testing.assert_close(story["bags"], expected)


def test_rpc_sync_would_have_copied_the_whole_table_to_the_driver(reports):
    # Why remote() is right for the story: rpc_sync returns the table itself, all of it,
    # to a driver that has no use for it (and a copy, not the table the trainer uses).
    fetched = reports[0]["fetched"]
    assert isinstance(fetched, nn.EmbeddingBag)
    rows = torch.randn(10, 3, generator=torch.Generator().manual_seed(SEED))
    assert torch.equal(fetched.weight.detach(), rows)


def test_every_worker_has_a_name_and_an_id(reports):
    assert [(r["name"], r["id"]) for r in reports] == [(f"worker{i}", i) for i in range(3)]
    assert reports[0]["worker2_id"] == 2  # rpc.get_worker_info("worker2")


def test_a_call_to_an_unknown_worker_fails_at_once(reports):
    message, seconds = reports[0]["unknown_worker"]
    assert "could not find destination name ps7" in message
    assert seconds < 5.0  # no wait for a worker that will never come


def test_shutdown_waits_for_work_still_in_flight(reports):
    worker0 = reports[0]["shutdown"]
    assert worker0["shutdown_started"] < worker0["work_finished"]  # left before it was done
    assert worker0["shutdown_returned"] >= worker0["work_finished"]  # but returned after
    assert worker0["future_done"] is True


def test_shutdown_waits_for_every_worker_to_call_it(reports):
    worker0, worker2 = reports[0]["shutdown"], reports[2]
    assert worker0["shutdown_started"] < worker2["arrived"]
    assert worker0["shutdown_returned"] >= worker2["arrived"]


def test_a_view_arrives_with_its_shape_and_stride_and_costs_its_storage(reports):
    """A tensor's meta travels: the transposed view is still transposed on arrival. What
    travels is storage: a small slice of a big tensor is copied down to its 40 bytes (torch
    does that for storage >= 8 KiB and >= 2x the view), a slice of a 4 KiB tensor sends all
    4 KiB, and ``clone()`` sends just the slice."""
    arrived = reports[0]["arrived"]
    assert arrived["transposed"] == {"shape": (4, 3), "stride": (1, 4), "storage_bytes": 48}
    assert arrived["slice_of_big"]["storage_bytes"] == 40
    assert arrived["slice_of_small"]["storage_bytes"] == 4096
    assert arrived["clone_of_small_slice"]["storage_bytes"] == 40
    assert {a["shape"] for n, a in arrived.items() if n != "transposed"} == {(10,)}


def test_the_profiler_records_the_rpc_and_the_callees_work(reports):
    """The call's event, named in full (``torch.add`` is recorded as the operator it runs,
    ``aten::add``), once; and the callee's own ``aten::add``, filed under it."""
    names = reports[0]["profiled"]
    call = "rpc_sync#aten::add(worker0 -> worker1)"
    assert names.count(call) == 1, names
    assert f"{call}#remote_op: aten::add" in names, names
