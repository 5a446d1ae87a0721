"""A test under torchrun, for ``bench harness``: one job of ``--torchrun-tests`` tests.

Every worker of ``torchrun --standalone --nproc-per-node=N -m pytest`` runs the same
all_reduce test as the harness's fresh and warm rows, in lockstep; the figure is the median
time from one test's start to the next's, read by rank 0 (``torchrun_ms``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

TORCHRUN_TESTS = """
import json, os, time
import pytest
import torch
import torch.distributed as dist

STARTS = []


def all_reduce_once(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


@pytest.mark.parametrize("i", range({tests}))
def test_all_reduce(run_ranks, world_size, i):
    STARTS.append(time.perf_counter())
    assert run_ranks(all_reduce_once) == [world_size * (world_size + 1) / 2] * world_size


def test_zz_the_end():
    STARTS.append(time.perf_counter())
    if os.environ["RANK"] == "0":
        with open(os.environ["BENCH_STARTS"], "w") as f:
            json.dump(STARTS, f)
"""


def time_torchrun(world_size: int, tests: int) -> list[float]:
    """Milliseconds per test of a torchrun job of ``world_size`` workers (one job)."""
    with tempfile.TemporaryDirectory(prefix="bench-torchrun-") as work:
        Path(work, "test_bench.py").write_text(TORCHRUN_TESTS.format(tests=tests))
        starts = Path(work, "starts.json")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += [f"--nproc-per-node={world_size}", "--monitor-interval=0.1"]
        command += ["-m", "pytest", "-q", "-p", "no:cacheprovider", "test_bench.py"]
        env = {**os.environ, "BENCH_STARTS": str(starts)}
        env.pop("PYTEST_XDIST_WORKER", None)
        done = subprocess.run(command, cwd=work, env=env, capture_output=True, timeout=300)
        if done.returncode != 0 or not starts.exists():
            raise RuntimeError(f"the torchrun job failed:\n{done.stdout.decode()[-3000:]}")
        return gaps_ms(json.loads(starts.read_text()))


def gaps_ms(stamps: list[float]) -> list[float]:
    """Milliseconds from each test's start (seconds, in order) to the next one's."""
    return [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:], strict=False)]
