"""Faults on purpose, inside a rank: the armed plan, the counts, and the actions taken.

The plan (``faults.plan``: which ranks, which point, which action) reaches a rank before its
group is made: ``arm(plan, rank)``, or the environment variable ``TUTORIAL_IMPL_FAULTS``
(``arm_from_env``). The collectives are counted at the process-group level by
``faults.group`` (direct ``dist.*`` calls, DDP's buckets, functional collectives and DTensor
alike), which reports each to ``INJECTOR.reached``; the rank's own code names points with
``fault_point(name)``. A fault fires *before* the collective starts on its rank (so torch's
flight recorder on that rank never records it: see ``desync``). Deterministic: the same
program reaches the same point in every run, because points are counted, never timed or
drawn at random. ``INJECTOR`` is the rank's one state: the plan, the counts, what fired
(``fired``) and what was seen (``history``). Nothing here imports torch (docs/faults.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tutorial_impl.testing import words
from tutorial_impl.testing.diagnose.stacks import frames_of, place
from tutorial_impl.testing.faults.plan import (
    ENV,
    Close,
    Delay,
    Exit,
    Fault,
    Hang,
    Plan,
    Point,
    Raise,
    check_plan,
    decode,
)

HISTORY = 10_000  # points a rank remembers (``Injector.history``)


class InjectedFault(RuntimeError):
    """What ``Raise`` raises: the rank, the point and the plan's message."""


@dataclass
class Injector:
    """A rank's faults: the armed plan, what each fault counted, what fired, what was seen."""

    rank: int | None = None
    plan: Plan = ()
    counts: list[int] = field(default_factory=list)  # per fault of the plan
    fired: list[tuple[Fault, Point]] = field(default_factory=list)
    reports: list[Fired] = field(default_factory=list)  # the same, as the results say them
    ops: dict[str, int] = field(default_factory=dict)  # collectives seen since armed, per op
    armed_at: float = 0.0  # ``time.monotonic()`` at the arming: a ``Fired``'s ``elapsed``
    history: deque[Point] = field(default_factory=lambda: deque(maxlen=HISTORY))
    sockets: list[tuple[int, str]] = field(default_factory=list)  # (fd, "socket:[inode]")
    steps: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Armings so far: a faulty group numbers its collectives from 1 again at each (a warm
    # world's test counts as a fresh world's would).
    epoch: int = 0
    report_to: str | None = None  # where a fired fault is written, for the parent (``Fired``)
    # ``Close``s fired in this process: a faulty group made before the last one has its
    # sockets shut, and fails each later collective at once (``group``), never inside gloo.
    closes: int = 0
    # Set when the call the plan was armed for is over: a ``Hang`` still sleeping then ends
    # (under torchrun the worker lives on, and a hung thread would hold its group).
    released: threading.Event = field(default_factory=threading.Event)
    # Called with the exit status (a code, or minus the signal) before a fault ends the
    # process: a torchrun worker tells its peers first (``torchrun.Launched``).
    before_death: Callable[[int], None] | None = None

    def arm(
        self,
        plan: Plan,
        rank: int,
        world_size: int | None = None,
        report_to: str | None = None,
        before_death: Callable[[int], None] | None = None,
    ) -> None:
        """Arm ``plan`` for this rank (counts start again; what was seen is kept).
        ``report_to``: a file each fault that fires is written to (JSON, ``read_fired``)
        before it acts, so the parent knows of it even when the rank dies;
        ``before_death``: what to do before a ``Kill`` or an ``Exit`` acts."""
        plan = check_plan(plan, world_size) if world_size is not None else tuple(plan)
        with self.lock:
            self.rank, self.plan = rank, plan
            self.counts = [0] * len(plan)
            self.fired.clear()
            self.reports.clear()
            self.steps.clear()
            self.ops.clear()
            self.armed_at = time.monotonic()
            self.epoch += 1
            self.report_to = report_to
            self.before_death = before_death
            self.released.set()  # an earlier call's hang ends: each arming has its own
            self.released = threading.Event()

    def reached(self, point: Point) -> None:
        """The rank is at ``point``: count it for every fault of this rank that matches, and
        act for the one whose count reaches its ``at`` (before the collective starts)."""
        due: list[tuple[Fault, Fired]] = []
        with self.lock:
            self.history.append(point)
            if point.step is None:
                self.ops[point.op or "?"] = self.ops.get(point.op or "?", 0) + 1
            for i, fault in enumerate(self.plan):
                if self.rank in fault.ranks and fault.matches(point):
                    self.counts[i] += 1
                    if self.counts[i] == fault.at:
                        report = fired(self.rank or 0, fault, point, self.armed_at)
                        due.append((fault, report))
                        self.fired.append((fault, point))
                        self.reports.append(report)
        for fault, report in due:
            self._perform(fault, point, report)

    def unfired(self, planned: Plan | None = None) -> list[Unfired]:
        """The faults of this rank's plan that it never reached, but optional ones, each
        with what the rank did instead (for ``FaultNotFired``). ``planned``: the plan the
        harness armed for the call; a fault of it the rank's code armed away (another plan
        armed since) is unfired too, whatever the new plan did."""
        if not self.plan and not planned:  # nothing was planned: nothing to miss
            return []
        with self.lock:
            counted = [(f, n, "") for f, n in zip(self.plan, self.counts, strict=True)]
            counted += [(f, 0, ARMED_AWAY) for f in planned or () if f not in self.plan]
            return [
                Unfired(
                    self.rank or 0,
                    str(fault) + note,
                    fault.op,
                    fault.step,
                    count,
                    dict(self.ops),
                    dict(self.steps),
                )
                for fault, count, note in counted
                if self.rank in fault.ranks and count < fault.at and not fault.optional
            ]

    def step(self, name: str) -> None:
        with self.lock:
            self.steps[name] = seq = self.steps.get(name, 0) + 1
        self.reached(Point(op=None, seq=seq, step=name))

    def _perform(self, fault: Fault, point: Point, report: Fired) -> None:
        action = fault.action
        what = f"injected fault on rank {self.rank} at {point}"
        print(f"[faults] {what}: {action}", file=sys.stderr, flush=True)
        if self.report_to is not None:
            _append(self.report_to, report)
        if isinstance(action, Raise):
            raise InjectedFault(f"{what}: {action.message}")
        if isinstance(action, Delay):
            delay(action.seconds)
        elif isinstance(action, Close):
            close_sockets(self.sockets)
            self.closes += 1
        elif isinstance(action, Hang):
            hang(self.released)
            raise InjectedFault(f"{what}: hung until its call was over")
        elif isinstance(action, Exit):
            self._last_words(action.code)
            exit_now(action.code)
        else:
            self._last_words(-signal.SIGKILL)
            kill_self()

    def _last_words(self, status: int) -> None:
        if self.before_death is not None:
            self.before_death(status)


@dataclass(frozen=True)
class Fired:
    """A fault that fired: on which rank, what it did, where (``all_reduce #3``, called at
    ``test_x.py:12``) and when. ``RankResults.fired`` holds these, per rank."""

    rank: int
    action: str  # the action's name: "kill", "raise", ...
    point: str  # as the group numbers it: ``all_reduce #8``
    counted: str = ""  # as the plan counted it, when that reads otherwise: ``3rd all_reduce``
    fault: str = ""  # the planned ``Fault``, as it reads: ``kill on rank(s) 1 at all_reduce #3``
    op: str | None = None  # the collective (None: a step)
    seq: int = 0  # its number in its group (of a step: the call's count)
    group: str = ""  # the group's name (``"0"``); a step: ""
    step: str | None = None  # the ``fault_point`` name, for a fault at a step
    where: str = ""  # the innermost line of the rank's own code: ``test_x.py:12``
    time: float = 0.0  # when it fired: ``time.time()``
    elapsed: float = 0.0  # seconds since the rank's plan was armed (its call's start)

    def __str__(self) -> str:
        counted = f", the {self.counted}" if self.counted else ""
        return f"injected {self.action} at {self.point}{counted}"


def fired(rank: int, fault: Fault, point: Point, armed_at: float | None = None) -> Fired:
    """What the parent is told of ``fault`` firing at ``point`` on ``rank`` (called where it
    fires: ``where`` is read from this thread's stack)."""
    spot = place(frames_of(sys._getframe(1), stop=""))
    return Fired(
        rank,
        fault.action.name,
        str(point),
        _counted(fault, point),
        fault=str(fault),
        op=point.op,
        seq=point.seq,
        group=point.group,
        step=point.step,
        where=f"{spot.file}:{spot.line}" if spot else "",
        time=time.time(),
        elapsed=time.monotonic() - armed_at if armed_at is not None else 0.0,
    )


@dataclass(frozen=True)
class Unfired:
    """A planned fault its rank never reached, and what the rank did instead."""

    rank: int
    fault: str  # the ``Fault`` as it reads
    op: str | None  # its filter
    step: str | None
    counted: int  # the points that matched it (fewer than its ``at``)
    ops: dict[str, int]  # the collectives the rank made on its faulty groups, per op
    steps: dict[str, int]  # the ``fault_point`` names it reached, and how often

    def __str__(self) -> str:
        if self.step is not None:
            did = f"it named fault_point({self.step!r}) {self.counted} time(s)"
        else:
            did = f"it made {self.counted} {self.op or 'collective'}(s) that matched"
        made = ", ".join(f"{op} {n}" for op, n in sorted(self.ops.items()))
        made = made or NO_COLLECTIVE
        named = ", ".join(f"{name!r} {n}" for name, n in sorted(self.steps.items())) or "none"
        return words.unfired(self.fault, self.rank, did, made, named)


# A harness plan's fault the rank's own code armed away (``faults.group.init_process_group``
# with a plan, ``faults.arm``): the parent still expects it.
ARMED_AWAY = " (another plan was armed in the rank since: this fault was not in it)"
NO_COLLECTIVE = (
    "none on a faulty group (a group made on plain gloo is not counted: make it with "
    "faulty_group.init_process_group or init_process_group('faulty'), docs/faults.md)"
)


class FaultNotFired(AssertionError):
    """A planned fault did not fire on a rank that returned: the test proved nothing about
    it. Not a ``RankError``: a ``pytest.raises(RankFailed)`` meant for the fault does not
    catch it. ``unfired``: each fault, with what its rank did instead."""

    def __init__(self, unfired: list[Unfired]) -> None:
        self.unfired = unfired
        super().__init__(words.not_fired(unfired))


def _counted(fault: Fault, point: Point) -> str:
    """``3rd all_reduce``: the plan's count, when it is not the point's own number (a
    fault at the 3rd all_reduce of a DDP loop strikes the group's collective #8)."""
    if point.step is not None or fault.at == point.seq:
        return ""
    suffix = (
        "th" if 10 <= fault.at % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(fault.at % 10, "th")
    )
    return f"{fault.at}{suffix} {fault.op or 'collective'}"


def _append(path: str, entry: Fired | Unfired) -> None:
    """One JSON line per entry (its kind first), written and flushed at once: a fired fault
    before its action (a kill next)."""
    with open(path, "a") as out:
        out.write(json.dumps([type(entry).__name__, dataclasses.asdict(entry)]) + "\n")


def report_unfired(planned: Plan | None = None, path: str | None = None) -> list[Unfired]:
    """After the rank's function returned: write what never fired of the armed plan and of
    ``planned`` (``Injector.unfired``) for the parent (to ``path``, default the armed
    ``report_to``); returns it."""
    missed = INJECTOR.unfired(planned)
    path = path or INJECTOR.report_to
    for entry in missed if path else ():
        _append(path, entry)
    return missed


def _read(path: str | os.PathLike[str], kind: type) -> list:
    try:  # closed here, never by the GC: its ResourceWarning fails a test under "-W error"
        with open(path) as text:
            lines = text.read().splitlines()
    except FileNotFoundError:
        return []
    found = []
    for line in lines:
        try:
            name, entry = json.loads(line)
            if name == kind.__name__:
                found.append(kind(**entry))
        except (ValueError, TypeError):
            continue  # a line cut short by the kill it announced
    return found


def read_fired(path: str | os.PathLike[str]) -> list[Fired]:
    """The faults a rank reported firing (``Injector.report_to``), oldest first."""
    return _read(path, Fired)


def read_unfired(path: str | os.PathLike[str]) -> list[Unfired]:
    """The faults a rank that returned never reached (``report_unfired``)."""
    return _read(path, Unfired)


# The actions' own steps, one function each (the tests stand in for them).


def delay(seconds: float) -> None:
    time.sleep(seconds)


def exit_now(code: int) -> None:
    sys.stdout.flush()
    os._exit(code)


def kill_self() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def hang(released: threading.Event) -> None:
    """Sleep until killed, or until ``released`` (a stack dump shows the rank here, inside its
    collective's call)."""
    released.wait()


def close_sockets(sockets: list[tuple[int, str]]) -> int:
    """Shut down (both ways) each connected socket of ``sockets`` still open under the same
    inode (a closed fd's number may have been reused by another file); returns how many."""
    closed = 0
    for fd, link in sockets:
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != link:
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with sock:
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                continue  # a listener: shutting it makes gloo's listener thread abort
            try:
                sock.shutdown(socket.SHUT_RDWR)
                closed += 1
            except OSError:
                pass  # not connected
    return closed


INJECTOR = Injector()  # this process's one state (a rank's)


# Arm a plan in this rank, before its faulty groups are made or between collectives
# (``Injector.arm``).
arm = INJECTOR.arm


def arm_from_env(rank: int, world_size: int | None = None) -> Plan:
    """Arm the plan in ``TUTORIAL_IMPL_FAULTS`` (none: an empty plan); returns it."""
    plan = decode(os.environ.get(ENV, "[]"))
    arm(plan, rank, world_size)
    return plan


def fault_point(name: str) -> None:
    """Name a point of the rank's own code (a step): a ``Fault(step=name, at=n)`` fires at
    its n-th call. Cheap, armed or not: a count under a lock, and the point remembered."""
    INJECTOR.step(name)
