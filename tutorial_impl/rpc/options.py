"""TensorPipe options in action: ``num_worker_threads``, ``rpc_timeout`` and per-call timeouts.

``TensorPipeRpcBackendOptions(num_worker_threads=N, rpc_timeout=T)`` (built by
``workers.rpc_options``) sets two things a worker lives with:

* ``num_worker_threads``: the pool that runs the requests this worker *receives*. At most N
  run at once; the rest wait in line. ``concurrency_probe`` measures it.
* ``rpc_timeout``: the deadline, in seconds, of every call that does not give its own
  ``timeout=``. ``rpc.get_rpc_timeout()`` reads it back.

A call that runs past its deadline fails on the caller with a RuntimeError ("RPC ran for more
than set timeout"). The callee is not told: its function keeps running and its late reply is
dropped. ``late_reply`` is such a function; ``release`` lets it finish early, so that nothing
is left waiting when the world shuts down.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
import torch.distributed.rpc as rpc

# --- How many requests a worker runs at once -----------------------------------------------

_lock = threading.Lock()
_running = {"now": 0, "peak": 0}


def busy(seconds: float) -> None:
    """Occupy one of the callee's worker threads for ``seconds``, counting who runs at once."""
    with _lock:
        _running["now"] += 1
        _running["peak"] = max(_running["peak"], _running["now"])
    time.sleep(seconds)
    with _lock:
        _running["now"] -= 1


def peak_running() -> int:
    return _running["peak"]


def concurrency_probe(callee: str, calls: int, seconds: float = 0.1) -> int:
    """Send ``calls`` requests at once; the most that ``callee`` ran side by side."""
    torch.futures.wait_all([rpc.rpc_async(callee, busy, args=(seconds,)) for _ in range(calls)])
    return rpc.rpc_sync(callee, peak_running)


# --- A reply that comes too late ------------------------------------------------------------

_releases: dict[str, threading.Event] = {}
_finished: dict[str, float] = {}  # key -> when late_reply returned, on this worker


def _release_event(key: str) -> threading.Event:
    with _lock:
        return _releases.setdefault(key, threading.Event())


def late_reply(key: str, seconds: float) -> str:
    """Reply after ``seconds``, or as soon as ``release(key)`` is called on this worker."""
    released = _release_event(key).wait(seconds)
    _finished[key] = time.monotonic()
    return "released" if released else "slept"


def release(key: str) -> None:
    _release_event(key).set()


def hold(key: str) -> None:
    """Undo ``release(key)``: the next ``late_reply(key, ...)`` is late again."""
    _release_event(key).clear()


def finished(key: str) -> float | None:
    """When ``late_reply(key, ...)`` returned on this worker (``time.monotonic``), or None."""
    return _finished.get(key)


def call_past_its_timeout(callee: str, timeout: float, key: str = "timeout") -> dict[str, Any]:
    """``rpc_sync`` of a function that would take a minute, with ``timeout=`` seconds.

    Returns the error and how long the caller waited; then releases the callee.
    """
    start = time.monotonic()
    try:
        rpc.rpc_sync(callee, late_reply, args=(key, 60.0), timeout=timeout)
        error = None
    except RuntimeError as exc:
        error = str(exc)
    waited = time.monotonic() - start
    raised_at = time.monotonic()
    rpc.rpc_sync(callee, release, args=(key,))
    return {"error": error, "waited": waited, "raised_at": raised_at}
