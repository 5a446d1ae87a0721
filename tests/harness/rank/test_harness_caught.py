"""pytest's conventions inside ranks, piece by piece, in this process (no ranks: fast).

The end-to-end proof, a stranger's project forked, warm and under torchrun, is
``test_harness_conformance``'s c18 and c28 cases. Here each piece is held against its
reference, Python's own ``warnings`` and ``threading``:

1. The test's filters cross to a rank and are the same filters there (``current_filters``,
   ``install``); one whose category a rank cannot find is refused by name.
2. In a rank, the filters decide (an "error" raises at the warning); the rest are recorded
   with category, file and line; thread and unraisable exceptions are caught; threads left
   running are waited for, a late failure fails the rank (``outcome.capture``).
3. In the parent, every catch reaches pytest's machinery labelled with the rank, category,
   file and line kept (``emit``).
"""

from __future__ import annotations

import re
import threading
import time
import warnings

import pytest

from tutorial_impl.testing import fixtures
from tutorial_impl.testing.rank import caught, outcome
from tutorial_impl.testing.rank.caught import Catcher, Caught, Warned
from tutorial_impl.testing.verdict import decision as verdict
from tutorial_impl.testing.verdict import errors


class OwnWarning(DeprecationWarning):
    """A project's own category: crosses by name."""


class Picky(UserWarning):
    def __init__(self, code: int, text: str) -> None:  # not one message argument
        super().__init__(f"{code}: {text}")


class Prefixed(UserWarning):
    def __init__(self, text: str) -> None:  # one argument, but not the message as given
        super().__init__(f"[lib] {text}")


# --- 1. the filters cross ------------------------------------------------------------------


def test_the_tests_filters_are_the_same_filters_in_a_rank():
    with warnings.catch_warnings():
        warnings.resetwarnings()
        warnings.filterwarnings("error", "Old.*API", OwnWarning, r"mylib\.", 12)
        warnings.filterwarnings("always", category=UserWarning)
        warnings.simplefilter("ignore", ResourceWarning)
        original = list(warnings.filters)
        portable = caught.current_filters()
        assert [f.category for f in portable] == [
            "builtins:ResourceWarning",
            "builtins:UserWarning",
            f"{__name__}:OwnWarning",
        ]
        warnings.resetwarnings()
        caught.install(portable)
        assert warnings.filters == original  # action, patterns with flags, class, line
        assert warnings.filters[2][1].flags & re.IGNORECASE  # filterwarnings' message flag


def test_a_filter_whose_category_a_rank_cannot_find_is_refused_by_name():
    missing = caught.Filter("error", None, 0, "nowhere_module:GoneWarning", None, 0, 0)
    with warnings.catch_warnings(), pytest.raises(RuntimeError) as info:
        caught.install((missing,))
    assert "error::nowhere_module:GoneWarning" in str(info.value)
    assert "ModuleNotFoundError" in str(info.value)


# --- 2. in a rank ---------------------------------------------------------------------------


def _capture(fn, filters=(), **kwargs):
    catcher = Catcher(filters)

    def body():
        with catcher.recording():
            return fn()

    return outcome.capture(body, 1, (), {}, catcher=catcher, **kwargs)


def _filters(*specs: tuple[str, type[Warning]]) -> caught.Filters:
    with warnings.catch_warnings():
        warnings.resetwarnings()
        for action, category in reversed(specs):
            warnings.simplefilter(action, category)
        return caught.current_filters()


def test_an_error_filter_raises_at_the_warning_in_the_rank():
    def old_api():
        warnings.warn("old API", DeprecationWarning)

    expected_line = old_api.__code__.co_firstlineno + 1
    report = _capture(old_api, _filters(("error", DeprecationWarning)))
    assert isinstance(report.outcome, outcome.Raised)
    where = f"test_harness_caught.py:{expected_line}"
    assert report.outcome.summary == f"DeprecationWarning: old API (at {where})"
    assert "in old_api" in report.outcome.traceback
    plain = _capture(lambda: 1 / 0).outcome  # an exception, not a warning: no place
    assert plain.summary == "ZeroDivisionError: division by zero"  # type: ignore[union-attr]
    assert not report.caught


def test_shown_warnings_are_recorded_with_category_file_and_line():
    def warns():
        warnings.warn("mind this", OwnWarning)
        line = _line()
        warnings.warn("dropped", ResourceWarning)
        return line

    filters = _filters(("always", OwnWarning), ("ignore", ResourceWarning))
    report = _capture(warns, filters)
    assert isinstance(report.outcome, outcome.Returned)
    (warned,) = report.caught.warnings
    assert warned == Warned(
        "mind this",
        (f"{__name__}:OwnWarning", "builtins:DeprecationWarning", "builtins:Warning"),
        __file__,
        report.outcome.value - 1,
    )
    # The rank's filters are its own again afterwards.
    assert warnings.filters is not None and not any(f[2] is OwnWarning for f in warnings.filters)


def _line() -> int:
    import inspect

    return inspect.currentframe().f_back.f_lineno  # type: ignore[union-attr]


def test_pytest_warns_in_a_rank_works_under_an_error_filter():
    def expects():
        with pytest.warns(DeprecationWarning, match="old"):
            warnings.warn("old API", DeprecationWarning)
        return "ok"

    report = _capture(expects, _filters(("error", DeprecationWarning)))
    assert report.outcome == outcome.Returned("ok")
    assert not report.caught


def test_thread_and_unraisable_exceptions_in_a_rank_are_caught():
    class Unclosable:
        def __del__(self):
            raise OSError("close failed")

    def body():
        thread = threading.Thread(target=lambda: 1 / 0, name="divider")
        thread.start()
        thread.join()
        Unclosable()
        return 3

    hooks = threading.excepthook, __import__("sys").unraisablehook
    report = _capture(body)
    assert report.outcome == outcome.Returned(3)
    (text,) = report.thread_errors
    assert text.startswith("Exception in thread divider\n") and "ZeroDivisionError" in text
    (unraisable,) = report.caught.unraisable
    assert unraisable.startswith("Exception ignored in: <function ")
    assert "Unclosable.__del__" in unraisable and "OSError: close failed" in unraisable
    assert (threading.excepthook, __import__("sys").unraisablehook) == hooks  # put back


def test_a_thread_that_fails_after_the_function_fails_the_rank():
    release = threading.Event()

    def leaves_threads():
        def late():
            time.sleep(0.05)
            raise ValueError("late")

        threading.Thread(target=late, name="late-one").start()
        threading.Thread(target=release.wait, name="lingers").start()
        threading.Thread(target=release.wait, name="daemonic", daemon=True).start()
        return 1

    start = time.monotonic()
    try:
        catcher = Catcher(grace=0.3)  # THREAD_GRACE in a rank: less here, the same wait
        report = outcome.capture(leaves_threads, 1, (), {}, catcher=catcher)
        waited = time.monotonic() - start
    finally:
        release.set()
    assert report.outcome == outcome.Raised(
        "ValueError",
        "late (in thread 'late-one', after the rank function had returned)",
        report.outcome.traceback,  # type: ignore[union-attr]
    )
    assert "Exception in thread late-one" in report.outcome.traceback  # type: ignore[union-attr]
    assert report.caught.left_running == ("lingers",)  # named; the daemon is not waited for
    assert 0.3 <= waited < 0.3 + 1.0
    assert report.thread_errors == ()


def test_a_late_thread_failure_does_not_hide_the_functions_own():
    def raises():
        def late():
            time.sleep(0.05)
            raise ValueError("late")

        threading.Thread(target=late, name="late-one").start()
        raise KeyError("own")

    report = outcome.capture(raises, 1, (), {})
    assert isinstance(report.outcome, outcome.Raised)
    assert report.outcome.exc_type == "KeyError"
    (text,) = report.thread_errors  # the late one is still said, as a thread's exception
    assert "ValueError: late" in text and "late-one" in text


def test_a_thread_that_ends_within_the_grace_is_not_named():
    def quick():
        threading.Thread(target=time.sleep, args=(0.05,), name="quick").start()

    start = time.monotonic()
    report = outcome.capture(quick, 0, (), {})
    assert report.outcome == outcome.Returned(None) and not report.caught
    assert time.monotonic() - start < caught.THREAD_GRACE


# --- 3. in the parent -----------------------------------------------------------------------


def test_the_parent_re_emits_each_catch_labelled_with_the_rank():
    warned = Warned("mind this", (f"{__name__}:OwnWarning",), "/src/lib.py", 7)
    picky = Warned("7: odd", (f"{__name__}:Picky",), "/src/lib.py", 9)
    prefixed = Warned("[lib] said", (f"{__name__}:Prefixed",), "/src/lib.py", 11)
    gone = Warned("from the rank only", ("rank_only:Gone", "builtins:FutureWarning"), "/x.py", 1)
    found = {
        1: Caught((warned, picky, prefixed), ("Exception ignored in: obj",), ("lingers",)),
        0: Caught((gone,)),
    }
    with warnings.catch_warnings(record=True) as log:
        warnings.simplefilter("ignore")  # the rank decided already: shown all the same
        warnings.simplefilter("always", pytest.PytestWarning)
        warnings.simplefilter("always", caught.RankThreadWarning)
        caught.emit({1: ("Exception in thread t\n\nboom",)}, found)
    said = [(w.category, str(w.message), w.filename, w.lineno) for w in log]
    here = __file__
    assert said[:4] == [
        (FutureWarning, "rank 0: from the rank only", "/x.py", 1),  # its base: found here
        (OwnWarning, "rank 1: mind this", "/src/lib.py", 7),
        (Picky, "rank 1: 7: odd", "/src/lib.py", 9),
        (Prefixed, "rank 1: [lib] said", "/src/lib.py", 11),  # the rank's text, as it was
    ]
    assert [(c, m) for c, m, _, _ in said[4:]] == [
        (pytest.PytestUnhandledThreadExceptionWarning, "rank 1: Exception in thread t\n\nboom"),
        (pytest.PytestUnraisableExceptionWarning, "rank 1: Exception ignored in: obj"),
        (caught.RankThreadWarning, "rank 1: " + caught.LEFT_RUNNING.format(name="lingers")),
    ]
    assert {f for _, _, f, _ in said[4:]} == {here}  # at the caller, not in the harness


def test_an_error_filter_in_the_parent_raises_a_threads_exception():
    with warnings.catch_warnings():
        warnings.simplefilter("error", pytest.PytestUnhandledThreadExceptionWarning)
        with pytest.raises(pytest.PytestUnhandledThreadExceptionWarning, match="^rank 2: "):
            caught.emit({2: ("Exception in thread t\n\nboom",)}, {})
        caught.emit({}, {2: Caught()})  # nothing caught: nothing said


def test_outside_pytest_a_ranks_warnings_are_left_alone():
    catcher = Catcher(None)  # run_ranks outside pytest: no filters, no one to re-emit
    with pytest.warns(UserWarning, match="^as before$"), catcher.recording():
        warnings.warn("as before", UserWarning)  # reaches the rank's own stderr
    assert not catcher.caught()


def test_a_failures_warnings_are_said_at_the_tests_line_past_the_harness():
    error = errors.error_for(1, outcome.Raised("ValueError", "boom", ""), "", {})
    error.thread_errors = {1: ("Exception in thread t\n\nboom",)}
    with warnings.catch_warnings(record=True) as log, pytest.raises(errors.RankFailed):
        warnings.simplefilter("always")
        fixtures.reported(error)  # the harness's frames between this line and ``emit``
    [(said, line)] = [(w.filename, w.lineno) for w in log]
    assert (said, line) == (__file__, _line() - 2)


def test_the_verdict_carries_every_ranks_catch_to_the_parent():
    warned = Warned("mind this", ("builtins:UserWarning",), "/src/lib.py", 7)
    reports = {
        0: outcome.Report(outcome.Returned(0), 10, 1.0, caught=Caught((warned,))),
        1: outcome.Report(outcome.Returned(1), 11, 1.0, caught=Caught(unraisable=("x",))),
        2: outcome.Report(outcome.Returned(2), 12, 1.0),  # nothing caught: not listed
    }
    run = verdict.Finished(3, reports, [0, 1, 2], {}, 60.0)
    results = verdict.decide(run)
    assert results.caught == {0: Caught((warned,)), 1: Caught(unraisable=("x",))}
    reports[2] = outcome.Report(outcome.Raised("ValueError", "boom", ""), 12, 1.0)
    with pytest.raises(errors.RankFailed) as failed:
        verdict.decide(run)
    assert failed.value.caught == results.caught  # a failure's too: emitted by ``reported``


def warn_on_rank_1(rank: int) -> int:
    if rank == 1:
        warnings.warn("from a rank", OwnWarning)  # WARN_HERE
    return rank


WARN_HERE = next(i for i, line in enumerate(open(__file__), 1) if line.endswith("# WARN_HERE\n"))


def test_through_real_ranks_the_warning_reaches_pytest_warns_around_run_ranks(run_ranks):
    with pytest.warns(OwnWarning, match="^rank 1: from a rank$") as seen:
        assert run_ranks(warn_on_rank_1, backend=None) == [0, 1]
    assert [(w.filename, w.lineno) for w in seen] == [(__file__, WARN_HERE)]
