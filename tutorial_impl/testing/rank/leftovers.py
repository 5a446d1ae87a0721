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
  has (its children, and the orphans handed to it meanwhile, generation after generation)
  and reaps them (``kill_leftovers``). Forked, that is the rank's last act before the parent
  kills its process group; warm, the rank lives on and serves the next test, so the kill
  happens at the end of every test. Under torchrun the worker does the same at the end of
  each call, sparing the children it had before the call (a fixture's server, say).
* **A rank the harness stops** (a deadline, a failure elsewhere) never reaches that point:
  the parent freezes it (SIGSTOP: it can start nothing more) and kills everything under it,
  then its process group (``kill_tree``, from ``supervise``). A rank that dies by itself (a
  crash, ``os._exit``) takes the rest of its process group with it, but a child it had moved
  to a session of its own is orphaned to init before anyone can see it: that one case stays.

What had to be killed is not a failure of the test: plain pytest lets a test leave a child
running, and the interpreter's exit (multiprocessing's at-exit hook) ends a pool the test
forgot. But it is named, rank, pid and command line, as a ``LeftoverProcessWarning`` in
pytest's warnings summary (``warn``), which a project makes an error with ``-W error`` or
``filterwarnings``. DataLoader workers, a pool used in ``with`` and a joined process have
ended before their function returns: nothing is said about them.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import time
import warnings

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
    """Kill and reap every live child of this process but ``keep`` and the harness's own
    helpers, and each orphan handed to this subreaper as their parents die; name them."""
    if not proctable.own_children():  # the common case, no child at all: one system call
        return ()
    keep = keep | helpers()
    killed: dict[int, Leftover] = {}
    stop = time.monotonic() + KILL_GRACE
    while time.monotonic() < stop:
        found = [pid for pid in proctable.own_children() if pid not in keep]
        if not found:
            break
        for pid in found:
            killed.setdefault(pid, Leftover(pid, proctable.command(pid)))
            _kill(pid)
        time.sleep(0.001)  # the killed exit; their children come to us
    _reap(killed)
    return tuple(killed.values())


def kill_tree(pid: int) -> tuple[Leftover, ...]:
    """Freeze process ``pid`` (a rank the harness is about to kill) and kill every process
    under it, orphans handed back to it included; name them. ``pid`` itself is left to its
    caller, stopped: a stopped process starts nothing (a fork under way when SIGSTOP comes
    is restarted after it, and SIGKILL ends a stopped process as any other)."""
    try:
        os.kill(pid, signal.SIGSTOP)
    except (ProcessLookupError, PermissionError):
        return ()
    killed: dict[int, Leftover] = {}
    stop = time.monotonic() + KILL_GRACE
    while time.monotonic() < stop:
        found = proctable.descendants(pid)
        if not found:
            break
        for child in found:
            killed.setdefault(child, Leftover(child, proctable.command(child)))
            _kill(child)
        time.sleep(0.001)
    return tuple(killed.values())


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def helpers() -> frozenset[int]:
    """The harness's and multiprocessing's own children of this process, never leftovers:
    the forkserver a nested ``run_ranks`` started here, multiprocessing's forkserver (its
    start method ``forkserver``) and its resource tracker."""
    from multiprocessing import forkserver as mp_forkserver
    from multiprocessing import resource_tracker

    from tutorial_impl.testing.forkserver import server as forkserver

    pids = {
        forkserver.SERVER.pid,
        getattr(mp_forkserver._forkserver, "_forkserver_pid", None),
        getattr(resource_tracker._resource_tracker, "_pid", None),
    }
    return frozenset(pid for pid in pids if pid is not None)


def _reap(killed: dict[int, Leftover]) -> None:
    """Reap the killed: multiprocessing's own through its bookkeeping (a process it started
    and someone else reaped would look alive to it for ever), the rest here."""
    multiprocessing.active_children()
    for pid in killed:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass  # reaped already, or not ours (a grandchild reaped by its own parent)


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
