"""Running a function on N ranks and waiting for them, with deadlines and no leftovers.

``run_ranks(fn, *args, world_size=2)`` starts the ranks, waits for each one to report, and
returns their return values in rank order. The waiting is where multi-rank tests usually go
wrong, so here are the rules this module keeps:

* **Fail fast.** The first rank that raises, skips or dies ends the wait; the others are
  killed at once, since they are probably blocked in a collective waiting for it.
* **Crashes are seen at once.** We wait on each process's *sentinel* (a file descriptor that
  becomes readable when the process exits) together with its result pipe, so a rank killed by
  a signal or by ``os._exit`` is noticed immediately rather than at a timeout.
* **Every wait has a deadline.** When it expires, each live rank gets SIGUSR1, which its
  ``faulthandler`` answers by writing the Python stack of every thread; we put those stacks in
  the error, then kill the ranks. The same happens to the other ranks when one fails, so the
  report says where they were (``forensics``), at a cost of ~0.1 s (at most 1 s).
* **Nothing outlives the call.** A ``finally`` sends SIGKILL to every rank's process group
  (the rank and anything it started), whatever happened, Ctrl-C included; see
  ``forkserver_init.py`` for the case where *we* are killed.
"""

from __future__ import annotations

import atexit
import os
import pickle
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, TextIO

from tutorial_impl.testing import backends, forensics
from tutorial_impl.testing import coverage as _coverage
from tutorial_impl.testing import debugging as _debugging
from tutorial_impl.testing import outcome as _o
from tutorial_impl.testing import ranks as _ranks
from tutorial_impl.testing.config import DEFAULT_DEADLINE, DEFAULT_INIT_METHOD, DEFAULT_WORLD_SIZE
from tutorial_impl.testing.errors import (
    RankExited,
    RankResults,
    error_for,
    prefixed,
    timeout_error,
)
from tutorial_impl.testing.lookup import FunctionRef, function_ref
from tutorial_impl.testing.rendezvous import INIT_METHODS, AgentStore

DEFAULT_TIMEOUT = DEFAULT_DEADLINE  # the old name, kept for importers
# c10d's warning when it cannot name a peer for a log message (rendezvous.py explains why
# that lookup may be refused); it says nothing about the test, so rank output omits it.
_DNS_NOISE = "[c10d] The hostname of the client socket cannot be retrieved"
_live: dict[int, Any] = {}  # pid -> Process, for the last-resort cleanup at exit


@dataclass
class _Rank:
    rank: int
    process: Any
    conn: Connection
    log_path: Path
    stack_path: Path
    outcome: _o.Outcome | None = None
    streamed: int = field(default=0)

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def output(self) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        if _DNS_NOISE in text:
            text = "".join(x for x in text.splitlines(True) if _DNS_NOISE not in x)
        return text


def _kill_pid(pid: int) -> None:
    """SIGKILL the process group a rank leads (the rank and anything it started)."""
    for kill, target in ((os.killpg, pid), (os.kill, pid)):
        try:
            kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _kill(r: _Rank) -> None:
    # Even a rank that has already exited may have left children in its process group
    # (the group outlives its leader), so its group is always killed. Its pid cannot have
    # been reused yet: a live process group keeps its id from being handed out again.
    if r.process.pid is not None:
        _kill_pid(r.process.pid)


def _release(ranks: list[_Rank]) -> None:
    """Let go of ranks that have been sent SIGKILL.

    SIGKILL cannot be caught or ignored: from here on a rank runs no more code, and the
    kernel tears it down. Its parent, the forkserver, reaps it. Waiting here for each exit
    would only add the milliseconds a torch-sized process takes to unmap to every test.
    """
    for r in ranks:
        _live.pop(r.process.pid, None)
        r.conn.close()


@atexit.register
def kill_all() -> None:
    """Kill every rank this process started that is still alive (interpreter exit)."""
    for pid in list(_live):
        _kill_pid(pid)
        _live.pop(pid, None)


def _relay(ranks: list[_Rank], stream: TextIO, prefix: bool) -> None:
    """Copy complete new lines of each rank's log to ``stream`` (live output for the CLI)."""
    for r in ranks:
        text = r.output()
        end = text.rfind("\n", r.streamed) + 1
        if end > r.streamed:
            chunk = text[r.streamed : end]
            r.streamed = end
            stream.write(prefixed(r.rank, chunk, 10**9) + "\n" if prefix else chunk)
            stream.flush()


def run_ranks(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = DEFAULT_WORLD_SIZE,
    backend: str | None = "gloo",
    init_method: str = DEFAULT_INIT_METHOD,
    timeout: float = DEFAULT_DEADLINE,
    fn_kwargs: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    log_dir: str | os.PathLike[str] | None = None,
    stream: TextIO | None = None,
    stream_prefix: bool = True,
    may_exit: Collection[int] = (),
    debug_rank: int | None = None,
) -> RankResults:
    """Run ``fn(rank, world_size, *args, **fn_kwargs)`` on ``world_size`` fresh ranks.

    With ``backend`` set (the default, ``"gloo"``) each rank has joined a process group with
    that backend through ``init_method`` (``env``, ``tcp`` or ``file``) before ``fn`` runs,
    and leaves it afterwards. With ``backend=None`` the ranks start with only the rendezvous
    environment (MASTER_ADDR, RANK, ...) and ``fn`` sets up what it needs: several groups,
    RPC, roles. ``timeout`` is the deadline for the whole run, in seconds.

    Returns the return values in rank order; raises ``RankFailed``, ``RankCrashed``,
    ``RankTimeout`` or ``RankSkipped``. ``stream`` relays the ranks' output while they run.

    ``may_exit`` names ranks whose death is part of the test (a server that fails on
    purpose): such a rank may end without reporting, by ``os._exit`` or a signal, and the
    run goes on. Its entry in the results is then a ``RankExited`` (rank, exit code, how),
    while the other ranks run to their own end, within the same deadline, and everything
    is killed at the end as usual. A rank outside ``may_exit`` that dies still fails the
    run at once, and a rank in it that raises still fails it too.

    ``debug_rank=N`` debugs rank N: its ``breakpoint()`` and the post-mortem of its exception
    wait on a local port for ``python -m tutorial_impl.testing.attach PORT``, the other ranks
    are held, and the deadline is paused meanwhile (see ``debugging``).
    """
    __tracebackhide__ = True
    call = prepare(fn, args, fn_kwargs, world_size, backend, init_method, timeout, env, may_exit)
    debug_env = _debugging.check_rank(debug_rank, world_size)
    own_dir = log_dir is None
    work = Path(tempfile.mkdtemp(prefix="ranks-") if own_dir else log_dir)  # type: ignore[arg-type]
    work.mkdir(parents=True, exist_ok=True)
    _debugging.forget(work)  # an earlier run's debugger files would pause this deadline
    store = AgentStore(timeout=timeout)
    ctx = _ranks.context()
    started: list[_Rank] = []
    try:
        for rank in range(world_size):
            spec = task_spec(call, rank, work, store.rank_env(rank, world_size), debug_env)
            reader, writer = ctx.Pipe(duplex=False)
            process = ctx.Process(target=_ranks.rank_main, args=(spec, writer), daemon=True)
            process.start()
            writer.close()  # only the rank holds the write end: EOF then means it is gone
            _live[process.pid] = process
            started.append(_Rank(rank, process, reader, Path(spec.log_path), Path(spec.stack_path)))
        return _supervise(
            started,
            _debugging.Deadline(timeout, work),
            timeout,
            stream,
            stream_prefix,
            call.may_exit,
        )
    finally:
        # Every rank that is still there is either done (it reported and now waits to be
        # killed) or no longer needed: kill them all, then collect their exit statuses.
        for r in started:
            _kill(r)
        _release(started)
        store.close()
        if own_dir:
            shutil.rmtree(work, ignore_errors=True)


@dataclass(frozen=True)
class Call:
    """One ``run_ranks`` call, checked: what every rank's spec is made from (``task_spec``).

    The fresh path (``run_ranks``) and the warm one (``warm``) both start here, so a call
    is checked, and its function and arguments travel, the same way in both."""

    function: FunctionRef
    payload: bytes
    world_size: int
    backend: str | None
    init_method: str
    timeout: float
    env: dict[str, str]
    may_exit: frozenset[int]
    coverage: dict[str, Any] | None


def prepare(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    fn_kwargs: dict[str, Any] | None,
    world_size: int,
    backend: str | None,
    init_method: str,
    timeout: float,
    env: dict[str, str] | None,
    may_exit: Collection[int] = (),
) -> Call:
    """Check a call's arguments (a ValueError or TypeError naming the problem) and pickle
    what the ranks need."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if init_method not in INIT_METHODS:
        raise ValueError(f"unknown init method {init_method!r}; expected one of {INIT_METHODS}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be positive: a number of seconds, got {timeout!r}")
    backends.check(backend)
    refusal = backends.mpi_refusal(backend, world_size)
    if refusal:
        raise ValueError(refusal)
    expected_exits = _check_ranks(may_exit, world_size)
    _check_gpus(backend, world_size, env)
    ref = function_ref(fn)
    try:
        payload = pickle.dumps((args, fn_kwargs or {}))
    except Exception as exc:
        raise TypeError(f"arguments for {ref.qualname} cannot be sent to the ranks: {exc}") from exc
    return Call(
        ref,
        payload,
        world_size,
        backend,
        init_method,
        timeout,
        dict(env or {}),
        expected_exits,
        _coverage.parent_settings(),
    )


def task_spec(
    call: Call,
    rank: int,
    work: Path,
    rank_env: dict[str, str],
    extra_env: dict[str, str] | None = None,
) -> _ranks.RankSpec:
    """What rank ``rank`` runs for ``call``, its files in ``work``. Its environment, last
    word first: ``extra_env`` (the debugger's), the caller's ``env``, ``rank_env`` (the
    rendezvous), the parent's own."""
    return _ranks.RankSpec(
        rank=rank,
        world_size=call.world_size,
        function=call.function,
        payload=call.payload,
        env={**rank_env, **call.env, **(extra_env or {})},
        log_path=str(work / f"rank{rank}.log"),
        stack_path=str(work / f"rank{rank}.stacks"),
        backend=call.backend,
        init_method=call.init_method,
        tmp_dir=str(work),
        timeout=call.timeout,
        parent_env=dict(os.environ),
        parent_path=list(sys.path),
        parent_cwd=os.getcwd(),
        coverage=call.coverage,
        owner_pid=os.getpid(),
    )


def _check_ranks(may_exit: Collection[int], world_size: int) -> frozenset[int]:
    """``may_exit`` as a set, or a ValueError naming what is not a rank of this world."""
    if isinstance(may_exit, (str, bytes)) or not isinstance(may_exit, Collection):
        raise ValueError(f"may_exit must be a collection of ranks, got {may_exit!r}")
    bad = [r for r in may_exit if type(r) is not int or not 0 <= r < world_size]
    if bad:
        raise ValueError(f"may_exit names {bad!r}, not ranks of a world of {world_size}")
    return frozenset(may_exit)


def _check_gpus(backend: str | None, world_size: int, env: dict[str, str] | None) -> None:
    """Refuse, in the parent, more NCCL ranks than GPUs (ranks check again: see ranks.py)."""
    if not backends.uses_nccl(backend) or "CUDA_VISIBLE_DEVICES" in (env or {}):
        return  # the ranks see other GPUs than we do: they will judge for themselves
    import torch

    shortage = backends.gpu_shortage(backend, world_size, torch.cuda.device_count())
    if shortage:
        raise ValueError(shortage)


def _supervise(
    ranks: list[_Rank],
    deadline: _debugging.Deadline,
    timeout: float,
    stream: TextIO | None,
    prefix: bool,
    may_exit: frozenset[int] = frozenset(),
) -> RankResults:
    __tracebackhide__ = True
    pending = {r.rank: r for r in ranks}
    by_handle: dict[Any, _Rank] = {}
    for r in ranks:
        by_handle[r.conn] = r
        by_handle[r.process.sentinel] = r
    while pending:
        remaining = deadline.remaining()  # paused while a rank is being debugged
        if remaining <= 0:
            alive = [r for r in pending.values() if r.process.exitcode is None]
            stacks = forensics.dump_stacks(alive)
            for r in ranks:
                _kill(r)
            where = {rank: forensics.where(text) for rank, text in stacks.items()}
            for rank in pending:
                ranks[rank].outcome = _o.TimedOut(where.get(rank, ""))
            raise timeout_error(list(pending), timeout, stacks, _outputs(ranks), where)
        handles = [h for r in pending.values() for h in (r.conn, r.process.sentinel)]
        ready = wait(handles, timeout=min(remaining, 0.1) if stream else remaining)
        if stream is not None:
            _relay(ranks, stream, prefix)
        for handle in ready:
            r = by_handle[handle]
            if r.rank not in pending:
                continue
            r.outcome = _receive(r)
            del pending[r.rank]
            if isinstance(r.outcome, _o.Died) and r.rank in may_exit:
                # part of the test: the rank's place in the results says how it ended
                r.outcome = _o.Returned(RankExited(r.rank, r.outcome.exitcode, r.outcome.how))
                continue
            if isinstance(r.outcome, _o.Raised):
                unexpected = {k: p for k, p in pending.items() if k not in may_exit}
                r = _crashed_peer(unexpected) or r
            if not isinstance(r.outcome, _o.Returned):
                # Where were the others? Asked before they are killed (not for a skip).
                quiet = isinstance(r.outcome, (_o.Skipped, _o.XFailed))
                stacks = {} if quiet else _where_the_others_were(pending, r)
                for other in ranks:
                    _kill(other)  # fail fast: the others may wait for this rank forever
                if stream is not None:
                    _relay(ranks, stream, prefix)
                _raise_for(r, ranks, stacks)
    if stream is not None:
        _relay(ranks, stream, prefix)
    results = RankResults(r.outcome.value for r in ranks)  # type: ignore[union-attr]
    results.outputs = [r.output() for r in ranks]
    return results


def _where_the_others_were(pending: dict[int, _Rank], failed: _Rank) -> dict[int, str]:
    """Stacks of the ranks still running, other than ``failed``; a rank whose result is
    already waiting in its pipe is not running any more and is left out."""
    running = [
        r
        for r in pending.values()
        if r is not failed and r.process.exitcode is None and not r.conn.poll()
    ]
    return forensics.dump_stacks(running) if running else {}


def _crashed_peer(pending: dict[int, _Rank], grace: float = 0.2) -> _Rank | None:
    """A rank that died without reporting, if one does within ``grace`` seconds.

    When a rank dies, its peers' next collective fails ("Connection closed by peer"), and
    that error can reach us a moment before the news of the death itself (the forkserver
    reports exits after its SIGCHLD). The death is the cause, so it is what we report.
    Ranks that reported stay alive until killed, so a pending rank that ended has crashed.
    """
    sentinels = {r.process.sentinel: r for r in pending.values()}
    for handle in wait(list(sentinels), timeout=grace) if sentinels else ():
        peer = sentinels[handle]
        peer.outcome = _receive(peer)
        if isinstance(peer.outcome, _o.Died):
            return peer
    return None


def _receive(r: _Rank) -> _o.Outcome:
    """The rank's one message, or how it died without sending one."""
    if r.conn.poll():
        try:
            data = r.conn.recv_bytes()
        except (EOFError, OSError):
            data = None
        if data is not None:
            try:
                return pickle.loads(data)
            except Exception as exc:  # noqa: BLE001 - e.g. a class the parent cannot import
                return _o.unpicklable("its result could not be unpickled in the parent", exc)
    r.process.join(1.0)
    return _o.died(r.process.exitcode)


def _outputs(ranks: list[_Rank]) -> dict[int, str]:
    return {r.rank: r.output() for r in ranks}


def _raise_for(r: _Rank, ranks: list[_Rank], stacks: dict[int, str]) -> None:
    __tracebackhide__ = True
    fatal_stack = r.stack_path.read_text(errors="replace") if r.stack_path.exists() else ""
    raise error_for(r.rank, r.outcome, fatal_stack, _outputs(ranks), stacks)
