"""Where were the ranks? Their Python stacks, asked for at the moment it matters.

Every rank enables ``faulthandler`` on SIGUSR1 (``rank.take_task``): when the signal
arrives, the handler writes the Python stack of every thread of the rank to its stack file,
straight from the C signal handler, so it answers even while the rank is blocked inside a
C++ collective, holding the GIL or not. The parent (``supervise``) asks at two moments:

* **At the deadline**, every rank still running (``RankTimeout.stacks``): the hang.
* **When a rank fails** (raises or dies), every *other* rank that has not reported yet,
  before they are killed (``RankFailed.stacks``, ``RankCrashed.stacks``). Usually they
  are blocked in a collective waiting for the one that failed, and their stacks say which
  collective, called from where: the question a distributed failure always raises next.

Asking costs one signal per rank and a short wait for the files to stop growing: about
0.1 s, never more than ``budget`` (1 s). Frames below the rank's entry point (the harness's
``rank_main`` or ``warm_rank_main``, multiprocessing, the forkserver) are cut: they are the
same in every dump.
"""

from __future__ import annotations

import os
import re
import signal
import sysconfig
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tutorial_impl.testing.diagnose.ask import LiveRank, ask
from tutorial_impl.testing.settings.timing import DUMP_BUDGET

# The harness frame every rank's stack ends in: a fresh rank's, or a warm world's (whose
# dump was read whole without it: another thread's ``_bootstrap`` named as the call).
_ENTRIES = (" in rank_main", " in warm_rank_main")


def dump_stacks(ranks: Iterable[LiveRank], budget: float = DUMP_BUDGET) -> dict[int, str]:
    """Signal each rank to dump its stacks, wait until the dumps are written, return them.

    Returns ``{rank: text}`` for every rank asked; a rank that could not answer (it was
    still starting, or died meanwhile) maps to an empty string.
    """
    ranks = list(ranks)
    # faulthandler writes from the signal handler, even while the rank is blocked in C++;
    # wait until every file has stopped growing (or the budget is spent).
    ask(ranks, signal.SIGUSR1, _stopped_growing(), budget)
    return {r.rank: trim(_read(r.stack_path)) for r in ranks}


def _stopped_growing() -> Callable[[Sequence[LiveRank]], bool]:
    """A readiness test for ``ask``: every file written and of the same size as last look."""
    sizes: dict[int, int] = {}

    def ready(asked: Sequence[LiveRank]) -> bool:
        now = {r.rank: _size(r.stack_path) for r in asked}
        done = now == sizes and all(now.values())
        sizes.clear()
        sizes.update(now)
        return done

    return ready


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
        if line.endswith(_ENTRIES):
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

Frame = tuple[str, int, str]  # (path, line, function), most recent call first
_FRAME = re.compile(r'^\s+File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
# Library frames: a user's question is "which of *my* lines", so these are looked through
# (``<string>``: code torch generates, e.g. the dispatch of a functional collective).
_LIBRARY = ("/site-packages/", "/dist-packages/", "/tutorial_impl/testing/", "<frozen ", "<string>")
_STDLIB = sysconfig.get_paths()["stdlib"]
_WRAPPERS = {"wrapper", "inner", "_fn", "decorate_context", "_wrapped_call_impl", "_call_impl"}


@dataclass(frozen=True)
class Place:
    """A rank's innermost line of user code, and the library call it sits in (if any)."""

    file: str  # the file's base name
    line: int
    func: str  # the user's function at that line
    call: str | None = None  # e.g. "all_reduce": what that line called, still running
    joining: str | None = None  # e.g. "init_process_group(env://)": a group it waits to form

    def __str__(self) -> str:
        if self.call:
            return f"in {self.call} at {self.file}:{self.line}"
        return f"at {self.file}:{self.line} in {self.func}"


def _is_user(path: str) -> bool:
    return not path.startswith(_STDLIB) and not any(part in path for part in _LIBRARY)


def place(frames: list[Frame]) -> Place | None:
    """The innermost frame of user code in ``frames`` (most recent first) and the
    outermost library call below it, or None when no frame is the user's."""
    for i, (path, line, func) in enumerate(frames):
        if not _is_user(path):
            continue
        called = [f for _, _, f in reversed(frames[:i]) if f not in _WRAPPERS]
        call = called[0] if called else None
        return Place(os.path.basename(path), line, func, call, joining(frames[:i]))
    return None


# torch's calls that form a group (every rank of it must come), and the rendezvous handlers
# below them that say how the ranks meet.
_FORMING = ("init_process_group", "new_group", "init_rpc")
_HANDLERS = {f"_{kind}_rendezvous_handler": f"{kind}://" for kind in ("env", "tcp", "file")}


def joining(frames: list[Frame]) -> str | None:
    """The outermost of torch's group-forming calls in ``frames`` (most recent first), with
    the init method its rendezvous handler names: ``init_process_group(env://)``; or None."""
    torch_calls = [func for path, _, func in frames if "/torch/distributed/" in path]
    forming = [func for func in torch_calls if func in _FORMING]
    if not forming:
        return None
    method = next((_HANDLERS[f] for f in torch_calls if f in _HANDLERS), None)
    return f"{forming[-1]}({method})" if method else forming[-1]


def frames_of_dump(dump: str) -> list[Frame]:
    """The frames of the main thread of a faulthandler dump (the one that ends in the
    harness's ``rank_main``), most recent call first."""
    blocks = dump.split("\n\n")
    threads = [b for b in blocks if any(line.endswith(_ENTRIES) for line in b.splitlines())]
    threads = threads or [dump]
    matches = (_FRAME.match(line) for line in threads[0].splitlines())
    return [(m["path"], int(m["line"]), m["func"]) for m in matches if m]


def frames_of(frame: Any, stop: str) -> list[Frame]:
    """A live thread's frames from ``frame`` outwards, most recent first, down to the
    first frame of a function named ``stop`` (excluded)."""
    frames: list[Frame] = []
    while frame is not None and frame.f_code.co_name != stop:
        frames.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return frames


def format_frames(title: str, frames: list[Frame]) -> str:
    """``frames`` as a stack dump reads, under ``title``."""
    lines = [title] + [f'  File "{path}", line {line} in {func}' for path, line, func in frames]
    return "\n".join(lines) + "\n"


def where(dump: str) -> Place | None:
    """Where a rank was, read from its faulthandler dump (see ``place``)."""
    return place(frames_of_dump(dump))
