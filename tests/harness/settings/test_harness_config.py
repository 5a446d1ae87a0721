"""Misconfiguration never passes silently: each marker, option and argument is checked.

A harness earns trust by refusing what it cannot honour. Every test here is a stranger's
project (``pytester``: only the installed package, no conftest) making a mistake a stranger
would make, and each mistake must give a clear message naming the marker, the argument and
what is accepted: never an INTERNALERROR that kills the session, never an argument ignored.

1. A ``world_size`` given by ``parametrize`` is honoured: ``run_ranks`` runs that many ranks.
2. Bad marker arguments fail that one test, before any rank starts; the session goes on.
3. Markers that cannot collide: the old generic names ``gpu``/``backend`` are honoured only
   on harness tests (with a deprecation warning); a foreign project's ``gpu`` or ``slow``
   marker keeps its own meaning.
4. Bad options and ini values are usage errors (exit status 4) naming the option.
5. GPU leases: two concurrent tests never hold the same GPU (``backends.lease``).
(pytest-timeout against the harness deadline: ``test_harness_report.py``.)
"""

from __future__ import annotations

import contextvars
import inspect
import os
import time
from types import SimpleNamespace

import pytest
import torch  # noqa: F401  (imported once here: pytester's in-process runs cannot re-import it)

from tutorial_impl.testing import backends
from tutorial_impl.testing.settings import config

pytest_plugins = ["pytester"]

# --- 1. a parametrized world_size is the world size -----------------------------------------

PARAMETRIZED = """
import pytest

def who(rank, world_size):
    return (rank, world_size)

@pytest.mark.parametrize("world_size", [1, 3])
def test_parametrized(run_ranks, world_size):
    results = run_ranks(who)
    assert list(results) == [(r, world_size) for r in range(world_size)]

@pytest.mark.parametrize("world_size", [3])
def test_parametrized_without_asking_for_the_fixture(run_ranks):
    assert len(run_ranks(who)) == 3

@pytest.mark.world_size(4)
@pytest.mark.parametrize("world_size", [3])
def test_given_twice(run_ranks, world_size):
    run_ranks(who)
"""


def test_a_parametrized_world_size_runs_that_many_ranks(pytester):
    """``parametrize("world_size", [3])`` runs 3 ranks (it once ran 2, and a test checking
    only per-rank properties passed while proving nothing about 3). Giving the size both ways
    is refused, naming both."""
    pytester.makepyfile(PARAMETRIZED)
    result = pytester.runpytest("-p", "no:cacheprovider", "-rfE")
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(
        ["*test_given_twice*world size is given twice*parametrize('world_size'*world_size(4)*"]
    )


# --- 2. bad marker arguments: that test fails, the session goes on ---------------------------

MISUSES = """
import pytest

def nothing(rank, world_size):
    pass

@pytest.mark.dist_backend(name="nccl")
def test_backend_keyword(run_ranks):
    run_ranks(nothing)

@pytest.mark.dist_backend("ncl")
def test_backend_misspelt(run_ranks):
    run_ranks(nothing)

@pytest.mark.dist_gpu("a100")
def test_gpu_model(run_ranks):
    run_ranks(nothing)

@pytest.mark.gpu("a100")  # the deprecated alias is checked as strictly on a harness test
def test_old_gpu_model(run_ranks):
    run_ranks(nothing)

@pytest.mark.dist_backend("mpi")
def test_forked_mpi(run_ranks):
    run_ranks(nothing)

@pytest.mark.rank_timeout(-1)
def test_negative_deadline(run_ranks):
    run_ranks(nothing)

@pytest.mark.rank_timeout(0)  # no time at all is no deadline: refused, not "no limit"
def test_zero_deadline(run_ranks):
    run_ranks(nothing)

@pytest.mark.rank_timeout(1e9)  # beyond what the waits beneath can take: refused, no OverflowError
def test_endless_deadline(run_ranks):
    run_ranks(nothing)

@pytest.mark.rank_timeout(10, secs=2)
def test_deadline_keyword(run_ranks):
    run_ranks(nothing)

@pytest.mark.world_size(0)
def test_no_ranks(run_ranks):
    run_ranks(nothing)

def test_the_session_goes_on(run_ranks):
    run_ranks(nothing)
"""

EXPECTED = {
    "test_backend_keyword": "dist_backend(name='nccl'): unknown keyword argument 'name'; "
    "accepted: dist_backend(",
    "test_backend_misspelt": "dist_backend('ncl'): unknown backend 'ncl'; expected one of",
    "test_gpu_model": "dist_gpu('a100'): 'a100' is not a number of GPUs; accepted: dist_gpu(n)",
    "test_old_gpu_model": "gpu('a100'): 'a100' is not a number of GPUs",
    "test_forked_mpi": "backend 'mpi' at world size 2: MPI takes its ranks from the MPI launcher",
    "test_negative_deadline": "rank_timeout(-1): -1; accepted: a positive number of seconds",
    "test_zero_deadline": "rank_timeout(0): 0; accepted: a positive number of seconds",
    "test_endless_deadline": "rank_timeout(1000000000.0): 1000000000.0; accepted: a positive "
    "number of seconds, at most 604800 (a week)",
    "test_deadline_keyword": "rank_timeout(10, secs=2): unknown keyword argument 'secs'",
    "test_no_ranks": "world_size(0): 0 is not a world size; accepted: an int >= 1",
}


def test_bad_marker_arguments_fail_that_test_with_a_message_naming_them(pytester):
    """Each misuse errors in its own setup (no rank started), saying what was written and
    what is accepted, and the well-formed test beside them still runs and passes."""
    pytester.makepyfile(MISUSES)
    result = pytester.runpytest("-p", "no:cacheprovider", "-rE")
    result.assert_outcomes(passed=1, errors=len(EXPECTED))
    text = result.stdout.str()
    assert "INTERNALERROR" not in text
    for test, message in EXPECTED.items():
        result.stdout.fnmatch_lines([f"*ERROR at setup of {test}*", "harness configuration: *"])
        assert message in text, f"{test}: {message!r} not in the report"


# --- 3. markers that cannot collide -------------------------------------------------------

FOREIGN = """
import pytest

@pytest.mark.gpu  # this project's own marker: "runs on our render farm", say
@pytest.mark.slow
def test_their_own_gpu_marker():
    pass

def nothing(rank, world_size):
    pass

@pytest.mark.backend("gloo")  # the harness's old name, on a harness test
def test_old_backend_name(run_ranks):
    run_ranks(nothing)
"""


def test_a_foreign_projects_gpu_and_slow_markers_keep_their_meaning(pytester):
    """The project registers its own ``gpu`` and ``slow``: its plain test runs (our GPU
    check would have skipped it on this CPU machine), and ``slow`` is theirs alone. The old
    name on a harness test still works, with a deprecation warning naming the new one."""
    pytester.makeini(
        "[pytest]\naddopts = --strict-markers\n"
        "markers =\n    gpu: runs on our render farm\n    slow: takes a while\n"
    )
    pytester.makepyfile(FOREIGN)
    result = pytester.runpytest("-p", "no:cacheprovider", "-rs")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        ["*HarnessDeprecationWarning: @pytest.mark.backend is deprecated: use *dist_backend*"]
    )
    markers = pytester.runpytest("-p", "no:cacheprovider", "--markers").stdout.str()
    assert "@pytest.mark.dist_gpu(n=1)" in markers
    assert "slower end-to-end" not in markers  # the plugin no longer registers a slow marker


# --- 4. bad options ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("how", "message"),
    [
        (["--rank-timeout=-5"], "--rank-timeout: -5.0; accepted: a positive number of seconds"),
        ("ini soon", "rank_timeout ini: 'soon' is not a number of seconds"),
        # Zero is refused too, not taken for "not given" and replaced by the default 60 s.
        (["--rank-timeout", "0"], "--rank-timeout: 0.0; accepted: a positive number of seconds"),
        ("ini 0", "rank_timeout ini: '0'; accepted: a positive number of seconds"),
        # Refused where it is read, not an OverflowError in every test's wait.
        (
            ["--rank-timeout", "1e9"],
            "--rank-timeout: 1000000000.0; accepted: a positive number "
            "of seconds, at most 604800 (a week)",
        ),
    ],
)
def test_a_bad_option_is_a_usage_error_naming_it(pytester, how, message):
    pytester.makepyfile("def test_x():\n    pass\n")
    if isinstance(how, str):  # "ini VALUE": the value in the project's ini file
        pytester.makeini(f"[pytest]\nrank_timeout = {how.split()[1]}\n")
        how = []
    result = pytester.runpytest("-p", "no:cacheprovider", *how)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert message in result.stderr.str()


# --- 5. GPU leases ------------------------------------------------------------------------


def test_two_tests_never_lease_the_same_gpu(tmp_path):
    """Leases are flocks, one per device: a second test asking for GPUs gets only free ones,
    waits while none are free and gives up at its deadline, and a released GPU is free again."""
    devices = ["0", "1", "2", "3"]
    with backends.lease(2, devices, timeout=1, directory=tmp_path) as first:
        assert first == ["0", "1"]
        with backends.lease(2, devices, timeout=1, directory=tmp_path) as second:
            assert second == ["2", "3"]  # the other worker's test gets the other two
        start = time.monotonic()
        with backends.lease(3, devices, timeout=0.3, directory=tmp_path) as third:
            assert third is None  # only 2 free: waited its deadline, then gave up
        assert time.monotonic() - start >= 0.3
    with backends.lease(4, devices, timeout=1, directory=tmp_path) as everything:
        assert everything == devices  # released on leaving the block


def test_the_defaults_live_in_one_place():
    """run_ranks's and the CLI's defaults are config's (a second copy would drift)."""
    from tutorial_impl.testing.settings import timing
    from tutorial_impl.testing.strategies import forked

    assert timing.DEFAULT_DEADLINE == config.DEFAULT_DEADLINE
    params = inspect.signature(forked.run_ranks).parameters
    defaults = {name: param.default for name, param in params.items()}
    assert defaults["world_size"] == config.DEFAULT_WORLD_SIZE
    assert defaults["backend"] == config.DEFAULT_BACKEND
    assert defaults["init_method"] == config.DEFAULT_INIT_METHOD
    assert defaults["timeout"] == config.DEFAULT_DEADLINE


def test_the_public_run_ranks_is_the_tests_own_in_the_tests_context_only(request):
    """During a test's body the plugin hands the public ``run_ranks`` to this test's
    (``forked.IN_TEST``); a fresh context, such as a thread the test starts, gets the
    standalone function (``IN_TEST`` is None there), as code outside any test does."""
    from tutorial_impl.testing.strategies import forked

    assert forked.IN_TEST.get().args == (request.node,)
    assert contextvars.Context().run(forked.IN_TEST.get) is None


LEASED = """
import os
import pytest

@pytest.mark.dist_gpu
@pytest.mark.rank_timeout(0.5)
def test_sees_only_its_gpu(run_ranks):
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "{expected}"
"""


@pytest.mark.parametrize(
    ("held", "options", "outcome"),
    [
        ([], [], {"passed": 1}),  # free: leased, and the test sees only that GPU
        (["1"], [], {"passed": 1}),  # GPU 1 busy: it gets GPU 0
        (["0", "1"], [], {"skipped": 1}),  # both busy past its deadline: skipped, with why
        (["0", "1"], ["--require-gpu"], {"errors": 1}),  # ...a failure on a GPU job
    ],
)
def test_a_gpu_test_leases_its_gpus_through_the_plugin(
    pytester, monkeypatch, held, options, outcome
):
    """A machine with two (pretend) GPUs, some held by another worker's test: the plugin
    leases a free one for the test's run, shows it through CUDA_VISIBLE_DEVICES, and gives
    back the GPU and the variable afterwards."""
    monkeypatch.setattr(backends, "why_not_here", lambda *args: None)  # pretend CUDA is here
    monkeypatch.setattr(backends, "visible_gpus", lambda: ["0", "1"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(backends, "lease_dir", lambda: pytester.path)  # this test's own locks
    expected = "0" if held != ["0"] else "1"
    pytester.makepyfile(LEASED.format(expected=expected))
    with backends.lease(len(held), held, timeout=1, directory=pytester.path) as got:
        assert got == held  # another worker's test holds these for the whole run
        result = pytester.runpytest("-p", "no:cacheprovider", "-rsE", *options)
    result.assert_outcomes(**outcome)
    if outcome != {"passed": 1}:
        result.stdout.fnmatch_lines(["*needs 1 GPU(s) of 2, and other tests*held them*"])
    assert "CUDA_VISIBLE_DEVICES" not in os.environ  # restored after the test
    with backends.lease(2, ["0", "1"], timeout=1, directory=pytester.path) as both:
        assert both == ["0", "1"]  # and every lease given back


def test_a_world_size_above_what_the_host_can_start_is_refused_naming_the_limit(monkeypatch):
    """docs/harness.md: at most the smallest of 256, RLIMIT_NPROC / 16, RLIMIT_NOFILE / 8
    and memory / 64 MiB; the message names the limit and what set it, before any rank."""
    import resource

    from tutorial_impl.testing import call
    from tutorial_impl.testing.settings import matrix

    limits = {resource.RLIMIT_NPROC: 10_000, resource.RLIMIT_NOFILE: 20_000}
    monkeypatch.setattr(resource, "getrlimit", lambda which: (limits[which], limits[which]))
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": (64 << 30) // 4096}  # 64 GiB
    monkeypatch.setattr(os, "sysconf", lambda name: pages[name])
    assert matrix.world_size_limit() == (256, "the harness's cap, MAX_WORLD_SIZE = 256")
    assert matrix.check_world_size(256) == 256
    with pytest.raises(ValueError, match=r"^world_size 257 is more ranks than this host can "):
        matrix.check_world_size(257)
    limits[resource.RLIMIT_NPROC] = 1600  # 100 ranks of 16 threads
    assert matrix.world_size_limit() == (100, "RLIMIT_NPROC 1600 / 16 per rank")
    limits[resource.RLIMIT_NOFILE] = 400  # 50 ranks of 8 files in the parent
    assert matrix.world_size_limit() == (50, "RLIMIT_NOFILE 400 / 8 per rank")
    pages["SC_PHYS_PAGES"] = (2 << 30) // 4096  # 2 GiB: 32 ranks
    assert matrix.world_size_limit() == (32, "2048 MiB of memory / 64 MiB per rank")
    limits[resource.RLIMIT_NPROC] = resource.RLIM_INFINITY  # no limit: not counted
    assert matrix.world_size_limit()[0] == 32
    for bad, words in [(0, "positive integer"), (True, "positive integer"), (33, "at most 32")]:
        with pytest.raises(ValueError, match=words):
            call.build(print, world_size=bad)
        with pytest.raises(ValueError, match=words):
            matrix.check_world_size(bad, "size")
    with pytest.raises(ValueError, match=r"world_size\(2, 33\): size 33 .* at most 32 \(2048"):
        matrix.sizes(SimpleNamespace(args=(2, 33)))
