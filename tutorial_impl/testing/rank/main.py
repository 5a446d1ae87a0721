"""What runs inside a rank: its first steps, one task, and its main loop.

A rank is forked from the harness's forkserver (``forkserver``) and runs ``rank_main`` (a
fresh rank) or ``warm.warm_rank_main`` (a warm one); both take the same steps here:
``enter_rank`` (its own process group, the death chain, its log and stack files), then
``run_task`` per test (the function, through the one capture of every strategy:
``outcome.capture``). Nothing here imports torch at import time; the forkserver preloads
torch, so inside a rank those imports are free.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import io
import multiprocessing.connection
import os
import pickle
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from tutorial_impl.testing import proctable
from tutorial_impl.testing.backends import gpu_shortage, uses_nccl
from tutorial_impl.testing.diagnose import records
from tutorial_impl.testing.faults import group, inject
from tutorial_impl.testing.forkserver import server as rank_server
from tutorial_impl.testing.rank import coverage, leftovers, outcome, torchenv
from tutorial_impl.testing.rank import debugging as _debugging
from tutorial_impl.testing.rank.caught import Catcher
from tutorial_impl.testing.rank.lookup import resolve
from tutorial_impl.testing.rank.shape import arguments
from tutorial_impl.testing.rank.spec import RankSpec
from tutorial_impl.testing.rendezvous import harness_view, init_method_url
from tutorial_impl.testing.settings.timing import FORK_GRACE, group_timeout


def release_forkserver() -> None:
    """Close this rank's copy of the forkserver's "alive" pipe.

    multiprocessing gives every forkserver child the write end of the pipe the server
    watches for EOF, so the server would only exit once its owner *and all its children*
    are gone. A hanging rank would then keep the server alive after pytest was killed, and
    the server keep the rank alive (see ``die_with_parent``): an orphan forever.
    """
    # Inside the server's children, the module's singleton is the one the server filled in.
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        os.close(fd)
        server._forkserver_alive_fd = None  # type: ignore[union-attr]


def die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this rank when its parent (the forkserver) dies.

    The forkserver exits as soon as the pytest process that started it is gone, even after a
    SIGKILL (once ranks have released its "alive" pipe), killing the ranks' process groups
    on its way out (``forkserver.boot``); this is the backstop for a rank that was still
    starting then. ``parent`` is the pid read before prctl, to close the race.
    """
    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    leftovers.prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _die_with_owner(owner: int | None) -> None:
    """Kill this rank's process group as soon as ``owner`` (the process that asked for the
    rank: a pytest process, an xdist worker) is gone.

    ``die_with_parent`` ties the rank to the forkserver, and the forkserver lives as long
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
        while proctable.running(owner):
            time.sleep(0.5)
    else:
        waiter = select.poll()  # not select.select: that refuses an fd number above 1023
        waiter.register(pidfd, select.POLLIN)
        while not waiter.poll():  # an empty answer only if a signal woke it: wait again
            pass
    os.killpg(0, signal.SIGKILL)  # this rank leads its group: it and all it started


def _redirect_output(spec: RankSpec) -> None:
    """Point this rank's fd 1 and 2 at its own log file (C++ and subprocess output too)."""
    fd = os.open(spec.files.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # Line buffering keeps stdout and stderr lines in the order they were written.
    for stream in (sys.stdout, sys.stderr):  # a warm rank's are, from its first test on
        if not stream.line_buffering:  # type: ignore[union-attr]
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]


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
    """Join the process group of the test with the requested backend and init method, on
    the harness's store (``spec.harness_env``, set only meanwhile: ``rendezvous``)."""
    import torch
    import torch.distributed as dist

    assert spec.backend is not None
    if uses_nccl(spec.backend):
        # One GPU per rank, chosen before NCCL initialises; never two ranks on one GPU.
        shortage = gpu_shortage(spec.backend, spec.world_size, torch.cuda.device_count())
        if shortage:
            raise RuntimeError(shortage)
        torch.cuda.set_device(spec.rank)
    backend = spec.backend
    if spec.faults and backend == "gloo":  # the plan needs its collectives: gloo behind it
        backend = group.BACKEND
    # torch's store barrier after the group is made (TORCH_DIST_INIT_BARRIER): no rank runs
    # the user's function before every rank's group is whole. Without it, rank 0's code
    # that destroyed the group at once (a library's setup_ddp) cut rank 1's gloo connect.
    with harness_view({**spec.harness_env, "TORCH_DIST_INIT_BARRIER": "1"}):
        dist.init_process_group(
            backend=backend,
            init_method=init_method_url(spec.init_method, spec.tmp_dir),
            rank=spec.rank,
            world_size=spec.world_size,
            timeout=group_timeout(spec.timeout),  # behind the harness deadline: see timing
        )


def enter_rank(spec: RankSpec) -> dict[str, str]:
    """A rank's first steps, for a fresh rank and a warm one alike: its own process group,
    the death chain, its log and stack files. Returns the environment torch was imported
    with (the forkserver's), for ``torchenv``."""
    parent = os.getppid()
    os.setpgid(0, 0)  # own process group: the parent can kill the rank *and* its children
    release_forkserver()
    die_with_parent(parent)
    leftovers.allow_children(spec.start_method)  # DataLoader workers, pools: ``leftovers``
    leftovers.become_subreaper()
    if spec.forkserver is not None:  # a nested run_ranks takes its ranks from the same server
        rank_server.SERVER.use_shared(spec.forkserver)
    records.serve()  # before any other thread: see ``records``
    _die_with_owner(spec.owner_pid)
    imported_with = torchenv.read_at_import()  # the forkserver's: what torch saw at import
    take_task(spec)
    import torch

    torch.set_num_threads(1)  # N ranks on 2 cores: oversubscription costs more than it buys
    group.register()
    return imported_with


def take_task(spec: RankSpec) -> None:
    """Point output, stack dumps, environment, path and directory at ``spec``'s run.

    A warm rank (``warm``) calls this again for every test it serves: each test has its own
    log and stack files, and sees the parent's environment as it is at that test's call.
    """
    _redirect_output(spec)
    records.answer_to(spec.files.records)
    stacks = open(spec.files.stacks, "w")  # noqa: SIM115 - must stay open for faulthandler
    faulthandler.enable(file=stacks, all_threads=True)  # segfaults, aborts
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)  # the deadline
    if _open.get("stacks") is not None:
        _open["stacks"].close()
    _open["stacks"] = stacks
    _replace_environ(spec.parent_env, spec.env)
    if spec.parent_path is not None:
        sys.path[:] = spec.parent_path
    if spec.parent_cwd is not None:
        try:
            os.chdir(spec.parent_cwd)
        except OSError:
            pass  # the parent's directory is gone; the forkserver's will do


def _replace_environ(parent: dict[bytes, bytes] | None, env: dict[str, str]) -> None:
    """Make the environment ``parent``'s (None: this process's own) with ``env`` over it,
    touching only the variables that differ (``clear`` then ``update`` cost a warm rank
    ~0.3 ms a test: a ``putenv`` per variable, twice). Compared as the OS holds them, bytes
    to bytes: decoding a hundred variables took a fresh rank 0.2 ms of CPU."""
    environ, now = os.environb, torchenv.environ_bytes()
    target = dict(now if parent is None else parent)
    target.update((os.fsencode(name), os.fsencode(value)) for name, value in env.items())
    for name in now.keys() - target.keys():
        del environ[name]
    for name, value in target.items():
        if now.get(name) != value:
            environ[name] = value


_open: dict[str, Any] = {}  # this rank's open stack file, which faulthandler writes to


def run_task(
    spec: RankSpec,
    imported_with: dict[str, str],
    join_group: bool,
    send: Callable[[bytes], None],
    baseline: Any = None,
) -> outcome.Report:
    """Run ``spec``'s function in this rank and ``send`` its pickled ``outcome.Report``;
    return it.

    ``join_group``: join the process group first (a fresh rank; a warm one is in its
    world's group already). A child the function forked that comes back here sends its
    report (a failure of this rank: see ``outcome.capture``) and ends at once.
    ``baseline`` (a warm rank's ``reuse.Baseline``) refreshes its snapshot right before the
    function; the warm rank checks against it once the report is sent (``strategies.warm.loop``)."""
    rank_pid = os.getpid()
    debugging = _debugging.Debugging(spec.rank, spec.files.debugging, spec.timeout)
    if _debugging.debug_rank() is not None:
        spec.timeout = _debugging.HOLD  # hold every rank while one is debugged
    cov = coverage.start_in_rank(spec.coverage)
    catcher = Catcher(spec.warning_filters)
    report = outcome.capture(
        _set_up_and_call,
        spec.rank,
        (spec,),
        {
            "imported_with": imported_with,
            "join_group": join_group,
            "baseline": baseline,
            "catcher": catcher,
        },
        on_error=debugging.post_mortem,
        catcher=catcher,
    )
    if os.getpid() != rank_pid:  # a forked child of the rank function: report and go
        send(pickle.dumps(report))
        os._exit(1)
    if report.forked:  # their reports first, if they come back
        proctable.wait_for_forked_copies(FORK_GRACE)
    killed = leftovers.kill_leftovers()
    # Quiet: said by a fresh rank, which its parent kills next (a warm one lives on).
    if killed or (baseline is None and catcher.none_running()):
        report = dataclasses.replace(report, killed=killed, quiet=not killed)
    try:
        message = dumps_on_cpu(report)
    except Exception as exc:  # noqa: BLE001
        failure = outcome.unpicklable("returned a value that cannot be pickled", exc)
        message = pickle.dumps(dataclasses.replace(report, outcome=failure, forked=False))
    coverage.save(cov)  # before reporting: once we have reported, we may be killed any time
    sys.stdout.flush()
    sys.stderr.flush()
    send(message)
    return report


def _set_up_and_call(
    spec: RankSpec,
    imported_with: dict[str, str],
    join_group: bool,
    baseline: Any,
    catcher: Catcher,
) -> Any:
    """What ``capture`` runs: find the function, join the group, call it in its shape
    (``shape``; a warm rank's ``baseline`` snapshot taken right before the call, and the
    test's warning filters applied to the call alone: what the harness did is not the
    test's)."""
    fn = resolve(spec.function)
    args, kwargs = arguments(spec.payload, spec.rank_params, spec.rank, spec.world_size)
    torchenv.apply_in_rank(imported_with, spec.env)  # before any group: torchenv
    # Before any group, on every task (no plan: disarmed; a warm world counts from 1 again).
    inject.arm(spec.faults, spec.rank, report_to=spec.files.fault)
    if join_group and spec.backend is not None:
        init_process_group(spec)
    if baseline is not None:
        baseline.refresh()
    with catcher.recording():
        value = fn(*args, **kwargs)
    inject.report_unfired(spec.faults)  # returned: a fault never reached fails the test
    return value


def rank_main(spec: RankSpec, conn: multiprocessing.connection.Connection) -> None:
    """The body of every rank process. Reports exactly one message, then waits to be killed."""
    try:
        run_task(spec, enter_rank(spec), join_group=True, send=conn.send_bytes)
        # Stay alive, group and sockets intact, until the parent SIGKILLs us, which it does
        # as soon as every rank has reported (or one has failed). A rank that left early could
        # reset a connection a slower peer still reads from (gloo, RPC), and tearing the group
        # down here (destroy_process_group, ~10 ms per peer in gloo) would only add latency.
        while True:
            signal.pause()
    finally:
        # Never run interpreter teardown: atexit hooks of torch/gloo can block on peers.
        os._exit(0)
