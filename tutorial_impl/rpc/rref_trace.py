"""2. The RRef protocol seen from every worker: the lifetime lesson, observed step by step.

``rref_lifetime`` (``rrefs.py``) runs here exactly as the lesson runs it: worker0 creates a
``Tracked`` on the owner with ``remote``, shares the RRef with a third worker, then both drop
theirs. An observer is called after each of its four steps; it waits until no RRef message
is in flight anywhere (no worker has an unconfirmed user RRef or an unanswered RRef
message), then reads each worker's RRef bookkeeping, as torch keeps it
(``rpc._rref_context_get_debug_info()``): the objects it owns for RRefs
(``num_owner_rrefs``), the user RRefs it knows of as an owner (``num_forks``), its user RRefs
the owner has not confirmed yet (``num_pending_users``), its RRef messages still waiting for
an answer (``num_pending_futures``).

The protocol's messages themselves travel inside torch's C++ RPC agent, out of Python's
reach. ``MESSAGES`` lists them per step, by role, as the design note names them
(https://pytorch.org/docs/stable/rpc/rref.html); the picture
(``tutorial_impl/pictures/draw_rpc.py``) draws them between the recorded states, and
``tests/test_pictures.py`` checks the two against each other: the owner's count of users
rises with each ``remote`` and fork request it receives and falls with each user delete.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch.distributed.rpc as rpc

from tutorial_impl.rpc import rrefs

ROLES = ("creator", "owner", "third")
# Per step of ``rref_lifetime``: (sender, receiver, message). "remote", "rpc_sync(hold)" and
# "rpc_sync(release)" are the lesson's own calls; the others are the protocol's.
MESSAGES: dict[str, list[tuple[str, str, str]]] = {
    "created": [
        ("creator", "owner", "remote"),
        ("owner", "creator", "remote's reply"),
    ],
    "shared with the third": [
        ("creator", "third", "rpc_sync(hold)"),
        ("third", "owner", "fork request"),
        ("owner", "third", "ack"),
        ("third", "creator", "child accept"),
    ],
    "creator dropped its rref": [
        ("creator", "owner", "user delete"),
    ],
    "third dropped its rref": [
        ("creator", "third", "rpc_sync(release)"),
        ("third", "owner", "user delete"),
    ],
}
CALLS = ("remote", "rpc_sync(hold)", "rpc_sync(release)")


@dataclass(frozen=True)
class ProtocolStep:
    """After one step of ``rref_lifetime``: the lesson's own record (``Tracked`` objects
    alive on the owner, the step's confirmation) and each role's RRef bookkeeping."""

    step: str
    alive: int
    confirmed: bool | None
    books: dict[str, dict[str, int]]


def bookkeeping() -> dict[str, int]:
    """This worker's RRef bookkeeping, as numbers."""
    return {key: int(value) for key, value in rpc._rref_context_get_debug_info().items()}


def settled_books(workers: dict[str, str], timeout: float = 5.0) -> dict[str, dict[str, int]]:
    """Each role's bookkeeping, once no RRef message is in flight (or ``timeout`` passed)."""
    deadline = time.monotonic() + timeout
    while True:
        books = {role: rpc.rpc_sync(name, bookkeeping) for role, name in workers.items()}
        quiet = all(
            b["num_pending_futures"] == 0 and b["num_pending_users"] == 0 for b in books.values()
        )
        if quiet or time.monotonic() > deadline:
            return books
        time.sleep(0.01)


def record_protocol(owner: str, third: str) -> list[ProtocolStep]:
    """Run the lifetime lesson from this worker (the creator), observing every step."""
    workers = dict(zip(ROLES, (rpc.get_worker_info().name, owner, third), strict=True))
    books: list[dict[str, dict[str, int]]] = []
    steps = rrefs.rref_lifetime(owner, third, lambda _: books.append(settled_books(workers)))
    return [
        ProtocolStep(name, alive, confirmed, seen)
        for (name, alive, confirmed), seen in zip(steps, books, strict=True)
    ]
