"""Under torchrun, the rank side of a call: ``fn`` run in a thread of this worker, watched.

``worker.Launched`` is the job side (the group, the answers gathered through the store, one
verdict); here is what one rank does in between. ``run_here`` runs the function through the
same capture as a forked rank (``outcome.capture``) in a thread of its own, with its printed
output copied (``_Tee``), while the main thread waits (``_wait``) for it to end, for another
rank's failure or skip, a lost worker, a returned rank that strands it
(``strategies.torchrun.stranded``), or the deadline. A function still running then is
abandoned, and named by the place its live frames are in (``diagnose.stacks``). What the rank
publishes at the end is its ``Answer``, pickled once (``pickled``).
"""

from __future__ import annotations

import dataclasses
import io
import multiprocessing.process
import os
import pickle
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tutorial_impl.testing import proctable
from tutorial_impl.testing.diagnose.recorder import Record
from tutorial_impl.testing.diagnose.stacks import format_frames, frames_of, place
from tutorial_impl.testing.diagnose.stranded import Standing, standing
from tutorial_impl.testing.faults import inject
from tutorial_impl.testing.rank import leftovers
from tutorial_impl.testing.rank import outcome as _o
from tutorial_impl.testing.rank.caught import Catcher, current_filters
from tutorial_impl.testing.rank.main import dumps_on_cpu
from tutorial_impl.testing.settings.timing import (
    FINISH_GRACE,
    FORK_GRACE,
    STORE_POLL_MAX,
    STORE_POLL_MIN,
)
from tutorial_impl.testing.strategies import supervise, waiting
from tutorial_impl.testing.strategies.torchrun.job import Job
from tutorial_impl.testing.strategies.torchrun.stranded import Look

ENTRY = "rank_function"  # the harness frame below a rank function's own frames
STR_FAILED = "<str() failed>"  # the message of an exception that cannot be put in words


@dataclass
class Answer:
    """What one rank publishes at the end of a call."""

    report: _o.Report
    output: str
    stacks: str = ""  # the function's thread, when it had not ended
    records: list[Record] | None = None  # this call's collectives (``records.this_test``)
    fired: list[inject.Fired] = field(default_factory=list)  # faults injected here
    unfired: list[inject.Unfired] = field(default_factory=list)  # faults never reached
    standing: Standing | None = None  # its groups; where its function was, if still running


def pickled(answer: Answer) -> bytes:
    """``answer`` as the store carries it (pickled once); a return value that cannot be
    pickled is this rank's failure, named as such, as for a forked rank."""
    try:
        return dumps_on_cpu(answer)
    except Exception as exc:  # noqa: BLE001
        failure = _o.unpicklable("returned a value that cannot be pickled", exc)
        report = _o.Report(failure, answer.report.pid, answer.report.at)
        return dumps_on_cpu(Answer(report, answer.output, answer.stacks))


class _Tee(io.TextIOBase):
    """Writes to the stream it replaces and keeps a copy: a rank's printed output."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.copy = io.StringIO()

    def write(self, text: str) -> int:
        self.copy.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


def run_here(
    job: Job,
    key: str,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    timeout: float,
    since_ns: int = 0,
) -> Answer:
    """Run ``fn`` in a thread; wait for it, another rank's failure, a lost worker, a returned
    rank that strands it (``strategies.torchrun.stranded``), or the deadline."""
    launch, worker = job.launch, os.getpid()
    box: dict[str, _o.Report] = {}
    done = threading.Event()
    child_r, child_w = os.pipe()  # where a forked child that came back reports
    catcher = Catcher(current_filters())  # this worker's: pytest's for the test

    def rank_function() -> None:  # the name frames_of stops at
        try:
            report = _o.capture(fn, launch.rank, args, kwargs, catcher=catcher)
        except BaseException as failure:  # noqa: BLE001 - the rank answers whatever happened
            report = _o.Report(uncaptured(failure), os.getpid(), time.time())
        if report.pid != worker:  # a child the function forked came back here
            os.write(child_w, pickle.dumps(report))
            os._exit(1)
        box.setdefault("report", report)
        done.set()

    def exited(code: int) -> None:  # rank 0's function called os._exit (Job.end_call)
        box.setdefault("report", _o.Report(_o.Lost(code), worker, time.time()))
        done.set()

    leftovers.become_subreaper()  # what the function starts stays within reach
    before, nested_before = leftovers.spared(), set(supervise.LIVE.pids)  # not the function's
    tee_out, tee_err = _Tee(sys.stdout), _Tee(sys.stderr)
    sys.stdout, sys.stderr = tee_out, tee_err
    # Not a daemon, as a forked rank's main thread is not: the threads the function starts
    # inherit that, and those are the ones waited for (``caught``). The worker never waits
    # for it at exit (it leaves through os._exit: ``strategies.torchrun.session``).
    thread = threading.Thread(target=rank_function, name=f"rank {launch.rank}", daemon=False)
    job.end_call = exited if launch.rank == 0 else None
    try:
        with catcher.recording():
            thread.start()
            look = Look(job, key, since_ns, thread.ident, timeout, ENTRY)
            ended = _wait(job, key, done, timeout, look)
    finally:
        job.end_call = None
        sys.stdout, sys.stderr = tee_out.stream, tee_err.stream
    output = tee_out.copy.getvalue() + tee_err.copy.getvalue()
    if ended is None and box["report"].forked:
        proctable.wait_for_forked_copies(FORK_GRACE)
    child = _child_report(child_r, child_w)
    killed = leftovers.kill_leftovers(keep=before)  # an abandoned function's children too
    if ended is not None:  # still running: where?
        killed += _kill_nested_ranks(thread, nested_before)
        report, stacks = _abandon(job, thread, ended, worker, killed)
        return Answer(child or report, output, stacks, standing=standing(thread.ident, ENTRY))
    report = _ended(job, key, box["report"], child, killed)
    return Answer(report, output, standing=standing(None, ENTRY))


def _kill_nested_ranks(thread: threading.Thread, before: set[int]) -> tuple[_o.Leftover, ...]:
    """The ranks of a nested ``run_ranks`` the abandoned function (in ``thread``) still waits
    for, killed and named, once ``thread`` may start no more (``supervise.ABANDONED``). They
    are the forkserver's children, not this worker's, so ``kill_leftovers`` does not see them,
    and the abandoned thread would end them only when its run ends: during the next test,
    whose ``multiprocessing.active_children()`` then listed them (another rank failed while
    this one was in the nested run). Taken off multiprocessing's book too, as the run's own
    ``finally`` (``supervise.LIVE.kill``) does; that run then finds them dead."""
    supervise.ABANDONED.add(thread)  # first: its nested run_ranks starts no more ranks
    doomed = set(supervise.LIVE.pids) - before
    if not doomed:
        return ()
    named = {
        p.pid: f"multiprocessing {type(p).__name__} {p.name!r}, a rank of a nested run_ranks"
        for p in list(multiprocessing.process._children)  # type: ignore[attr-defined]
        if p.pid in doomed
    }
    for pid in sorted(doomed):
        supervise.kill_group(pid)
        supervise.LIVE.pids.discard(pid)
    for p in list(multiprocessing.process._children):  # type: ignore[attr-defined]
        if p.pid in doomed:
            multiprocessing.process._children.discard(p)  # type: ignore[attr-defined]
    return tuple(
        _o.Leftover(pid, named.get(pid, "a rank of a nested run_ranks")) for pid in sorted(doomed)
    )


def uncaptured(failure: BaseException) -> _o.Raised:
    """The outcome of a function whose capture itself raised: an exception the capture could
    not put in words (its ``__str__`` raised, say), named by its type, at once, instead of a
    thread that ends without an answer and a rank waited for until the deadline. ``failure``
    is what the capture raised; the function's own exception is the one it was handling."""
    exc = failure.__context__ or failure
    kind = type(exc)
    name = kind.__qualname__
    if kind.__module__ != "builtins":
        name = f"{kind.__module__}.{name}"
    # Python's own formatting of a traceback survives an unprintable exception.
    return _o.Raised(name, STR_FAILED, "".join(traceback.format_exception(failure)))


def _abandon(
    job: Job,
    thread: threading.Thread,
    why: type,
    worker: int,
    killed: tuple[_o.Leftover, ...],
) -> tuple[_o.Report, str]:
    """A function still running when the wait ended (``why``): left to end by itself
    (``job.abandoned``), its report and stacks naming the place its live frames are in."""
    job.abandoned.append(thread)
    frames = frames_of(sys._current_frames().get(thread.ident or -1), ENTRY)
    title = f"Thread {thread.ident:#x} ({thread.name}, most recent call first):"
    report = _o.Report(why(place(frames)), worker, time.time(), killed=killed)
    return report, format_frames(title, frames)


def _ended(
    job: Job,
    key: str,
    report: _o.Report,
    child: _o.Report | None,
    killed: tuple[_o.Leftover, ...],
) -> _o.Report:
    """The report of a function that ended: a forked child's that came back here unless the
    function failed itself, with what it left running; told to the other ranks at once."""
    if child is not None and not isinstance(report.outcome, _o.Failure):
        report = child
    report = dataclasses.replace(report, killed=killed)
    announce(job, key, report)
    return report


def _wait(job: Job, key: str, done: threading.Event, timeout: float, look: Look) -> type | None:
    """None once the function has ended; else the outcome class of why the wait ended, by
    the rules every strategy keeps (``waiting.wait``); the other ranks then stop too."""
    ending = waiting.wait(_Store(job, key, done, look), _Clock(timeout), FINISH_GRACE)
    if ending is not None:
        job.channel.set(f"{key}/failed")  # the others waiting stop too
    return ending


class _Clock:
    """The call's deadline, from now (a torchrun worker has no debugger to pause it for)."""

    poll = None

    def __init__(self, timeout: float) -> None:
        self.end = time.monotonic() + timeout

    def remaining(self) -> float:
        return self.end - time.monotonic()


class _Store:
    """The evidence one worker has of a call (``waiting.Evidence``): its own function's end,
    and the job's store (another rank's failure or skip, lost workers, returned ranks'
    answers), polled more slowly while nothing happens."""

    def __init__(self, job: Job, key: str, done: threading.Event, look: Look) -> None:
        self.job, self.key, self.done, self.look = job, key, done, look
        self.pause, self.skip_seen = STORE_POLL_MIN, None

    def settle(self, wait_for: float) -> bool:
        ended = self.done.wait(min(wait_for, self.pause))
        self.pause = min(self.pause * 2, STORE_POLL_MAX)
        if self.skip_seen is None and self.job.channel.has(f"{self.key}/skipped"):
            self.skip_seen = time.monotonic()
        return ended

    def failed(self) -> bool:
        channel = self.job.channel
        # Another rank failed, or was told to end (SIGTERM: "abort"), or a worker was lost.
        trouble = channel.has(f"{self.key}/failed") or channel.has("abort")
        return trouble or bool(self.job.heartbeats.lost_ranks())

    def skipped_since(self) -> float | None:
        return self.skip_seen

    def stranded(self) -> bool:
        return self.look.stranded() and not self.done.is_set()


def announce(job: Job, key: str, report: _o.Report) -> None:
    """Tell the other ranks at once how this rank's function ended, if not well."""
    if isinstance(report.outcome, (_o.Skipped, _o.XFailed)):
        job.channel.set(f"{key}/skipped")
    elif not isinstance(report.outcome, _o.Returned):
        job.channel.set(f"{key}/failed")


def _child_report(reader: int, writer: int) -> _o.Report | None:
    """The report a forked child wrote, if one did; closes the pipe."""
    os.close(writer)
    os.set_blocking(reader, False)
    try:
        data = os.read(reader, 1 << 16)
    except BlockingIOError:
        data = b""
    finally:
        os.close(reader)
    return pickle.loads(data) if data else None
