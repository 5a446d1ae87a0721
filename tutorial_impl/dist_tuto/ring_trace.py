"""4.5 seen step by step: a trace of which chunk each rank sends, receives and holds.

The ring allreduces of ``ring.py`` run here exactly as they always do; only the ``dist`` they
call is swapped, for the length of one call, for a recording stand-in (``RecordingDist``) that
passes every call on to ``torch.distributed`` and writes down each message.

How a message says what it carries. Each rank's input is ``encode(rank, chunk)`` in every
element of each of the N chunks: ``(1 << rank) + (chunk << 8)``. A sum of such values keeps
both facts: its low 8 bits are the set of ranks added in (each rank a different bit), and the
rest is ``chunk`` times the number of ranks. So ``decode`` reads, from nothing but the numbers
a rank sent or received, which chunk they are and whose contributions they hold: the picture
(``tutorial_impl/pictures.py``) and the test (``tests/dist_tuto/test_06_ring.py``, which checks
it against the algorithm's schedule in closed form) both come from the real run.

What each rank *holds* is read the same way from the running sum the ring keeps (the
tutorial's ``accum``, the optimal ring's ``work``, found in the ring's own frame) at each call
it makes: the call after a receive shows what that receive, added in, gave the rank.
One change of timing makes those snapshots exact: a receive posted early (the optimal ring
posts all its all-gather receives at once) lands in the rank's buffer when the ring waits for
it, not whenever gloo's thread gets it. A correct ring never reads a buffer before its
``wait``, so the ring cannot tell; the picture can, and would otherwise differ run to run.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tutorial_impl.dist_tuto import ring

MAX_RANKS = 8  # the rank set lives in the low 8 bits of every value
ELEMENTS_PER_CHUNK = 2  # small: one segment per chunk, so one message per ring step

# A piece of a message or of a buffer: (chunk, the ranks whose data it holds, summed).
Piece = tuple[int, frozenset[int]]


def encode(rank: int, chunk: int) -> int:
    return (1 << rank) + (chunk << 8)


def decode_value(value: int) -> Piece:
    """``(chunk, ranks)`` of one element; a value no sum of ``encode`` can give is an error."""
    mask = value & 0xFF
    count = bin(mask).count("1")
    chunk, rest = divmod(value >> 8, count) if count else (-1, 1)
    if count == 0 or rest:
        raise ValueError(f"{value} is not a sum of encoded chunks from distinct ranks")
    return chunk, frozenset(r for r in range(MAX_RANKS) if mask >> r & 1)


def decode(t: torch.Tensor) -> tuple[Piece, ...]:
    """The pieces a tensor holds, in order: each run of equal elements is one chunk's."""
    pieces: list[Piece] = []
    for value in t.reshape(-1).tolist():
        piece = decode_value(int(value))
        if not pieces or pieces[-1] != piece:
            pieces.append(piece)
    return tuple(pieces)


def ring_input(rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s tensor: N chunks of ``ELEMENTS_PER_CHUNK``, each saying (rank, chunk)."""
    if not 1 <= size <= MAX_RANKS:
        raise ValueError(f"the trace encodes at most {MAX_RANKS} ranks, got a world of {size}")
    chunks = [torch.full((ELEMENTS_PER_CHUNK,), encode(rank, c)) for c in range(size)]
    return torch.cat(chunks)


@dataclass
class Event:
    """One call the ring made: a message sent or received, and what the rank held then."""

    kind: str  # "send" or "recv"; a recv is recorded when its data is there (recv, wait)
    peer: int
    pieces: tuple[Piece, ...]


@dataclass
class RankTrace:
    events: list[Event] = field(default_factory=list)
    # What the ring's running sum held at each of its calls, in call order, and at the end.
    holdings: list[tuple[Piece, ...]] = field(default_factory=list)
    # For each event, the index in ``holdings`` of the first call made after it.
    next_call: list[int] = field(default_factory=list)


# Where each ring keeps its running sum: the tutorial's private ``accum``; the optimal
# ring's ``work`` (the result's own memory, which its chunks are views of).
RUNNING_SUM = {"allreduce": "accum", "_ring": "work"}


class _Recorded:
    """A request whose ``wait`` also records; a receive's data lands at that moment."""

    def __init__(self, tracer: RecordingDist, work: Any, on_done: Callable[[], None]):
        self._tracer, self._work, self._on_done = tracer, work, on_done

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        self._tracer._snapshot()
        done = self._work.wait(*args, **kwargs)
        self._on_done()
        return done

    def is_completed(self) -> bool:
        return self._work.is_completed()


class RecordingDist:
    """``torch.distributed`` for the ring, writing down every point-to-point message.

    Anything else (``get_rank``, the layout check's ``all_reduce``, ...) goes straight on.
    """

    def __init__(self) -> None:
        self.trace = RankTrace()

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    def _snapshot(self) -> None:
        frame = sys._getframe(1)
        while frame is not None:
            name = RUNNING_SUM.get(frame.f_code.co_name)
            if name is not None and frame.f_globals is vars(ring):
                break
            frame = frame.f_back
        if frame is None or name not in frame.f_locals:
            # ring.py changed: a picture of stale holdings would be wrong without a word
            raise RuntimeError(
                f"ring_trace looks for the running sum in ring.py as {RUNNING_SUM}; not found"
            )
        self.trace.holdings.append(decode(frame.f_locals[name]))
        # An event waiting for "the next call" gets this one.
        while len(self.trace.next_call) < len(self.trace.events):
            self.trace.next_call.append(len(self.trace.holdings) - 1)

    def _record(self, kind: str, peer: int, t: torch.Tensor) -> None:
        self.trace.events.append(Event(kind, peer, decode(t)))

    def send(self, tensor: torch.Tensor, dst: int, *args: Any, **kwargs: Any) -> None:
        self._snapshot()
        self._record("send", dst, tensor)
        dist.send(tensor, dst, *args, **kwargs)

    def isend(self, tensor: torch.Tensor, dst: int, *args: Any, **kwargs: Any) -> _Recorded:
        self._snapshot()
        self._record("send", dst, tensor)  # the ring leaves it alone until its wait
        return _Recorded(self, dist.isend(tensor, dst, *args, **kwargs), lambda: None)

    def recv(self, tensor: torch.Tensor, src: int, *args: Any, **kwargs: Any) -> int:
        self._snapshot()
        got = dist.recv(tensor, src, *args, **kwargs)
        self._record("recv", src, tensor)
        return got

    def irecv(self, tensor: torch.Tensor, src: int, *args: Any, **kwargs: Any) -> _Recorded:
        self._snapshot()
        landing = torch.empty_like(tensor)

        def land() -> None:
            tensor.copy_(landing)
            self._record("recv", src, tensor)

        return _Recorded(self, dist.irecv(landing, src, *args, **kwargs), land)


@contextmanager
def recording() -> Iterator[RankTrace]:
    """Swap ``ring.dist`` for a ``RecordingDist`` while the block runs."""
    tracer = RecordingDist()
    real = ring.dist
    ring.dist = tracer  # type: ignore[assignment]  # the rings look ``dist`` up at call time
    try:
        yield tracer.trace
    finally:
        ring.dist = real


@dataclass(frozen=True)
class Step:
    """Step ``step`` of one rank: the message it sent and the one it received, each with its
    peer, and what its running sum held after adding (or storing) what arrived."""

    step: int
    send_to: int
    sent: tuple[Piece, ...]
    recv_from: int
    received: tuple[Piece, ...]
    holds: tuple[Piece, ...]


def steps(trace: RankTrace, result: torch.Tensor) -> list[Step]:
    """The trace as steps: the k-th message sent and the k-th received make step k."""
    sends = [e for e in trace.events if e.kind == "send"]
    recvs = [(i, e) for i, e in enumerate(trace.events) if e.kind == "recv"]
    if len(sends) != len(recvs):
        raise ValueError(f"{len(sends)} messages sent but {len(recvs)} received")
    final = decode(result)
    out = []
    for k, (sent, (i, got)) in enumerate(zip(sends, recvs, strict=True)):
        after = trace.next_call[i] if i < len(trace.next_call) else -1
        holds = trace.holdings[after] if after >= 0 else final
        out.append(Step(k, sent.peer, sent.pieces, got.peer, got.pieces, holds))
    return out


def trace_rings(rank: int, size: int) -> dict[str, list[Step]]:
    """Run both rings on the encoded inputs, recording; each ring's steps on this rank.

    A rank function: it runs inside a gloo process group (the harness's, or the CLI's).
    """
    out = {}
    for name, fn in (("tutorial", ring.allreduce), ("optimal", ring.ring_allreduce)):
        send = ring_input(rank, size)
        result = torch.empty_like(send)
        with recording() as trace:
            fn(send, result)
        out[name] = steps(trace, result)
    return out
