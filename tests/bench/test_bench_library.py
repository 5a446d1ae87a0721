"""The library benchmark (``tutorial_impl/bench/library.py``) on a tiny run.

The benchmark claims that a library's suite, ported to the harness with no preload setting,
costs about what its own spawn pool costs per test (warm worlds) and a few times that (fresh
ranks), and that the library is preloaded with nobody naming it. No speed is asserted here:
the run only has to be real and the figures consistent. The tiny run is the benchmark's own
suite and arithmetic with its pytest session run in this process (``run_session`` replaced:
the one in-process pytester run of this file), its ranks and its pool's workers forked by
this process's forkserver: a subprocess would import torch twice more. That the forkserver
of a fresh session imports what its test files import is shown by
``test_harness_isolation.py``'s own fresh session.

Read in this order: a tiny run, then the arithmetic on stamps of known value, then nonsense
arguments.
"""

from __future__ import annotations

import json

import pytest
import torch  # noqa: F401 - imported before the in-process run (pytester restores sys.modules)

from tutorial_impl.bench import library

pytest_plugins = ["pytester"]


@pytest.mark.slow
def test_a_tiny_run_measures_the_three_ways(pytester, monkeypatch, capsys):
    """World size 1, a light "heavy" import, and a pool whose worker this process's
    forkserver forks keep it cheap."""

    def in_this_process(work, tests, *args):
        stamps = work / "stamps.json"
        monkeypatch.setenv("BENCH_STAMPS", str(stamps))
        monkeypatch.setenv("BENCH_TESTS", str(tests))
        monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
        result = pytester.runpytest_inprocess(
            str(work), "--rootdir", str(work), "-c", str(work / "pytest.ini"),
            "-p", "no:cacheprovider", "-p", "no:randomly", *args,
        )  # fmt: skip
        assert result.ret == 0, result.stdout.str()[-3000:]
        return json.loads(stamps.read_text())

    monkeypatch.setattr(library, "run_session", in_this_process)
    path = pytester.path / "library.json"
    argv = ["--tests", "6", "--world-size", "1", "--heavy", "json", "--unpreloaded-tests", "0"]
    assert library.main([*argv, "--pool-start-method", "harness", "--json", str(path)]) == 0
    figures = json.loads(path.read_text())
    assert figures["tests"] == 6 and figures["world_size"] == 1 and figures["batches"] == 2
    assert figures["pool_start_method"] == "harness"
    assert figures["pool_ms"] > 0 and figures["fresh_ms"] > 0 and figures["warm_ms"] > 0
    assert figures["fresh_ratio"] == pytest.approx(figures["fresh_ms"] / figures["pool_ms"])
    assert figures["warm_ratio"] == pytest.approx(figures["warm_ms"] / figures["pool_ms"])
    cpu = [figures[f"{way}_cpu_ms"] for way in ("pool", "fresh", "warm")]
    assert min(cpu) >= 0  # in ticks of 10 ms (and here the ranks' forkserver is no child)
    if figures["pool_cpu_ms"]:
        cpu_ratio = figures["warm_cpu_ms"] / figures["pool_cpu_ms"]
        assert figures["warm_cpu_ratio"] == pytest.approx(cpu_ratio)
    assert figures["unpreloaded_ms"] is None and figures["unpreloaded_ratio"] is None
    # The pool was made (its fixture timed) and the forkserver was running already here.
    assert figures["pool_start_ms"] > 0 and figures["fresh_start_ms"] >= 0
    pool_suite = figures["pool_start_ms"] / 1e3 + 6 * figures["pool_ms"] / 1e3
    assert figures["pool_suite_s"] == pytest.approx(pool_suite)
    ratio = figures["fresh_suite_s"] / figures["pool_suite_s"]
    assert figures["fresh_suite_ratio"] == pytest.approx(ratio)
    printed = capsys.readouterr().out
    assert f"{figures['fresh_ratio']:5.2f}x the pool" in printed
    assert f"a suite of 6 such tests, its start included: pool {pool_suite:.2f} s" in printed


def test_a_test_costs_the_median_gap_to_the_next_of_its_way_after_the_first(monkeypatch):
    stamps = [("fresh", 0.0), ("fresh", 0.5), ("fresh", 0.52), ("fresh", 0.532), ("pool", 0.6)]
    stamps = [(f"test_{name}", t, 0.0) for name, t in stamps]
    # 500 ms (the forkserver's start) left out, 60 ms (the next is no fresh test) not a gap
    assert library.per_test_ms(stamps, "fresh") == pytest.approx(16.0)
    # ... and the first test paid the forkserver's start: 500 ms less a test's 16
    assert library.start_ms(stamps, "fresh") == pytest.approx(484.0)
    with pytest.raises(ValueError, match="at least 3 tests"):
        library.per_test_ms(stamps[:2], "fresh")


def test_cpu_is_counted_block_by_block_after_the_first(monkeypatch):
    """CPU seconds of the whole session at each test's start: a block of a way costs what
    the session spent from its first test to the next block's first."""
    cpu = [0.0, 5.0, 5.1, 5.3, 5.32, 5.52, 5.56]  # the first fresh block started the server
    names = ["fresh", "fresh", "pool", "fresh", "fresh", "pool", "zz_end"]
    stamps = [(f"test_{name}", 0.0, seconds) for name, seconds in zip(names, cpu, strict=True)]
    assert library.per_test_cpu_ms(stamps, "fresh") == pytest.approx(110.0)  # 0.22 s, 2 tests
    assert library.per_test_cpu_ms(stamps, "pool") == pytest.approx(40.0)
    with pytest.raises(ValueError, match="at least 2 blocks"):
        library.per_test_cpu_ms(stamps[:3], "fresh")
    cost = {"pool": 0.010, "fresh": 0.012, "warm": 0.005}

    def session(work, tests, *args):
        ways = {"fresh": 0.5} if "rank_preload_test_imports=false" in args else cost
        stamps, now = [], 0.0
        for _ in range(2):  # blocks
            for way, seconds in ways.items():
                for _test in range(tests // 2):
                    stamps.append((f"test_{way}", now, now * 2))  # CPU: both cores, always
                    now += seconds
        stamps.append(("test_zz_end", now, now * 2))
        return {"stamps": stamps, "report": {"preloaded": ["heavylib"]}, "pool_made_s": 0.3}

    monkeypatch.setattr(library, "run_session", session)
    figures = library.measure(8, 2, ["json"], unpreloaded_tests=4)
    assert figures["pool_ms"] == pytest.approx(10.0) and figures["warm_ms"] == pytest.approx(5.0)
    assert figures["fresh_ratio"] == pytest.approx(1.2)
    assert figures["warm_cpu_ms"] == pytest.approx(10.0)
    assert figures["fresh_cpu_ratio"] == pytest.approx(1.2)
    # 8 tests a way: the pool made in 300 ms, then 10 ms a test; fresh 12 ms, no start here
    assert figures["pool_start_ms"] == pytest.approx(300.0)
    assert figures["pool_suite_s"] == pytest.approx(0.38)
    assert figures["fresh_suite_s"] == pytest.approx(0.096)
    assert figures["fresh_suite_ratio"] == pytest.approx(0.096 / 0.38)
    assert figures["unpreloaded_ms"] == pytest.approx(500.0)
    assert figures["unpreloaded_ratio"] == pytest.approx(50.0)
    assert figures["preloaded"] == ["heavylib"]


def test_the_benchmark_refuses_nonsense_arguments():
    with pytest.raises(SystemExit, match="--tests must be at least 6"):
        library.main(["--tests", "5"])
    with pytest.raises(SystemExit, match="--unpreloaded-tests 0 or at least 3"):
        library.main(["--unpreloaded-tests", "1"])
    with pytest.raises(SystemExit, match="must be positive"):
        library.main(["--batches", "0"])
