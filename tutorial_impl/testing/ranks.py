"""Starting rank processes fast, and what runs inside each one.

Spawning a fresh interpreter per rank costs seconds here, almost all of it ``import torch``.
So we use multiprocessing's *forkserver*: one clean, single-threaded server process is
started once per pytest session, imports torch once (the "preload"), and then forks a copy
of itself for every rank. Forking an interpreter that has already imported torch takes a few
milliseconds.

**One server per xdist session.** Under ``pytest -n N`` the xdist *controller* starts the
server before its workers exist (``start_shared_forkserver``, from the plugin's
``pytest_configure_node``) and hands each worker the server's address through
``workerinput``; a worker's ranks then come from that one server (``use_shared_forkserver``)
instead of a server of its own, saving the worker a torch import (~3 s of CPU each). A
server only forks: what a rank runs with (environment, ``sys.path``, directory, coverage)
travels in its ``RankSpec`` from the worker that asked. Its death chain has three links:
the test's supervisor kills its ranks; the server kills every rank when the controller is
gone (``forkserver_init``); and each rank watches the worker that asked for it and kills
its own process group when that worker dies (``_die_with_owner``).

Why not plain ``fork`` of the test process itself? A pytest(-xdist) process has threads
(execnet, the TCPStore server, pytest-timeout), and forking a threaded process can copy a
lock that some other thread held, deadlocking the child. It may also have initialised CUDA,
which cannot survive a fork. The forkserver is neither threaded nor touches CUDA.

Everything in this module below ``rank_main`` runs *in the rank*. Nothing here imports torch
at import time (the pytest plugin imports this module, and a plugin must not cost every pytest
run two seconds); the forkserver preloads torch, so inside a rank those imports are free.
"""

from __future__ import annotations

import ctypes
import faulthandler
import io
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import select
import signal
import sys
import threading
import time
import types
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing import forkserver as _mp_forkserver
from multiprocessing import popen_forkserver as _mp_popen_forkserver
from multiprocessing import resource_tracker as _mp_resource_tracker
from typing import Any

from tutorial_impl.testing import coverage as _coverage
from tutorial_impl.testing import debugging as _debugging
from tutorial_impl.testing import outcome as _outcome
from tutorial_impl.testing import proctable as _proctable
from tutorial_impl.testing import torchenv as _torchenv
from tutorial_impl.testing.backends import gpu_shortage, uses_nccl  # noqa: F401 (old home)
from tutorial_impl.testing.lookup import FunctionRef, resolve
from tutorial_impl.testing.rendezvous import init_method_url

# Modules every rank needs; imported once in the forkserver, so a forked rank starts warm.
# ``forkserver_init`` comes first: it stops ranks from re-running the parent's main script.
DEFAULT_PRELOAD = [
    "tutorial_impl.testing.forkserver_init",
    "torch",
    "torch.distributed",
    "torch.nn",
    __name__,
]
_preload: list[str] = list(DEFAULT_PRELOAD)
# Variables torch reads only at import, which a rank cannot re-apply (see ``torchenv``).
IMPORT_ONLY = _torchenv.IMPORT_ONLY
_context: Any = None


def add_preload(modules: list[str]) -> None:
    """Ask the forkserver to import ``modules`` once, before it forks any rank.

    Only effective before the first rank starts in this process (the server starts then).
    """
    for name in modules:
        if name not in _preload:
            _preload.append(name)


class _OwnForkServer:
    """What ``popen_forkserver`` calls the ``forkserver`` module, with *our* server in it.

    multiprocessing has one forkserver per process, a module-level singleton, and whoever
    starts it first decides what it preloads. A test that used a ``Pool`` or a ``DataLoader``
    with the forkserver context (the default start method from Python 3.14) before its first
    rank would get ranks from that server: without the preloads, without the death chain of
    ``forkserver_init`` and without ``gc.freeze``. So the harness runs a ``ForkServer`` of
    its own, a second instance of multiprocessing's class, and its processes connect to that
    one; everything else (``read_signed``...) is the module's own.
    """

    def __getattr__(self, name: str) -> Any:
        if name in ("connect_to_new_process", "ensure_running", "get_inherited_fds"):
            return getattr(_server, name)  # read at each call: a fallback may replace it
        return getattr(_mp_forkserver, name)


def _own_popen() -> type:
    """``popen_forkserver.Popen``, its ``_launch`` reading ``forkserver`` as our server."""
    base = _mp_popen_forkserver.Popen
    launch = base._launch
    names = {**launch.__globals__, "forkserver": _OwnForkServer()}
    own_launch = types.FunctionType(launch.__code__, names, launch.__name__, launch.__defaults__)
    return type("RankPopen", (base,), {"_launch": own_launch, "__module__": __name__})


_rank_popen: Any = None
_server: Any = None  # the harness's ForkServer, once ``context`` has made it
_shared: dict[str, Any] | None = None  # an xdist worker: the controller's server to use
# The key of ``workerinput`` (xdist's dict sent from the controller to each worker).
WORKERINPUT_KEY = "tutorial_impl_forkserver"


class ForkServerFallbackWarning(RuntimeWarning):
    """The xdist controller's rank forkserver could not be reached; this worker started
    one of its own (the run goes on, at the cost of one more torch import)."""


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
            return _fall_back(exc).connect_to_new_process(fds)


def _fall_back(exc: OSError) -> Any:
    """Replace the unreachable shared server by one of this process's own; say so once."""
    global _server, _shared
    _shared = None
    _server = _own_server()
    with warnings.catch_warnings():  # a warning, never an error (-W error): the run goes on
        warnings.simplefilter("default")
        warnings.warn(
            f"the xdist controller's rank forkserver could not be reached ({exc}); this "
            "worker starts a forkserver of its own",
            ForkServerFallbackWarning,
            stacklevel=2,
        )
    return _server


def _own_server() -> Any:
    """A new, not yet started ``ForkServer`` with the harness's preload."""
    server = _mp_forkserver.ForkServer()
    # Ranks measure coverage when we do (see ``coverage``); then import it once, there.
    measuring = ["coverage"] if _coverage.parent_settings() is not None else []
    # Keep '__main__' out of the preload: under pytest it is pytest's own entry point.
    # ``forkserver_ready`` goes last: it freezes everything the others imported.
    server.set_forkserver_preload([*_preload, *measuring, "tutorial_impl.testing.forkserver_ready"])
    return server


def forkserver_pid() -> int | None:
    """The pid of the forkserver this process's ranks come from (under xdist, the one the
    controller started and every worker shares), or None before it has started."""
    return getattr(_server, "_forkserver_pid", None)


class RankProcess(mp.context.ForkServerProcess):
    """A process started by the harness's own forkserver (``context``)."""

    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        return _rank_popen(process_obj)


class _RankContext(mp.context.ForkServerContext):
    Process = RankProcess


def context() -> Any:
    """The multiprocessing context ranks are started with: our own forkserver, lazily (in an
    xdist worker given the controller's, a client of that one)."""
    global _context, _server, _rank_popen
    if _context is None:
        _server = _SharedForkServer(_shared) if _shared is not None else _own_server()
        _rank_popen = _own_popen()
        _context = _RankContext()
    return _context


def start_shared_forkserver() -> dict[str, Any]:
    """In the xdist controller: start the rank forkserver now; what a worker needs to use it.

    ``ensure_running`` returns as soon as the server process is spawned: its listening socket
    exists already (the starter binds it), and the server accepts on it once its preload is
    imported, so a worker that asks for a rank earlier just waits in the socket's queue. The
    controller keeps the server's "alive" fd: the server exits when the controller is gone.
    Address, pid and authkey (Python 3.14+) are plain values: they travel in ``workerinput``.
    """
    context()
    _server.ensure_running()
    return {
        "address": _server._forkserver_address,
        "pid": _server._forkserver_pid,
        "authkey": getattr(_server, "_forkserver_authkey", None),
    }


def use_shared_forkserver(shared: dict[str, Any]) -> None:
    """In an xdist worker, before its first rank: take ranks from the controller's server
    (``start_shared_forkserver``'s answer) instead of starting one of its own."""
    global _shared
    if _context is None:  # a server already in use (an in-process pytester run) stays
        _shared = dict(shared)


@dataclass
class RankSpec:
    """Everything one rank needs, sent to it by pickle. The function travels *by name*."""

    rank: int
    world_size: int
    function: FunctionRef
    payload: bytes  # pickle of (args, kwargs): unpickled inside the rank, errors reported
    env: dict[str, str]
    log_path: str
    stack_path: str
    backend: str | None = "gloo"  # None: the function initialises what it needs itself
    init_method: str = "env"
    tmp_dir: str | None = None
    timeout: float = 60.0
    extra: dict[str, Any] = field(default_factory=dict)
    # The parent's environment, import path and working directory at the call (the
    # forkserver's date from its start: a variable a test set since then, or the directory
    # of a test file pytest put on sys.path since then, would otherwise be missing).
    parent_env: dict[str, str] | None = None
    parent_path: list[str] | None = None
    parent_cwd: str | None = None
    coverage: dict[str, Any] | None = None  # the parent's coverage settings, if measuring
    owner_pid: int | None = None  # the process that asked for the rank: it dies with it


# ---------------------------------------------------------------------------------------
# Inside the rank
# ---------------------------------------------------------------------------------------


def release_forkserver() -> None:
    """Close this rank's copy of the forkserver's "alive" pipe.

    multiprocessing gives every forkserver child the write end of the pipe the server
    watches for EOF, so the server would only exit once its owner *and all its children*
    are gone. A hanging rank would then keep the server alive after pytest was killed, and
    the server keep the rank alive (see ``_die_with_parent``): an orphan forever.
    """
    # Inside the server's children, the module's singleton is the one the server filled in.
    server = getattr(_mp_forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        os.close(fd)
        server._forkserver_alive_fd = None  # type: ignore[union-attr]


def _die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this rank when its parent (the forkserver) dies.

    The forkserver exits as soon as the pytest process that started it is gone, even after a
    SIGKILL (once ranks have released its "alive" pipe), killing the ranks' process groups
    on its way out (``forkserver_init``); this is the backstop for a rank that was still
    starting then. ``parent`` is the pid read before prctl, to close the race.
    """
    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _die_with_owner(owner: int | None) -> None:
    """Kill this rank's process group as soon as ``owner`` (the process that asked for the
    rank: a pytest process, an xdist worker) is gone.

    ``_die_with_parent`` ties the rank to the forkserver, and the forkserver lives as long
    as *its* owner; under xdist that is the controller, shared by every worker, so a worker
    SIGKILLed while its ranks hang would leave them running. So a daemon thread waits for
    the owner: on a pidfd (Linux 5.3+: it becomes readable when the process exits, even
    while it is an unreaped zombie), else by polling every half second. A daemon thread
    blocked in ``poll`` holds no lock and no GIL, and warm worlds' leftover checks ignore
    daemon threads (and this one starts before their baseline anyway).
    """
    if owner is None:
        return
    threading.Thread(
        target=_watch_owner, args=(owner,), name="rank-owner-watch", daemon=True
    ).start()


def _watch_owner(owner: int) -> None:
    try:
        pidfd = os.pidfd_open(owner)
    except ProcessLookupError:
        pass  # gone already
    except (AttributeError, OSError):  # no pidfd here: poll (a zombie counts as gone)
        while _proctable.running(owner):
            time.sleep(0.5)
    else:
        waiter = select.poll()  # not select.select: that refuses an fd number above 1023
        waiter.register(pidfd, select.POLLIN)
        while not waiter.poll():  # an empty answer only if a signal woke it: wait again
            pass
    os.killpg(0, signal.SIGKILL)  # this rank leads its group: it and all it started


def _redirect_output(spec: RankSpec) -> None:
    """Point this rank's fd 1 and 2 at its own log file (C++ and subprocess output too)."""
    fd = os.open(spec.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # Line buffering keeps stdout and stderr lines in the order they were written.
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]


class _CpuPickler(pickle.Pickler):
    """Pickles every tensor as its CPU copy, however deeply it is nested in the result.

    A rank's GPU is its own (and gone once the rank is killed): unpickling a CUDA tensor in
    the parent would put it on the parent's GPU, or fail on a machine the parent sees no
    GPU of. So returned tensors arrive on the CPU, whatever device they were on.
    """

    def reducer_override(self, obj: Any) -> Any:
        import torch

        if isinstance(obj, torch.Tensor) and obj.device.type not in ("cpu", "meta"):
            return obj.cpu().__reduce_ex__(pickle.DEFAULT_PROTOCOL)
        return NotImplemented


def dumps_on_cpu(obj: Any) -> bytes:
    """``obj`` pickled, every tensor in it as its CPU copy (see ``_CpuPickler``)."""
    import torch

    if not torch.cuda.is_initialized():  # no GPU tensor can exist: the fast plain pickle
        return pickle.dumps(obj)
    buffer = io.BytesIO()
    _CpuPickler(buffer).dump(obj)
    return buffer.getvalue()


def init_process_group(spec: RankSpec) -> None:
    """Join the process group of the test with the requested backend and init method."""
    import torch
    import torch.distributed as dist

    assert spec.backend is not None
    if uses_nccl(spec.backend):
        # One GPU per rank, chosen before NCCL initialises; never two ranks on one GPU.
        shortage = gpu_shortage(spec.backend, spec.world_size, torch.cuda.device_count())
        if shortage:
            raise RuntimeError(shortage)
        torch.cuda.set_device(spec.rank)
    dist.init_process_group(
        backend=spec.backend,
        init_method=init_method_url(spec.init_method, spec.tmp_dir),
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=spec.timeout),
    )


def enter_rank(spec: RankSpec) -> dict[str, str]:
    """A rank's first steps, for a fresh rank and a warm one alike: its own process group,
    the death chain, its log and stack files. Returns the environment torch was imported
    with (the forkserver's), for ``torchenv``."""
    parent = os.getppid()
    os.setpgid(0, 0)  # own process group: the parent can kill the rank *and* its children
    release_forkserver()
    _die_with_parent(parent)
    _die_with_owner(spec.owner_pid)
    imported_with = dict(os.environ)  # the forkserver's: what torch saw at import
    take_task(spec)
    import torch

    torch.set_num_threads(1)  # N ranks on 2 cores: oversubscription costs more than it buys
    return imported_with


def take_task(spec: RankSpec) -> None:
    """Point output, stack dumps, environment, path and directory at ``spec``'s run.

    A warm rank (``warm``) calls this again for every test it serves: each test has its own
    log and stack files, and sees the parent's environment as it is at that test's call.
    """
    _redirect_output(spec)
    stacks = open(spec.stack_path, "w")  # noqa: SIM115 - must stay open for faulthandler
    faulthandler.enable(file=stacks, all_threads=True)  # segfaults, aborts
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)  # the deadline
    global _stacks
    if _stacks is not None:
        _stacks.close()
    _stacks = stacks
    if spec.parent_env is not None:
        os.environ.clear()
        os.environ.update(spec.parent_env)
    os.environ.update(spec.env)
    if spec.parent_path is not None:
        sys.path[:] = spec.parent_path
    if spec.parent_cwd is not None:
        try:
            os.chdir(spec.parent_cwd)
        except OSError:
            pass  # the parent's directory is gone; the forkserver's will do


_stacks: Any = None  # the open stack file faulthandler writes to


def run_task(spec: RankSpec, imported_with: dict[str, str], join_group: bool) -> bytes:
    """Run ``spec``'s function in this rank; the pickled outcome to report.

    ``join_group``: join the process group first (a fresh rank; a warm one is in its
    world's group already)."""
    debugging = _debugging.Debugging(spec.rank, os.path.dirname(spec.log_path))
    if _debugging.debug_rank() is not None:
        spec.timeout = _debugging.HOLD  # hold every rank while one is debugged
    cov = None
    try:
        cov = _coverage.start_in_rank(spec.coverage)
        fn = resolve(spec.function)
        args, kwargs = pickle.loads(spec.payload)
        _torchenv.apply_in_rank(imported_with, spec.env)  # before any group: torchenv
        if join_group and spec.backend is not None:
            init_process_group(spec)
        value = fn(spec.rank, spec.world_size, *args, **kwargs)
        try:
            message = dumps_on_cpu(_outcome.Returned(value))
        except Exception as exc:  # noqa: BLE001
            message = pickle.dumps(
                _outcome.unpicklable("returned a value that cannot be pickled", exc)
            )
    except BaseException as exc:  # noqa: BLE001 - everything must be reported, even exit()
        try:
            debugging.post_mortem(exc)  # only in the rank being debugged
        except BaseException:  # noqa: BLE001 - the debugger went away: report the error
            pass
        message = pickle.dumps(_outcome.from_exception(exc))
    _coverage.save(cov)  # before reporting: once we have reported, we may be killed any time
    sys.stdout.flush()
    sys.stderr.flush()
    return message


def rank_main(spec: RankSpec, conn: multiprocessing.connection.Connection) -> None:
    """The body of every rank process. Reports exactly one message, then waits to be killed."""
    try:
        message = run_task(spec, enter_rank(spec), join_group=True)
        conn.send_bytes(message)
        conn.close()
        # Stay alive, group and sockets intact, until the parent SIGKILLs us, which it does
        # as soon as every rank has reported (or one has failed). A rank that left early could
        # reset a connection a slower peer still reads from (gloo, RPC), and tearing the group
        # down here (destroy_process_group, ~10 ms per peer in gloo) would only add latency.
        while True:
            signal.pause()
    finally:
        # Never run interpreter teardown: atexit hooks of torch/gloo can block on peers.
        os._exit(0)
