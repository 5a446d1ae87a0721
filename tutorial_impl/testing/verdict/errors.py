"""What ``run_ranks`` returns and raises, and the text of its reports.

A failure report is built for a reader who was not there, and its **first line is the
cause**: ``rank 1 raised ValueError: boom on one``, ``rank 1 was killed by signal SIGKILL``,
or, for a hang, from the ranks' records: ``rank 0 waits in all_reduce #2 at t.py:12; rank 1
never reached #2``. That line is what pytest's ``-ra``, junit XML and CI summaries show.
Then come the failing rank's traceback, where every other running rank was (``stacks``), and
what every rank printed (``outputs``), each line prefixed ``[rank N]``. Under pytest the
stacks and outputs go to report sections of their own instead (``report.py``).

Every exception here has structured fields (``rank``, ``exc_type``, ``pending``, ...), one
constructor style, and survives pickling (a test may pass it between processes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tutorial_impl.testing import words
from tutorial_impl.testing.diagnose.stacks import Place
from tutorial_impl.testing.faults.inject import Fired
from tutorial_impl.testing.rank import outcome as _o

OUTPUT_TAIL_LINES = 200  # per rank, in error messages


def _rebuild(cls: type, args: tuple, state: dict[str, Any]) -> RankError:
    error = Exception.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class RankError(Exception):
    """Base of everything ``run_ranks`` raises about its ranks.

    ``str(error)`` is the whole report; ``headline`` its first line, the cause. ``outputs``
    maps each rank to what it printed, ``stacks`` each other running rank to its Python
    stacks at the moment of the failure. ``sections=False`` (the pytest plugin sets it)
    leaves stacks and outputs out of ``str(error)``, for report sections of their own.
    """

    def __init__(
        self, message: str, outputs: dict[int, str], stacks: dict[int, str] | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.outputs = outputs
        self.stacks = stacks or {}
        self.in_message = True  # stacks and outputs in str(error)
        self.failed_ranks: list[int] = []  # every rank that failed (raised or died)
        self.thread_errors: dict[int, tuple[str, ...]] = {}  # exceptions in rank threads
        self.caught: dict[int, _o.Caught] = {}  # the ranks' warnings (``caught``)
        self.outcomes: dict[int, _o.Outcome] = {}  # how every rank ended (``verdict``)
        self.killed: dict[int, tuple[_o.Leftover, ...]] = {}  # what ranks left running

    @property
    def headline(self) -> str:
        return self.message.partition("\n")[0]

    def __str__(self) -> str:
        if not self.in_message:
            return self.message
        return self.message + self._stacks_text() + outputs_section(self.outputs)

    def _stacks_text(self) -> str:
        return ""

    def __reduce__(self) -> tuple[Any, ...]:
        # Exception pickles as cls(*args), which these constructors do not take.
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))


class RankFailed(RankError):
    """A rank raised an exception: ``rank``, ``exc_type`` and ``exc_message`` say which and
    what, ``traceback`` where; ``stacks`` maps every other rank still running to its
    Python stacks at that moment (see ``diagnose.stacks``)."""

    def __init__(
        self,
        rank: int,
        tb: str,
        message: str,
        outputs: dict[int, str],
        stacks: dict[int, str] | None = None,
        exc_type: str = "",
        exc_message: str = "",
    ) -> None:
        super().__init__(message, outputs, stacks)
        self.rank = rank
        self.traceback = tb
        self.exc_type = exc_type
        self.exc_message = exc_message

    def _stacks_text(self) -> str:
        return _others_section(self.rank, self.stacks)


class RankCrashed(RankError):
    """A rank process ended (signal, ``os._exit``) without reporting a result.

    ``exitcode`` is negative for a signal; ``stacks``: the other ranks still running then.
    """

    def __init__(
        self,
        rank: int,
        exitcode: int | None,
        message: str,
        outputs: dict[int, str],
        stacks: dict[int, str] | None = None,
    ) -> None:
        super().__init__(message, outputs, stacks)
        self.rank = rank
        self.exitcode = exitcode

    def _stacks_text(self) -> str:
        return _others_section(self.rank, self.stacks)


class RankTimeout(RankError):
    """The deadline (``timeout`` seconds) passed: ``pending`` ranks had not finished,
    ``where`` maps each to its innermost line of user code, ``stacks`` to its Python stacks."""

    def __init__(
        self,
        stacks: dict[int, str],
        message: str,
        outputs: dict[int, str],
        pending: list[int] | None = None,
        where: dict[int, Place] | None = None,
        timeout: float | None = None,
    ) -> None:
        super().__init__(message, outputs, stacks)
        self.pending = sorted(pending if pending is not None else stacks)
        self.where = where or {}
        self.timeout = timeout

    def _stacks_text(self) -> str:
        return "\n\n" + stacks_section(self.stacks) if self.stacks else ""


class RankSkipped(RankError):
    """A rank called ``pytest.skip``; the pytest plugin turns this into a skipped test."""

    def __init__(self, rank: int, reason: str, outputs: dict[int, str]) -> None:
        super().__init__(words.SKIPPED.format(rank=rank, reason=reason), outputs)
        self.rank = rank
        self.reason = reason


class RankXFailed(RankError):
    """A rank called ``pytest.xfail``; the pytest plugin turns this into an expected failure."""

    def __init__(self, rank: int, reason: str, outputs: dict[int, str]) -> None:
        super().__init__(words.XFAILED.format(rank=rank, reason=reason), outputs)
        self.rank = rank
        self.reason = reason


@dataclass(frozen=True)
class RankExited:
    """How a rank of ``run_ranks(..., may_exit={rank})`` ended without reporting a result.

    It stands in that rank's place in the results: ``exitcode`` is the process's exit code,
    negative for a signal (``-9`` for SIGKILL), and ``how`` says it in words.
    """

    rank: int
    exitcode: int | None
    how: str


class RankResults(list):  # type: ignore[type-arg]
    """The ranks' return values in rank order; what each rank printed (``outputs``), the
    exceptions its own threads raised (``thread_errors``), what else it warned (``caught``),
    the processes it left running (``killed``), the faults fired in it (``fired``)."""

    outputs: list[str]
    thread_errors: dict[int, tuple[str, ...]] = {}  # noqa: RUF012 - replaced per instance
    caught: dict[int, _o.Caught] = {}  # noqa: RUF012 - replaced per instance
    killed: dict[int, tuple[_o.Leftover, ...]] = {}  # noqa: RUF012 - replaced per instance
    fired: dict[int, tuple[Fired, ...]] = {}  # noqa: RUF012 - every rank's, oldest first


def prefixed(rank: int, text: str, limit: int = OUTPUT_TAIL_LINES) -> str:
    """``text`` with every line prefixed ``[rank N]``, keeping only the last ``limit`` lines."""
    lines = text.rstrip("\n").splitlines()
    cut = len(lines) - limit
    shown = [f"[rank {rank}] {line}" for line in lines[-limit:]]
    if cut > 0:
        shown.insert(0, f"[rank {rank}] ... ({cut} earlier lines cut)")
    return "\n".join(shown)


def outputs_section(outputs: dict[int, str]) -> str:
    """The section of a report that shows what each rank printed (empty if nothing)."""
    parts = [prefixed(rank, out) for rank, out in sorted(outputs.items()) if out.strip()]
    if not parts:
        return ""
    return "\n\n----- output of the ranks (stdout and stderr) -----\n" + "\n".join(parts)


def stack_text(text: str) -> str:
    return text.rstrip() or "(no answer: the rank was still starting, or had just died)"


def stacks_section(stacks: dict[int, str]) -> str:
    """Each rank's stack dump under its own heading, in rank order."""
    return "\n\n".join(
        f"----- Python stacks of rank {rank} -----\n" + stack_text(text)
        for rank, text in sorted(stacks.items())
    )


def _others_section(failed: int, stacks: dict[int, str]) -> str:
    if not stacks:
        return ""
    names = ", ".join(str(r) for r in sorted(stacks))
    return (
        f"\n\n===== where the other running rank(s) {names} were when rank {failed} failed "
        "=====\n" + stacks_section(stacks)
    )


def timeout_error(
    pending: list[int],
    timeout: float,
    stacks: dict[int, str],
    outputs: dict[int, str],
    where: dict[int, Place] | None = None,
    ended: dict[int, str] | None = None,
    explained: str | None = None,
    fired: str = "",
    waiting: frozenset[int] = frozenset(),
) -> RankTimeout:
    """The deadline passed with ``pending`` ranks unfinished; ``stacks`` are their dumps;
    ``explained``, ``waiting``: see ``words.hang``; ``fired``: the faults injected."""
    where = where or {}
    message = words.hang(pending, timeout, where, ended, explained, waiting)
    if fired:
        message += f" ({fired})"
    return RankTimeout(stacks, message, outputs, list(pending), where, timeout)


def add_to_headline(error: RankError, text: str) -> None:
    """Append ``text`` to the first line of ``error``'s report."""
    set_headline(error, error.headline + text)


def set_headline(error: RankError, headline: str) -> None:
    """Make ``headline`` the first line of ``error``'s report."""
    error.message = headline + error.message[len(error.headline) :]
    error.args = (error.message,)


def skip_outlived_error(
    skipped: int,
    reason: str,
    pending: list[int],
    waited: float,
    stacks: dict[int, str],
    outputs: dict[int, str],
    where: dict[int, Place],
) -> RankTimeout:
    """Rank ``skipped`` skipped, and ``pending`` were still running ``waited`` s later: not a
    skip (the others might still have failed), a failure that says why."""
    message = words.skip_outlived(skipped, reason, pending, waited, where)
    return RankTimeout(stacks, message, outputs, list(pending), where, None)


def _describe(result: _o.Outcome) -> str:
    if isinstance(result, _o.Raised):
        return f"raised {result.summary}"
    return f"{result.how}" if isinstance(result, _o.Died) else repr(result)


def error_for(
    rank: int,
    result: _o.Outcome,
    fatal_stack: str,
    outputs: dict[int, str],
    stacks: dict[int, str] | None = None,
    also: dict[int, _o.Outcome] | None = None,
    named: list[int] | None = None,
) -> RankError:
    """The exception for one rank's bad outcome; the one place they are built. The failing
    rank comes first (the cause in one line, then its traceback or how it died), then every
    other rank that failed too (``also``: named on the first line as well), then ``stacks``:
    where each other running rank was at that moment, then what every rank printed."""
    if isinstance(result, _o.Skipped):
        return RankSkipped(rank, result.reason, outputs)
    if isinstance(result, _o.XFailed):
        return RankXFailed(rank, result.reason, outputs)
    also = also or {}
    # ``named``: the others that failed of their own accord (default: all of ``also``); a
    # death's consequences (its peers' "Connection closed by peer") are shown, not named.
    own = sorted(also if named is None else named)
    named_text = words.failed_too(own)
    others = "".join(
        words.ALSO_FAILED.format(rank=r, how=_describe(o))
        + (o.traceback.rstrip() if isinstance(o, _o.Raised) else "")
        for r, o in sorted(also.items())
    )
    if isinstance(result, _o.Raised):
        said = words.RAISED.format(rank=rank, summary=result.summary)
        message = f"{said}{named_text}\n\n{result.traceback.rstrip()}"
        error: RankError = RankFailed(
            rank,
            result.traceback,
            message + others,
            outputs,
            stacks,
            result.exc_type,
            result.message,
        )
    elif isinstance(result, _o.Died):
        extra = ""
        if fatal_stack.strip():
            extra = f"\n\n----- fatal-signal stack of rank {rank} -----\n{fatal_stack}"
        message = words.DIED.format(rank=rank, how=result.how) + named_text + extra
        error = RankCrashed(rank, result.exitcode, message + others, outputs, stacks)
    else:
        raise TypeError(f"rank {rank}: {result!r} is not a failure")
    error.failed_ranks = sorted([rank, *own])
    return error
