"""Waiting for rank processes, with deadlines and no leftovers: the engine under the forked
and the warm runners. It gathers one ``outcome.Report`` per rank; ``verdict`` decides.

The waiting is where multi-rank tests usually go wrong. Its rules (fail fast, a skip's grace,
a hang that cannot resolve, the deadline) are written once, in ``waiting``, for torchrun's
workers too; ``_Watch`` is the evidence they read here: each rank's pipe and process.

* **Crashes are seen at once.** Each process's *sentinel* (a file descriptor that becomes
  readable when the process exits) is waited on together with its result pipe, so a rank
  killed by a signal or by ``os._exit`` is noticed immediately rather than at a timeout.
* **Every wait has a deadline.** When it expires, each live rank gets SIGUSR1, which its
  ``faulthandler`` answers by writing the Python stack of every thread (``diagnose.stacks``); the
  same happens to the ranks still running when the wait ends for another reason.
* **Only the rank answers for its rank.** A report sent by a child a rank forked is that
  rank's failure, also when it arrives after the rank's own report.
* **Nothing outlives the call.** The runners kill every rank's process group in a
  ``finally``, after everything under the rank in other groups or sessions (not looked for
  when the rank's own report said nothing of its test runs any more: ``Report.quiet``, a
  rank with no child and no thread the function started); ``kill_all`` at
  exit is the last resort (``forkserver.boot`` covers a killed parent). What a rank the wait
  stopped had started is killed before the verdict, and named (``leftovers``).
"""

from __future__ import annotations

import atexit
import multiprocessing.process
import os
import pickle
import signal
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, TextIO

from tutorial_impl.testing.call import Call
from tutorial_impl.testing.diagnose import records, stacks
from tutorial_impl.testing.diagnose.recorder import Record
from tutorial_impl.testing.diagnose.stranded import POLL, Standing, Stranded, find
from tutorial_impl.testing.faults import inject
from tutorial_impl.testing.rank import leftovers
from tutorial_impl.testing.rank import outcome as _o
from tutorial_impl.testing.rank.debugging import Deadline
from tutorial_impl.testing.rank.spec import RankFiles
from tutorial_impl.testing.settings.timing import CRASH_GRACE
from tutorial_impl.testing.strategies import waiting
from tutorial_impl.testing.verdict.decision import Finished
from tutorial_impl.testing.verdict.errors import RankExited, prefixed

# c10d's warning when it cannot name a peer for a log message (rendezvous.py explains why
# that lookup may be refused); it says nothing about the test, so rank output omits it.
_DNS_NOISE = "[c10d] The hostname of the client socket cannot be retrieved"
RELAY_POLL = 0.1  # how often a streaming run copies the ranks' new output lines


@dataclass
class Proc:
    """One rank process as the parent sees it."""

    rank: int
    process: Any
    conn: Connection
    files: RankFiles  # the task's: a warm rank's change with each test
    streamed: int = 0  # characters of its log already relayed
    extra: list[Any] = field(default_factory=list)  # messages after its report (warm checks)
    quiet: bool = False  # its own report of this task said so (``outcome.Report.quiet``)

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def stack_path(self) -> Path:  # for ``diagnose.stacks.dump_stacks``
        return Path(self.files.stacks)

    @property
    def records_path(self) -> Path:  # for ``records.ask``
        return Path(self.files.records)

    def output(self) -> str:
        try:
            text = Path(self.files.log).read_text(errors="replace")
        except FileNotFoundError:
            return ""
        if _DNS_NOISE in text:
            text = "".join(x for x in text.splitlines(True) if _DNS_NOISE not in x)
        return text


class Live:
    """The rank processes of this process still alive: killed at interpreter exit."""

    def __init__(self) -> None:
        self.pids: set[int] = set()

    def add(self, pid: int) -> None:
        self.pids.add(pid)

    def kill(self, procs: list[Proc]) -> None:
        """SIGKILL each rank's process group and let go of it. SIGKILL cannot be caught:
        from here on a rank runs no more code; its parent, the forkserver, reaps it. Each is
        taken off multiprocessing's book of this process's children at once, so that the
        caller's ``multiprocessing.active_children()`` no longer lists it: a process that
        calls ``run_ranks`` again (a torchrun worker, a rank with a nested ``run_ranks``) must
        not see the ranks of an earlier call as its own children. Not waited for: a killed
        rank's exit (the kernel freeing its memory) took 5-8 ms of every fresh test's wall
        time when each was joined here (``docs/benchmarks.md``)."""
        for p in procs:
            if p.pid is not None:
                kill_group(p.pid, frozen_first=not p.quiet)
                self.pids.discard(p.pid)
            p.conn.close()
            multiprocessing.process._children.discard(p.process)  # type: ignore[attr-defined]

    def kill_all(self) -> None:
        for pid in list(self.pids):
            kill_group(pid)
        self.pids.clear()


LIVE = Live()
atexit.register(LIVE.kill_all)
# The threads of this process running a rank function a torchrun worker abandoned (``here``):
# its test has ended, so a nested ``run_ranks`` there may start no ranks (``forked.start``);
# they would outlive the test, into the next one's processes.
ABANDONED: set[threading.Thread] = set()


def kill_group(pid: int, frozen_first: bool = True) -> None:
    """SIGKILL the process group a rank leads (the rank and anything it started). Even a
    rank that has exited may have left children in its group, so the group is always
    killed; its id cannot have been reused while the group lives. First, unless the rank
    reported that nothing of its test still runs (``frozen_first=False``: ``Report.quiet``),
    everything under the rank, whatever group or session it moved to (``leftovers.kill_tree``:
    the rank frozen, a look at each of its threads' children; ~0.4 ms of CPU a rank)."""
    if frozen_first:
        leftovers.kill_tree(pid)
    for kill, target in ((os.killpg, pid), (os.kill, pid)):
        try:
            kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def supervise(
    procs: list[Proc], deadline: Deadline, call: Call, since_ns: int | None = None
) -> Finished:
    """Wait for every rank's report of ``call`` (the rules above; its ``deadline``,
    ``stream``, ``stream_prefix`` and ``may_exit``); what was seen, for ``verdict``.
    ``since_ns``: a warm world's task start (its ranks' records of earlier tests are not
    this test's; ``records.this_test``)."""
    timeout = call.deadline
    watch = _Watch(procs, call.stream, call.stream_prefix, call.may_exit, since_ns, timeout)
    watch.run(deadline)
    watch.late_reports()
    watch.relay()
    found = watch.this_test(watch.records)
    # A rank stopped here never killed what it started (``leftovers``): the parent does.
    stopped = [p for p in procs if isinstance(watch.reports[p.rank].outcome, _o.Unfinished)]
    swept = {p.rank: leftovers.kill_tree(p.pid) for p in stopped if p.pid is not None}
    return Finished(
        world_size=len(procs),
        reports=watch.reports,
        order=watch.order,
        outputs={p.rank: p.output() for p in procs},
        deadline=timeout,
        stacks=watch.stacks,
        fatal=watch.fatal,
        skip_wait=watch.skip_wait,
        records=found,
        fired={p.rank: fired for p in procs if (fired := inject.read_fired(p.files.fault))},
        swept={rank: killed for rank, killed in swept.items() if killed},
        unfired={p.rank: u for p in procs if (u := inject.read_unfired(p.files.fault))},
        stranded=watch.stranded_seen or watch.stranded_in(found),
    )


class _Watch:
    def __init__(
        self,
        procs: list[Proc],
        stream: TextIO | None,
        prefix: bool,
        may_exit: frozenset[int],
        since_ns: int | None = None,
        timeout: float = 0.0,
    ) -> None:
        self.procs = procs
        self.since_ns, self.timeout = since_ns, timeout
        self.standings: dict[int, Standing] = {}
        self.stranded_seen: Stranded | None = None  # seen while some ranks ran (``stranded``)
        self.look_at: float | None = None  # when to look for it next
        self.pending = {p.rank: p for p in procs}
        self.stream, self.prefix, self.may_exit = stream, prefix, may_exit
        self.reports: dict[int, _o.Report] = {}
        self.order: list[int] = []
        self.stacks: dict[int, str] = {}
        self.fatal: dict[int, str] = {}
        self.records: dict[int, list[Record]] = {}
        self.skip_at: float | None = None
        self.skip_wait = 0.0

    def handles(self) -> dict[Any, Proc]:
        found = {p.conn: p for p in self.pending.values()}
        found.update({p.process.sentinel: p for p in self.pending.values()})
        return found

    def run(self, deadline: Deadline) -> None:
        """Wait by the rules (``waiting.wait``); the ranks still running then are stopped."""
        ending = waiting.wait(self, deadline, CRASH_GRACE)
        if ending is not None:
            if self.skip_at is not None:
                self.skip_wait = time.monotonic() - self.skip_at
            self.stop_the_rest(ending)

    # --- the evidence ``waiting.wait`` reads ------------------------------------------
    def settle(self, wait_for: float) -> bool:
        """Take the reports and deaths that arrive within ``wait_for`` s (back at the first,
        at the next look for a stranding, and at the next relay of a streaming run)."""
        if self.stream:
            wait_for = min(wait_for, RELAY_POLL)
        if self.look_at is not None:
            wait_for = max(0.0, min(wait_for, self.look_at - time.monotonic()))
        handles = self.handles()
        ready = wait(list(handles), timeout=wait_for)
        self.relay()
        self.take_ready(handles, ready)
        return not self.pending

    def failed(self) -> bool:
        return any(isinstance(self.reports[r].outcome, _o.Failure) for r in self.order)

    def skipped_since(self) -> float | None:
        return self.skip_at

    def returned(self) -> list[int]:
        return [r for r in self.order if isinstance(self.reports[r].outcome, _o.Returned)]

    def stranded(self) -> bool:
        """Whether the ranks still running are stranded (``diagnose.stranded``): looked at
        every ``POLL`` s from ``POLL`` s after a rank returned; never while none has."""
        moment = time.monotonic()
        if not self.pending or not self.returned():
            self.look_at = None
            return False
        if self.look_at is None or moment < self.look_at:
            self.look_at = self.look_at or moment + POLL
            return False
        self.look_at = moment + POLL
        found, said = records.ask_all([p for p in self.procs if p.process.exitcode is None])
        self.standings.update(said)
        self.stranded_seen = self.stranded_in(self.this_test(found))
        return self.stranded_seen is not None

    def stranded_in(self, found: dict[int, list[Record]]) -> Stranded | None:
        running = [r for r, rep in self.reports.items() if isinstance(rep.outcome, _o.Unfinished)]
        running += list(self.pending)
        if not running:
            return None
        return find(found, self.standings, self.returned(), running, self.timeout)

    def this_test(self, found: dict[int, list[Record]]) -> dict[int, list[Record]]:
        """``found`` as this test's records: a warm world's numbered from the test's start
        (``records.this_test``), a rank's that reported cut at its report (a warm rank's own
        check comes after)."""
        if self.since_ns is not None:
            found = {r: records.this_test(recs, self.since_ns) for r, recs in found.items()}
        for r, report in self.reports.items():
            if r in found and not isinstance(report.outcome, _o.Unfinished):
                found[r] = [rec for rec in found[r] if rec.created_ns <= report.at * 1e9]
        return found

    def take(self, p: Proc) -> None:
        """Record ``p``'s report (or how it died), once."""
        if p.rank not in self.pending:
            return
        del self.pending[p.rank]
        report = receive(p)
        p.quiet = report.quiet and report.pid == p.pid
        if isinstance(report.outcome, _o.Died):
            if p.rank in self.may_exit:  # part of the test: its place in the results says so
                how = RankExited(p.rank, report.outcome.exitcode, report.outcome.how)
                report = _o.Report(_o.Returned(how), report.pid, report.at)
            elif p.stack_path.exists():
                self.fatal[p.rank] = p.stack_path.read_text(errors="replace")
        if isinstance(report.outcome, (_o.Skipped, _o.XFailed)) and self.skip_at is None:
            self.skip_at = time.monotonic()
        self.reports[p.rank] = report
        self.order.append(p.rank)

    def take_ready(self, handles: dict[Any, Proc], ready: list[Any]) -> None:
        """Take every report ``ready`` holds, in the order the ranks ended (``Report.at``),
        not the order of their handles: a parent behind under load finds several at once,
        and the first failure is the cause."""
        start = len(self.order)
        for handle in ready:
            self.take(handles[handle])
        self.order[start:] = sorted(self.order[start:], key=lambda r: self.reports[r].at)

    def stop_the_rest(self, kind: type[_o.TimedOut] | type[_o.Stopped]) -> None:
        """The ranks still running: their stacks, and ``kind`` as their outcome."""
        for p in list(self.pending.values()):
            if p.conn.poll():  # its report is already waiting: it is not running any more
                self.take(p)
        running = [p for p in self.pending.values() if p.process.exitcode is None]
        self.stacks = stacks.dump_stacks(running) if running else {}
        if running:  # every live rank's collectives, the ones that reported too
            alive = [p for p in self.procs if p.process.exitcode is None]
            self.records, said = records.ask_all(alive)
            self.standings.update(said)
        for rank, p in sorted(self.pending.items()):
            where = stacks.where(self.stacks.get(rank, ""))
            self.reports[rank] = _o.Report(kind(where), p.pid or 0, time.time())
        self.pending.clear()

    def late_reports(self) -> None:
        """Messages a rank's pipe holds after its report: a forked child's report fails the
        rank; anything else (a warm rank's check) is kept for its reader."""
        for p in self.procs:
            while not p.conn.closed and p.conn.poll():
                try:
                    message = pickle.loads(p.conn.recv_bytes())
                except Exception:  # noqa: BLE001 - EOF or garbage: nothing more to read
                    break
                if not (isinstance(message, _o.Report) and message.pid != p.pid):
                    p.extra.append(message)
                    continue
                p.quiet = False  # a child it forked reported: it did not end quietly
                if not isinstance(self.reports[p.rank].outcome, _o.Failure):
                    self.reports[p.rank] = message
                    self.order.append(p.rank)

    def relay(self) -> None:
        """Copy complete new lines of each rank's log to the stream (the CLI's live output)."""
        if self.stream is None:
            return
        for p in self.procs:
            text = p.output()
            end = text.rfind("\n", p.streamed) + 1
            if end > p.streamed:
                chunk = text[p.streamed : end]
                p.streamed = end
                self.stream.write(prefixed(p.rank, chunk, 10**9) + "\n" if self.prefix else chunk)
                self.stream.flush()


def receive(p: Proc) -> _o.Report:
    """The rank's report, or how it died without sending one."""
    if p.conn.poll():
        try:
            data = p.conn.recv_bytes()
        except (EOFError, OSError):
            data = None
        if data is not None:
            try:
                message = pickle.loads(data)
            except Exception as exc:  # noqa: BLE001 - e.g. a class the parent cannot import
                failure = _o.unpicklable("its result could not be unpickled in the parent", exc)
                return _o.Report(failure, p.pid or 0, time.time())
            if isinstance(message, _o.Report):
                return message
    p.process.join(1.0)
    return _o.Report(_o.died(p.process.exitcode), p.pid or 0, time.time())
