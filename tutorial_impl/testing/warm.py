"""Warm worlds: one set of ranks and one process group serving many tests, as safe as fresh.

A fresh world costs every test a fork per rank and a process-group rendezvous (tens of ms
here; seconds for an NCCL communicator). Under the ``warm_world`` marker (a module's
``pytestmark`` or a class; ``warm_world(False)`` opts one test out) the ranks of a world stay
alive between tests: each test's rank function is sent to them as a *task* (the function by
name, its pickled arguments, fresh log and stack files), runs in the group the world made,
and reports its outcome exactly as a fresh rank does. Waiting, fail-fast, deadlines, stack
dumps and the report are the supervisor's own code (``supervisor._supervise``), so a failing
test reads the same in a warm world as in a fresh one.

Reuse is where peers went wrong (a failure skipping the rest of a class; one stalled rank
hanging the run; leaked groups), so a world is reused only when it is as good as new. After
every task each rank checks itself and answers within ``CHECK_DEADLINE`` seconds (the
answers are read when the world is next wanted, so the check runs while pytest moves on):

* no process group, RPC agent, non-daemon thread, child process or pending ``isend`` /
  ``irecv`` was left behind;
* the default group is the one the world made (not destroyed, not replaced);
* grad mode and the default dtype are as the world started (and torch's and ``random``'s
  generators are reset to a fresh rank's state before each test);
* a barrier of the whole world completes within the deadline (nobody is stuck, no
  collective is half done).

Anything wrong, and also any test that failed (in a rank or in the parent), and the world is
killed, every rank, as a fresh one would be; the next test gets a fresh world. Nothing is
skipped. Worlds are keyed by everything that must not differ between the tests they serve
(world size, backend, init method, deadline, the ``env=`` a test asks for, torch's debug
level, the visible GPUs, coverage), at most ``MAX_WORLDS`` per process (each xdist worker has
its own), and all are killed when the module that used them ends and at session end.

Not warm (the call quietly takes the fresh path): ``may_exit``, ``debug_rank`` /
``--rank-pdb``, ``stream``, and tests that lease GPUs.
"""

from __future__ import annotations

import os
import pickle
import random
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from tutorial_impl.testing import debugging as _debugging
from tutorial_impl.testing import outcome as _o
from tutorial_impl.testing import ranks as _ranks
from tutorial_impl.testing import supervisor as _sup
from tutorial_impl.testing.config import DEFAULT_DEADLINE, DEFAULT_INIT_METHOD, DEFAULT_WORLD_SIZE
from tutorial_impl.testing.errors import RankResults

MAX_WORLDS = 4  # warm worlds one process keeps; the least recently used goes first
CHECK_DEADLINE = 2.0  # seconds the ranks have to prove the world is still good
MARKER = "warm_world"
# Options a warm world serves; any other (may_exit, debug_rank, stream...) runs fresh.
OPTIONS = {"world_size", "backend", "init_method", "timeout", "fn_kwargs", "env", "log_dir"}


@dataclass(eq=False)
class World:
    """The ranks of one warm world and what they share: the store and the key."""

    key: tuple[Any, ...]
    ranks: list[_sup._Rank]
    store: Any
    work: Path  # the world's own directory (file:// rendezvous, start-up logs)
    rank_env: list[dict[str, str]]
    tasks: int = 0  # tests served so far
    unchecked: bool = False  # the ranks' answers to the check after the last task are unread
    problem: str | None = field(default=None)  # why it was retired, if it was

    def close(self) -> None:
        for r in self.ranks:
            _sup._kill(r)
        _sup._release(self.ranks)
        self.store.close()
        shutil.rmtree(self.work, ignore_errors=True)

    @property
    def pids(self) -> list[int]:
        return [r.process.pid for r in self.ranks]


_worlds: OrderedDict[tuple[Any, ...], World] = OrderedDict()
_served: list[World] = []  # worlds used by the test now running (retired if it fails)
replaced: list[str] = []  # why each retired world was retired, for tests and the bench


def suits(options: dict[str, Any]) -> bool:
    """Whether a ``run_ranks`` call with these keyword options can run warm."""
    return set(options) <= OPTIONS


def key_of(call: _sup.Call) -> tuple[Any, ...]:
    """What two calls must share to be served by one world."""
    return (
        call.world_size,
        call.backend,
        call.init_method,
        call.timeout,
        tuple(sorted(call.env.items())),
        os.environ.get("TORCH_DISTRIBUTED_DEBUG"),
        os.environ.get("CUDA_VISIBLE_DEVICES"),
        call.coverage is not None,
    )


def run(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = DEFAULT_WORLD_SIZE,
    backend: str | None = "gloo",
    init_method: str = DEFAULT_INIT_METHOD,
    timeout: float = DEFAULT_DEADLINE,
    fn_kwargs: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    log_dir: str | os.PathLike[str] | None = None,
) -> RankResults:
    """``run_ranks`` in a warm world: the same arguments, results and errors."""
    __tracebackhide__ = True
    call = _sup.prepare(fn, args, fn_kwargs, world_size, backend, init_method, timeout, env)
    own_dir = log_dir is None
    work = Path(tempfile.mkdtemp(prefix="ranks-") if own_dir else log_dir)  # type: ignore[arg-type]
    work.mkdir(parents=True, exist_ok=True)
    try:
        specs = [_sup.task_spec(call, rank, work, {}) for rank in range(world_size)]
        world = _world_for(call, specs)
        _served.append(world)
        for r, spec in zip(world.ranks, specs, strict=True):
            spec.env = {**world.rank_env[r.rank], **spec.env}
            r.log_path, r.stack_path, r.outcome, r.streamed = (
                Path(spec.log_path),
                Path(spec.stack_path),
                None,
                0,
            )
            if world.tasks:  # a new world was started with its first task already
                r.conn.send_bytes(pickle.dumps(spec))
        world.tasks += 1
        try:
            results = _sup._supervise(
                world.ranks, _debugging.Deadline(timeout, work), timeout, None, True
            )
        except BaseException as exc:
            retire(world, f"the test failed: {type(exc).__name__}")  # killed its ranks already
            raise
        world.unchecked = True  # the ranks check themselves now; read before the next task
        return results
    finally:
        if own_dir:
            shutil.rmtree(work, ignore_errors=True)


def _world_for(call: _sup.Call, specs: list[_ranks.RankSpec]) -> World:
    """The warm world for ``call``, or a new one started with ``specs`` as its first task."""
    key = key_of(call)
    world = _worlds.get(key)
    if world is not None and world.unchecked:
        world.unchecked = False
        problem = _checked(world)
        if problem:
            retire(world, problem)
            world = None
    if world is not None:
        _worlds.move_to_end(key)
        return world
    while len(_worlds) >= MAX_WORLDS:
        _, oldest = _worlds.popitem(last=False)
        oldest.close()
    from tutorial_impl.testing.rendezvous import AgentStore

    store = AgentStore(timeout=call.timeout)
    home = Path(tempfile.mkdtemp(prefix="warm-world-"))
    ctx = _ranks.context()
    started: list[_sup._Rank] = []
    rank_env = [store.rank_env(rank, call.world_size) for rank in range(call.world_size)]
    try:
        for spec in specs:
            first = _sup.task_spec(call, spec.rank, home, rank_env[spec.rank])
            first.log_path, first.stack_path, first.payload = spec.log_path, spec.stack_path, b""
            parent_end, rank_end = ctx.Pipe(duplex=True)
            process = ctx.Process(target=warm_rank_main, args=(first, spec, rank_end), daemon=True)
            process.start()
            rank_end.close()  # only the rank holds its end: EOF then means it is gone
            _sup._live[process.pid] = process
            started.append(_sup._Rank(spec.rank, process, parent_end, Path(), Path()))
    except BaseException:
        for r in started:
            _sup._kill(r)
        _sup._release(started)
        store.close()
        shutil.rmtree(home, ignore_errors=True)
        raise
    world = _worlds[key] = World(key, started, store, home, rank_env)
    return world


def _checked(world: World) -> str | None:
    """Each rank's answer to "are you as good as new?": None when all say yes in time."""
    pending = {r.conn: r for r in world.ranks}
    sentinels = {r.process.sentinel: r for r in world.ranks}
    end = time.monotonic() + CHECK_DEADLINE + 1.0  # the ranks' own barrier deadline, and some
    while pending:
        left = end - time.monotonic()
        if left <= 0:
            return f"ranks {sorted(r.rank for r in pending.values())} did not answer the check"
        for handle in wait([*pending, *sentinels], timeout=left):
            if handle in sentinels:
                return f"rank {sentinels[handle].rank} died after its test"
            try:
                problem = pickle.loads(handle.recv_bytes())
            except (EOFError, OSError):
                return f"rank {pending[handle].rank} closed its pipe after its test"
            if problem:
                return f"rank {pending[handle].rank}: {problem}"
            del pending[handle]
    return None


def retire(world: World, why: str) -> None:
    """Kill ``world``'s ranks; the next test that needs such a world gets a fresh one."""
    if _worlds.get(world.key) is world:
        del _worlds[world.key]
    if world.problem is None:
        world.problem = why
        replaced.append(why)
    world.close()


def test_ended(failed: bool) -> None:
    """The plugin's word after each test: a world that served a failed test is retired."""
    served = list(_served)
    _served.clear()
    if failed:
        for world in served:
            retire(world, "its test failed")


def close_all() -> None:
    """Kill every warm world of this process (a module that used them ended; session end)."""
    while _worlds:
        _, world = _worlds.popitem()
        world.close()
    _served.clear()


def pids() -> list[int]:
    """The pids of every warm rank alive in this process's worlds."""
    return [pid for world in _worlds.values() for pid in world.pids]


# ---------------------------------------------------------------------------------------
# Inside a warm rank
# ---------------------------------------------------------------------------------------


class Baseline:
    """What a rank looked like when its world was made, to compare with after each test."""

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        c10d = dist.distributed_c10d
        self.default = c10d._get_default_group() if dist.is_initialized() else None
        self.groups = set(c10d._world.pg_map)
        self.threads = set(threading.enumerate())
        self.dtype = torch.get_default_dtype()
        self.rng = torch.get_rng_state(), random.getstate()
        self.works: list[Any] = []  # this test's isend/irecv work (see ``_track_work``)
        _track_work(self.works)

    def restore(self) -> None:
        """Give the next test the random state a fresh rank starts with (the forkserver's)."""
        import torch

        self.works.clear()
        torch.set_rng_state(self.rng[0])
        random.setstate(self.rng[1])

    def leftovers(self) -> str | None:
        """What the last test left behind that a fresh world would not have, or None."""
        import torch
        import torch.distributed as dist

        c10d = dist.distributed_c10d
        default = c10d._get_default_group() if dist.is_initialized() else None
        if default is not self.default:
            return "the default process group was destroyed or replaced"
        extra = [g for g in c10d._world.pg_map if g not in self.groups]
        if extra:
            return f"{len(extra)} process group(s) left behind (destroy_process_group)"
        if _rpc_agent_running():
            return "an RPC agent left running (rpc.shutdown)"
        threads = [
            t.name
            for t in threading.enumerate()
            if t not in self.threads and not t.daemon and t.is_alive()
        ]
        if threads:
            return f"non-daemon thread(s) left running: {threads}"
        children = _children()
        if children:
            return f"child process(es) left running: {children}"
        if not torch.is_grad_enabled() or torch.get_default_dtype() != self.dtype:
            return "grad mode or the default dtype changed"
        pending = [w for w in self.works if not w.is_completed()]
        if pending:
            return (
                f"{len(pending)} isend/irecv never completed (a receive nobody sent to, or a "
                "send nobody received): it would take the next test's message"
            )
        if self.default is not None:
            try:
                dist.barrier(async_op=True).wait(timedelta(seconds=CHECK_DEADLINE))
            except Exception as exc:  # noqa: BLE001 - any failure means: not reusable
                return f"the world's barrier did not complete: {exc}"
        return None


def _track_work(works: list[Any]) -> None:
    """Record every point-to-point work a test starts (``dist.isend``, ``dist.irecv``,
    ``dist.batch_isend_irecv``), so the check after it can ask whether any is still pending.

    gloo has no list of a group's pending operations to ask instead. A test that leaves an
    ``irecv`` unwaited, with no matching send, leaves it posted: in a fresh world it dies with
    its rank, but in a warm one it would swallow the next test's message from that peer.
    (Found only through ``torch.distributed``'s attributes, as ``dist.irecv(...)`` calls them;
    a function imported by name before the world started is not seen.)"""
    import torch.distributed as dist

    def tracked(original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            for work in result if isinstance(result, list) else [result]:
                if work is not None:
                    works.append(work)
            return result

        call.__wrapped__ = original  # type: ignore[attr-defined]
        call.__name__ = original.__name__
        call.__doc__ = original.__doc__
        return call

    for name in ("isend", "irecv", "batch_isend_irecv"):
        original = getattr(dist, name)
        setattr(dist, name, tracked(getattr(original, "__wrapped__", original)))


def _children() -> list[int]:
    """This rank's live child processes (Linux: /proc), which a fresh world's end kills."""
    found = []
    for task in Path("/proc/self/task").glob("*/children"):
        try:
            found += [int(pid) for pid in task.read_text().split()]
        except OSError:
            pass
    return found


def _rpc_agent_running() -> bool:
    import torch.distributed.rpc as rpc

    return rpc.is_available() and rpc.api._is_current_rpc_agent_set()


def warm_rank_main(start: _ranks.RankSpec, task: _ranks.RankSpec, conn: Connection) -> None:
    """The body of a warm rank: join the world's group (``start``), then run ``task`` and
    every task after it, reporting each outcome and then the rank's own check."""
    try:
        imported_with = _ranks.enter_rank(start)
        try:
            from tutorial_impl.testing import torchenv

            torchenv.apply_in_rank(imported_with, start.env)
            if start.backend is not None:
                _ranks.init_process_group(start)
            baseline = Baseline()
        except BaseException as exc:  # noqa: BLE001 - reported as the first test's failure
            conn.send_bytes(pickle.dumps(_o.from_exception(exc)))
            while True:
                time.sleep(3600)
        while True:
            task.env = {**start.env, **task.env}
            _ranks.take_task(task)
            baseline.restore()
            conn.send_bytes(_ranks.run_task(task, imported_with, join_group=False))
            conn.send_bytes(pickle.dumps(baseline.leftovers()))
            task = pickle.loads(conn.recv_bytes())  # EOF: the world is closed
    finally:
        os._exit(0)  # never run interpreter teardown (see ranks.rank_main)
