"""Under torchrun: a parent for each worker's session, to tell the job how the session ended.

A worker that crashes (a segfault, ``os.abort``, gloo aborting on mismatched sizes, the OOM
killer's SIGKILL) says nothing on its way out: its peers would only see its heartbeat stop,
and only its parent can learn the signal. torchrun's agent is that parent, and it answers by
stopping every other worker at once, before any report is written. So a worker's pytest forks
as it joins the job (``watch``, before anything else of the session exists): the child runs
the session, and the parent, the process torchrun started and watches, waits for it.

The session leaves through ``goodbye`` (``Job.real_exit``): an end it chose, reported by
itself. Any other end is a crash: the watcher tells the peers through the job's store how the
session ended (``channel.Departure``: ``rank 1 was killed by signal SIGSEGV``, at once, not after
``HEARTBEAT_LOST`` s), waits (at most ``REPORT_WAIT`` s) until the job's report is written,
then ends the same way, so that torchrun and the scheduler see the crash. Meanwhile it passes
the agent's SIGTERM (and SIGHUP) on to the session (``session``: it reports, then exits), and
should the watcher itself be killed, the kernel kills the session too (``PR_SET_PDEATHSIG``).
The session's own orphans come to the watcher (a child subreaper), which kills what is left
of them as it ends: nothing of the session outlives the process torchrun started.

Not where CUDA was initialized before the session (a forked child cannot use it): there the
worker stays one process, and a crash is named by its lost heartbeat, without the signal.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import resource
import signal
import sys
import time
import warnings
from datetime import timedelta

from tutorial_impl.testing import proctable
from tutorial_impl.testing.rank import leftovers
from tutorial_impl.testing.settings.timing import REPORT_WAIT, STORE_POLL_MAX
from tutorial_impl.testing.strategies.torchrun.launch import Launch

FORWARDED = (signal.SIGTERM, signal.SIGHUP)  # what an agent or a scheduler ends a worker with
WATCH_POLL = 0.1  # seconds between two looks at the session
_said: dict[str, int] = {}  # the session's end of the pipe, and its pid: {"fd": .., "pid": ..}


def watch(launch: Launch) -> None:
    """Fork: return in the child, which runs the session; the parent watches it and never
    returns. Does nothing where the session cannot be forked (see the module's doc)."""
    if not sys.platform.startswith("linux") or _cuda_started():
        return
    reader, writer = os.pipe()
    parent = os.getpid()
    leftovers.become_subreaper()  # the session's orphans come here: none outlives us
    before = frozenset(proctable.own_children())
    with warnings.catch_warnings():  # 3.12+ warns of a fork beside threads: none is needed
        warnings.simplefilter("ignore", DeprecationWarning)
        child = os.fork()
    if child == 0:
        os.close(reader)
        _said.update(fd=writer, pid=os.getpid())
        leftovers.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the session dies with us
        if os.getppid() != parent:
            os._exit(1)
        return
    os.close(writer)
    code = _watch(launch, child, reader)
    # What the session spared as its own helpers (a forkserver a nested run_ranks started, a
    # resource tracker), orphaned now: they would end by themselves, a moment after us.
    leftovers.kill_leftovers(keep=before)
    _end_as(code)


def goodbye() -> None:
    """The session is about to end by its own choice (its report is written, or its peers
    were told): the watcher has nothing to add."""
    if _said.get("pid") != os.getpid():  # a process the session forked: not its end
        return
    fd = _said.pop("fd", None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.write(fd, b".")


def _cuda_started() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def _watch(launch: Launch, child: int, said: int) -> int:
    """Wait for the session; tell the job if it crashed; its exit code (minus a signal)."""
    for signum in FORWARDED:
        signal.signal(signum, lambda signum, _: _forward(child, signum))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the session
    while True:  # polled: a signal another thread of this process takes would not
        # interrupt a blocking wait, and its handler would run only once the wait ends
        try:
            pid, status = os.waitpid(child, os.WNOHANG)
        except ChildProcessError:  # reaped elsewhere: nothing more can be learnt
            return 1
        if pid:
            break
        time.sleep(WATCH_POLL)
    code = os.waitstatus_to_exitcode(status)
    os.set_blocking(said, False)
    try:
        chose = os.read(said, 1) == b"."
    except BlockingIOError:
        chose = False
    if not chose:
        _tell(launch, code)
    return code


def _forward(child: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(child, signum)


def _tell(launch: Launch, code: int) -> None:
    """Tell the peers how this worker's session ended, unless it said so itself (a fault
    that kills: ``Job.leave``), and wait until the job's report is written. A crash is also
    marked ``CRASHED``: the reporter then waits for the agent to end it (``Channel.crashed``)."""
    import torch.distributed as dist

    from tutorial_impl.testing.strategies.torchrun.channel import CRASHED, Channel, Departure

    try:
        store = dist.TCPStore(
            launch.master_addr,
            launch.master_port,
            world_size=launch.world_size,
            is_master=False,
            wait_for_workers=False,
            timeout=timedelta(seconds=10),
        )
        channel = Channel(launch, store)
        if not channel.has(f"exited/{launch.rank}"):
            channel.set(f"exited/{launch.rank}", Departure(code, time.time()))
        if code != 0:
            channel.set(f"{CRASHED}/{launch.rank}")
        stop = time.monotonic() + REPORT_WAIT
        while not channel.has("done") and time.monotonic() < stop:
            time.sleep(STORE_POLL_MAX)
    except Exception:  # noqa: BLE001 - no store (rank 0 hosted it): the heartbeat tells
        pass


def _end_as(code: int) -> None:
    """End this process as the session ended: the same signal, or the same exit code."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if code < 0:
        faulthandler.disable()  # no traceback of this process: the session's was shown
        with contextlib.suppress(ValueError, OSError):  # no second core dump
            _, hard = resource.getrlimit(resource.RLIMIT_CORE)
            resource.setrlimit(resource.RLIMIT_CORE, (0, hard))
        with contextlib.suppress(OSError, ValueError):  # SIGKILL and SIGSTOP have no handler
            signal.signal(-code, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {-code})
        os.kill(os.getpid(), -code)
        time.sleep(1)  # the signal ends this process meanwhile
        os._exit(128 - code)
    os._exit(code)
