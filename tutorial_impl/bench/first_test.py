"""The first test of a session: a fresh ``pytest`` whose one test runs ranks, to its verdict.

A session's first test that runs ranks needs the rank forkserver, which imports torch and
what the test files import before it forks a rank (seconds). The harness starts it when the
session starts, behind collection (``testing/forkserver/plan.py``: ``start_early``); with
``-o rank_forkserver_early=false`` the first test starts it, as the harness did before.
Each run here is a fresh ``pytest`` process in a throwaway project of one test file, which
imports torch at its top as a test file does and has one ``run_ranks`` test; the figure is
the time from starting the process to that test's verdict (``run_ranks`` returned: the test
writes the time, on the machine's monotonic clock, which every process shares). Runs go in
pairs, early then late, so that a change in the machine's load falls on both alike.

``bench harness`` runs it (``--first-test-runs`` pairs per world size; JSON keys
``first_test_ms``, the median with the early start, ``first_test_late_ms``, the median with
the start in the first test, ``first_test_saved_ms``, their difference, and
``first_test_runs_ms``, every run of each; None with no runs); figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TEST_FILE = """
import os, time

import torch  # as a test file does: pytest imports it while collecting


def one(rank, world_size):
    return rank


def test_first(run_ranks):
    assert run_ranks(one, world_size={world_size}) == list(range({world_size}))
    with open(os.environ["BENCH_VERDICT"], "w") as f:
        f.write(repr(time.monotonic()))
"""
TIMEOUT = 600.0  # seconds for one fresh session: a loaded machine imports torch slowly
HELP = "pairs of fresh sessions, forkserver started early and by the first test (0: none)"


def runs(text: str) -> int:
    """A count, 0 or more: ``--first-test-runs``'s (pairs) and ``--train-step-tests``'."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (none) or more, not {value}")
    return value


def one_run(work: Path, early: bool) -> float:
    """Milliseconds from starting a fresh pytest in ``work`` to its first test's verdict."""
    stamp = work / "verdict"
    stamp.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_first.py"]
    command += ["-o", f"rank_forkserver_early={'true' if early else 'false'}"]
    env = {**os.environ, "BENCH_VERDICT": str(stamp)}
    env.pop("PYTEST_XDIST_WORKER", None)  # a fresh session, whoever runs the benchmark
    start = time.monotonic()
    done = subprocess.run(command, cwd=work, env=env, capture_output=True, timeout=TIMEOUT)
    if done.returncode != 0 or not stamp.exists():
        raise RuntimeError(f"the fresh session failed:\n{done.stdout.decode()[-3000:]}")
    return (float(stamp.read_text()) - start) * 1e3


def time_first_tests(world_size: int, runs: int) -> dict[str, list[float]]:
    """``runs`` pairs of fresh sessions, early then late: each run's milliseconds."""
    times: dict[str, list[float]] = {"early": [], "late": []}
    with tempfile.TemporaryDirectory(prefix="bench-first-test-") as work:
        Path(work, "test_first.py").write_text(TEST_FILE.format(world_size=world_size))
        for _ in range(runs):
            for way in times:
                times[way].append(one_run(Path(work), early=way == "early"))
    return times


def figures(times: dict[str, list[float]]) -> dict[str, Any]:
    """The row's figures from each run's milliseconds (None for no runs)."""
    if not times["early"]:
        return dict.fromkeys(HARNESS_KEYS)
    early, late = statistics.median(times["early"]), statistics.median(times["late"])
    return {
        "first_test_ms": early,
        "first_test_late_ms": late,
        "first_test_saved_ms": late - early,
        "first_test_runs_ms": times,
    }


HARNESS_KEYS = ("first_test_ms", "first_test_late_ms", "first_test_saved_ms", "first_test_runs_ms")


def harness_figures(world_size: int, runs: int) -> dict[str, Any]:
    """``bench harness``'s row for ``world_size``: ``runs`` pairs of fresh sessions."""
    return figures(time_first_tests(world_size, runs) if runs else {"early": [], "late": []})


def harness_line(world_size: int, fig: dict[str, Any]) -> str:
    if fig["first_test_ms"] is None:
        return f"world {world_size}: first test of a session: not run"
    runs = fig["first_test_runs_ms"]
    return (
        f"world {world_size}: first test of a session {fig['first_test_ms'] / 1e3:6.2f} s, "
        f"forkserver started by the test {fig['first_test_late_ms'] / 1e3:6.2f} s, saved "
        f"{fig['first_test_saved_ms'] / 1e3:5.2f} s   (medians of {len(runs['early'])} pairs, "
        f"fresh pytest to verdict)"
    )
