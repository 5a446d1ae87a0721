"""Processes a rank starts: allowed, as in any program, and none of them outlives its test.

A rank function may start processes as a worker of a torchrun job can: ``DataLoader``
workers, a ``multiprocessing`` pool or process, subprocesses, a nested ``run_ranks``. Forked
and warm ranks are processes multiprocessing started as daemons (``forked.start``,
``warm.start_world``): their parent, the test's process, may let them go at exit without
joining them, which is the harness's promise too (it kills them, ``supervise.LIVE``). A
daemon may not start children in multiprocessing's book, because when it is terminated
nothing would end those children. Here something does, so the rank clears the flag in its
own copy of itself (``allow_children``) and takes over the guarantee:

* **The rank is a child subreaper** (``PR_SET_CHILD_SUBREAPER``): a process it started whose
  parent exits is handed to the rank, not to init; a child that left the rank's session
  (``start_new_session=True``) or daemonized stays within reach.
* **When its function has ended**, before it reports, the rank kills every process it still
  has (its children, the processes its multiprocessing forkserver started for it, which are
  that server's children, not the rank's, and the orphans handed to it meanwhile, generation
  after generation) and reaps them (``kill_leftovers``). Forked, that is the rank's last act
  before the parent kills its process group; warm, the rank lives on and serves the next
  test, so the kill happens at the end of every test. Under torchrun the worker does the
  same at the end of each call, sparing what it had before the call (``spared``: a
  fixture's server, say). Nothing respawns what is killed: a forgotten pool's maintenance
  thread is stopped first, and each round is frozen (SIGSTOP) before any of it is killed.
* **A rank the harness stops** (a deadline, a failure elsewhere) never reaches that point:
  the parent freezes it (SIGSTOP: it can start nothing more) and kills everything under it,
  then its process group (``kill_tree``, from ``supervise``). A rank that dies by itself (a
  crash, ``os._exit``) takes the rest of its process group with it, but a child it had moved
  to a session of its own is orphaned to init before anyone can see it: that one case stays.
* **multiprocessing's own helpers** (its forkserver, its resource tracker) are no leftovers:
  started once and kept for the rank's later children, as in any program, they end with the
  rank (they read a pipe whose other end it holds; forked, its process group goes too). A
  stopped rank's are killed without a word.

What had to be killed is not a failure of the test: plain pytest lets a test leave a child
running, and the interpreter's exit (multiprocessing's at-exit hook) ends a pool the test
forgot. But each is named once, with its rank and pid, by what it is (``describe``): a
multiprocessing process by its class and name (``ForkProcess 'ForkPoolWorker-1:2'``), a
fork by that (its command line is its parent's, the harness's server's), anything else by
its command line; as a ``LeftoverProcessWarning`` in pytest's warnings summary (``warn``),
which a project makes an error with ``-W error`` or ``filterwarnings``. DataLoader workers,
a pool used in ``with`` and a joined process have ended before their function returns:
nothing is said about them; DataLoader workers still alive are named as any process (the
DataLoader's SIGCHLD handler, which would raise in the rank, is set aside meanwhile).
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import multiprocessing.process
import os
import re
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterator

from tutorial_impl.testing import proctable
from tutorial_impl.testing.rank.outcome import Leftover

KILL_GRACE = 2.0  # seconds to kill leftovers, generations of orphans included
_PR_SET_CHILD_SUBREAPER = 36
# libc's prctl, looked up once at import: in the forkserver, which imports this module
# before it forks any rank. Looked up in each rank (``ctypes.CDLL(None)`` and the
# attribute), it cost every rank ~0.3 ms of CPU, most of it copying the pages it wrote.
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def prctl(option: int, arg: int) -> int:
    """Linux's ``prctl(option, arg, 0, 0, 0)`` (the caller checks the platform)."""
    assert _PRCTL is not None
    return int(_PRCTL(option, arg, 0, 0, 0))


class LeftoverProcessWarning(RuntimeWarning):
    """Processes a rank started were still running when its function ended; the harness
    killed them (the message names each: rank, pid, command line)."""


def allow_children(start_method: str | None) -> None:
    """Let this rank start processes with multiprocessing (``Pool``, ``Process``, DataLoader
    workers) as the test's process would: it is not a daemon whose children nobody would end
    (see above), and its default start method is the test process's (``start_method``, None:
    the platform's), not the ``forkserver`` multiprocessing made it for starting the rank
    (DataLoader workers would then come from a server of the rank's own, a fresh interpreter
    that imports the test's main module: seconds, where a fork takes milliseconds)."""
    multiprocessing.current_process()._config["daemon"] = False  # type: ignore[attr-defined]
    multiprocessing.set_start_method(start_method, force=True)


def become_subreaper() -> None:
    """Have orphans among this process's descendants handed to it instead of init (Linux)."""
    if sys.platform.startswith("linux"):
        prctl(_PR_SET_CHILD_SUBREAPER, 1)


def kill_leftovers(keep: frozenset[int] = frozenset()) -> tuple[Leftover, ...]:
    """Kill and reap every process this process's code started and left running, but
    ``keep`` (``spared``) and multiprocessing's own helpers: its live children, the
    processes its multiprocessing forkserver started for it (children of that server, not
    of this process), everything under those, and each orphan handed to this subreaper as
    their parents die; name each once, by what it is (``describe``).

    Nothing respawns what is killed: a forgotten ``Pool``'s maintenance thread is stopped
    first (``_stop_pool_handlers``), and each round's processes are all frozen (SIGSTOP)
    before any is killed, so a parent among them cannot start a replacement. Python's
    SIGCHLD handler is set aside meanwhile: a ``DataLoader``'s raises in this thread when
    one of its workers dies by a signal ("DataLoader worker ... is killed by signal"), and
    here that is what the harness did, not the test."""
    if not proctable.own_children():  # the common case, no child at all: one system call
        return ()
    keep = keep | _harness_helpers()
    named = _started_by_multiprocessing()
    killed: dict[int, Leftover] = {}
    with _sigchld_set_aside():
        stop = time.monotonic() + KILL_GRACE
        while time.monotonic() < stop:
            found = [pid for pid in _started_here() if pid not in keep]
            if not found:
                break
            frozen = _freeze(found)
            _stop_pool_handlers(set(frozen))
            for pid in frozen:
                killed.setdefault(pid, Leftover(pid, describe(pid, named)))
            for pid in frozen:
                _kill(pid)
            time.sleep(0.001)  # the killed exit; their children come to us
        _reap(killed)
    return tuple(killed.values())


def spared() -> frozenset[int]:
    """What ``kill_leftovers`` would kill now: processes that a later ``kill_leftovers``
    (with this as ``keep``) spares, such as those a worker had before a call."""
    return frozenset(_started_here()) if proctable.own_children() else frozenset()


def _started_here() -> list[int]:
    """This process's live children but multiprocessing's helpers, and the live children of
    its multiprocessing forkserver (processes started with the ``forkserver`` context)."""
    helpers = _mp_helpers()
    found = [pid for pid in proctable.own_children() if pid not in helpers]
    server = _mp_forkserver()
    if server is not None:
        found += [pid for pid in proctable.live_children(server) if pid not in found]
    return found


def _freeze(pids: list[int]) -> list[int]:
    """SIGSTOP ``pids`` and everything under them, parents first (a stopped process starts
    nothing); return them all, parents before their children."""
    frozen: list[int] = []
    for pid in pids:
        for each in (pid, *proctable.descendants(pid)):
            if each not in frozen:
                _signal(each, signal.SIGSTOP)
                frozen.append(each)
    return frozen


def kill_tree(pid: int) -> tuple[Leftover, ...]:
    """Freeze process ``pid`` (a rank the harness is about to kill) and kill every process
    under it, orphans handed back to it included; name them (multiprocessing's helpers the
    rank started, its forkserver and resource tracker, are killed without a word). ``pid``
    itself is left to its caller, stopped: a stopped process starts nothing (a fork under
    way when SIGSTOP comes is restarted after it, and SIGKILL ends a stopped process as
    any other). Each round's processes are all frozen, then named (a process is told from
    its parent, still there), then killed."""
    if not _signal(pid, signal.SIGSTOP):
        return ()
    rank = proctable.command(pid)
    killed: dict[int, Leftover] = {}
    helpers: set[int] = set()
    stop = time.monotonic() + KILL_GRACE
    while time.monotonic() < stop:
        found = proctable.descendants(pid)
        if not found:
            break
        for child in found:
            _signal(child, signal.SIGSTOP)
        for child in found:
            if child not in killed and child not in helpers:
                what = _seen_from_outside(child, pid, rank)
                if what is None:
                    helpers.add(child)
                else:
                    killed[child] = Leftover(child, what)
        for child in found:
            _kill(child)
        time.sleep(0.001)
    return tuple(killed.values())


def _kill(pid: int) -> None:
    _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: int) -> bool:
    """Send ``sig`` to ``pid``; whether it was there to receive it."""
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def helpers() -> frozenset[int]:
    """The harness's and multiprocessing's own children of this process, never leftovers:
    the forkserver a nested ``run_ranks`` started here, multiprocessing's forkserver (its
    start method ``forkserver``) and its resource tracker."""
    return _harness_helpers() | _mp_helpers()


def _harness_helpers() -> frozenset[int]:
    from tutorial_impl.testing.forkserver import server as rank_server

    pid = rank_server.SERVER.pid
    return frozenset() if pid is None else frozenset({pid})


def _mp_forkserver() -> int | None:
    """The pid of this process's multiprocessing forkserver, if it started one."""
    server = sys.modules.get("multiprocessing.forkserver")
    return getattr(getattr(server, "_forkserver", None), "_forkserver_pid", None)


def _mp_helpers() -> frozenset[int]:
    """multiprocessing's own helpers of this process: its forkserver, its resource tracker.
    They are what the ``forkserver`` and ``spawn`` start methods need, started once and
    kept for the process's later children, as in any program: never leftovers. They end
    with the process that started them (they read a pipe whose other end it holds)."""
    tracker = sys.modules.get("multiprocessing.resource_tracker")
    pids = {
        _mp_forkserver(),
        getattr(getattr(tracker, "_resource_tracker", None), "_pid", None),
    }
    return frozenset(pid for pid in pids if pid is not None)


def _started_by_multiprocessing() -> dict[int, str]:
    """pid -> what it is, for the processes this process's multiprocessing started (by any
    start method or context, a pool's workers and a DataLoader's included): its class and
    name, which say more than a command line (a fork has its parent's; multiprocessing
    forgets the target once the process has started)."""
    found = {}
    for process in list(multiprocessing.process._children):  # type: ignore[attr-defined]
        if process.pid is not None:
            found[process.pid] = f"multiprocessing {type(process).__name__} {process.name!r}"
    return found


def describe(pid: int, named: dict[int, str]) -> str:
    """What process ``pid``, which this process started, is: its multiprocessing name and
    target (``named``), else, for a fork that never exec'd, that (its command line is its
    parent's), else its command line."""
    if pid in named:
        return named[pid]
    command = proctable.command(pid)
    parent = proctable.parent(pid)
    if parent is not None and command == proctable.command(parent):
        return f"a fork of pid {parent} (os.fork: no command line of its own)"
    return command


# multiprocessing's helpers as a command line shows them: exec'd by the rank, never forks.
_MP_HELPER = re.compile(r" -c from multiprocessing\.(forkserver|resource_tracker) import main;")


def _seen_from_outside(pid: int, rank: int, rank_command: str) -> str | None:
    """What process ``pid`` under frozen rank ``rank`` is, named from the rank's parent (the
    rank's own book cannot be read): None for multiprocessing's helpers the rank started."""
    command = proctable.command(pid)
    parent = proctable.parent(pid)
    if parent == rank and command != rank_command and _MP_HELPER.search(command):
        return None
    if parent is not None and command == proctable.command(parent):
        if parent == rank:
            return "a fork of the rank (os.fork, or a process multiprocessing forked)"
        if _MP_HELPER.search(command):
            return f"a process multiprocessing's forkserver (pid {parent}) started for the rank"
        return f"a fork of pid {parent} (os.fork: no command line of its own)"
    return command


def _stop_pool_handlers(doomed: set[int]) -> None:
    """Stop the maintenance thread of each ``multiprocessing.Pool`` of this process with a
    worker among ``doomed``: it starts a new worker for each that ends (a forgotten
    ``Pool(2)`` killed worker by worker was 22 processes), and it ends on its next wake-up
    (a worker's end) once its state says so, as ``Pool.terminate`` has it. A pool whose
    workers are all spared (a fixture's, under torchrun) keeps its thread."""
    pool = sys.modules.get("multiprocessing.pool")
    if pool is None:
        return
    handle = pool.Pool._handle_workers.__func__
    for thread in threading.enumerate():
        target = getattr(thread, "_target", None)
        args = getattr(thread, "_args", ())
        if getattr(target, "__func__", None) is handle and len(args) > 5:
            if any(getattr(worker, "pid", None) in doomed for worker in args[5]):
                thread._state = pool.TERMINATE  # type: ignore[attr-defined]


@contextlib.contextmanager
def _sigchld_set_aside() -> Iterator[None]:
    """Python's SIGCHLD handler, if any, set aside meanwhile (the main thread only can)."""
    old = signal.getsignal(signal.SIGCHLD)
    if not callable(old) or threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGCHLD, old)


def _reap(killed: dict[int, Leftover]) -> None:
    """Reap the killed: multiprocessing's own through its bookkeeping (a process it started
    and someone else reaped would look alive to it for ever; one its forkserver started is
    forgotten once that server has said it ended, at this or a later look), the rest here.
    Each child of ours is waited for (within ``KILL_GRACE``) while SIGCHLD is still set
    aside: a killed DataLoader worker not yet reaped when its handler is back made the next
    SIGCHLD raise "DataLoader worker ... is killed by signal" in the rank (seen once)."""
    stop = time.monotonic() + KILL_GRACE
    waiting = set(killed)
    while True:
        multiprocessing.active_children()
        for pid in list(waiting):
            try:  # ended? (not reaped here: multiprocessing's own must see it end)
                ended = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:  # reaped, or not ours (a grandchild, a forkserver's)
                waiting.discard(pid)
                continue
            if ended is not None and not _of_multiprocessing(pid):
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
                waiting.discard(pid)
        if not waiting or time.monotonic() > stop:
            return
        time.sleep(0.001)


def _of_multiprocessing(pid: int) -> bool:
    return any(p.pid == pid for p in multiprocessing.process._children)  # type: ignore[attr-defined]


def warn(killed: dict[int, tuple[Leftover, ...]]) -> None:
    """Name what the harness killed for each rank, as one warning per rank, at the line of
    the user's code that called ``run_ranks`` (the fixture, the plain function, a warm world
    or a torchrun job: however many of the harness's frames lie between)."""
    for rank, processes in sorted(killed.items()):
        if processes:
            names = "; ".join(str(p) for p in processes)
            warnings.warn(
                LeftoverProcessWarning(
                    f"rank {rank} left {len(processes)} process(es) running when its function "
                    f"ended; the harness killed them: {names}"
                ),
                stacklevel=_outside_the_harness(),
            )


_HARNESS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tutorial_impl/testing


def _outside_the_harness() -> int:
    """The ``stacklevel`` of the first frame, counted from ``warn``'s caller, whose code is
    not the harness's (``warnings.warn(..., skip_file_prefixes=...)`` is Python 3.12+)."""
    frame, level = sys._getframe(2), 2  # level 1 is warn itself; 2 the harness line calling it
    while frame is not None and frame.f_code.co_filename.startswith(_HARNESS + os.sep):
        frame, level = frame.f_back, level + 1
    return level
