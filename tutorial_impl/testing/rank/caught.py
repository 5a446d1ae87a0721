"""What pytest catches around a test body, caught around a rank function.

Around every test, pytest records warnings under the test's filters (``-W``, the ini's
``filterwarnings``, the test's ``filterwarnings`` marks: ``_pytest/warnings.py``) and turns
an exception in a thread (``threading.excepthook``) or one Python could not raise
(``sys.unraisablehook``: a ``__del__`` that raised) into a warning of its own. A rank
function is a test body in another process (or, under torchrun, another thread): pytest
sees none of that there, so the rank does it and hands what it caught to the parent in its
report (``outcome.Report``), and the parent gives it to pytest's own machinery, labelled
``rank N: ...`` (``emit``).

* **Warnings** are decided in the rank, under the filters the test had when it called
  ``run_ranks`` (``current_filters``, read in the parent: pytest's, in pytest's order, with
  whatever the test's body added), so an "error" filter raises *at the warning*, in the
  rank, as it would in a test: the rank fails with the warning as its exception, at its
  location. The rest are recorded (``Warned``) and re-emitted in the parent with their
  category, file and line, past the filters (the rank applied them already): pytest's
  warnings summary shows them, and ``pytest.warns`` around ``run_ranks`` sees them.
* **Exceptions in threads and unraisable exceptions** become, in the parent, pytest's
  ``PytestUnhandledThreadExceptionWarning`` and ``PytestUnraisableExceptionWarning``, under
  the test's filters, as pytest does at the end of a test phase (so ``-W error`` fails it).
* **Threads the function left running** (non-daemon, as those an interpreter waits for at
  exit) are waited for ``THREAD_GRACE`` s (a rank ends once it has reported: what they do
  later is lost). One that raises meanwhile fails the rank (``Catcher.settle``); one still
  running then is named in a ``RankThreadWarning``.

Nothing here imports pytest in a rank: ``emit`` (the parent's) imports it when it runs.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from tutorial_impl.testing.settings.timing import THREAD_GRACE


class RankThreadWarning(UserWarning):
    """A thread a rank function started was still running ``THREAD_GRACE`` s after the
    function returned: the rank ended with it (forked), or it runs on (warm: the world is
    replaced; torchrun: in the worker)."""


@dataclass(frozen=True)
class Filter:
    """One entry of ``warnings.filters``, as it crosses to a rank: patterns as text, the
    category by name (``module:qualname``); ``install`` makes it an entry again."""

    action: str
    message: str | None  # the pattern's text; None matches every message
    message_flags: int
    category: str
    module: str | None
    module_flags: int
    lineno: int


Filters = tuple[Filter, ...]


def current_filters() -> Filters:
    """The filters a warning raised here now would meet (in the parent: the test's)."""
    return tuple(_portable(entry) for entry in warnings.filters)


def _portable(entry: tuple[Any, ...]) -> Filter:
    action, message, category, module, lineno = entry
    return Filter(
        action,
        getattr(message, "pattern", message),
        getattr(message, "flags", 0),
        _name(category),
        getattr(module, "pattern", module),
        getattr(module, "flags", 0),
        lineno,
    )


def _name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _resolve(name: str) -> type:
    """The class named ``module:qualname`` (its module imported if need be)."""
    module_name, _, qualname = name.partition(":")
    found: Any = sys.modules.get(module_name) or importlib.import_module(module_name)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def install(filters: Filters) -> None:
    """Make ``filters`` this process's warning filters (inside a ``catch_warnings``). A
    category that cannot be found here is an error naming the filter: dropping the filter
    could turn an "error" the test asked for into a pass."""
    import re

    entries = []
    for f in filters:
        try:
            category = _resolve(f.category)
        except Exception as exc:
            raise RuntimeError(
                f"the test's warning filter {f.action}::{f.category} names a category this "
                f"rank cannot import ({type(exc).__name__}: {exc})"
            ) from None
        message = re.compile(f.message, f.message_flags) if f.message is not None else None
        module = re.compile(f.module, f.module_flags) if f.module is not None else None
        entries.append((f.action, message, category, module, f.lineno))
    warnings.filters[:] = entries
    warnings._filters_mutated()  # type: ignore[attr-defined]  # the registries' cache


@dataclass(frozen=True)
class Warned:
    """One warning a rank recorded: its text, its category with its bases (by name: the
    parent takes the first it can find), where it was raised."""

    message: str
    category: tuple[str, ...]
    filename: str
    lineno: int


@dataclass(frozen=True)
class Caught:
    """What one rank's function left for pytest's warning machinery."""

    warnings: tuple[Warned, ...] = ()
    unraisable: tuple[str, ...] = ()  # formatted as pytest formats them
    left_running: tuple[str, ...] = ()  # names of threads still running after the grace

    def __bool__(self) -> bool:
        return bool(self.warnings or self.unraisable or self.left_running)


def _warned(record: warnings.WarningMessage) -> Warned:
    bases = [c for c in record.category.__mro__ if issubclass(c, Warning)]
    return Warned(str(record.message), tuple(map(_name, bases)), record.filename, record.lineno)


@dataclass
class Catcher:
    """The catching of one rank function's run: ``hooks`` around all of it, ``recording``
    around the function itself (not the harness's set-up), ``settle`` once it returned."""

    filters: Filters | None = None  # None: not under pytest, warnings are left alone
    grace: float = THREAD_GRACE  # how long ``settle`` waits for the threads left running
    thread_errors: list[str] = field(default_factory=list)
    late: list[tuple[str, BaseException]] = field(default_factory=list)
    unraisable: list[str] = field(default_factory=list)
    log: list[warnings.WarningMessage] = field(default_factory=list)
    left_running: list[str] = field(default_factory=list)
    _before: set[threading.Thread] = field(default_factory=set)
    _settling: bool = False

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        """Thread and unraisable exceptions go to this catcher meanwhile."""
        thread_hook, unraisable_hook = threading.excepthook, sys.unraisablehook
        threading.excepthook, sys.unraisablehook = self._thread_error, self._unraisable
        self._before = set(threading.enumerate())
        try:
            yield
        finally:
            threading.excepthook, sys.unraisablehook = thread_hook, unraisable_hook

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Warnings recorded under ``filters`` (an "error" one raises where it is warned).
        Without filters (``run_ranks`` outside pytest) nothing is recorded: no one would
        re-emit the warnings, and a rank's own stderr shows them, as before."""
        if self.filters is None:
            yield
            return
        with warnings.catch_warnings(record=True) as log:
            install(self.filters)
            self.log = log
            yield

    def settle(self) -> tuple[str, BaseException] | None:
        """Wait (at most ``grace`` s in all) for the non-daemon threads started meanwhile;
        name those still running. The first exception one raised after the function
        returned, or None."""
        self._settling = True
        stop = time.monotonic() + self.grace
        for thread in self._started():
            thread.join(max(0.0, stop - time.monotonic()))
        self.left_running = [t.name for t in self._started() if t.is_alive()]
        return self.late[0] if self.late else None

    def none_running(self) -> bool:
        """Whether every thread alive now was alive before the function (daemons count)."""
        return all(t in self._before for t in threading.enumerate())

    def _started(self) -> list[threading.Thread]:
        return [
            t
            for t in threading.enumerate()
            if t not in self._before and not t.daemon and t is not threading.current_thread()
        ]

    def caught(self) -> Caught:
        return Caught(
            tuple(_warned(r) for r in self.log),
            tuple(self.unraisable),
            tuple(self.left_running),
        )

    def _thread_error(self, args: Any) -> None:
        name = getattr(args.thread, "name", "<unknown>")
        text = f"Exception in thread {name}\n\n" + _format(
            args.exc_type, args.exc_value, args.exc_traceback
        )
        if self._settling and args.exc_value is not None:
            self.late.append((text, args.exc_value))
        else:
            self.thread_errors.append(text)

    def _unraisable(self, args: Any) -> None:
        said = args.err_msg or "Exception ignored in"
        self.unraisable.append(
            f"{said}: {args.object!r}\n\n"
            + _format(args.exc_type, args.exc_value, args.exc_traceback)
        )


def _format(exc_type: Any, value: Any, tb: Any) -> str:
    return "".join(traceback.format_exception(exc_type, value, tb))


# --- in the parent: into pytest's machinery -----------------------------------------------


def _category(names: tuple[str, ...]) -> type[Warning]:
    """The first of ``names`` this process can find (a class of the rank's only: a base)."""
    for name in names:
        try:
            found = _resolve(name)
        except Exception:  # noqa: BLE001 - try its base
            continue
        if isinstance(found, type) and issubclass(found, Warning):
            return found
    return UserWarning


def _instance(category: type[Warning], text: str) -> Warning:
    """A ``category`` carrying ``text`` (a constructor with other arguments: made bare)."""
    try:
        made = category(text)
        if str(made) == text:
            return made
    except Exception:  # noqa: BLE001
        pass
    made = Exception.__new__(category)
    made.args = (text,)
    return made


def emit(thread_errors: dict[int, tuple[str, ...]], caught: dict[int, Caught]) -> None:
    """Hand every rank's catch to pytest, labelled with the rank: its warnings as the rank
    decided them, then its thread and unraisable exceptions and threads left running as
    warnings under the test's filters (an "error" one raises here, as pytest's would)."""
    __tracebackhide__ = True  # a warning raised here is the ranks', not the harness's
    import pytest

    level = _outside_the_harness()
    for rank, found in sorted(caught.items()):
        with warnings.catch_warnings():  # showwarning stays pytest's: only the filters
            warnings.simplefilter("always")  # the rank applied the test's filters already
            for w in found.warnings:
                category = _category(w.category)
                message = _instance(category, f"rank {rank}: {w.message}")
                warnings.warn_explicit(message, category, w.filename, w.lineno)
    for rank in sorted({*thread_errors, *caught}):
        found = caught.get(rank, Caught())
        for text in thread_errors.get(rank, ()):
            said = pytest.PytestUnhandledThreadExceptionWarning(f"rank {rank}: {text}")
            warnings.warn(said, stacklevel=level)
        for text in found.unraisable:
            said = pytest.PytestUnraisableExceptionWarning(f"rank {rank}: {text}")
            warnings.warn(said, stacklevel=level)
        for name in found.left_running:
            said = RankThreadWarning(f"rank {rank}: {LEFT_RUNNING.format(name=name)}")
            warnings.warn(said, stacklevel=level)


def _outside_the_harness() -> int:
    """The ``stacklevel`` that puts a warning ``emit`` gives at the caller of ``run_ranks``
    (the test, or its helper), past the harness's own frames."""
    here = os.path.dirname(os.path.dirname(__file__)) + os.sep  # testing/, above rank/
    frame, level = sys._getframe(2), 2  # emit's caller
    while frame is not None and frame.f_code.co_filename.startswith(here):
        frame, level = frame.f_back, level + 1
    return level


LEFT_RUNNING = (
    "thread {name!r}, started by the rank function, was still running "
    f"{THREAD_GRACE:g} s after the function returned; the rank did not wait for it further"
)
