"""Under torchrun: every worker of the job runs its own pytest, and ``run_ranks`` runs here.

Forked (the default), one pytest process starts fresh ranks for each test. Under a cluster
launcher the ranks already exist: ``torchrun --nnodes=2 --nproc-per-node=2 -m pytest`` starts
four pytest processes on two machines, each one a rank of the job (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` in its environment). They collect the same
tests and run them in lockstep, so ``run_ranks(fn)`` calls ``fn(rank, world_size)`` right
here, as this rank, in the job's process group.

What makes lockstep safe, when naive ``torchrun -m pytest`` hangs at the first failure:

* **A channel that a stuck collective cannot block.** The ranks talk through the job's own
  key-value store (torchrun's agent hosts it; ``Channel``), never through the process group:
  a rank blocked in ``all_reduce`` still answers through its other threads, and every wait on
  the store has a deadline.
* **The function runs in a thread of its own** (``run``); the main thread watches three
  things: the function ending, another rank failing (fail fast), and the deadline. Either of
  the last two ends the wait with the stacks of every rank still busy, read from inside each
  process (``sys._current_frames``) and passed through the store.
* **One outcome for every rank.** Each rank publishes its outcome (the value, or the
  exception as text) and reads everyone's, so every rank returns the same ``results`` or
  raises the same error, built by ``errors.error_for`` exactly as for forked ranks.
* **A fresh process group after any failure** (``World.group``): a failed call may have left
  collectives half done, so the next call destroys the job's group and makes a new one on the
  same store. Destroying it closes its connections, which also frees peers still blocked in
  a collective of the old group ("Connection closed by peer"); a thread stuck in plain Python
  (a ``sleep``) stays behind as a daemon thread, which ``os._exit`` at the session's end
  ignores.

The pytest side (one report, agreed verdicts, the same tests on every rank) is in
``launched_session``.
"""

from __future__ import annotations

import io
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from tutorial_impl.testing import backends, forensics
from tutorial_impl.testing import outcome as _o
from tutorial_impl.testing.errors import RankResults, error_for, timeout_error
from tutorial_impl.testing.rendezvous import AgentStore, avoid_reverse_dns_stalls

# What torchrun (and torch.distributed.launch, and an srun that starts torchrun) puts in
# every worker's environment.
LAUNCH_ENV = (
    "TORCHELASTIC_RUN_ID",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)
ANSWER_GRACE = 10.0  # seconds past its own deadline a rank may take to publish its outcome
# After another rank failed: how long this rank's function may take to end by itself (all
# ranks failing the same assertion fail within microseconds; their own outcomes are better
# evidence than "still running").
FINISH_GRACE = 0.2
_POLL_MIN, _POLL_MAX = 0.001, 0.02  # store polling interval, growing while nothing changes


@dataclass(frozen=True)
class Launch:
    """This worker's place in the launched job, read from its environment."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    run_id: str
    restart: int
    agent_store: bool  # the agent hosts the store (torchrun's default); else rank 0 does

    @property
    def describe(self) -> str:
        return f"rank {self.rank} of {self.world_size} (torchrun job {self.run_id})"


def detect(environ: dict[str, str] | os._Environ[str] = os.environ) -> Launch | None:
    """The launch this process is part of, or None when torchrun did not start it.

    A malformed variable is a ValueError naming it, never a silent forked run."""
    if not all(name in environ for name in LAUNCH_ENV):
        return None
    numbers = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        try:
            numbers[name] = int(environ[name])
        except ValueError:
            raise ValueError(
                f"torchrun variable {name}={environ[name]!r} is not a number"
            ) from None
    if not 0 <= numbers["RANK"] < numbers["WORLD_SIZE"]:
        raise ValueError(
            f"RANK={numbers['RANK']} is not a rank of WORLD_SIZE={numbers['WORLD_SIZE']}"
        )
    return Launch(
        rank=numbers["RANK"],
        world_size=numbers["WORLD_SIZE"],
        local_rank=numbers["LOCAL_RANK"],
        master_addr=environ["MASTER_ADDR"],
        master_port=numbers["MASTER_PORT"],
        run_id=environ["TORCHELASTIC_RUN_ID"],
        restart=int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
        agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
    )


class Channel:
    """Keys in the job's store, under this session's own prefix; no wait without a deadline.

    ``publish(key, obj)`` writes ``key/RANK``; ``collect(key, timeout)`` reads every rank's,
    polling (a blocking ``wait`` would hold the store client's lock, and the watchdog thread
    shares the client), and returns those that arrived in time.
    """

    def __init__(self, launch: Launch, store: Any) -> None:
        import torch.distributed as dist

        self.launch = launch
        prefix = f"tutorial-impl-pytest/{launch.run_id}/{launch.restart}/"
        self._store = dist.PrefixStore(prefix, store)

    def publish(self, key: str, obj: Any) -> None:
        """``key/RANK`` = ``obj``, pickled (or ``obj`` itself, if it is pickled already)."""
        data = obj if isinstance(obj, bytes) else _dumps(obj)
        self._store.set(f"{key}/{self.launch.rank}", data)

    def set(self, key: str, obj: Any = True) -> None:
        self._store.set(key, pickle.dumps(obj))

    def has(self, key: str) -> bool:
        return bool(self._store.check([key]))

    def get(self, key: str) -> Any:
        return pickle.loads(self._store.get(key))

    def collect(self, key: str, timeout: float) -> dict[int, Any]:
        """Every rank's ``key``, waiting at most ``timeout`` s; missing ranks are absent."""
        keys = {r: f"{key}/{r}" for r in range(self.launch.world_size)}
        stop = time.monotonic() + timeout
        pause = _POLL_MIN
        while True:
            if self._store.check(list(keys.values())) or time.monotonic() > stop:
                break
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX)
        found = {}
        for rank, name in keys.items():
            if self._store.check([name]):
                found[rank] = pickle.loads(self._store.get(name))
        return found

    def gather(self, key: str, obj: Any, timeout: float) -> dict[int, Any]:
        self.publish(key, obj)
        return self.collect(key, timeout)


def _dumps(obj: Any) -> bytes:
    from tutorial_impl.testing.ranks import dumps_on_cpu

    return dumps_on_cpu(obj)


# --- the job's process group ----------------------------------------------------------------


class World:
    """The launched job: its store, the channel, and the default process group we manage.

    Every rank calls ``group`` (or ``no_group``) at the same point of the same test, so the
    decisions here, taken from outcomes every rank agreed on, are the same on every rank.
    """

    def __init__(self, launch: Launch, timeout: float) -> None:
        import torch
        import torch.distributed as dist

        avoid_reverse_dns_stalls()
        self.launch = launch
        # The agent's store (a client of it), or, without an agent store, the one rank 0
        # hosts on MASTER_PORT as env:// would; kept for the whole session either way.
        self.store = dist.TCPStore(
            launch.master_addr,
            launch.master_port,
            world_size=launch.world_size,
            is_master=launch.rank == 0 and not launch.agent_store,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout),
        )
        self.channel = Channel(launch, self.store)
        if torch.cuda.is_available() and torch.cuda.device_count() > launch.local_rank:
            torch.cuda.set_device(launch.local_rank)  # one worker per GPU, as torchrun means
        self.calls = 0  # run_ranks calls so far: the same count on every rank (lockstep)
        self.generation = 0  # process groups made so far
        self.current: tuple[str, float, str] | None = None  # backend, timeout, debug level
        self.pg: Any = None  # the default group we made
        self.dirty = False  # the last call failed: its group is not reused
        self.abandoned: list[threading.Thread] = []  # rank functions still running
        self.in_call = False  # a run_ranks call is on: it keeps its own deadline
        self.stale: list[Any] = []  # rendezvous stores of failed backend=None calls

    def group(self, backend: str, timeout: float) -> None:
        """Make sure the default group has ``backend``, is clean, and times out at ``timeout``."""
        import torch
        import torch.distributed as dist

        wanted = (backend, timeout, os.environ.get("TORCH_DISTRIBUTED_DEBUG", ""))
        if self.current == wanted and not self.dirty and self._ours():
            return
        self.no_group()
        dist.set_debug_level_from_env()  # --check-collectives: DETAIL wraps the new group
        if backends.uses_nccl(backend):
            torch.cuda.set_device(self.launch.local_rank)  # LOCAL_RANK's GPU, as torchrun means
        self.generation += 1
        dist.init_process_group(
            backend=backend,
            store=dist.PrefixStore(f"tutorial-impl-world-{self.generation}", self.store),
            rank=self.launch.rank,
            world_size=self.launch.world_size,
            # Longer than the harness deadline, which must see a hang first (and take the
            # stacks); short enough that a collective abandoned then ends by itself.
            timeout=timedelta(seconds=timeout + ANSWER_GRACE),
        )
        self.current = wanted
        self.pg = dist.group.WORLD
        self.dirty = False

    def _ours(self) -> bool:
        """The default group is still the one we made (a test may destroy or replace it)."""
        import torch.distributed as dist

        return dist.is_initialized() and dist.group.WORLD is self.pg

    def no_group(self) -> None:
        """Leave the default group, if any (a ``backend=None`` test makes its own)."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        self.current = None

    def fresh_rendezvous(self, key: str, timeout: float) -> tuple[dict[str, str], Any]:
        """MASTER_ADDR/MASTER_PORT of a new store rank 0 hosts on port 0 (for RPC, or a
        test's own groups): what a ``backend=None`` rank function would get forked."""
        host = None
        if self.launch.rank == 0:
            host = AgentStore(host=self.launch.master_addr, timeout=timeout)
            self.channel.set(key, host.port)
        port = self._wait_for(key, timeout)
        env = {
            "MASTER_ADDR": self.launch.master_addr,
            "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",  # rank 0 connects as a client too
        }
        return env, host

    def _wait_for(self, key: str, timeout: float) -> Any:
        stop = time.monotonic() + timeout
        while not self.channel.has(key):
            if time.monotonic() > stop:
                raise TimeoutError(f"rank 0 did not publish {key} within {timeout:g} s")
            time.sleep(_POLL_MAX)
        return self.channel.get(key)


# --- one run_ranks call ---------------------------------------------------------------------


@dataclass(frozen=True)
class Busy:
    """This rank's function was still running when the call ended (another rank failed)."""

    where: str


@dataclass
class Answer:
    """What one rank publishes at the end of a call."""

    outcome: Any  # an outcome.Outcome, or Busy
    output: str
    stacks: str = ""  # the function's thread, when it had not ended


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


def run(
    world: World,
    fn: Callable[..., Any],
    *args: Any,
    world_size: int,
    backend: str | None = "gloo",
    timeout: float,
    fn_kwargs: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    may_exit: Collection[int] = (),
    debug_rank: int | None = None,
    **ignored: Any,
) -> RankResults:
    """``run_ranks`` under torchrun: ``fn(rank, world_size, *args)`` here, as this rank.

    Returns every rank's value in rank order (on every rank), or raises the error every rank
    agrees on. ``init_method``, ``log_dir`` and ``stream`` do not apply: the job has its own
    rendezvous, and output goes where torchrun sends it.
    """
    __tracebackhide__ = True
    launch = world.launch
    if world_size != launch.world_size:
        raise ValueError(
            f"world_size={world_size} but this torchrun job has {launch.world_size} ranks"
        )
    if may_exit:
        raise ValueError(
            "may_exit cannot be honoured under torchrun: a worker that exits ends the whole "
            "job (run this test forked)"
        )
    if debug_rank is not None:
        raise ValueError("debug_rank / --rank-pdb are for forked runs, not under torchrun")
    world.calls += 1
    key = f"call/{world.calls}"
    host = None
    saved = dict(os.environ)
    world.in_call = True
    try:
        os.environ.update(env or {})  # before the group: TORCH_DISTRIBUTED_DEBUG, say
        if backend is None:
            world.no_group()
            rendezvous, host = world.fresh_rendezvous(f"{key}/port", timeout)
            os.environ.update(rendezvous)
        else:
            world.group(backend, timeout)
        mine = _run_here(world, key, fn, args, fn_kwargs or {}, timeout)
        answers = world.channel.gather(key, _pickled(mine), timeout + ANSWER_GRACE)
    finally:
        world.in_call = False
        os.environ.clear()
        os.environ.update(saved)
    outcomes = {r: a.outcome for r, a in answers.items()}
    world.dirty = not all(isinstance(o, _o.Returned) for o in outcomes.values()) or (
        len(answers) < launch.world_size
    )
    if host is not None and world.dirty:
        world.stale.append(host)  # a failed call's store stays up: a rank may still use it
    elif host is not None:
        host.close()
    outputs = {r: a.output for r, a in answers.items()}
    _raise_for_failure(launch.world_size, answers, timeout)
    results = RankResults(outcomes[r].value for r in range(launch.world_size))
    results.outputs = [outputs[r] for r in range(launch.world_size)]
    return results


def _pickled(answer: Answer) -> bytes:
    """``answer`` as the store carries it (pickled once); a return value that cannot be
    pickled is this rank's failure, named as such, as for a forked rank."""
    try:
        return _dumps(answer)
    except Exception as exc:  # noqa: BLE001
        outcome = _o.unpicklable("returned a value that cannot be pickled", exc)
        return _dumps(Answer(outcome, answer.output, answer.stacks))


def _run_here(
    world: World,
    key: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    timeout: float,
) -> Answer:
    """Run ``fn`` in a thread; wait for it, for another rank's failure, or the deadline."""
    launch = world.launch
    box: dict[str, Any] = {}
    done = threading.Event()

    def rank_function() -> None:  # the name the stacks show for this thread's entry
        try:
            box["outcome"] = _o.Returned(fn(launch.rank, launch.world_size, *args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - pytest.skip, exit() and all
            box["outcome"] = _o.from_exception(exc)
        finally:
            done.set()

    failed = f"{key}/failed"
    tee_out, tee_err = _Tee(sys.stdout), _Tee(sys.stderr)
    sys.stdout, sys.stderr = tee_out, tee_err
    thread = threading.Thread(target=rank_function, name=f"rank {launch.rank}", daemon=True)
    stop = time.monotonic() + timeout
    pause = _POLL_MIN
    try:
        thread.start()
        while not done.wait(pause):
            pause = min(pause * 2, _POLL_MAX)
            if world.channel.has(failed) and not done.wait(FINISH_GRACE):
                outcome: Any = Busy("")
                break
            if time.monotonic() > stop:
                outcome = _o.TimedOut("")
                world.channel.set(failed)
                break
        else:
            outcome = box["outcome"]
            if not isinstance(outcome, _o.Returned):
                world.channel.set(failed)  # fail fast: the others stop waiting for us
    finally:
        sys.stdout, sys.stderr = tee_out.stream, tee_err.stream
    output = tee_out.copy.getvalue() + tee_err.copy.getvalue()
    if isinstance(outcome, (Busy, _o.TimedOut)):
        world.abandoned.append(thread)
        stacks = thread_stacks(thread)
        where = forensics.where(stacks)
        outcome = Busy(where) if isinstance(outcome, Busy) else _o.TimedOut(where)
        return Answer(outcome, output, stacks)
    return Answer(outcome, output)


def thread_stacks(thread: threading.Thread) -> str:
    """``thread``'s Python stack, most recent call first, as faulthandler writes it (so
    ``forensics.where`` reads it), down to the harness's rank-function frame."""
    frame = sys._current_frames().get(thread.ident or -1)
    lines = [f"Thread {thread.ident:#x} ({thread.name}, most recent call first):"]
    while frame is not None:
        code = frame.f_code
        lines.append(f'  File "{code.co_filename}", line {frame.f_lineno} in {code.co_name}')
        if code.co_name == "rank_function":
            lines[-1] = lines[-1].replace("rank_function", "rank_main")  # forensics' entry mark
            break
        frame = frame.f_back
    return "\n".join(lines) + "\n"


def main_thread_stack() -> str:
    """The main thread's Python stack (where pytest is in the test), most recent call first,
    without pytest's and pluggy's own frames below the test."""
    main = threading.main_thread()
    frame = sys._current_frames().get(main.ident or -1)
    lines = [f"Thread {main.ident:#x} (main thread: the test, most recent call first):"]
    while frame is not None:
        path = frame.f_code.co_filename
        if "/_pytest/" in path or "/pluggy/" in path:
            break
        lines.append(f'  File "{path}", line {frame.f_lineno} in {frame.f_code.co_name}')
        frame = frame.f_back
    return "\n".join(lines) + "\n"


def _raise_for_failure(world_size: int, answers: dict[int, Answer], timeout: float) -> None:
    """Raise the one error every rank agrees on, or return if every rank returned."""
    __tracebackhide__ = True
    outcomes = {r: a.outcome for r, a in answers.items()}
    outputs = {r: a.output for r, a in answers.items()}
    silent = [r for r in range(world_size) if r not in answers]
    # The cause first: an exception, then a skip or xfail, then a hang.
    for kinds in ((_o.Raised, _o.Exited, _o.Killed), (_o.Skipped, _o.XFailed)):
        for rank in sorted(outcomes):
            if isinstance(outcomes[rank], kinds):
                stacks = {r: a.stacks for r, a in answers.items() if a.stacks and r != rank}
                stacks.update({r: "(no answer through the store)" for r in silent})
                raise error_for(rank, outcomes[rank], "", outputs, stacks)
    pending = [r for r, o in outcomes.items() if isinstance(o, (_o.TimedOut, Busy))] + silent
    if pending:
        stacks = {r: answers[r].stacks if r in answers else "" for r in pending}
        where = {r: outcomes[r].where for r in pending if r in outcomes and outcomes[r].where}
        raise timeout_error(sorted(pending), timeout, stacks, outputs, where)


# --- what a launched job can run ------------------------------------------------------------


def size_mismatch(world_size: int, launch: Launch) -> str:
    return (
        f"needs world_size {world_size}; this torchrun job has {launch.world_size} ranks "
        "(under torchrun a test runs on the whole job: launch it with that many workers)"
    )


def why_not_here(launch: Launch, settings: Any) -> str | None:
    """Why this job cannot run a test with these settings (``config.Settings``), or None.

    A world size other than the job's is skipped (not run on a subgroup: a test's
    collectives on the default group must mean the whole world it asked for). A GPU test
    needs LOCAL_RANK's GPU on every rank."""
    if settings.world_size != launch.world_size:
        return size_mismatch(settings.world_size, launch)
    reason = backends.why_not_here(settings.backend, 1, 1 if settings.gpus else 0)
    if reason or not settings.gpus:
        return reason
    import torch

    if torch.cuda.device_count() <= launch.local_rank:
        return f"LOCAL_RANK {launch.local_rank} has no GPU ({torch.cuda.device_count()} visible)"
    return None


def basetemp(launch: Launch) -> str:
    """A temporary directory of this rank's own, under pytest's usual per-user root."""
    import getpass
    import tempfile

    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no name for this uid (a container)
        user = "unknown"
    root = os.path.join(tempfile.gettempdir(), f"pytest-of-{user}")
    return os.path.join(root, f"torchrun-{launch.run_id[:12]}-rank{launch.rank}")
