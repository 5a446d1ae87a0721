"""Where were the ranks? Their Python stacks, asked for at the moment it matters.

Every rank enables ``faulthandler`` on SIGUSR1 (``ranks.rank_main``): when the signal
arrives, the handler writes the Python stack of every thread of the rank to its stack file,
straight from the C signal handler, so it answers even while the rank is blocked inside a
C++ collective, holding the GIL or not. The supervisor asks at two moments:

* **At the deadline**, every rank still running (``RankTimeout.stacks``): the hang.
* **When a rank fails** (raises or dies), every *other* rank that has not reported yet,
  before they are killed (``RankFailed.stacks``, ``RankCrashed.stacks``). Usually they
  are blocked in a collective waiting for the one that failed, and their stacks say which
  collective, called from where: the question a distributed failure always raises next.

Asking costs one signal per rank and a short wait for the files to stop growing: about
0.1 s, never more than ``budget`` (1 s). Frames below the rank's entry point (the harness's
``rank_main``, multiprocessing, the forkserver) are cut: they are the same in every dump.
"""

from __future__ import annotations

import os
import re
import signal
import sysconfig
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

DUMP_BUDGET = 1.0  # seconds the supervisor may wait for stacks, at most
_POLL = 0.05
_ENTRY = " in rank_main"  # the harness frame every rank's stack ends in


class LiveRank(Protocol):
    """What ``dump_stacks`` needs to know of a rank (the supervisor's ``_Rank``)."""

    rank: int
    stack_path: Path

    @property
    def pid(self) -> int | None: ...


def dump_stacks(ranks: Iterable[LiveRank], budget: float = DUMP_BUDGET) -> dict[int, str]:
    """Signal each rank to dump its stacks, wait until the dumps are written, return them.

    Returns ``{rank: text}`` for every rank asked; a rank that could not answer (it was
    still starting, or died meanwhile) maps to an empty string.
    """
    ranks = list(ranks)
    for r in ranks:
        if r.pid is None:
            continue
        try:
            os.kill(r.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    # faulthandler writes from the signal handler, even while the rank is blocked in C++;
    # wait until every file has stopped growing (or the budget is spent).
    sizes: dict[int, int] = {}
    stop = time.monotonic() + budget
    while ranks and time.monotonic() < stop:
        time.sleep(_POLL)
        now = {r.rank: _size(r.stack_path) for r in ranks}
        if now == sizes and all(now.values()):
            break
        sizes = now
    return {r.rank: trim(_read(r.stack_path)) for r in ranks}


def trim(dump: str) -> str:
    """Drop the frames below ``rank_main`` from each thread of a faulthandler dump."""
    out: list[str] = []
    below_entry = False
    for line in dump.splitlines():
        if not line.startswith(" "):  # "Thread 0x... (most recent call first):" or blank
            below_entry = False
        if below_entry:
            continue
        out.append(line)
        if line.endswith(_ENTRY):
            below_entry = True
    return "\n".join(out) + ("\n" if out else "")


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


# --- reading a dump: where was the rank's own code? -------------------------------------------

_FRAME = re.compile(r'^\s+File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
# Library frames: a user's question is "which of *my* lines", so these are looked through.
_LIBRARY = ("/site-packages/", "/dist-packages/", "/tutorial_impl/testing/", "<frozen ")
_STDLIB = sysconfig.get_paths()["stdlib"]
_WRAPPERS = {"wrapper", "inner", "_fn", "decorate_context", "_wrapped_call_impl", "_call_impl"}


def _is_user(path: str) -> bool:
    return not path.startswith(_STDLIB) and not any(part in path for part in _LIBRARY)


def where(dump: str) -> str:
    """The rank's innermost line of user code and the library call it sits in.

    ``"in all_reduce at test_x.py:12"`` for a rank blocked in a collective called from line
    12 of the user's file; ``"at test_x.py:30 in wait_here"`` when the innermost frame is the
    user's own (a C call like ``time.sleep`` leaves no frame of its own). Read from the main
    thread, the one that ends in the harness's ``rank_main``; "" when nothing matches.
    """
    threads = [block for block in dump.split("\n\n") if _ENTRY in block] or [dump]
    frames = [m.groupdict() for m in map(_FRAME.match, threads[0].splitlines()) if m]
    for i, frame in enumerate(frames):  # most recent call first
        if not _is_user(frame["path"]):
            continue
        location = f"{os.path.basename(frame['path'])}:{frame['line']}"
        called = [f["func"] for f in reversed(frames[:i]) if f["func"] not in _WRAPPERS]
        if called:
            return f"in {called[0]} at {location}"
        return f"at {location} in {frame['func']}"
    return ""
