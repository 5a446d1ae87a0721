"""2. seen on a clock: when each call of ``p2p.py`` started and returned, on both ranks.

``run_blocking`` and ``run_nonblocking`` run here exactly as they always do; only the ``dist``
they call is swapped, for the length of one call, for a timing stand-in (``TimedDist``) that
passes every call on to ``torch.distributed`` and writes down when it started and returned.
A request from ``isend``/``irecv`` comes back wrapped, so its ``wait()`` is timed too.

One change makes the difference visible: the receiver arrives late. Before its receive, rank
1 sleeps ``LATE`` seconds (recorded as a span of its own). gloo moves the data only once the
receiver has posted its receive, so a blocking ``send`` holds rank 0 until then, while an
``isend`` returns at once and rank 0 waits in ``wait()`` instead. The picture
(``tutorial_impl/pictures/draw_dist_tuto.py``) is drawn from these spans, and
``tests/test_pictures.py`` checks them: the blocking send ends after the receive started,
the ``isend`` returns before it.

Every rank reads one clock, ``time.monotonic()``, which on Linux is the machine's (not the
process's): spans from two ranks on one machine can be compared.
"""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from tutorial_impl.dist_tuto import p2p

LATE = 0.15  # seconds rank 1 sleeps before each receive
RANKS = 2  # the tutorial's two ranks; in a larger world the others only meet the barriers


@dataclass(frozen=True)
class Span:
    """One call on one rank: what (``send``, ``recv``, ``isend``, ``irecv``, ``wait``, or
    ``late``: the receiver's sleep), with which peer, from ``start`` to ``end`` (seconds)."""

    rank: int
    call: str
    peer: int | None
    start: float
    end: float


class _TimedWork:
    """A request whose ``wait`` is timed; ``call`` says which request it is."""

    def __init__(self, tracer: TimedDist, work: Any, peer: int) -> None:
        self._tracer, self._work, self._peer = tracer, work, peer

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        with self._tracer.timed("wait", self._peer):
            return self._work.wait(*args, **kwargs)

    def is_completed(self) -> bool:
        return self._work.is_completed()


class TimedDist:
    """``torch.distributed`` for ``p2p.py``, timing every point-to-point call."""

    def __init__(self, rank: int, late: float) -> None:
        self.rank, self.late = rank, late
        self.spans: list[Span] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    @contextmanager
    def timed(self, call: str, peer: int | None) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            self.spans.append(Span(self.rank, call, peer, start, time.monotonic()))

    def _arrive_late(self) -> None:
        with self.timed("late", None):
            time.sleep(self.late)

    def send(self, tensor: Any, dst: int, *args: Any, **kwargs: Any) -> None:
        with self.timed("send", dst):
            dist.send(tensor, dst, *args, **kwargs)

    def recv(self, tensor: Any, src: int, *args: Any, **kwargs: Any) -> int:
        self._arrive_late()
        with self.timed("recv", src):
            return dist.recv(tensor, src, *args, **kwargs)

    def isend(self, tensor: Any, dst: int, *args: Any, **kwargs: Any) -> _TimedWork:
        with self.timed("isend", dst):
            return _TimedWork(self, dist.isend(tensor, dst, *args, **kwargs), dst)

    def irecv(self, tensor: Any, src: int, *args: Any, **kwargs: Any) -> _TimedWork:
        self._arrive_late()
        with self.timed("irecv", src):
            return _TimedWork(self, dist.irecv(tensor, src, *args, **kwargs), src)


def timed_run(fn: Any, rank: int, late: float = LATE) -> list[Span]:
    """Run ``fn(rank, RANKS)`` from ``p2p.py`` with its ``dist`` timed; its prints dropped."""
    tracer = TimedDist(rank, late)
    real = p2p.dist
    p2p.dist = tracer  # type: ignore[assignment]  # p2p.py looks ``dist`` up at call time
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            fn(rank, RANKS)
    finally:
        p2p.dist = real
    return tracer.spans


def trace_p2p(rank: int, size: int, late: float = LATE) -> dict[str, list[Span]]:
    """Both modes of lesson T2 on ranks 0 and 1, timed; each mode starts at a barrier.

    A rank function (a gloo process group of at least 2 ranks): ``{mode: spans}`` on ranks 0
    and 1, ``{}`` elsewhere.
    """
    if size < RANKS:
        raise ValueError(f"the p2p timeline needs {RANKS} ranks, got a world of {size}")
    out: dict[str, list[Span]] = {}
    for mode, fn in p2p.MODES.items():
        dist.barrier()
        if rank < RANKS:
            out[mode] = timed_run(fn, rank, late)
    dist.barrier()
    return out
