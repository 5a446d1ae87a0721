"""How long a rank's death takes to become the test's verdict: SIGKILL to ``run_ranks`` raising.

A test that kills a rank on purpose (``Fault(action=Kill())``, docs/faults.md) ends when the
parent has seen the death, waited a moment for the peers' errors it caused (``CRASH_GRACE``),
stopped the rest and decided (``verdict``). Each run here is a fresh world on the faulty
group (``faults.group.init_process_group``, the plan given in the rank): every rank makes
``WARMUP`` small all_reduces, then the last rank notes the time and enters one more, where
the plan SIGKILLs it before the collective starts; its peers, inside that all_reduce, see
their connections reset. The figure is the time from the note to ``run_ranks`` raising
``RankCrashed`` in the parent, on the same clock (``time.time``: one machine).

``bench harness`` runs it (``--kill-runs`` per world size, JSON keys ``kill_verdict_ms``, the
median, and ``kill_verdict_runs_ms``, every run); figures: docs/benchmarks.md.
"""

from __future__ import annotations

import signal
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

WARMUP = 3  # all_reduces before the fatal one: the group's connections are all made


def killed_in_all_reduce(rank: int, world_size: int, stamp: str) -> None:
    """The rank function: the last rank dies at all_reduce #WARMUP+1, having written the time."""
    import torch
    import torch.distributed as dist

    from tutorial_impl.testing.faults import group
    from tutorial_impl.testing.faults.plan import Fault, Kill

    victim = world_size - 1
    plan = (Fault(ranks={victim}, at=WARMUP + 1, op="all_reduce", action=Kill()),)
    group.init_process_group(rank, world_size, plan, timeout=timedelta(seconds=60))
    t = torch.ones(1)
    for _ in range(WARMUP):
        dist.all_reduce(t)
    if rank == victim:
        with open(stamp, "w") as f:  # opened first: the kill follows the time by microseconds
            f.write(repr(time.time()))
    dist.all_reduce(t)  # the victim is killed in here; its peers raise "connection reset"


def time_kill(world_size: int, runs: int) -> list[tuple[float, int]]:
    """Each run's milliseconds from the SIGKILL to the verdict, and how many peers were still
    running then (their stacks taken: the parent waits ``CRASH_GRACE`` for their errors)."""
    with tempfile.TemporaryDirectory(prefix="bench-kill-") as work:
        return [one_run(world_size, Path(work, f"killed-{i}")) for i in range(runs)]


def one_run(world_size: int, stamp: Path) -> tuple[float, int]:
    from tutorial_impl.testing import RankCrashed, run_ranks

    try:
        run_ranks(killed_in_all_reduce, str(stamp), world_size=world_size, backend=None)
    except RankCrashed as exc:
        verdict = time.time()
        if (exc.rank, exc.exitcode) != (world_size - 1, -signal.SIGKILL):
            raise AssertionError(f"the wrong verdict: {exc.headline}") from exc
        return (verdict - float(stamp.read_text())) * 1e3, len(exc.stacks)
    raise AssertionError("a run whose last rank was killed returned")


def harness_figures(world_size: int, runs: int) -> dict[str, Any]:
    """``bench harness``'s row: the median of ``runs``, every run, the peers running at each
    verdict (None with no runs)."""
    measured = time_kill(world_size, runs)
    times = [ms for ms, _ in measured] or None
    return {
        "kill_verdict_ms": statistics.median(times) if times else None,
        "kill_verdict_runs_ms": times,
        "kill_verdict_running": [running for _, running in measured] or None,
    }


def harness_line(world_size: int, fig: dict[str, Any]) -> str:
    times = fig["kill_verdict_runs_ms"]
    if not times:
        return f"world {world_size}: SIGKILL to verdict: not run"
    return (
        f"world {world_size}: SIGKILL to verdict {fig['kill_verdict_ms']:6.1f} ms  "
        f"(median of {len(times)}: {min(times):.1f}-{max(times):.1f} ms; peers still running "
        f"at the verdict: {max(fig['kill_verdict_running'])} at most)"
    )
