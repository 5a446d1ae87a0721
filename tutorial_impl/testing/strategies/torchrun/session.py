"""The pytest side of a torchrun job: the same tests everywhere, one verdict each, one report.

``plugin.py`` registers a ``LaunchedSession`` when pytest runs as a worker of a torchrun job
(see ``job``; ``torchrun`` runs the ``run_ranks`` calls). Its hooks, in the order pytest calls them:

``pytest_collection_finish``
    every rank publishes the test ids it collected (and its collection errors) and reads
    everyone's: ranks that would not run the same tests in the same order refuse, all of
    them, with the first difference named, before any test runs.
``pytest_runtest_setup`` / ``_call`` / ``_teardown`` (wrappers)
    start and stop the watchdog's clock for the phase: past the deadline it publishes this
    rank's stacks to the store and interrupts the main thread (``PhaseDeadline``). The same
    watchdog thread beats this worker's heartbeat (``job.Heartbeats``), so that the others
    name a worker that exits within seconds, instead of waiting out their deadlines.
``pytest_runtest_makereport`` (wrapper)
    every rank publishes how the phase went and reads everyone's; every rank then reports the
    same outcome: failed if any rank failed, else skipped if any skipped, else passed. Rank 0
    adds the other ranks' tracebacks and output as report sections. A setup that failed on
    one rank thus fails on all, and no rank runs the test body alone. Once the session has
    stopped (a rank lost or stuck, rank 0's exit, a SIGTERM), every later test is skipped on
    every rank, ``not run: `` and why, without an exchange: each test gets a report.
``pytest_sessionfinish`` / ``pytest_unconfigure``
    the ranks agree on one exit status, and each worker exits with it through ``os._exit``
    (no interpreter teardown around gloo's threads: see ``dist_tuto/process.py``), once rank
    0's report is written, so the agents and the scheduler see the truth.

SIGTERM or SIGHUP (torchrun's agent ending the job because a worker has ended, a scheduler)
fails the phase running (``JobStopped``), tells the other ranks, and the report is written
within ``STOP_BUDGET`` s. Ranks other than 0 write nothing to the terminal and no junit XML:
rank 0's report is the job's, or, if rank 0 is lost, the lowest rank left's (``reporter``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tutorial_impl.testing import words
from tutorial_impl.testing.diagnose import stacks
from tutorial_impl.testing.rank import leftovers
from tutorial_impl.testing.settings.timing import (
    ANSWER_GRACE,
    COLLECT_TIMEOUT,
    GIVE_UP,
    HEARTBEAT,
    PHASE_GRACE,
    REPORT_MARGIN,
    REPORT_WAIT,
    STATUS_TIMEOUT,
    STOP_BUDGET,
)
from tutorial_impl.testing.strategies.torchrun import watcher
from tutorial_impl.testing.strategies.torchrun.job import Job
from tutorial_impl.testing.strategies.torchrun.phases import (
    agree,
    collection_problem,
    job_status,
    lockstep_problem,
    verdict_of,
)
from tutorial_impl.testing.strategies.torchrun.reporter import Reporter

_INTERRUPT = getattr(signal, "SIGUSR2", None)


class PhaseDeadline(Exception):
    """Raised in the main thread by the watchdog: a test phase ran past its deadline."""


class JobStopped(Exception):
    """Raised in the main thread, in a test phase, when the worker gets SIGTERM (or SIGHUP):
    torchrun's agent (a worker of the job ended), or the scheduler, is ending the job."""


@dataclass
class _Phase:
    seq: int
    limit: float  # seconds
    stop: float  # monotonic time
    dumped: bool = False


class LaunchedSession:
    """Hooks of a pytest run that is one rank of a torchrun job (registered by the plugin)."""

    def __init__(self, config: pytest.Config, job: Job, deadline_of: Any) -> None:
        self.config = config
        self.job = job
        self.launch = job.launch
        self.deadline_of = deadline_of  # item -> its harness deadline, in seconds
        self.seq = 0  # report exchanges so far, the same count on every rank
        self.refusal: str | None = None  # why no test ran (collection differs)
        self.broken: str | None = None  # why the session stopped early
        self.stopped_at: str | None = None  # the test it stopped in: the later ones not run
        self.stopping: str | None = None  # why this worker was told to end (SIGTERM)
        self.status = 0
        self.hosts: dict[int, str] = {}
        self.lost: set[int] = set()  # ranks whose worker exited (heartbeat lost)
        self.not_run = 0  # tests skipped because the session stopped before them
        self.finished = False  # the ranks agreed on the exit status
        self._phase: _Phase | None = None
        self._main = threading.main_thread().ident
        if threading.current_thread() is threading.main_thread():
            if _INTERRUPT is not None:
                signal.signal(_INTERRUPT, self._interrupted)
            for signum in watcher.FORWARDED:
                signal.signal(signum, self._stop)
        threading.Thread(target=self._watch, name="harness watchdog", daemon=True).start()
        self.reporter = Reporter(config, self.launch.rank)

    # --- the report header and summary (rank 0's terminal) -----------------------------

    def pytest_report_header(self) -> list[str]:
        return [
            f"torchrun: {self.launch.world_size} ranks, {self.launch.describe}; rank 0 reports "
            "for every rank (the others are quiet)"
        ]

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        by_host: dict[str, list[int]] = {}
        for rank, host in sorted(self.hosts.items()):
            by_host.setdefault(host, []).append(rank)
        if by_host:
            terminalreporter.write_line(
                f"torchrun: {self.launch.world_size} ranks on {len(by_host)} host(s): "
                + "; ".join(f"{h}: ranks {', '.join(map(str, r))}" for h, r in by_host.items())
            )
        broken = self.broken
        if broken and self.not_run:
            broken += f"\n{self.not_run} test(s) after it not run (reported as skipped)"
        if broken and self.reporter.took_over:
            broken += f"\n{self.reporter.took_over}"
        for title, text in (("torchrun: no test ran", self.refusal), ("torchrun", broken)):
            if text:
                terminalreporter.section(title, sep="=", red=True, bold=True)
                terminalreporter.line(text)

    # --- the same tests on every rank ---------------------------------------------------

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        errors = [
            rep.longreprtext.strip().splitlines()[-1] if rep.longreprtext.strip() else rep.nodeid
            for rep in _reporter(self.config).stats.get("error", [])
            if getattr(rep, "when", None) is None
        ]
        mine = {"ids": [item.nodeid for item in session.items], "errors": errors}
        mine["host"] = socket.gethostname()
        got = self.job.channel.gather("collected", mine, COLLECT_TIMEOUT, self.job.heartbeats)
        self.hosts = {r: g["host"] for r, g in got.items()}
        self.refusal = collection_problem(got, self.launch.world_size)
        if self.refusal:
            session.items.clear()  # every rank: nothing runs, nobody waits for anybody

    # --- the watchdog's clock, one phase at a time ---------------------------------------

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Any:
        if self._not_run(item):  # skipped on every rank (pytest's own skip: no fixture)
            item.add_marker(pytest.mark.skip(reason=words.not_run(self.broken)))
            return (yield)
        with self._clock(item, "setup"):
            return (yield)

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Any:
        with self._clock(item, "call"):
            return (yield)

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Any:
        with self._clock(item, "teardown"):
            return (yield)

    def _limit(self, item: pytest.Item) -> float:
        return self.deadline_of(item) + PHASE_GRACE

    def _not_run(self, item: pytest.Item) -> bool:
        return self.broken is not None and item.nodeid != self.stopped_at

    @contextlib.contextmanager
    def _clock(self, item: pytest.Item, when: str) -> Iterator[None]:
        if self.stopping and when != "teardown":  # told to end between two phases: no
            raise JobStopped(f"{self.stopping}; {words.SESSION_STOPS}")  # more test code
        limit = self._limit(item)
        self._phase = _Phase(self.seq + 1, limit, time.monotonic() + limit)
        try:
            yield
        finally:
            self._phase = None

    def _interrupted(self, signum: int, frame: Any) -> None:
        __tracebackhide__ = True
        phase = self._phase
        if phase is None or not phase.dumped:
            return  # the phase ended as the watchdog fired: nothing to stop any more
        raise PhaseDeadline(
            f"rank {self.launch.rank} ran past the harness deadline "
            f"({phase.limit:g} s) outside any run_ranks call; the watchdog "
            "stopped it here"
        )

    def _stop(self, signum: int, frame: Any) -> None:
        """SIGTERM (or SIGHUP): the job is ending. Tell the other ranks (``abort``), fail the
        phase running now (``JobStopped``): the session reports it, the later tests as not
        run, writes the report and exits; whatever happens, within ``STOP_BUDGET`` s."""
        __tracebackhide__ = True
        if os.getpid() != self.job.pid:  # a process a test forked (a pool's worker): as
            signal.signal(signum, signal.SIG_DFL)  # if this handler were not there
            os.kill(os.getpid(), signum)
            return
        if self.stopping is not None:
            return  # once: the watcher passes on what the agent may also send the group
        if self.finished and not self.reporter.is_me():
            _exit(self.status, self.job)  # its part is done: the status is agreed
        name = signal.Signals(signum).name
        self.stopping = (
            f"rank {self.launch.rank} got {name}: torchrun's agent (a worker of the job has "
            "ended) or the scheduler is ending the job"
        )
        with contextlib.suppress(Exception):
            self.job.channel.set("abort", self.stopping)
        threading.Thread(target=self._end_by, name="harness stop", daemon=True).start()
        if self._phase is not None:
            raise JobStopped(f"{self.stopping}; {words.SESSION_STOPS}")

    def _end_by(self) -> None:
        time.sleep(STOP_BUDGET)
        _exit(self.status if self.finished else 1, self.job)  # 1: the session was cut short

    def _watch(self) -> None:
        """Past a phase's deadline: publish this rank's stacks, interrupt the main thread;
        if the others gave up on us meanwhile, end this worker (it cannot report)."""
        channel = self.job.channel
        beaten = 0.0
        while True:
            time.sleep(0.1)
            if time.monotonic() - beaten >= HEARTBEAT:
                self.job.heartbeats.beat()
                beaten = time.monotonic()
            phase = self._phase
            if phase is not None and self.job.in_call:  # run_ranks keeps its own time
                phase.stop = max(phase.stop, time.monotonic() + phase.limit)
            if phase is None or time.monotonic() < phase.stop:
                continue
            if not phase.dumped:
                phase.dumped = True
                channel.set(f"stacks/{phase.seq}/{self.launch.rank}", _main_thread_stack())
                if _INTERRUPT is not None and self._main is not None:
                    signal.pthread_kill(self._main, _INTERRUPT)
            elif time.monotonic() > phase.stop + GIVE_UP and channel.has("abort"):
                stop = time.monotonic() + GIVE_UP
                while not channel.has("done") and time.monotonic() < stop:
                    time.sleep(0.1)
                _exit(1, self.job)

    # --- one verdict per phase ------------------------------------------------------------

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
        rep = yield
        if self._not_run(item):  # decided alike on every rank: nothing to exchange
            self.not_run += rep.when == "setup"
            return rep
        self.seq += 1
        if call.excinfo is not None and isinstance(call.excinfo.value, PhaseDeadline | JobStopped):
            crash = getattr(rep.longrepr, "reprcrash", None)
            if crash is not None:
                crash.message = str(call.excinfo.value)
        mine = verdict_of(rep)
        wait = self._limit(item) + ANSWER_GRACE + REPORT_MARGIN
        got = self.job.channel.gather(f"report/{self.seq}", mine, wait, self.job.heartbeats)
        gone = [r for r in range(self.launch.world_size) if r not in got]
        lost = {
            r: self.job.heartbeats.how(r)
            for r in gone
            if r not in self.lost and self.job.heartbeats.lost(r)
        }
        for r in self.lost:  # named when they went; the phases after it are this rank's own
            got.setdefault(r, mine)
        agree(rep, mine, got, self.launch.rank, self.launch.world_size, self._stacks_of, lost)
        problem = lockstep_problem(mine, got, self.launch.world_size, lost)
        problem = problem or (self.job.ending if rep.when == "teardown" else None)
        problem = problem or self._aborted()
        self.lost |= set(lost)
        self.reporter.after_loss(self.lost, self.launch.world_size, lost)
        if problem and not self.broken:
            self.broken, self.stopped_at = problem, item.nodeid
            self.job.channel.set("abort", problem)
        return rep

    def _aborted(self) -> str | None:
        """Why another rank stopped the session (``abort``), read after an exchange that it
        took part in: every rank stops after the same phase."""
        if not self.job.channel.has("abort"):
            return None
        why = self.job.channel.get("abort")
        return why if isinstance(why, str) else "another rank stopped the session"

    def _stacks_of(self, rank: int) -> str:
        key = f"stacks/{self.seq}/{rank}"
        stop = time.monotonic() + 2.0  # its watchdog publishes them at its deadline
        while not self.job.channel.has(key) and time.monotonic() < stop:
            time.sleep(0.05)
        return self.job.channel.get(key) if self.job.channel.has(key) else ""

    # --- one exit status ------------------------------------------------------------------

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        mine = int(exitstatus)
        if self.refusal:  # not "no tests collected": the ranks refused to run them
            mine = int(pytest.ExitCode.USAGE_ERROR)
        got = self.job.channel.gather("status", mine, STATUS_TIMEOUT, self.job.heartbeats)
        self.status = job_status(got, self.launch.world_size)
        session.exitstatus = self.status
        self.finished = True
        # From here on a SIGTERM (``_stop``) ends no phase: the report is written, and the
        # worker exits with the agreed status, within ``STOP_BUDGET`` s.

    @pytest.hookimpl(trylast=True)
    def pytest_unconfigure(self) -> None:
        """Exit with the agreed status, once rank 0's report is written: the agent SIGTERMs
        the workers still running as soon as one exits non-zero, and rank 0 must not be cut
        off mid-report. Rank 0 then waits briefly for the others to leave first, so the
        agent sees every worker end by itself; after a crash, until the agent ends this one
        (at most ``GIVE_UP`` s): torchrun names one failed worker, the lowest rank among those
        it finds ended at a look, which must be the crashed one, not this rank's status."""
        channel = self.job.channel
        if not self.reporter.is_me():
            stop = time.monotonic() + REPORT_WAIT
            while not channel.has("done") and time.monotonic() < stop:
                time.sleep(0.05)
            channel.publish("leaving", self.status)
            _exit(self.status, self.job)
        channel.set("done")
        channel.publish("leaving", self.status)
        channel.collect("leaving", GIVE_UP, self.job.heartbeats)
        if channel.crashed():  # the agent, which saw that worker end, ends this one
            stop = time.monotonic() + GIVE_UP
            while self.stopping is None and time.monotonic() < stop:
                time.sleep(0.01)
        _exit(self.status, self.job)


def _main_thread_stack() -> str:
    """The main thread's Python stack (where pytest is in the test), most recent call first,
    without pytest's and pluggy's own frames below the test."""
    main = threading.main_thread()
    frames = stacks.frames_of(sys._current_frames().get(main.ident or -1), "")
    own = []
    for frame in frames:
        if "/_pytest/" in frame[0] or "/pluggy/" in frame[0]:
            break
        own.append(frame)
    title = f"Thread {main.ident:#x} (main thread: the test, most recent call first):"
    return stacks.format_frames(title, own)


def _exit(status: int, job: Job) -> None:
    """Leave without interpreter teardown: gloo's threads, and any rank function still
    stuck in a thread, would make it abort or hang (see ``dist_tuto.process.exit_process``).
    First kill what the session's tests still left (its fixtures have ended): a process a
    thread of a rank function started after its call had ended, too late for the call's own
    sweep (``here``), would otherwise outlive the job, in a session of its own."""
    leftovers.kill_leftovers()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # noqa: BLE001
            pass
    job.real_exit(status)  # the session's own end: not the hook a test's os._exit meets


def _reporter(config: pytest.Config) -> Any:
    return config.pluginmanager.get_plugin("terminalreporter")
