"""Lesson 2, RRef: a reference to an object that lives on exactly one worker.

The reference claims: each RRef has one owner and the object lives only there; holders that
are not the owner get *copies* on request (``to_here``); an RRef can be shared with other
workers, with reference counting handled for them. The RRef API adds ``owner()``,
``owner_name()``, ``is_owner()``, ``local_value()`` (owner only), ``confirmed_by_owner()`` and
the ``rpc_sync()`` / ``rpc_async()`` / ``remote()`` proxies that run a method on the owner.

One world of three workers (``rrefs_lesson``): worker0 creates a ``Counter(10)`` on worker1
with ``remote`` and walks through ``rref_tour``, sharing the RRef with worker2 on the way.
The counter's value after each step is plain arithmetic on 10. Read in order: ownership,
``local_value``, the proxies, copies, sharing, where the object was built, confirmation,
and an RRef to a local object.
"""

from __future__ import annotations

import time

import pytest
import torch.distributed.rpc as rpc

from tutorial_impl.rpc.rrefs import (
    Counter,
    counters_built_here,
    rref_lifetime,
    rref_tour,
    wait_until_confirmed,
)
from tutorial_impl.rpc.workers import init_worker, shutdown_worker

RPC_TIMEOUT = 10.0


def rrefs_lesson(rank: int, world_size: int) -> dict:
    init_worker(rank, world_size, RPC_TIMEOUT)
    report: dict = {}
    if rank == 0:
        report["tour"] = rref_tour("worker1", "worker2")
        report["lifetime"] = rref_lifetime("worker1", "worker2")
        # An RRef can also wrap an object of this worker: then this worker is the owner.
        local = rpc.RRef(Counter(1))
        report["local"] = {
            "owner_name": local.owner_name(),
            "is_owner": local.is_owner(),
            "confirmed": local.confirmed_by_owner(),
            "local_value": local.local_value().increment(1),
        }
    shutdown_worker(RPC_TIMEOUT)  # after worker0's tour: shutdown waits for everyone
    report["counters_built"] = counters_built_here()
    return report


@pytest.fixture(scope="module")
def reports(rpc_worlds) -> list[dict]:
    return rpc_worlds.run(rrefs_lesson, world_size=3, backend=None, timeout=30)


@pytest.fixture(scope="module")
def tour(reports) -> dict:
    return reports[0]["tour"]


def test_an_rref_has_one_owner_and_the_creator_is_not_it(tour):
    assert tour["owner"] == ("worker1", 1)  # owner(): a WorkerInfo (name, id)
    assert tour["owner_name"] == "worker1"
    assert tour["is_owner"] is False


def test_local_value_is_refused_anywhere_but_on_the_owner(tour):
    # The error says who asked and where to call it instead.
    error = tour["local_value_error"]
    assert "can't call localValue() on user WorkerInfo(id=0, name=worker0)" in error
    assert "Call it on owner WorkerInfo(id=1, name=worker1)" in error
    # On the owner, local_value() is the object itself: used there with no RPC at all.
    assert tour["on_owner"]["is_owner"] is True


def test_the_proxies_run_methods_on_the_owner(tour):
    assert tour["rpc_sync"] == 10 + 2  # rref.rpc_sync().increment(2)
    assert tour["rpc_async"] == 12 + 3  # rref.rpc_async().increment(3).wait()
    # rref.remote().value(): the result is another RRef, owned by the same owner.
    assert tour["remote_owner"] == "worker1"
    assert tour["remote_value"] == 15


def test_a_copy_from_to_here_is_not_the_object(tour):
    assert tour["copy_after_increment"] == 15 + 100  # the copy changed...
    assert tour["owner_after_copy_increment"] == 15  # ... the object on worker1 did not


def test_an_rref_passed_to_a_third_worker_reaches_the_same_object(tour):
    third = tour["third"]
    assert third["me"] == "worker2"
    assert third["owner_name"] == "worker1"
    assert third["is_owner"] is False
    assert third["after_increment"] == 15 + 4  # worker2 sees worker0's changes
    assert tour["on_owner"]["after_increment"] == 19 + 5  # the owner sees worker2's
    assert tour["final"] == 24  # and worker0 sees them all: there is one object


def test_the_object_was_built_on_its_owner_only(reports):
    # worker1 built the remote Counter; worker0 built only its local one (the to_here copy
    # was unpickled, not constructed); worker2 used the object without ever having one.
    assert [r["counters_built"] for r in reports] == [1, 1, 0]
    assert reports[0]["tour"]["on_owner"]["counters_built"] == 1


def test_the_owner_confirms_the_reference(tour):
    # Confirmation arrives asynchronously; the RRef was usable before it (see above).
    assert tour["confirmed"] is True


class NeverConfirmed:
    """Stands in for an RRef whose owner's confirmation never arrives (a lost or slow
    owner): ``wait_until_confirmed`` only polls ``confirmed_by_owner()``."""

    def __init__(self) -> None:
        self.polls = 0

    def confirmed_by_owner(self) -> bool:
        self.polls += 1
        return False


def test_a_confirmation_that_never_comes_is_a_no_at_the_deadline():
    # The "True" above means something only because a wait that runs out answers False:
    # it must not pass a missing confirmation off as one.
    never = NeverConfirmed()
    started = time.monotonic()
    assert wait_until_confirmed(never, timeout=0.1) is False
    waited = time.monotonic() - started
    assert 0.1 <= waited < 2.0  # it waited out its deadline, and not much longer
    assert never.polls > 1  # and kept asking until then


def test_an_rref_to_a_local_object_is_owned_here(reports):
    assert reports[0]["local"] == {
        "owner_name": "worker0",
        "is_owner": True,
        "confirmed": True,
        "local_value": 2,
    }


def test_the_owner_frees_the_object_after_the_last_user_rref(reports):
    """Observed on the owner (worker1): one object while any user RRef exists, the creator's
    or the third worker's (a fork of it, confirmed by the owner), none once both are gone."""
    assert reports[0]["lifetime"] == [
        ("created", 1, True),
        ("shared with the third", 1, True),  # the third's fork, confirmed by the owner
        ("creator dropped its rref", 1, None),  # the third's reference keeps it alive
        ("third dropped its rref", 0, None),  # the last user gone: the owner freed it
    ]
