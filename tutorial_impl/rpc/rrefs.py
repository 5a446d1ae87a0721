"""RRef: a distributed shared pointer to an object that lives on exactly one worker.

``rpc.remote(owner, Counter)`` builds a ``Counter`` on ``owner`` and returns an ``RRef`` to it.
The reference's points, each shown by a test in ``tests/rpc/test_rpc_rrefs.py``:

* An RRef has one owner (``owner()``, ``owner_name()``, ``is_owner()``), and the object lives
  only there. ``local_value()`` is the object itself, on the owner only; elsewhere it raises.
* Holders reach the object through proxies: ``rref.rpc_sync().increment(2)``,
  ``rref.rpc_async().increment(3)`` (a Future), ``rref.remote().value()`` (another RRef, owned
  by the same owner). Every holder sees every change, because there is only one object.
* ``to_here()`` copies the value to the caller. The copy is *not* the object: changing it
  changes nothing on the owner.
* An RRef can be passed on, in the arguments of an RPC, to a worker that neither created nor
  owns the object; reference counting follows it transparently.
* ``confirmed_by_owner()``: whether the owner already knows about this reference. A fresh
  RRef is usable at once; the confirmation arrives asynchronously.
* **Lifetime** (the design note's RRef protocol, ``rref_lifetime``): the owner keeps the
  object while any *user* RRef to it exists anywhere, and frees it after the last one is
  gone. Sharing a user RRef with a third worker makes a *fork*: a new user the owner counts
  (it is told, then confirms the new user; until then the sharer keeps the object alive for
  it). So the creator may drop its RRef while the third still holds one: the object stays;
  when the third drops its own, the owner frees it. Deletions reach the owner as messages,
  asynchronously, so the owner is watched until it happens, with a deadline.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import torch.distributed.rpc as rpc


class Counter:
    """A tiny stateful object. ``built`` counts the Counters this *process* constructed:
    unpickling a copy (what ``to_here`` does) does not construct one."""

    built = 0

    def __init__(self, start: int = 0) -> None:
        Counter.built += 1
        self.count = start

    def increment(self, by: int = 1) -> int:
        self.count += by
        return self.count

    def value(self) -> int:
        return self.count


def counters_built_here() -> int:
    return Counter.built


def wait_until_confirmed(rref: rpc.RRef[Any], timeout: float = 5.0) -> bool:
    """Poll ``confirmed_by_owner()`` until it is True or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while not rref.confirmed_by_owner():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def use_shared_counter(counter: rpc.RRef[Counter], by: int) -> dict[str, Any]:
    """Runs on a third worker that was handed the RRef: it uses the object on its owner."""
    return {
        "me": rpc.get_worker_info().name,
        "owner_name": counter.owner_name(),
        "is_owner": counter.is_owner(),
        "after_increment": counter.rpc_sync().increment(by),
    }


def on_owner(counter: rpc.RRef[Counter], by: int) -> dict[str, Any]:
    """Runs on the owner: ``local_value()`` is the object itself, used without any RPC."""
    return {
        "is_owner": counter.is_owner(),
        "after_increment": counter.local_value().increment(by),
        "counters_built": Counter.built,
    }


def rref_tour(owner: str, third: str) -> dict[str, Any]:
    """The lesson from the creator's side (the caller of ``remote``), in order."""
    counter = rpc.remote(owner, Counter, args=(10,))
    owner_info = counter.owner()  # a WorkerInfo: the owner's name and id (its rank)
    seen: dict[str, Any] = {
        "owner": (owner_info.name, owner_info.id),
        "owner_name": counter.owner_name(),
        "is_owner": counter.is_owner(),
    }
    try:
        counter.local_value()
        seen["local_value_error"] = None
    except RuntimeError as exc:
        seen["local_value_error"] = str(exc)
    # The three proxies: each runs the method on the owner.
    seen["rpc_sync"] = counter.rpc_sync().increment(2)  # 12
    seen["rpc_async"] = counter.rpc_async().increment(3).wait()  # 15
    value_rref = counter.remote().value()  # an RRef to the int 15, on the owner
    seen["remote_owner"] = value_rref.owner_name()
    seen["remote_value"] = value_rref.to_here()
    # A copy is not the object.
    copy = counter.to_here()
    copy.increment(100)
    seen["copy_after_increment"] = copy.value()
    seen["owner_after_copy_increment"] = counter.rpc_sync().value()
    # Shared with a third worker, then used on the owner itself: one object for all.
    seen["third"] = rpc.rpc_sync(third, use_shared_counter, args=(counter, 4))
    seen["on_owner"] = rpc.rpc_sync(owner, on_owner, args=(counter, 5))
    seen["final"] = counter.rpc_sync().value()
    seen["confirmed"] = wait_until_confirmed(counter)
    return seen


# --- lifetime ------------------------------------------------------------------------------


class Tracked:
    """Counts the instances alive in this process (the owner's view of its objects)."""

    alive = 0

    def __init__(self) -> None:
        Tracked.alive += 1

    def __del__(self) -> None:
        Tracked.alive -= 1


def tracked_alive_here() -> int:
    gc.collect()  # only the RRef protocol should keep an object alive, not a stray cycle
    return Tracked.alive


_held: list[rpc.RRef[Any]] = []  # a third worker's user RRefs, kept between two calls


def hold(rref: rpc.RRef[Tracked]) -> bool:
    """Runs on the third worker: keep the shared RRef; say whether the owner confirmed it."""
    _held.append(rref)
    return wait_until_confirmed(rref)


def release() -> None:
    """Runs on the third worker: drop its user RRef (a delete message goes to the owner)."""
    _held.clear()
    gc.collect()


def wait_for_alive(owner: str, count: int, timeout: float = 5.0) -> int:
    """Ask the owner how many ``Tracked`` it holds until it says ``count`` or time is up."""
    deadline = time.monotonic() + timeout
    while (alive := rpc.rpc_sync(owner, tracked_alive_here)) != count:
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)
    return alive


def rref_lifetime(
    owner: str, third: str, observe: Callable[[str], None] | None = None
) -> list[tuple[str, int, bool | None]]:
    """Create an object on ``owner``, share it with ``third``, drop the references one by
    one; after each step: (step, objects alive on the owner, this step's confirmation).

    ``observe(step)``, if given, is called after each step (``rpc/rref_trace.py`` looks at
    every worker's RRef bookkeeping there)."""
    steps: list[tuple[str, int, bool | None]] = []

    def step(name: str, alive: int, confirmed: bool | None) -> None:
        steps.append((name, alive, confirmed))
        if observe is not None:
            observe(name)

    rref = rpc.remote(owner, Tracked)
    step("created", wait_for_alive(owner, 1), wait_until_confirmed(rref))
    confirmed = rpc.rpc_sync(third, hold, args=(rref,))
    step("shared with the third", wait_for_alive(owner, 1), confirmed)
    del rref
    gc.collect()
    time.sleep(0.2)  # give a wrong owner time to free it: it must not
    step("creator dropped its rref", wait_for_alive(owner, 1), None)
    rpc.rpc_sync(third, release)
    step("third dropped its rref", wait_for_alive(owner, 0), None)
    return steps
