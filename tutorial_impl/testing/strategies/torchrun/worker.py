"""Under torchrun: ``run_ranks(fn)`` runs ``fn`` right here, as this rank of the job.

Forked, one pytest process starts fresh ranks for each test. Under a cluster launcher the
ranks already exist (``job``): every worker runs the same test in lockstep, so the call runs
``fn(rank, world_size)`` (in the function's shape: ``shape``) in this process, in the job's
process group. What makes that safe:

* **The function runs in a thread of its own** (``here``: the rank side of a call), through
  the same capture as a forked rank (``outcome.capture``); the main thread watches four
  things: the function ending, another rank failing (fail fast), a worker of the job gone
  (its heartbeat lost), and the deadline. Any of the last three ends the wait with the place
  this rank's function was in, read from its live frames (``diagnose.stacks``), passed
  through the job's store.
* **One verdict for every rank.** Each rank publishes its report (the value, or the
  exception as text) and reads everyone's; ``verdict.decide`` (``protocol.run``) turns them into
  the same results or the same error on every rank, by the rules forked ranks are judged by.
* **Nothing asked for is dropped.** A field of the call the job cannot honour
  (``NOT_HONOURED``, the strategy's ``cannot``) is refused by name, before anything runs.
* **A fault that ends its worker ends the job, after the verdict.** A ``Kill`` or an
  ``Exit`` fires in this worker as it would in a forked rank, but first the worker tells its
  peers through the store how it leaves and which fault fired (``Job.leave``), shuts its
  group's sockets (its peers' collectives fail as on a real death), and waits for rank 0's
  report; then it dies as asked, and torchrun's agent ends the job. Rank 0 writes the report:
  its ``Exit`` (or a rank function's ``os._exit``) ends only its function, the test fails with
  it, and the session stops after the test; a ``Kill`` there is refused.
* **An abandoned function stays out of later tests' reports.** A function still running at
  its deadline cannot be killed (it is a thread of this worker); it ends by itself once its
  collective hits the group's timeout. Its log records then belong to a test that has ended:
  ``AbandonedLogs`` keeps them out of the captured logs of the tests that come after.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from tutorial_impl.testing.call import Call
from tutorial_impl.testing.diagnose import records
from tutorial_impl.testing.faults import group, inject
from tutorial_impl.testing.rank import outcome as _o
from tutorial_impl.testing.rank.lookup import resolve
from tutorial_impl.testing.rank.shape import arguments
from tutorial_impl.testing.settings.timing import ANSWER_GRACE
from tutorial_impl.testing.strategies import protocol
from tutorial_impl.testing.strategies.torchrun import stranded
from tutorial_impl.testing.strategies.torchrun.here import Answer, pickled, run_here
from tutorial_impl.testing.strategies.torchrun.job import Job
from tutorial_impl.testing.strategies.torchrun.launch import size_mismatch
from tutorial_impl.testing.strategies.torchrun.launch import why_not_here as job_refuses
from tutorial_impl.testing.verdict.decision import Finished

NOT_HONOURED: Mapping[str, str] = MappingProxyType(
    {
        "init_method": "the job has torchrun's own rendezvous",
        "log_dir": "a worker's output goes where torchrun sends it",
        "stream": "a worker's output goes where torchrun sends it",
        "stream_prefix": "a worker's output goes where torchrun sends it",
        "may_exit": "a worker that exits ends the whole job; run this test forked",
        "debug_rank": "debugging one rank is for forked runs (--rank-pdb)",
    }
)
# A plan is honoured but for one value: a kill of the rank that reports for the job.
KILLS_REPORTER = (
    "a kill on rank 0 leaves the job without the rank that reports it; put it on another "
    "rank, or run this test forked"
)


def reporter_killed(call: Call) -> str | None:
    """The refusal of a plan that kills rank 0, which reports for the job; else None."""
    if any(f.action.name == "kill" and 0 in f.ranks for f in call.faults):
        return protocol.refused(["faults"], Launched.name, {"faults": KILLS_REPORTER})
    return None


class Launched:
    """This worker as one rank of the job: the ``torchrun`` strategy."""

    name = "torchrun"
    cannot = NOT_HONOURED
    serial = True  # this worker is one rank of one job
    own_ranks = False  # the job's workers are torchrun's, each capturing its own output

    def __init__(self, job: Job) -> None:
        self.job = job

    @property
    def size(self) -> int:
        return self.job.launch.world_size

    def why_not_here(self, settings: Any) -> str | None:
        return job_refuses(self.job.launch, settings)

    def gather(self, call: Call) -> Finished:
        __tracebackhide__ = True
        job, launch = self.job, self.job.launch
        refusal = protocol.refusal(self, call) or reporter_killed(call)
        if refusal or call.world_size != launch.world_size:
            raise ValueError(refusal or size_mismatch(call.world_size, launch))
        job.calls += 1
        key = f"call/{job.calls}"
        host = None
        saved = dict(os.environ)
        job.in_call = True
        try:
            os.environ.update(call.env)  # before the group: TORCH_DISTRIBUTED_DEBUG, say
            if call.backend is None:
                job.no_group()
                rendezvous, host = job.fresh_rendezvous(f"{key}/port", call.deadline)
                os.environ.update(rendezvous)
                os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # rank 0 hosts it
            else:
                job.group(_backend(call), call.deadline)
            rank, size = launch.rank, launch.world_size
            args, kwargs = arguments(call.payload, call.rank_params, rank, size)
            since_ns = time.time_ns()
            # A faulty group numbers this call's collectives from 1.
            inject.arm(call.faults, rank, before_death=self._leave)
            fn = resolve(call.function)
            mine = run_here(job, key, fn, args, kwargs, call.deadline, since_ns)
            mine.records, mine.fired = records.own(rank, since_ns), _my_fired()
            mine.unfired = inject.INJECTOR.unfired(call.faults)  # read if it returned
            inject.arm((), rank)
            wait = call.deadline + ANSWER_GRACE
            answers = job.channel.gather(key, pickled(mine), wait, job.heartbeats)
        finally:
            job.in_call = False
            os.environ.clear()
            os.environ.update(saved)
        finished = finish(job, answers, call.deadline)
        job.ending = job.ending or _reporter_left(answers)
        job.dirty = any(not isinstance(o, _o.Returned) for o in finished.outcomes.values())
        job.dirty |= bool(finished.fired)  # a group that saw a fault is made anew
        if host is not None and job.dirty:
            job.stale.append(host)  # a failed call's port stays reserved: a rank may still use it
        elif host is not None:
            host.close()
        return finished

    def test_ended(self, failed: bool) -> None:
        pass  # a dirty job's group is made anew by its next call (``Job.dirty``)

    def close(self) -> None:
        pass  # the job ends with the session (``strategies.torchrun.session``)

    def _leave(self, status: int) -> None:
        """Before a fault ends this worker (``status``: the exit code, or minus the signal):
        tell the peers, shut the group's sockets as the kernel would, wait for rank 0's
        report. Rank 0 (an ``Exit``: a ``Kill`` there is refused) only shuts its sockets: it
        writes the report, and its exit ends its function, not the worker
        (``Job._exit_mid_session``)."""
        if self.job.launch.rank == 0:
            inject.close_sockets(inject.INJECTOR.sockets)
            return
        self.job.leave(status, tuple(_my_fired()))
        inject.close_sockets(inject.INJECTOR.sockets)
        self.job.await_report()


def _reporter_left(answers: dict[int, Answer]) -> str | None:
    """Why the session stops after this test, the same on every rank: rank 0's function
    called ``os._exit`` (its answer says ``Lost``: ``Job._exit_mid_session``)."""
    outcome = answers[0].report.outcome if 0 in answers else None
    if not isinstance(outcome, _o.Lost):
        return None
    return (
        f"rank 0 {outcome.how} in a rank function; rank 0 writes the job's report, so the "
        "session stops after this test"
    )


def _backend(call: Call) -> str:
    """The group's backend: gloo behind the fault injector when the call has a plan."""
    assert call.backend is not None
    if call.faults and call.backend == "gloo":
        group.register()
        return group.BACKEND
    return call.backend


def _my_fired() -> list[inject.Fired]:
    return list(inject.INJECTOR.reports)


def finish(job: Job, answers: dict[int, Answer], deadline: float) -> Finished:
    """Every rank's answer as the verdict reads it. A rank that published none is named as
    it said when it left (``Departure``: a fault or ``os._exit`` ended it, and it said nothing
    more after), else as exited when its heartbeat is lost, else as still running."""
    reports = {r: a.report for r, a in answers.items()}
    stacks = {r: a.stacks for r, a in answers.items() if a.stacks}
    fired = {r: a.fired for r, a in answers.items() if a.fired}
    for r in range(job.launch.world_size):
        if r in reports:
            continue
        departure = job.heartbeats.departure(r)
        if departure is not None:
            reports[r] = _o.Report(departure.outcome, 0, departure.at)
            fired[r] = list(departure.fired)
            continue
        lost = job.heartbeats.lost(r)
        reports[r] = _o.Report(_o.Lost(None) if lost else _o.Stopped(None), 0, time.time())
        stacks[r] = "(no answer through the store: the worker is gone)" if lost else ""
    return Finished(
        world_size=job.launch.world_size,
        reports=reports,
        order=sorted(reports, key=lambda r: (reports[r].at, r)),
        outputs={r: a.output for r, a in answers.items()},
        deadline=deadline,
        stacks=stacks,
        records={r: a.records for r, a in answers.items() if a.records is not None},
        fired=fired,
        unfired={r: a.unfired for r, a in answers.items() if a.unfired},
        stranded=stranded.of_answers(answers, deadline),
    )


class _FromAbandoned(logging.Filter):
    """Drops the records logged by the rank functions this worker abandoned."""

    def __init__(self, job: Job) -> None:
        super().__init__()
        self.job = job

    def filter(self, record: logging.LogRecord) -> bool:
        return all(thread.ident != record.thread for thread in self.job.abandoned)


class AbandonedLogs:
    """A pytest plugin of a torchrun worker: in each phase of each test, once a function has
    been abandoned, every log handler (pytest's capture of this phase, and any logger's own)
    drops that function's records. Its hooks are plain, not wrappers, so they run inside
    pytest's logging capture, when this phase's handlers exist."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.filter = _FromAbandoned(job)

    def mute(self) -> None:
        if not self.job.abandoned:
            return
        loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
        for logger in loggers:
            for handler in getattr(logger, "handlers", ()):  # placeholders have none
                if self.filter not in handler.filters:
                    handler.addFilter(self.filter)

    def pytest_runtest_setup(self) -> None:
        self.mute()

    def pytest_runtest_call(self) -> None:
        self.mute()

    def pytest_runtest_teardown(self) -> None:
        self.mute()
