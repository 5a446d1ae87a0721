"""What one rank reports: a small typed value, pickled once through the rank's result pipe.

A rank ends in exactly one of these ways, and ``verdict`` decides from the type alone:

``Returned(value)``            the rank function returned ``value``
``Raised(...)``                it raised: the exception's type, message and traceback, as text
``Skipped(reason)``            it called ``pytest.skip``: the test is skipped
``XFailed(reason)``            it called ``pytest.xfail``: the test is an expected failure
``Exited(exitcode)``           the process ended without reporting (``os._exit``, a crash)
``Killed(signal)``             ... or a signal killed it (the OOM killer's SIGKILL, a segfault)
``Lost()``                     a torchrun worker that is gone (its heartbeat stopped)
``TimedOut(where)``            it was still running at the deadline; ``where`` is its
                               innermost frame of user code, from its stack dump
``Stopped(where)``             it was still running when the run ended for another rank's
                               sake (a failure elsewhere, or a skip the others outlived)

``capture`` is the one place a rank's result is caught, for every way of starting ranks
(forked, warm, under torchrun): it calls the rank function, turns what happened into one of
the above, and wraps it in a ``Report`` that says which process answered (only the rank
itself may: a child it forked that returns from the function is a failure of that rank),
when, which exceptions the rank's own threads raised meanwhile, and what else pytest would
have caught around a test body (``caught``: warnings, unraisable exceptions, threads the
function left running; one of those that raises after the function returned fails the
rank). ``verdict.decide`` turns every rank's report into one verdict. Everything here
pickles: the exception is carried as text, because the exception object itself may not
unpickle in the parent (a class defined in a test module, a constructor with other
arguments).
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from tutorial_impl.testing import words
from tutorial_impl.testing.diagnose.stacks import place
from tutorial_impl.testing.rank.caught import Catcher, Caught

if TYPE_CHECKING:
    from tutorial_impl.testing.diagnose.stacks import Place

HEADLINE_CHARS = 300  # an exception message longer than this is cut in the headline


@dataclass(frozen=True)
class Returned:
    value: Any


@dataclass(frozen=True)
class Raised:
    exc_type: str  # "ValueError", or "package.module.MyError" for a class outside builtins
    message: str  # str(exc)
    traceback: str  # the full formatted traceback, as the rank saw it
    warned_at: str | None = None  # a warning an "error" filter raised: "test_x.py:12"

    @property
    def summary(self) -> str:
        """``ValueError: boom``: the type and the first line of the message (a warning
        raised as an error: and where, ``DeprecationWarning: old API (at test_x.py:12)``)."""
        first = self.message.strip().splitlines()[0] if self.message.strip() else ""
        if len(first) > HEADLINE_CHARS:
            first = first[:HEADLINE_CHARS] + "..."
        said = f"{self.exc_type}: {first}" if first else self.exc_type
        return f"{said} (at {self.warned_at})" if self.warned_at else said


@dataclass(frozen=True)
class Skipped:
    reason: str


@dataclass(frozen=True)
class XFailed:
    reason: str


@dataclass(frozen=True)
class Exited:
    exitcode: int | None
    # How it is said: forked or warm, the parent saw the process end; ``Lost`` is a torchrun
    # worker its peers found gone (it said so through the store, or its heartbeat stopped).
    UNKNOWN: ClassVar[str] = words.EXITED_UNKNOWN
    KNOWN: ClassVar[str] = words.EXITED

    @property
    def how(self) -> str:
        return self.UNKNOWN if self.exitcode is None else self.KNOWN.format(self.exitcode)


@dataclass(frozen=True)
class Killed:
    signal: int

    @property
    def exitcode(self) -> int:
        return -self.signal

    @property
    def how(self) -> str:
        return words.KILLED.format(signal.Signals(self.signal).name)


@dataclass(frozen=True)
class Lost(Exited):
    """A torchrun worker that is gone: its exit code is what it passed to os._exit if it said
    so first, else unknown (its heartbeat stopped; the code is its agent's)."""

    exitcode: int | None = None
    UNKNOWN: ClassVar[str] = words.LOST_UNKNOWN
    KNOWN: ClassVar[str] = words.LOST


@dataclass(frozen=True)
class TimedOut:
    where: Place | None  # "in all_reduce at test_x.py:12"; None when the stack said nothing


@dataclass(frozen=True)
class Stopped:
    where: Place | None  # as for TimedOut: where it was when the run was ended around it


Outcome = Returned | Raised | Skipped | XFailed | Exited | Killed | Lost | TimedOut | Stopped
Died = (Exited, Killed)  # ended without reporting (Lost is an Exited): isinstance(o, Died)
Failure = (Raised, Exited, Killed)  # beats everything else, wherever it happens
Unfinished = (TimedOut, Stopped)
FORKED_CHILD = "tutorial_impl.testing.ForkedChildReturned"  # Raised.exc_type of an intruder


@dataclass(frozen=True)
class Leftover:
    """A process a rank left running, which the harness killed (``leftovers``): its pid and
    command line when it was found."""

    pid: int
    command: str

    def __str__(self) -> str:
        return f"pid {self.pid} ({self.command})"


@dataclass(frozen=True)
class Report:
    """One rank's answer: its outcome, the process that gave it, when, the exceptions its
    own threads raised meanwhile (formatted), what else pytest would have caught around
    it (``caught``; the parent hands those two to pytest as warnings, ``caught.emit``), and
    the processes it left running, which it killed before answering (``leftovers``)."""

    outcome: Outcome
    pid: int
    at: float  # time.time() when the function ended
    thread_errors: tuple[str, ...] = ()
    forked: bool = False  # the function forked this process (os.fork, a fork-started Process)
    caught: Caught = Caught()  # its warnings, unraisable exceptions, threads left running
    killed: tuple[Leftover, ...] = ()
    # Nothing of the test's runs in the rank any more: no thread the function started is
    # alive, no process is left. Its parent may then kill it outright (``supervise.LIVE``)
    # instead of freezing it first to look for processes under it (``leftovers.kill_tree``).
    quiet: bool = False


class _Forks:
    """How many times this process has forked (``os.register_at_fork``): whether a rank
    function forked is then a comparison, not a look at every child process."""

    def __init__(self) -> None:
        self.count = 0
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_parent=self._one_more)

    def _one_more(self) -> None:
        self.count += 1


FORKS = _Forks()


def died(exitcode: int | None) -> Exited | Killed:
    """How a process that sent nothing ended, from its exit code (negative: a signal)."""
    if exitcode is not None and exitcode < 0:
        return Killed(-exitcode)
    return Exited(exitcode)


def _type_name(exc: BaseException) -> str:
    cls = type(exc)
    if cls.__module__ in ("builtins", "__main__"):
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def skip_kind(exc: BaseException) -> type[Skipped] | type[XFailed] | None:
    """``Skipped`` for ``pytest.skip`` (and ``unittest.SkipTest``, which pytest also skips
    on), ``XFailed`` for ``pytest.xfail``, else None: decided by pytest's own exception
    types, never by a class name (an application's ``class Skipped(Exception)`` is a
    failure). A rank that raised pytest's exception has pytest imported; one that has not
    cannot have raised it, so nothing here imports pytest."""
    outcomes = sys.modules.get("_pytest.outcomes")
    if outcomes is not None:
        if isinstance(exc, outcomes.Skipped):
            return Skipped
        if isinstance(exc, outcomes.XFailed):
            return XFailed
    unittest = sys.modules.get("unittest")
    if unittest is not None and isinstance(exc, unittest.SkipTest):
        return Skipped
    return None


def from_exception(exc: BaseException) -> Raised | Skipped | XFailed:
    """The outcome of a rank function that raised ``exc`` (called inside its except block)."""
    kind = skip_kind(exc)
    if kind is not None:
        return kind(safe_str(getattr(exc, "msg", None) or exc))
    return Raised(_type_name(exc), safe_str(exc), traceback.format_exc(), _warned_at(exc))


UNPRINTABLE = "<str() failed>"  # the message of an exception whose ``__str__`` raised


def safe_str(exc: object) -> str:
    """``str(exc)``, or ``UNPRINTABLE`` when its ``__str__`` raises (or returns no str): the
    rank still reports the exception by its type, at once, instead of dying silently in
    its own report (``exited with code 0``)."""
    try:
        return str(exc)
    except BaseException:  # noqa: BLE001 - whatever __str__ raised, the rank reports
        return UNPRINTABLE


def _warned_at(exc: BaseException) -> str | None:
    """Where a warning was raised as an exception (an "error" filter): the innermost line of
    the user's code in its traceback (``stacks.place``), not the library's ``warnings.warn``
    (``typing_extensions.deprecated``'s wrapper, a ``stacklevel=2`` helper); the innermost
    line when no frame is the user's."""
    if not isinstance(exc, Warning) or exc.__traceback__ is None:
        return None
    frames = [(f.filename, f.lineno or 0, f.name) for f in traceback.extract_tb(exc.__traceback__)]
    spot = place(frames[::-1])
    if spot is not None:
        return f"{spot.file}:{spot.line}"
    path, line, _ = frames[-1]
    return f"{os.path.basename(path)}:{line}"


# True while a rank function runs in this thread (``capture``): a ``run_ranks`` called there
# is a nested one, with ranks of its own, never the test's. Under torchrun the rank function
# runs in a thread of the test's own pytest process, where the test is running (``RUNNING``).
IN_RANK: ContextVar[bool] = ContextVar("IN_RANK", default=False)


def capture(
    fn: Callable[..., Any],
    rank: int,
    args: tuple,
    kwargs: dict,
    on_error: Callable[[BaseException], None] | None = None,
    catcher: Catcher | None = None,
) -> Report:
    """Run ``fn(*args, **kwargs)`` in rank ``rank`` and report how it ended: the one
    rank-side capture of every strategy. Never raises (``exit()`` and Ctrl-C included).

    What pytest would catch around a test body is caught meanwhile (``catcher``: threads'
    and unraisable exceptions; its ``recording`` of warnings is the caller's to open around
    the function itself), and the threads the function left running are waited for
    (``Catcher.settle``): one that raises then fails the rank, unless it failed already.

    If the function forked and the *child* comes back here, its report is a failure of the
    rank that says so (the parent tells it apart by ``pid``): a child answering for its rank
    would hide whatever the rank itself did.
    """
    owner, forks = os.getpid(), FORKS.count
    catcher = catcher if catcher is not None else Catcher()
    with catcher.hooks():
        token = IN_RANK.set(True)
        try:
            outcome: Outcome = Returned(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - everything is reported, even exit()
            outcome = from_exception(exc)
            if on_error is not None and os.getpid() == owner:
                try:
                    on_error(exc)
                except BaseException:  # noqa: BLE001 - the debugger went away: report the error
                    pass
        finally:
            IN_RANK.reset(token)
        late = catcher.settle() if os.getpid() == owner else None
    if os.getpid() != owner:
        outcome = forked_child(rank, os.getpid())
    elif late is not None and not isinstance(outcome, Failure):
        outcome = _late_failure(*late)
    elif late is not None:
        catcher.thread_errors.append(late[0])
    forked = FORKS.count != forks
    return Report(
        outcome, os.getpid(), time.time(), tuple(catcher.thread_errors), forked, catcher.caught()
    )


def _late_failure(text: str, exc: BaseException) -> Raised:
    """A thread's exception after the rank function returned, as the rank's failure."""
    name = text.splitlines()[0].removeprefix("Exception in thread ")
    message = words.AFTER_RETURN.format(message=safe_str(exc), thread=name)
    return Raised(_type_name(exc), message, text)


def forked_child(rank: int, pid: int) -> Raised:
    message = (
        f"a process forked inside rank {rank} (pid {pid}) returned from the rank function "
        "instead of ending with os._exit; only the rank itself answers for its rank"
    )
    return Raised(FORKED_CHILD, message, f"{FORKED_CHILD}: {message}\n")


def unpicklable(what: str, exc: BaseException) -> Raised:
    """A result that could not cross the pipe: a failure of the rank, named as such."""
    said = f"{what}: {safe_str(exc)}"
    return Raised(type(exc).__name__, said, f"{type(exc).__name__}: {said}\n")
