"""Starting rank processes fast: the harness's own forkserver.

Spawning a fresh interpreter per rank costs seconds here, almost all of it ``import torch``.
So we use multiprocessing's *forkserver*: one clean, single-threaded server process is
started once per pytest session, imports torch once (the "preload"), and then forks a copy
of itself for every rank. Forking an interpreter that has already imported torch takes a few
milliseconds. A session starts it behind its collection (``start``, from ``preload``), so
that the first test does not wait for the preload; a failed start is the first rank's error.

**One server per xdist session.** Under ``pytest -n N`` the xdist *controller* starts the
server before its workers exist (``start_shared_forkserver``, from the plugin's
``pytest_configure_node``) and hands each worker the server's address through
``workerinput``; a worker's ranks then come from that one server (``use_shared_forkserver``)
instead of a server of its own, saving the worker a torch import (~3 s of CPU each). A
server only forks: what a rank runs with (environment, ``sys.path``, directory, coverage)
travels in its ``RankSpec`` from the worker that asked. Its death chain has three links:
the test's runner kills its ranks; the server kills every rank when the controller is
gone (``forkserver.boot``); and each rank watches the worker that asked for it and kills
its own process group when that worker dies (``_die_with_owner``).

Why not plain ``fork`` of the test process itself? A pytest(-xdist) process has threads
(execnet, the TCPStore server, pytest-timeout), and forking a threaded process can copy a
lock that some other thread held, deadlocking the child. It may also have initialised CUDA,
which cannot survive a fork. The forkserver is neither threaded nor touches CUDA.

The server's state (what it preloads, the server itself, or the controller's that an xdist
worker uses) belongs to one object, ``SERVER``: a forkserver is a resource of the process,
shared by every pytest session that process runs (an in-process pytester run reuses it).
What runs inside a rank is in ``rank``. Nothing here imports torch at import time (the
pytest plugin imports this module, and a plugin must not cost every pytest run two seconds).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import threading
import time
import types
import warnings
from multiprocessing import forkserver as _mp_forkserver
from multiprocessing import popen_forkserver as _mp_popen_forkserver
from multiprocessing import resource_tracker as _mp_resource_tracker
from typing import Any

from tutorial_impl.testing.rank import coverage

# Modules every rank needs; imported once in the forkserver, so a forked rank starts warm.
# ``forkserver.boot`` comes first: it stops ranks from re-running the parent's main script.
DEFAULT_PRELOAD = [
    "tutorial_impl.testing.forkserver.boot",
    "torch",
    "torch.distributed",
    "torch.nn",
    # What unpickling a tensor imports on first use (``torch.load`` of its storage): every
    # rank given a tensor argument would import it itself (3-4 ms of CPU a rank).
    "torch.utils.serialization",
    "tutorial_impl.testing.rank.main",
    "tutorial_impl.testing.strategies.warm.loop",
]
# Imported after those and ``rank_preload``, when the session gave a plan: what the test
# files import, imported once, guarded (``forkserver.probe``); then ``forkserver.ready``.
PLANNED_PRELOAD = "tutorial_impl.testing.forkserver.probe"
PLAN_ENV = "TUTORIAL_IMPL_RANK_PRELOAD_PLAN"  # the plan, in the server's environment
# The key of ``workerinput`` (xdist's dict sent from the controller to each worker).
WORKERINPUT_KEY = "tutorial_impl_forkserver"


class ForkServerFallbackWarning(RuntimeWarning):
    """The xdist controller's rank forkserver could not be reached; this worker started
    one of its own (the run goes on, at the cost of one more torch import)."""


class ForkServerStartError(RuntimeError):
    """The rank forkserver this session started early (``RankServer.start``) could not be
    started: raised by the first ``run_ranks`` after it, which the test reports."""


STOP_WITHIN = 5.0  # seconds for a killed server to be reaped (SIGKILL: at once, but loaded)


class RankServer:
    """This process's rank forkserver: what it preloads, and the server once started.

    ``context()`` starts it lazily (in an xdist worker given the controller's server, a
    client of that one); a pytest session starts it earlier, behind its collection
    (``start``; ``preload.start_early``). ``add_preload`` and ``plan`` only count before
    that. ``plan``: what the server reads to preload what the test files import
    (``preload.plan``), or None."""

    def __init__(self) -> None:
        self.preload: list[str] = list(DEFAULT_PRELOAD)
        self.plan: dict[str, Any] | None = None
        self.report_path: str | None = None  # where the started server says what it preloaded
        self.server: Any = None  # a ForkServer, once ``context`` has made it
        self.shared: dict[str, Any] | None = None  # an xdist worker: the controller's
        self._context: Any = None
        self.popen: Any = None
        self.failed: Exception | None = None  # why ``start`` could not start it (once)

    def add_preload(self, modules: list[str]) -> None:
        """Ask the forkserver to import ``modules`` once, before it forks any rank."""
        for name in modules:
            if name not in self.preload:
                self.preload.append(name)

    def context(self) -> Any:
        """The multiprocessing context ranks are started with."""
        if self.failed is not None:  # said once, by the first rank's test; later ones retry
            failed, self.failed = self.failed, None
            raise ForkServerStartError(
                "the rank forkserver could not be started when the session started: "
                f"{type(failed).__name__}: {failed}"
            ) from failed
        if self._context is None:
            self.server = _SharedForkServer(self.shared) if self.shared else self._own_server()
            self.popen = _own_popen()
            self._context = _RankContext()
        return self._context

    def _own_server(self) -> Any:
        """A new, not yet started ``ForkServer`` with the harness's preload."""
        server = _PlannedForkServer()
        # Ranks measure coverage when we do (see ``coverage``); then import it once, there.
        measuring = ["coverage"] if coverage.parent_settings() is not None else []
        planned = []
        if self.plan is not None:
            if self.report_path is None:
                self.report_path = _report_path()
            # The parent's import path: on Python 3.11 multiprocessing's forkserver does
            # not take it over (3.12 does), and the test files' imports must resolve as here.
            server.plan = {**self.plan, "report": self.report_path, "sys_path": list(sys.path)}
            planned = [PLANNED_PRELOAD]
        # Keep '__main__' out of the preload: under pytest it is pytest's own entry point.
        # ``forkserver.ready`` goes last: it freezes everything the others imported.
        ready = "tutorial_impl.testing.forkserver.ready"
        server.set_forkserver_preload([*self.preload, *measuring, *planned, ready])
        return server

    @property
    def started(self) -> bool:
        """Whether this process has a server to take ranks from (its own, or a shared one)."""
        return self._context is not None

    def start(self) -> None:
        """Start this process's own server now, not at its first rank: ``ensure_running``
        only spawns it (milliseconds), and the server imports its preload while the caller
        goes on. A failure is kept for the first rank to raise (``context``): a test reports
        it, not the hook that called this."""
        if self.started or self.shared or self.failed is not None:
            return
        try:
            self.address()
        except Exception as exc:  # noqa: BLE001 - raised again by the first rank's test
            self._forget()
            self.failed = exc

    def stop(self) -> None:
        """Kill the server ``start`` started for ranks that did not come (it has forked
        none: its preload is cut short) and reap it; the next rank starts a new one."""
        server = self.server
        pid = getattr(server, "_forkserver_pid", None)
        if self.shared or pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        _reap(pid, STOP_WITHIN)
        with contextlib.suppress(OSError):
            os.close(server._forkserver_alive_fd)
        with contextlib.suppress(OSError, TypeError):
            os.unlink(server._forkserver_address)
        self._forget()

    def _forget(self) -> None:
        self.server = self._context = self.popen = self.report_path = None

    def report(self) -> dict[str, Any] | None:
        """What the server preloaded from the plan and what it dropped, and why (see
        ``forkserver.probe``); None before it has finished (or without a plan)."""
        if self.report_path is None:
            return None
        try:
            with open(self.report_path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def fall_back(self, exc: OSError) -> Any:
        """Replace the unreachable shared server by one of this process's own; say so once."""
        self.shared = None
        self.server = self._own_server()
        with warnings.catch_warnings():  # a warning, never an error (-W error): the run goes on
            warnings.simplefilter("default")
            warnings.warn(
                f"the xdist controller's rank forkserver could not be reached ({exc}); this "
                "worker starts a forkserver of its own",
                ForkServerFallbackWarning,
                stacklevel=3,
            )
        return self.server

    def start_shared(self) -> dict[str, Any]:
        """In the xdist controller: start the rank forkserver now; what a worker needs to
        use it.

        ``ensure_running`` returns as soon as the server process is spawned: its listening
        socket exists already, and the server accepts on it once its preload is imported, so
        a worker that asks for a rank earlier just waits in the socket's queue. The
        controller keeps the server's "alive" fd: the server exits when the controller is
        gone. Address, pid and authkey (3.14+) are plain values: they travel in workerinput.
        """
        return self.address()

    def address(self) -> dict[str, Any]:
        """What another process needs to take ranks from the server this process uses,
        started if it was not: an xdist worker (``start_shared``), a rank's nested
        ``run_ranks`` (``RankSpec.forkserver``)."""
        self.context()
        self.server.ensure_running()
        return {
            "address": self.server._forkserver_address,
            "pid": self.server._forkserver_pid,
            "authkey": getattr(self.server, "_forkserver_authkey", None),
        }

    def use_shared(self, shared: dict[str, Any]) -> None:
        """In an xdist worker, before its first rank: take ranks from the controller's
        server instead of starting one of its own."""
        if self._context is None:  # a server already in use (in-process pytester) stays
            self.shared = dict(shared)

    @property
    def pid(self) -> int | None:
        """The pid of the server this process's ranks come from, or None before it starts."""
        return getattr(self.server, "_forkserver_pid", None)


SERVER = RankServer()


def add_preload(modules: list[str]) -> None:
    """Ask this process's forkserver to import ``modules`` once (before its first rank)."""
    SERVER.add_preload(modules)


def context() -> Any:
    return SERVER.context()


def forkserver_pid() -> int | None:
    return SERVER.pid


def _reap(pid: int, within: float) -> None:
    """Wait for child ``pid`` to end, at most ``within`` seconds (it was sent SIGKILL)."""
    deadline = time.monotonic() + within
    while True:
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                return
        except ChildProcessError:
            return  # reaped already
        if time.monotonic() >= deadline:
            return  # not reaped: a zombie until pytest exits, never a process that runs
        time.sleep(0.01)


def _report_path() -> str:
    fd, path = tempfile.mkstemp(prefix="tutorial-impl-preload-", suffix=".json")
    os.close(fd)
    os.unlink(path)  # the server writes it when done: its absence means "not yet"
    atexit.register(_remove, path)
    return path


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


class _PlannedForkServer(_mp_forkserver.ForkServer):
    """multiprocessing's ``ForkServer``, started with the session's plan in its environment.

    The server's one input besides the preload list (module names) and ``sys.path`` is the
    environment it inherits; ``forkserver.probe`` reads the plan there and removes it."""

    plan: dict[str, Any] | None = None
    # ``run_ranks`` from several threads at once (the stress test's) may all find the server
    # not yet started: one of them starts it with the plan set, the others wait for it. (Each
    # setting the variable and deleting it after, the second deletion raised KeyError.)
    _starting = threading.Lock()

    def ensure_running(self) -> None:
        with self._starting:
            if self.plan is None or self._forkserver_pid is not None:  # not starting it now
                return super().ensure_running()
            os.environ[PLAN_ENV] = json.dumps(self.plan)
            try:
                super().ensure_running()
            finally:
                del os.environ[PLAN_ENV]  # no rank's or later process's business


class _OwnForkServer:
    """What ``popen_forkserver`` calls the ``forkserver`` module, with *our* server in it.

    multiprocessing has one forkserver per process, a module-level singleton, and whoever
    starts it first decides what it preloads. A test that used a ``Pool`` or a ``DataLoader``
    with the forkserver context (the default start method from Python 3.14) before its first
    rank would get ranks from that server: without the preloads, without the death chain of
    ``forkserver.boot`` and without ``gc.freeze``. So the harness runs a ``ForkServer`` of
    its own, a second instance of multiprocessing's class, and its processes connect to that
    one; everything else (``read_signed``...) is the module's own.
    """

    def __getattr__(self, name: str) -> Any:
        if name in ("connect_to_new_process", "ensure_running", "get_inherited_fds"):
            return getattr(SERVER.server, name)  # read at each call: a fallback may replace it
        return getattr(_mp_forkserver, name)


def _own_popen() -> type:
    """``popen_forkserver.Popen``, its ``_launch`` reading ``forkserver`` as our server."""
    base = _mp_popen_forkserver.Popen
    launch = base._launch
    names = {**launch.__globals__, "forkserver": _OwnForkServer()}
    own_launch = types.FunctionType(launch.__code__, names, launch.__name__, launch.__defaults__)
    return type("RankPopen", (base,), {"_launch": own_launch, "__module__": __name__})


class _SharedForkServer(_mp_forkserver.ForkServer):
    """A client of a forkserver another process started: the xdist controller's.

    multiprocessing's ``ForkServer`` is both the server's starter and its client: the client
    part (``connect_to_new_process``) only needs the server's socket address, an "alive" fd
    to hand each child (its ``release_forkserver`` closes it at once, so any write end does:
    here one of a pipe of our own) and, from Python 3.14, the authkey of the server's
    handshake. ``ensure_running`` would start a server; here it only starts this process's
    resource tracker, whose fd every child gets (each worker keeps its own). If the server
    cannot be reached (gone, refused), this process starts a server of its own and goes on.
    """

    def __init__(self, shared: dict[str, Any]) -> None:
        super().__init__()
        self._forkserver_address = shared["address"]
        self._forkserver_pid = shared["pid"]
        if shared.get("authkey") is not None:
            self._forkserver_authkey = shared["authkey"]
        alive_r, self._forkserver_alive_fd = os.pipe()
        os.close(alive_r)  # nobody reads it: it only stands in for the owner's alive fd

    def ensure_running(self) -> None:
        _mp_resource_tracker.ensure_running()

    def connect_to_new_process(self, fds: Any) -> Any:
        try:
            return super().connect_to_new_process(fds)
        except OSError as exc:  # refused, no such socket: the controller's server is gone
            return SERVER.fall_back(exc).connect_to_new_process(fds)


class RankProcess(mp.context.ForkServerProcess):
    """A process started by the harness's own forkserver (``context``)."""

    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        return SERVER.popen(process_obj)


class _RankContext(mp.context.ForkServerContext):
    Process = RankProcess
