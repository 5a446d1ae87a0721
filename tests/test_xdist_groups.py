"""This suite's scheduling under ``pytest -n``: tests marked ``xdist_group`` share one worker.

The suite's tests that share one expensive run (a module-scoped fixture, each claim its own
test) or an expensive import carry ``xdist_group("name")``, and the root ``conftest.py``
switches ``-n`` to xdist's "loadgroup" scheduler so that each group goes to one worker. Two
things broke that silently, each enough alone: the workers parse only the command line, so
they never saw the switch and did not tag their tests; and pytest 9.2 reads a test's id from
a field xdist (3.8) does not write the tag to (pytest-xdist issue #1386). Every group's tests
were handed out one by one, and a shared run ran once on each worker that got one of them.

The proof: the root conftest in a project of its own, two files whose grouped tests are
interleaved with ungrouped ones, run with ``-n 2``: its controller in this process, its two
workers new interpreters (a controller of its own was a third, ~0.4 s of CPU). The harness's
plugin is left out of that run: under ``-n`` its controller starts the rank forkserver, an
import of torch (2.5 s of CPU) no test there needs. Every grouped test must run on one
worker, tagged with its group; and the ungrouped ones stay handed out one at a time, so the
tests of one file still spread over both workers. Without xdist (``-p no:xdist``, as the
serial profile ``.ci/suite_profile.py`` runs) the marker is still known, so ``--strict-markers``
does not refuse a grouped test.
"""

from __future__ import annotations

import gc
import json
import re
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT_CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"
PLUGIN = "tutorial_impl.testing.plugin"
NO_PLUGIN = ("-p", f"no:{PLUGIN}")  # see the docstring; the conftest names it too, cut below


def root_conftest() -> str:
    """The root conftest as it is, less the line that loads the harness's plugin."""
    text = ROOT_CONFTEST.read_text()
    line = f'pytest_plugins = ["{PLUGIN}"]\n'
    assert line in text
    return text.replace(line, "")


TESTS = """
import time
import pytest

@pytest.mark.xdist_group("shared")
@pytest.mark.parametrize("i", range(3))
def test_grouped(i):
    time.sleep(0.05)

@pytest.mark.parametrize("i", range(6))
def test_alone(i):
    time.sleep(0.05)  # long enough that both workers are handed some
"""


# What the last serial profile measured (``.ci/suite_order.json``): two ungrouped tests
# dearest, the group cheaper than either even summed, the rest not named (cheap).
COSTS = {
    "test_two.py::test_alone[4]": 9.0,
    "test_one.py::test_alone[1]": 8.0,
    "test_one.py::test_grouped[0]": 1.0,
    "test_two.py::test_grouped[2]": 1.5,
}


def costs_file(pytester: pytest.Pytester) -> None:
    (pytester.path / ".ci").mkdir()
    (pytester.path / ".ci" / "suite_order.json").write_text(json.dumps(COSTS))


@pytest.mark.slow
def test_a_group_runs_on_one_worker_and_the_rest_is_spread(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(root_conftest())
    pytester.makepyfile(test_one=TESTS, test_two=TESTS)
    costs_file(pytester)
    # The controller runs here (its workers are new interpreters all the same): a controller
    # of its own would be one more interpreter importing pytest and xdist (~0.4 s of CPU).
    # The conftest turns the collector off at the session's start and on again when
    # collection ends, which a controller never reaches: this process's state is restored.
    collecting = gc.isenabled()
    try:
        result = pytester.runpytest_inprocess("-n", "2", "-v", "-p", "no:cacheprovider", *NO_PLUGIN)
    finally:
        if collecting:
            gc.enable()
    result.assert_outcomes(passed=18)
    ran = re.findall(r"\[(gw\d)\] \[ *\d+%\] PASSED (\S+)", result.stdout.str())
    assert len(ran) == 18, result.stdout.str()
    grouped = {worker for worker, test in ran if "::test_grouped" in test}
    assert len(grouped) == 1, ran  # all six on one worker
    assert all(test.endswith("@shared") for _, test in ran if "::test_grouped" in test), ran
    alone = {worker for worker, test in ran if "::test_alone" in test}
    assert alone == {"gw0", "gw1"}, ran  # not everything in one unit: "load" for the rest
    # The two dearest go out first, one to each worker: each worker's first test (a worker
    # runs what it was handed in order), though the group has more tests (xdist's default
    # reorder would hand it out first).
    first = {worker: test for worker, test in reversed(ran)}
    assert set(first.values()) == {"test_two.py::test_alone[4]", "test_one.py::test_alone[1]"}, ran


def test_without_xdist_the_group_marker_is_still_known(pytester: pytest.Pytester) -> None:
    """A subprocess: in this process xdist is loaded, and an in-process run sees its marker."""
    pytester.makeconftest(root_conftest())
    pytester.makepyfile(test_one=TESTS)
    result = pytester.runpytest_subprocess(
        "-p", "no:xdist", "--strict-markers", "-p", "no:cacheprovider", *NO_PLUGIN
    )
    result.assert_outcomes(passed=9)


def test_the_dearest_tests_come_first_a_group_by_its_sum(pytester: pytest.Pytester) -> None:
    """The order the root conftest gives (serially it is the run's order): the tests the
    costs file names, dearest first, a group at the sum of its tests' costs with all of
    them; then the other slow tests; the rest as collected. In-process: the order needs no
    xdist."""
    pytester.makeconftest(root_conftest())
    pytester.makepyfile(
        test_one=TESTS, test_two="import pytest\n\n@pytest.mark.slow\ndef test_s(): pass\n"
    )
    costs = {
        "test_one.py::test_alone[4]": 3.0,
        "test_one.py::test_grouped[0]": 1.0,  # the group: 2.5, between the alone ones
        "test_one.py::test_grouped[1]": 1.5,
        "test_one.py::test_alone[2]": 2.0,  # above either of the group's, below their sum
    }
    (pytester.path / ".ci").mkdir()
    (pytester.path / ".ci" / "suite_order.json").write_text(json.dumps(costs))
    result = pytester.runpytest("--collect-only", "-q", "-p", "no:cacheprovider", *NO_PLUGIN)
    order = [line for line in result.stdout.lines if "::" in line]
    expected = [f"test_one.py::test_{name}" for name in (
        "alone[4]", "grouped[0]", "grouped[1]", "grouped[2]", "alone[2]",
        "alone[0]", "alone[1]", "alone[3]", "alone[5]",
    )]  # fmt: skip
    slow = "test_two.py::test_s"  # named by no figure, marked slow: before the other unnamed
    assert order == [*expected[:5], slow, *expected[5:]], result.stdout.str()
    # Without the file (a project that never profiled): slow first, then collection order.
    (pytester.path / ".ci" / "suite_order.json").write_text("not json")
    result = pytester.runpytest("--collect-only", "-q", "-p", "no:cacheprovider", *NO_PLUGIN)
    order = [line for line in result.stdout.lines if "::" in line]
    assert order == [slow, *sorted(expected, key=lambda t: ("alone" in t, t))], result.stdout.str()
