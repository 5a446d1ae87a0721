"""What one rank reports: a small typed value, pickled once through the rank's result pipe.

A rank ends in exactly one of these ways, and the supervisor decides from the type alone:

``Returned(value)``            the rank function returned ``value``
``Raised(...)``                it raised: the exception's type, message and traceback, as text
``Skipped(reason)``            it called ``pytest.skip``: the test is skipped
``XFailed(reason)``            it called ``pytest.xfail``: the test is an expected failure
``Exited(exitcode)``           the process ended without reporting (``os._exit``, a crash)
``Killed(signal)``             ... or a signal killed it (the OOM killer's SIGKILL, a segfault)
``TimedOut(where)``            it was still running at the deadline; ``where`` is its
                               innermost frame of user code, from its stack dump

The exceptions that ``run_ranks`` raises are built from these, in one place
(``errors.error_for``). Everything here pickles: the exception is carried as text, because
the exception object itself may not unpickle in the parent (a class defined in a test
module, a constructor with other arguments).
"""

from __future__ import annotations

import signal
import traceback
from dataclasses import dataclass
from typing import Any

HEADLINE_CHARS = 300  # an exception message longer than this is cut in the headline


@dataclass(frozen=True)
class Returned:
    value: Any


@dataclass(frozen=True)
class Raised:
    exc_type: str  # "ValueError", or "package.module.MyError" for a class outside builtins
    message: str  # str(exc)
    traceback: str  # the full formatted traceback, as the rank saw it

    @property
    def summary(self) -> str:
        """``ValueError: boom``: the type and the first line of the message."""
        first = self.message.strip().splitlines()[0] if self.message.strip() else ""
        if len(first) > HEADLINE_CHARS:
            first = first[:HEADLINE_CHARS] + "..."
        return f"{self.exc_type}: {first}" if first else self.exc_type


@dataclass(frozen=True)
class Skipped:
    reason: str


@dataclass(frozen=True)
class XFailed:
    reason: str


@dataclass(frozen=True)
class Exited:
    exitcode: int | None

    @property
    def how(self) -> str:
        if self.exitcode is None:
            return "closed its result pipe but is still running"
        return f"exited with code {self.exitcode} (os._exit or a crash)"


@dataclass(frozen=True)
class Killed:
    signal: int

    @property
    def exitcode(self) -> int:
        return -self.signal

    @property
    def how(self) -> str:
        return f"was killed by signal {signal.Signals(self.signal).name}"


@dataclass(frozen=True)
class TimedOut:
    where: str  # "in all_reduce (test_x.py:12)", or "" when the stack said nothing


Outcome = Returned | Raised | Skipped | XFailed | Exited | Killed | TimedOut
Died = (Exited, Killed)  # ended without reporting: isinstance(o, Died)


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


def from_exception(exc: BaseException) -> Raised | Skipped | XFailed:
    """The outcome of a rank function that raised ``exc`` (called inside its except block).

    ``pytest.skip`` and ``pytest.xfail`` raise exceptions too; they are told apart by name,
    so that a rank need not import pytest.
    """
    name = type(exc).__name__
    reason = str(getattr(exc, "msg", None) or exc)
    if name in ("Skipped", "SkipTest"):
        return Skipped(reason)
    if name == "XFailed":
        return XFailed(reason)
    return Raised(_type_name(exc), str(exc), traceback.format_exc())


def unpicklable(what: str, exc: BaseException) -> Raised:
    """A result that could not cross the pipe: a failure of the rank, named as such."""
    return Raised(type(exc).__name__, f"{what}: {exc}", f"{type(exc).__name__}: {what}: {exc}\n")
