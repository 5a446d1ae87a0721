"""The harness as an installed pytest plugin, seen from a project that only installed it.

A throwaway project (``pytester``) has no conftest: the plugin arrives through the package's
``pytest11`` entry point. Its test file defines its rank functions itself and uses
``run_ranks``, the world-size matrix and the cross-rank assertions. It must pass under
pytest's default import mode, ``--import-mode=importlib`` and xdist (``-n 1``), and its
failing twin must fail with reports that say what went wrong.

The xdist run is the costly part (its worker imports torch), so it is done once and shared:
the same run measures coverage (``--cov``) over copies of the repository's ring and
collectives tests, whose code runs almost entirely inside ranks, and checks it is reported as
covered. Its controller runs in this process: a worker is a new interpreter all the same, and
a controller of its own would add one more, and a rank forkserver (torch again), for nothing
these claims need (``test_harness_leaks`` runs a controller of its own, with its server).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from tutorial_impl.testing import run_ranks
from tutorial_impl.testing.rank import coverage as rank_coverage

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parents[2]
PLUGIN = "tutorial_impl.testing.plugin"

# A user's test file: rank functions above the tests that run them.
USER_TESTS = """
import pytest
import torch
import torch.distributed as dist

from tutorial_impl.testing import assert_close_across_ranks, assert_equal_across_ranks


def my_sum(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def test_my_sum(run_ranks):
    assert run_ranks(my_sum) == [3.0, 3.0]


@pytest.mark.world_size(1, 2, 4)
def test_my_sum_at_every_size(run_ranks, world_size):
    assert run_ranks(my_sum) == [world_size * (world_size + 1) / 2] * world_size


class Point:  # defined in the test file, pickled to the ranks and back
    def __init__(self, x):
        self.x = x

    def __eq__(self, other):
        return isinstance(other, Point) and other.x == self.x


def shifted(rank, world_size, point):
    return Point(point.x + rank)


def test_objects_of_the_test_file_travel_both_ways(run_ranks):
    assert run_ranks(shifted, Point(10)) == [Point(10), Point(11)]


def replicas_agree(rank, world_size):
    torch.manual_seed(rank)
    weight = torch.randn(4, 4)
    dist.broadcast(weight, src=0)
    assert_equal_across_ranks(weight)
    assert_close_across_ranks(weight + rank * 1e-9, rtol=1e-6, atol=1e-6)
    assert_equal_across_ranks({"step": 3, "optimizer": "adam"})


@pytest.mark.world_size(2, 3)
def test_replicas_agree(run_ranks):
    run_ranks(replicas_agree)
"""
USER_PASSES = 7  # 1 + 3 sizes + 1 + 2 sizes

# Its failing twin: each test fails in one way a user must be able to read off the report.
FAILING_TESTS = """
import pytest
import torch
import torch.distributed as dist

from tutorial_impl.testing import assert_close_across_ranks, assert_equal_across_ranks


def drift(rank, world_size):
    t = torch.ones(3)
    if rank == 2:
        t[1] = 1.5
    assert_close_across_ranks(t, rtol=1e-5, atol=1e-5)


@pytest.mark.world_size(4)
def test_one_rank_drifts(run_ranks):
    run_ranks(drift)


def two_camps(rank, world_size):
    assert_equal_across_ranks(f"checkpoint-{rank % 2}", name="checkpoint name")


@pytest.mark.world_size(3)
def test_ranks_disagree_on_an_object(run_ranks):
    run_ranks(two_camps)


def broken_at_two(rank, world_size):
    assert world_size != 2


@pytest.mark.world_size(1, 2)
def test_one_size_of_the_matrix_fails(run_ranks):
    run_ranks(broken_at_two)


def test_lambda(run_ranks):
    run_ranks(lambda rank, world_size: rank)


def test_nested_function(run_ranks):
    def inner(rank, world_size):
        return rank

    run_ranks(inner)
"""


def test_a_user_file_passes_in_default_and_importlib_import_modes(pytester):
    """The guarantee: rank functions defined in a test file are found by the ranks.

    Default (prepend) mode imports the file by a name its directory makes importable; in
    importlib mode the name (``tests.test_user`` here, under dummy parent packages) leads
    nowhere in another process, so ranks load the file itself under that name, and the
    ``Point`` objects pickled in the parent still unpickle there and back."""
    pytester.makepyfile(**{"tests/test_user": USER_TESTS})
    for mode in ("prepend", "importlib"):
        result = pytester.runpytest("-p", "no:cacheprovider", f"--import-mode={mode}")
        result.assert_outcomes(passed=USER_PASSES)


def test_a_failing_user_file_shows_what_went_wrong(pytester):
    """Each failure names its cause: the disagreeing rank and its values, the failing size
    of a matrix (the other size passes), and why a lambda or nested function cannot run."""
    pytester.makepyfile(test_failing=FAILING_TESTS)
    result = pytester.runpytest("-p", "no:cacheprovider", "-rA")
    result.assert_outcomes(passed=1, failed=5)
    text = result.stdout.str()
    # The cross-rank assertion names rank 2 against the majority, with both values.
    assert "value is not close (rtol=1e-05, atol=1e-05) across ranks: rank(s) 2 disagree " in text
    assert "with rank(s) 0, 1, 3" in text
    assert "rank(s) 2: tensor([1.0000, 1.5000, 1.0000])" in text
    assert "rank(s) 0, 1, 3: tensor([1., 1., 1.])" in text
    # ... for any object, under the name the test gave it.
    assert "checkpoint name is not equal across ranks: rank(s) 1 disagree with rank(s) 0, 2" in text
    assert "rank(s) 1: 'checkpoint-1'" in text
    # One item per size: only size 2 fails.
    assert "PASSED test_failing.py::test_one_size_of_the_matrix_fails[world_size1]" in text
    assert "FAILED test_failing.py::test_one_size_of_the_matrix_fails[world_size2]" in text
    # What cannot work is refused before any rank starts, saying why.
    assert text.count("is not a module-level function") >= 2
    assert "Define it at the top level of the test file" in text


# A library's tests, ported as they were written: call shapes other than (rank, world_size),
# and a helper that calls run_ranks itself (the docs' MetricTester, added from harness.md).
PORTED_SHAPES = """
import functools

import pytest
import torch
import torch.distributed as dist

from tutorial_impl.testing import run_ranks


def only_rank(rank):
    return rank


def scaled(rank, *, scale):
    return rank * scale


def by_keyword(rank, scale):
    return rank * scale


def offset_sum(offset, rank, world_size, *, scale=1):
    total = torch.tensor([float(offset + rank)])
    dist.all_reduce(total)
    return total.item() * scale


def needs_x(rank, world_size, x):
    return x


def skips(rank):
    pytest.skip("no data on this machine")


def test_shapes(run_ranks):
    assert run_ranks(only_rank) == [0, 1]
    assert run_ranks(scaled, fn_kwargs={"scale": 5}) == [0, 5]
    assert run_ranks(by_keyword, fn_kwargs={"scale": 5}, world_size=3) == [0, 5, 10]
    assert run_ranks(functools.partial(offset_sum, 10, scale=2)) == [42.0, 42.0]


def test_a_call_the_signature_cannot_take(run_ranks):
    run_ranks(needs_x)


def test_a_skip_in_a_helpers_ranks_skips_the_test():
    run_ranks(skips)  # the public function, in the test's body: the fixture's verdict
"""
# An ignite-style conftest: the project's own world_size fixture, for its own tests.
PORTED_CONFTEST = """
import pytest


@pytest.fixture
def world_size():
    return 1
"""
PORTED_UNDER_CONFTEST = """
import pytest
import torch
import torch.distributed as dist

from tutorial_impl.testing import run_ranks as public_run_ranks


def all_reduced(rank, world_size):
    total = torch.tensor([1.0])
    dist.all_reduce(total)
    return total.item()


def test_two_rank_all_reduce(run_ranks, world_size):
    assert run_ranks(all_reduced) == [float(world_size)] * world_size  # true on 1 rank too


def test_two_rank_all_reduce_from_a_helper():
    assert public_run_ranks(all_reduced) == [2.0, 2.0]


@pytest.mark.parametrize("world_size", [2])
def test_parametrized_size(run_ranks, world_size):
    assert run_ranks(all_reduced) == [2.0, 2.0]


def test_the_projects_own_meaning(world_size):
    assert world_size == 1
"""
PORTED_OWN_RUNNER = """
import pytest


@pytest.fixture
def run_ranks():
    return lambda fn: [fn(0, 1)]


def test_with_its_own_runner(run_ranks):
    assert run_ranks(max) == [1]
"""


def test_a_ported_librarys_tests_run_as_written_or_are_refused_by_name(pytester):
    """A stranger's library, ported (issue 25): rank functions of every shape its tests had,
    the docs' helper class calling run_ranks (its world size from the test's marker), a skip
    in a helper's ranks, and a conftest world_size fixture returning 1 that must not shrink a
    two-rank test in silence, nor a run_ranks fixture of its own take the harness's place."""
    files = {
        **_readme_blocks("`run_ranks`"),
        "tests/test_shapes.py": PORTED_SHAPES,
        "tests/test_own_runner.py": PORTED_OWN_RUNNER,
        "tests/ported/conftest.py": PORTED_CONFTEST,
        "tests/ported/test_ported.py": PORTED_UNDER_CONFTEST,
    }
    assert "tests/test_metric.py" in files
    for path, body in files.items():
        (pytester.path / path).parent.mkdir(parents=True, exist_ok=True)
        (pytester.path / path).write_text(body)
    result = pytester.runpytest("-p", "no:cacheprovider", "-rA", "--junitxml=run.xml", "tests")
    result.assert_outcomes(passed=4, skipped=1, failed=2, errors=2)
    text = result.stdout.str()
    for passing in (
        "test_metric.py::test_sum_over_three_ranks",
        "test_shapes.py::test_shapes",
        "ported/test_ported.py::test_parametrized_size[2]",
        "ported/test_ported.py::test_the_projects_own_meaning",
    ):
        assert f"PASSED tests/{passing}" in text
    # Refused before any rank started, naming the function, the call and why.
    assert (
        "TypeError: run_ranks: rank function test_shapes.needs_x(rank, world_size, x) cannot be "
        "called as needs_x(rank, world_size): missing a required argument: 'x'"
    ) in text
    times = {
        case.get("name"): float(case.get("time"))
        for case in ET.parse(pytester.path / "run.xml").iter("testcase")
    }
    assert times["test_a_call_the_signature_cannot_take"] < 1.0
    assert "SKIPPED [1] tests/test_shapes.py" in text and "rank 0: no data on this machine" in text
    # The conftest's world_size (1) shrinks no two-rank test: each is refused, by name.
    shadowed = "fixture 'world_size' of tests/ported/conftest.py:5 shadows the harness's"
    assert text.count(shadowed) >= 2, text
    assert "ERROR tests/ported/test_ported.py::test_two_rank_all_reduce - " in text
    assert "FAILED tests/ported/test_ported.py::test_two_rank_all_reduce_from_a_helper" in text
    assert "fixture 'run_ranks' of tests/test_own_runner.py:5 shadows the harness's" in text


def _copy_tutorial_tests(destination: Path) -> list[str]:
    """Copy the repository's ring and collectives tests (found wherever they live under
    tests/) with any helper modules beside them, so they run in the throwaway project."""
    copied = []
    for name in ("test_06_ring.py", "test_03_collectives.py"):
        found = sorted((REPO / "tests").rglob(name))
        assert found, f"{name} not found under {REPO / 'tests'}"
        for path in found[0].parent.glob("*.py"):
            helper = not path.name.startswith(("test_", "conftest"))
            if (helper or path == found[0]) and not (destination / path.name).exists():
                shutil.copy(path, destination / path.name)
        copied.append(name)
    return copied


def _percent(report: dict, module: str) -> float:
    """Percent covered of ``tutorial_impl/.../<module>`` (not the benchmark of that name)."""
    for name, entry in report["files"].items():
        path = Path(name)
        if path.name == module and "tutorial_impl" in path.parts and "bench" not in path.parts:
            return entry["summary"]["percent_covered"]
    raise AssertionError(f"{module} missing from the coverage report: {sorted(report['files'])}")


def forked(rank: int, world_size: int) -> int:
    return rank


@pytest.mark.slow
@pytest.mark.timeout(600)  # ~10 s on a quiet 2-core machine; minutes when it is overloaded
def test_xdist_run_of_an_installed_plugin_with_coverage_inside_ranks(pytester, run_ranks):
    """One ``pytest -n 1 --cov=tutorial_impl.dist_tuto`` in a project with no conftest: the
    user's file passes under xdist, and ring.py / collectives.py, whose code runs in ranks,
    are reported at what their tests really reach (ring.py: 17% with the parent's coverage
    alone). Every rank's data file has been combined into the report, and the run leaves
    this session measuring as it was."""
    # This session's rank forkserver starts now, with this session's plan: started by the
    # run's controller (this process), it would preload that run's plan for later tests.
    assert run_ranks(forked, world_size=1, backend=None) == [0]
    measuring = rank_coverage.parent_settings()
    pytester.makepyfile(test_user=USER_TESTS)
    ring, collectives = _copy_tutorial_tests(pytester.path)
    # Enough of each module to reach every line worth reaching, and no more: under coverage
    # every rank starts, traces and saves its own measurement, so each rank run costs. The
    # fewest rank runs that reach the lines (measured one test at a time): ring.py 93% from
    # the demo, the byte count (both rings, 4 ranks) and one mismatch (the error path), where
    # the whole correctness matrix adds one line; collectives.py 95% from the demo (every
    # collective) and every reduce op (3 ranks), plus the op checks, which run in the parent.
    tutorial_tests = [
        f"{ring}::test_bytes_sent_per_rank_match_the_theory",
        f"{ring}::test_mismatched_inputs_raise_on_every_rank[recv]",
        f"{ring}::test_demo_prints_the_tutorial_line",
        f"{collectives}::test_every_reduce_op_on_gloo",
        f"{collectives}::test_check_op_messages_name_op_dtype_and_backend",
        f"{collectives}::test_check_op_refuses_what_no_backend_reduces",
        f"{collectives}::test_cli_demo",
    ]
    # One xdist worker is xdist all the same (a controller, a worker process, reports sent
    # back); a second would only import torch once more. The measured package is the one the
    # two modules are in, not all of tutorial_impl: the report parses every file of it, twice
    # (pytest-cov's total, then the JSON): seconds of CPU for the whole package.
    result = pytester.runpytest_inprocess(
        "-n",
        "1",
        "-p",
        "no:cacheprovider",
        "--cov=tutorial_impl.dist_tuto",
        "--cov-report=json:coverage.json",
        "--durations=5",
        "test_user.py",
        *tutorial_tests,
    )
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == 0 and outcomes.get("errors", 0) == 0, result.stdout.str()
    assert "1 worker [" in result.stdout.str(), result.stdout.str()  # xdist ran the tests
    # Every item ran and passed: one id is two items ([gloo] and [nccl], both in the parent).
    assert outcomes["passed"] == USER_PASSES + len(tutorial_tests) + 1, result.stdout.str()
    report = json.loads((pytester.path / "coverage.json").read_text())
    assert _percent(report, "ring.py") > 90
    assert _percent(report, "collectives.py") > 90
    assert not list(pytester.path.glob(".coverage.*")), "rank data files left uncombined"
    assert rank_coverage.parent_settings() == measuring, "the run changed this session's coverage"


def test_the_plugin_is_registered_once_with_a_conftest_line_too(pytester):
    """The entry point registers the plugin under its module name, so a conftest naming
    the module (as this repository's root conftest does) finds it and adds no second copy;
    ``-p no:<name>`` turns it off."""
    pytester.makeconftest(f"pytest_plugins = [{PLUGIN!r}]")
    config = pytester.parseconfigure("-p", "no:cacheprovider")
    plugin = sys.modules[PLUGIN]
    assert [p for p in config.pluginmanager.get_plugins() if p is plugin] == [plugin]
    assert config.pluginmanager.get_plugin(PLUGIN) is plugin
    pytester.makepyfile("def test_x(run_ranks):\n    pass\n")
    result = pytester.runpytest("-p", "no:cacheprovider", "-p", f"no:{PLUGIN}")
    result.stdout.fnmatch_lines(["*fixture 'run_ranks' not found*"])


def test_options_are_documented_in_pytest_help(pytester):
    result = pytester.runpytest("--help")
    result.stdout.fnmatch_lines(
        [
            "torch.distributed multi-rank harness:",
            "*--rank-timeout=RANK_TIMEOUT*",
            "*--init-method=*",
            "*--require-gpu*fail, instead of skipping, every test marked dist_gpu*",
        ]
    )


# The modules that exist for pytest (hooks, fixtures, the torchrun job's pytest side): the
# only ones that may import it.
PYTEST_SIDE = {
    "plugin",
    "fixtures",
    "forkserver.plan",
    "torchcase",  # pytest's hooks for torch's MultiProcessTestCase classes
    "strategies.torchrun.phases",
    "strategies.torchrun.session",
    "strategies.torchrun.reporter",  # which rank writes the report and junit
}


def test_loading_the_plugin_does_not_import_torch_and_a_script_does_not_import_pytest():
    """The plugin loads in every pytest run of the environment; torch (seconds) only comes
    when a test needs it. And a script's ``run_ranks``, with everything else of the harness
    (the warm pool, the audit, the torchrun job), imports neither: a rank whose function's
    module imported the warm pool paid for pytest's import (~160 ms of CPU a rank) when the
    pool's summary imported pytest at its top."""
    code = f"""
import importlib, pkgutil, sys
import tutorial_impl.testing as harness
side = {sorted(PYTEST_SIDE)!r}
names = [m.name for m in pkgutil.walk_packages(harness.__path__, "tutorial_impl.testing.")]
for name in names:
    if name.removeprefix("tutorial_impl.testing.") not in side:
        importlib.import_module(name)
assert len(names) > 40, names
loaded = [m for m in ("pytest", "torch") if m in sys.modules]
assert not loaded, f"importing the harness's modules imported {{loaded}}"
import {PLUGIN}
assert "torch" not in sys.modules, "torch imported"
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


GPU_TESTS = """
import pytest

@pytest.mark.dist_gpu
def test_gpu():
    pass

@pytest.mark.dist_backend("nccl")
def test_nccl():
    pass

@pytest.mark.dist_backend("mpi")
def test_mpi():
    pass
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CPU-only machine")
def test_require_gpu_turns_gpu_skips_into_failures(pytester):
    """Without the option a GPU test this machine cannot run is skipped; with it, the
    same test fails with the reason, so a GPU CI job cannot pass by skipping. It fails in
    its setup, before any fixture runs, which pytest reports as an error. A non-GPU skip
    (MPI missing) stays a skip."""
    pytester.makepyfile(GPU_TESTS)
    plain = pytester.runpytest("-p", "no:cacheprovider")
    plain.assert_outcomes(skipped=3)
    assert plain.ret == 0
    required = pytester.runpytest("-p", "no:cacheprovider", "--require-gpu", "-rEs")
    required.assert_outcomes(errors=2, skipped=1)
    assert required.ret == pytest.ExitCode.TESTS_FAILED
    text = required.stdout.str()
    assert "--require-gpu: this GPU test cannot run here: needs CUDA and 1 GPU(s)" in text
    # Each error shows the reason (the short summary may repeat it: CI=true does not truncate)
    assert text.count("--require-gpu: this GPU test cannot run here") >= 2
    required.stdout.fnmatch_lines(["ERROR *::test_gpu - *", "ERROR *::test_nccl - *"])


MATRIX = """
import pytest

@pytest.mark.world_size(1, 2, 4)
def test_sizes(run_ranks, world_size):
    pass

@pytest.mark.world_size(3)
def test_single(world_size):
    assert world_size == 3

@pytest.mark.dist_gpu
@pytest.mark.dist_backend("nccl")
@pytest.mark.world_size(1, 2, 4)
def test_gpus(run_ranks):
    pass
"""


def test_the_matrix_makes_one_item_per_size_selectable_by_k_and_m(pytester, monkeypatch):
    """Ids ``[world_sizeN]``, a ``world_size(n=N)`` marker per item, the single-size marker
    unchanged, and a size that needs more GPUs than the machine has skipped at collection
    time with the reason (a machine with 2 GPUs is pretended here)."""
    import torch.distributed as dist

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    pytester.makepyfile(MATRIX)
    items, _ = pytester.inline_genitems("-p", "no:cacheprovider")
    assert [item.name for item in items] == [
        "test_sizes[world_size1]",
        "test_sizes[world_size2]",
        "test_sizes[world_size4]",
        "test_single",
        "test_gpus[world_size1]",
        "test_gpus[world_size2]",
        "test_gpus[world_size4]",
    ]
    skips = {item.name: [m.kwargs["reason"] for m in item.iter_markers("skip")] for item in items}
    assert skips["test_gpus[world_size4]"] == ["needs 4 GPUs, found 2"]
    assert skips["test_gpus[world_size2]"] == skips["test_sizes[world_size4]"] == []
    for option in (["-k", "world_size4"], ["-m", "world_size(n=4)"]):
        chosen = pytester.runpytest("-p", "no:cacheprovider", "--collect-only", "-q", *option)
        chosen.stdout.fnmatch_lines(
            ["*::test_sizes[[]world_size4[]]", "*::test_gpus[[]world_size4[]]", "2/7 tests*"]
        )


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("@pytest.mark.world_size(2, 0)\ndef test_x(run_ranks): pass", "positive integers"),
        ("@pytest.mark.world_size(2, 2)\ndef test_x(run_ranks): pass", "only once"),
        ("@pytest.mark.world_size(1, 2)\ndef test_x(): pass", "this test uses neither"),
    ],
)
def test_a_bad_matrix_fails_its_own_test_and_the_session_goes_on(pytester, source, message):
    pytester.makepyfile(f"import pytest\n\n{source}\n\ndef test_after():\n    pass\n")
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1, passed=1)  # an error in its setup, not in collection
    result.stdout.fnmatch_lines([f"*harness configuration:*{message}*"])


def coverage_in_the_rank(rank: int, world_size: int) -> tuple[bool, bool]:
    """Whether this rank imported coverage, and whether it is measuring."""
    coverage = sys.modules.get("coverage")
    return coverage is not None, coverage is not None and coverage.Coverage.current() is not None


def test_ranks_measure_coverage_exactly_when_the_parent_does():
    """Measured: ranks start coverage (the xdist test above checks the report).
    Not measured: ranks do not even import coverage, so nothing is slower."""
    measuring = rank_coverage.parent_settings() is not None
    results = run_ranks(coverage_in_the_rank, world_size=2, backend=None, timeout=60)
    assert results == [(measuring, measuring)] * 2


def _readme_blocks(section: str) -> dict[str, str]:
    """The code blocks of a section of docs/harness.md, keyed by the path in their first
    comment line."""
    readme = (REPO / "docs" / "harness.md").read_text()
    start = readme.index(f"## {section}\n")
    end = readme.find("\n## ", start + 1)
    blocks = re.findall(r"```\w*\n(.*?)```", readme[start:end], re.S)
    named = {b.split("\n", 1)[0].lstrip("# ").strip(): b for b in blocks if b.startswith("# ")}
    return {path: body for path, body in named.items() if path.endswith((".py", ".toml"))}


def test_the_readme_examples_pass_as_written(pytester):
    """The README's harness example and the complete project of "Testing your own
    distributed code" in docs/harness.md (its library, its test file, its pytest
    configuration), run as written: 3 + 3 tests, one per world size."""
    files = _readme_blocks("Testing your own distributed code")
    assert set(files) == {"pyproject.toml", "src/mylib/averaging.py", "tests/test_averaging.py"}
    for path, body in files.items():
        (pytester.path / path).parent.mkdir(parents=True, exist_ok=True)
        (pytester.path / path).write_text(body)
    (pytester.path / "src/mylib/__init__.py").write_text("")
    readme = (REPO / "README.md").read_text()
    harness = readme[readme.index("## Testing distributed code with the harness") :]
    (pytester.path / "tests/test_blocking.py").write_text(
        re.search(r"```python\n(.*?)```", harness, re.S).group(1)
    )
    pytester.syspathinsert(pytester.path / "src")
    result = pytester.runpytest("-p", "no:cacheprovider", "tests")
    result.assert_outcomes(passed=6)


LIVE_TESTS = """
import os
import sys
import time


def tick_then_wait(rank, world_size, sentinel):
    print("tick", flush=True)
    stop = time.monotonic() + 10
    while not os.path.exists(sentinel) and time.monotonic() < stop:
        time.sleep(0.05)
    return os.path.exists(sentinel)  # the terminal showed a tick while the ranks ran


class Terminal:  # stands for the terminal -s leaves the test: it marks the first tick
    def __init__(self, real, sentinel):
        self.real, self.sentinel, self.lines = real, sentinel, []

    def write(self, text):
        self.lines.append(text)
        if "] tick" in text:
            open(self.sentinel, "a").close()
        return self.real.write(text)

    def flush(self):
        self.real.flush()


def test_ranks_are_seen_live(run_ranks, tmp_path):
    sentinel = str(tmp_path / "seen")
    terminal = sys.stdout = Terminal(sys.stdout, sentinel)
    try:
        assert run_ranks(tick_then_wait, sentinel) == [True, True]
    finally:
        sys.stdout = terminal.real
    assert "[rank 1] tick\\n" in terminal.lines
"""


def test_with_capture_off_rank_output_is_shown_live(pytester):
    """docs/harness.md: ``pytest -n0 -s`` shows each rank's lines as they come. Each rank
    prints, then waits (10 s at most) until the terminal has shown a line of it: it is
    seen while the ranks run, not after they end."""
    pytester.makepyfile(test_live=LIVE_TESTS)
    result = pytester.runpytest("-p", "no:cacheprovider", "-s")
    result.assert_outcomes(passed=1)
