"""RPC never retries; the application does, with backoff, and only what is idempotent.

The reference: the framework "does not automatically retry any rpc_sync, rpc_async and remote
calls", because it cannot know whether an operation is idempotent, i.e. safe to run twice.
A call that failed may still have run on the callee: a timeout says only that no reply came
in time. So retrying belongs to the application, which knows its operations:

* ``retry(call, attempts, backoff)`` below: call again after ``backoff``, ``2 * backoff``,
  ``4 * backoff`` ... seconds, so a struggling network is not flooded with retries.
* Safe: ``put(key, value)`` (running it twice leaves the same table as running it once).
* Unsafe: ``increment(by)`` (each run adds again). ``lose_next_reply`` makes the callee's
  next reply late, exactly as a lost packet would, and the retried increment counts twice.

Remote exceptions come back to the caller with their type and the callee's traceback text
(``raise_remotely``), so the caller can tell a transient failure from a bug.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from tutorial_impl.rpc.options import hold, late_reply, release

T = TypeVar("T")


def retry(
    call: Callable[[], T],
    attempts: int = 3,
    backoff: float = 0.1,
    retry_on: tuple[type[BaseException], ...] = (RuntimeError,),
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Return ``call()``, calling it up to ``attempts`` times while it raises ``retry_on``.

    Waits ``backoff * 2**i`` seconds after the i-th failure (exponential backoff). The last
    error is raised when every attempt failed. RPC timeouts and lost connections arrive as
    RuntimeError; retry only calls that are safe to repeat.
    """
    if attempts < 1:
        raise ValueError(f"attempts must be at least 1, got {attempts}")
    if not backoff >= 0:
        raise ValueError(f"backoff must be >= 0 seconds, got {backoff!r}")
    for attempt in range(attempts):
        try:
            return call()
        except retry_on:
            if attempt == attempts - 1:
                raise
            sleep(backoff * 2**attempt)
    raise AssertionError("unreachable")


# --- Services that run on the callee --------------------------------------------------------

_state: dict[str, Any] = {"calls": 0, "fail_first": 0, "counter": 0, "lose_next": False}
_table: dict[str, Any] = {}
LOST_REPLY_HOLD = 60.0  # seconds a "lost" reply is held back, unless released


def fail_first(k: int) -> None:
    """From now on, the first ``k`` calls of ``flaky_add`` fail (like a flaky network)."""
    _state.update(calls=0, fail_first=k)


def flaky_add(a: float, b: float) -> float:
    _state["calls"] += 1
    if _state["calls"] <= _state["fail_first"]:
        raise RuntimeError(f"transient failure {_state['calls']} of {_state['fail_first']}")
    return a + b


def calls_seen() -> int:
    return _state["calls"]


def lose_next_reply() -> None:
    """The next ``increment`` or ``put`` does its work, then holds its reply back."""
    hold("lost")
    _state["lose_next"] = True


def _maybe_lose_reply() -> None:
    if _state["lose_next"]:
        _state["lose_next"] = False
        late_reply("lost", LOST_REPLY_HOLD)


def increment(by: int) -> int:
    """Not idempotent: every run adds ``by`` again."""
    _state["counter"] += by
    _maybe_lose_reply()
    return _state["counter"]


def put(key: str, value: Any) -> dict[str, Any]:
    """Idempotent: running it twice leaves the same table as running it once."""
    _table[key] = value
    _maybe_lose_reply()
    return dict(_table)


def counter() -> int:
    return _state["counter"]


def release_lost_replies() -> None:
    release("lost")


def raise_remotely(row: int) -> None:
    """A bug on the callee: the caller gets this ValueError, with this traceback as text."""
    raise ValueError(f"row {row} is not in the table")
