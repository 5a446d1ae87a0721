"""Per-test overhead of the harness against ``torch.multiprocessing.spawn``.

One "test" here is the smallest multi-rank test there is: start N ranks, join a gloo
process group, do one all_reduce, check it, tear everything down. Both sides do exactly
that, and both rendezvous race-free (the parent binds a TCPStore to port 0):

* **harness**: ``run_ranks``, ranks forked from a warm forkserver that imported torch once.
* **spawn**: ``torch.multiprocessing.spawn`` per test, as most suites do: every rank is a
  fresh interpreter that imports torch itself.

    python -m tutorial_impl bench harness [--repeats 20] [--spawn-repeats 3] [--json PATH]

prints the median milliseconds per test of each and the ratio spawn / harness, per world
size. ``--json PATH`` writes ``{"2": {"harness_ms": ..., "spawn_ms": ..., "ratio": ...}}``.

It also prices ``--check-collectives`` (torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, see
``testing/rank/torchenv.py``): microseconds per small all_reduce in a group without and with the
check, the slowest rank's mean over ``--collectives`` calls, and their ratio (JSON keys
``collective_us``, ``checked_collective_us``, ``check_ratio``).

And warm worlds (``testing/strategies/warm/pool.py``): the same test in a world whose ranks and
group served the test before (``warm_ms``, and ``warm_speedup`` = harness_ms / warm_ms, both in
this run), the same warm test under ``--warm-audit`` (``audit_ms``: it runs fresh too;
``audit_cost`` = audit_ms / warm_ms), the same test as one of a torchrun job's tests
(``torchrun_ms``: every worker of ``torchrun --standalone --nproc-per-node=N -m pytest`` runs it
in lockstep; the median time from one test's start to the next's, read by rank 0; ``--torchrun-
tests 0`` leaves it out, as None), the time a poisoned warm world costs to replace
(``replace_ms``: the test after one that left a group behind, a fresh world), and the 1-minute
load average while measuring (``load_average``): on a loaded machine every figure grows. The
check runs torch's ``ProcessGroupWrapper``, which before each collective has the ranks compare
what they are about to call through an extra exchange, so a small collective costs several times
as much.

And faults (docs/faults.md): torch's flight recorder off, on, and DETAIL in alternating
rounds of fresh worlds (``--recorder-rounds`` of ``--recorder-calls`` small all_reduces;
``bench/recorder_cost.py``: keys ``fr_off_us``, ``fr_on_us``, ``fr_detail_us``, their
``_cpu_us``, ``fr_recorder_ratio`` = on/off and ``fr_detail_ratio`` = DETAIL/off with their
``_cpu_`` forms, medians of each round's ratio, and ``fr_rounds``), and the time from an
injected SIGKILL to the verdict (``--kill-runs``; ``bench/kill_verdict.py``: keys
``kill_verdict_ms``, the median, ``kill_verdict_runs_ms`` and ``kill_verdict_running``, the
peers still in their collective at each verdict); a session's first test (``--first-test-runs``,
``bench/first_test.py``: keys ``first_test_*``); a training step, DDP and AdamW as a user's
test with no setting, fresh and warm, beside the plain test, ``mp.spawn`` and torch's
``MultiProcessTestCase`` (``--train-step-tests``, ``bench/train_step.py``: keys ``train_*``).
0 rounds or runs: None.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing

from tutorial_impl.bench.torchrun_cost import gaps_ms, time_torchrun  # noqa: F401 - its row
from tutorial_impl.testing import call as _call
from tutorial_impl.testing import run_ranks
from tutorial_impl.testing.forkserver import server
from tutorial_impl.testing.rank.torchenv import CHECK_COLLECTIVES
from tutorial_impl.testing.rendezvous import avoid_reverse_dns_stalls
from tutorial_impl.testing.strategies import protocol
from tutorial_impl.testing.strategies.forked import FORKED
from tutorial_impl.testing.strategies.warm.audit import Audited
from tutorial_impl.testing.strategies.warm.pool import WarmPool


def all_reduce_once(rank: int, world_size: int) -> float:
    """The harness side: the group is already up; one all_reduce of rank + 1."""
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def all_reduce_many(rank: int, world_size: int, calls: int) -> float:
    """Mean microseconds per all_reduce of one float, after a warm-up, in this rank."""
    t = torch.ones(1)
    for _ in range(10):  # the group's first calls set up connections and buffers
        dist.all_reduce(t)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(t)
    return (time.perf_counter() - start) / calls * 1e6


def time_collectives(world_size: int, calls: int, checked: bool) -> float:
    """The slowest rank's mean microseconds per small all_reduce, with or without the check."""
    env = dict(CHECK_COLLECTIVES) if checked else {"TORCH_DISTRIBUTED_DEBUG": "OFF"}
    return max(run_ranks(all_reduce_many, calls, world_size=world_size, timeout=120, env=env))


def _spawn_rank(rank: int, world_size: int, host: str, port: int) -> None:
    """The spawn side: a fresh interpreter joins the parent's store and does the same."""
    torch.set_num_threads(1)  # same conditions as the harness ranks
    store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    expected = world_size * (world_size + 1) / 2
    if t.item() != expected:  # spawn returns nothing, so the check happens here
        raise AssertionError(f"rank {rank}: all_reduce gave {t.item()}, expected {expected}")
    dist.destroy_process_group()


def time_harness(world_size: int, repeats: int) -> list[float]:
    """Milliseconds per ``run_ranks`` call, after one warm-up call (the forkserver start)."""
    expected = [world_size * (world_size + 1) / 2] * world_size
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        results = run_ranks(all_reduce_once, world_size=world_size, timeout=60)
        elapsed = (time.perf_counter() - start) * 1e3
        if results != expected:
            raise AssertionError(f"harness all_reduce gave {results}, expected {expected}")
        if i:  # the first call starts the forkserver: that is once per session, not per test
            times.append(elapsed)
    return times


def time_warm(world_size: int, repeats: int) -> list[float]:
    """Milliseconds per test in a warm world (``testing/strategies/warm/pool.py``): the same
    all_reduce test, its ranks and group kept from the test before, checked after each test."""
    expected = [world_size * (world_size + 1) / 2] * world_size
    times = []
    pool = WarmPool()
    call = _call.build(all_reduce_once, world_size=world_size, timeout=60)
    for i in range(repeats + 1):
        start = time.perf_counter()
        results = protocol.run(pool, call)
        elapsed = (time.perf_counter() - start) * 1e3
        if results != expected:
            raise AssertionError(f"warm all_reduce gave {results}, expected {expected}")
        if i:  # the first call starts the world: once per module of tests, not per test
            times.append(elapsed)
    pool.close()
    return times


def leave_a_group(rank: int, world_size: int) -> float:
    """A test that poisons its warm world: it leaves a process group behind."""
    dist.new_group(list(range(world_size)))
    return all_reduce_once(rank, world_size)


def time_replace(world_size: int, repeats: int) -> list[float]:
    """Milliseconds a poisoned warm world costs: the poisoning test, its check and the
    fresh world started for the next test, minus one warm test (what reuse would cost)."""
    times = []
    pool = WarmPool()
    good = _call.build(all_reduce_once, world_size=world_size, timeout=60)
    poisoned = _call.build(leave_a_group, world_size=world_size, timeout=60)
    for _ in range(repeats):
        protocol.run(pool, good)  # a warm world
        protocol.run(pool, poisoned)  # ... poisoned
        start = time.perf_counter()
        protocol.run(pool, good)  # ... replaced
        times.append((time.perf_counter() - start) * 1e3)
    pool.close()
    return times


def time_audited(world_size: int, repeats: int) -> list[float]:
    """Milliseconds per warm test under ``--warm-audit``: warm, then fresh, verdicts compared."""
    pool = WarmPool()
    audited = Audited(pool, FORKED)
    call = _call.build(all_reduce_once, world_size=world_size, timeout=60)
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        protocol.run(audited, call)
        if i:  # the first starts the world
            times.append((time.perf_counter() - start) * 1e3)
    pool.close()
    return times


def time_spawn(
    world_size: int, repeats: int, rank_fn: Callable[..., None] | None = None, extra: tuple = ()
) -> list[float]:
    """Milliseconds per ``torch.multiprocessing.spawn`` of a fresh group: ``rank_fn(rank,
    world_size, host, port, *extra)`` in each interpreter (by default one all_reduce,
    ``_spawn_rank``; the training-step row passes its step, ``train_step``)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        # Port 0: the kernel picks a free port while binding; nothing to race for.
        store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True,
                              wait_for_workers=False, timeout=timedelta(seconds=60))  # fmt: skip
        torch.multiprocessing.spawn(
            rank_fn or _spawn_rank,
            args=(world_size, "127.0.0.1", store.port, *extra),
            nprocs=world_size,
        )
        del store
        times.append((time.perf_counter() - start) * 1e3)
    return times


def measure(
    world_sizes: list[int],
    repeats: int,
    spawn_repeats: int,
    collectives: int = 200,
    torchrun_tests: int = 20,
    recorder_rounds: int = 7,
    recorder_calls: int = 500,
    kill_runs: int = 5,
    first_test_runs: int = 3,
    train_step_tests: int = 6,
) -> dict[str, dict]:
    # Imported here, not by the ranks: a warm rank checks every global of the modules it has.
    from tutorial_impl.bench import first_test, kill_verdict, recorder_cost, train_step

    server.add_preload([__name__])  # ranks find all_reduce_once already imported
    figures = {}
    for world_size in world_sizes:
        # Warm first: the fresh runs' killed ranks are still being torn down for a while.
        warm_ms = statistics.median(time_warm(world_size, repeats))
        harness_ms = statistics.median(time_harness(world_size, repeats))
        replace_ms = statistics.median(time_replace(world_size, max(1, repeats // 4)))
        audit_ms = statistics.median(time_audited(world_size, repeats))
        torchrun = time_torchrun(world_size, torchrun_tests) if torchrun_tests else None
        torchrun_ms = statistics.median(torchrun) if torchrun else None
        spawn_ms = statistics.median(time_spawn(world_size, spawn_repeats))
        plain_us = time_collectives(world_size, collectives, checked=False)
        checked_us = time_collectives(world_size, collectives, checked=True)
        figures[str(world_size)] = {
            "harness_ms": harness_ms,
            "spawn_ms": spawn_ms,
            "ratio": spawn_ms / harness_ms,
            "collective_us": plain_us,
            "checked_collective_us": checked_us,
            "check_ratio": checked_us / plain_us,
            "warm_ms": warm_ms,
            "warm_speedup": harness_ms / warm_ms,
            "replace_ms": replace_ms,
            "audit_ms": audit_ms,
            "audit_cost": audit_ms / warm_ms,
            "torchrun_ms": torchrun_ms,
            "load_average": os.getloadavg()[0],
        }
        faults = recorder_cost.harness_figures(world_size, recorder_rounds, recorder_calls)
        faults |= kill_verdict.harness_figures(world_size, kill_runs)
        faults |= first_test.harness_figures(world_size, first_test_runs)
        faults |= train_step.measure(world_size, train_step_tests, spawn_repeats)
        figures[str(world_size)] |= faults
        print_rows(world_size, figures[str(world_size)], (repeats, spawn_repeats, collectives))
    return figures


def print_rows(world_size: int, row: dict, counts: tuple[int, int, int]) -> None:
    """One world size's figures, as lines of the table (``counts``: the repeats, the spawn
    repeats and the collectives they are medians or means of)."""
    from tutorial_impl.bench import first_test, kill_verdict, recorder_cost, train_step

    repeats, spawn_repeats, collectives = counts
    harness_ms, spawn_ms, warm_ms = row["harness_ms"], row["spawn_ms"], row["warm_ms"]
    plain_us, checked_us = row["collective_us"], row["checked_collective_us"]
    torchrun_ms = row["torchrun_ms"]
    lines = [
        f"harness {harness_ms:7.1f} ms  spawn {spawn_ms:8.1f} ms  "
        f"ratio {spawn_ms / harness_ms:6.1f}x   (medians of {repeats} and {spawn_repeats})",
        f"warm    {warm_ms:7.1f} ms  fresh/warm {harness_ms / warm_ms:5.1f}x  poisoned world "
        f"replaced in {row['replace_ms']:6.1f} ms   (load {os.getloadavg()[0]:.1f})",
        f"audited {row['audit_ms']:7.1f} ms  audit/warm {row['audit_ms'] / warm_ms:5.1f}x  "
        + (f"torchrun {torchrun_ms:7.1f} ms a test" if torchrun_ms else "torchrun: not run"),
        f"all_reduce {plain_us:7.1f} us  checked {checked_us:7.1f} us  "
        f"check {checked_us / plain_us:5.1f}x   (means of {collectives}, slowest rank)",
    ]
    for line in lines:
        print(f"world {world_size}: {line}", flush=True)
    rows = (recorder_cost, kill_verdict, first_test, train_step)  # each module's own line
    print(*(m.harness_line(world_size, row) for m in rows), sep="\n", flush=True)


def build_parser() -> argparse.ArgumentParser:
    # Imported here, as the rows' modules above: this module is every rank's test module (the
    # forkserver preloads it), and a warm rank checks the globals of each such module after
    # every test (``strategies.warm.reuse``), so what it imports is part of what it measures.
    from tutorial_impl.bench import first_test, train_step

    parser = argparse.ArgumentParser(
        prog="python -m tutorial_impl bench harness",
        description="Per-test overhead (start ranks, init gloo, one all_reduce, tear down) "
        "of the harness vs torch.multiprocessing.spawn.",
    )
    parser.add_argument("--repeats", type=int, default=20, help="harness runs per world size")
    parser.add_argument(
        "--spawn-repeats",
        type=int,
        default=3,
        help="spawn runs per world size (each costs seconds: a fresh interpreter per rank)",
    )
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument(
        "--collectives",
        type=int,
        default=200,
        help="all_reduce calls per rank for the price of --check-collectives",
    )
    parser.add_argument(
        "--torchrun-tests",
        type=int,
        default=20,
        help="tests of the torchrun job per world size (0: no torchrun job)",
    )
    parser.add_argument(
        "--recorder-rounds",
        type=int,
        default=7,
        help="rounds of fresh worlds, flight recorder off, on and DETAIL (0: none)",
    )
    parser.add_argument(
        "--recorder-calls", type=int, default=500, help="all_reduce calls per rank and world"
    )
    parser.add_argument(
        "--kill-runs", type=int, default=5, help="runs timed from SIGKILL to verdict (0: none)"
    )
    parser.add_argument("--first-test-runs", type=first_test.runs, default=3, help=first_test.HELP)
    parser.add_argument("--train-step-tests", type=first_test.runs, default=6, help=train_step.HELP)
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.repeats < 1 or args.spawn_repeats < 1 or args.collectives < 1:
        raise SystemExit("--repeats, --spawn-repeats and --collectives must be at least 1")
    if args.torchrun_tests < 0 or args.torchrun_tests == 1:
        raise SystemExit("--torchrun-tests must be 0 (none) or at least 2")
    if args.recorder_rounds < 0 or args.recorder_calls < 1 or args.kill_runs < 0:
        raise SystemExit("--recorder-rounds and --kill-runs must be at least 0, --recorder-calls 1")
    if any(w < 1 for w in args.world_sizes):
        raise SystemExit("--world-sizes must be positive")
    # run_ranks's store does this itself; the spawn side's store and fresh interpreters need
    # it too (they inherit the C environment): without it, a dropped DNS query for
    # TCPStore's log messages stalls a rendezvous 5 s now and then, on either side.
    avoid_reverse_dns_stalls()
    # Each spawned rank (a fresh interpreter, stderr shared with us) would otherwise print
    # c10d's warning that it could not name its peer; ranks read this when importing torch.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    print(f"{os.cpu_count()} CPUs; torch {torch.__version__}; medians per test")
    figures = measure(
        args.world_sizes,
        args.repeats,
        args.spawn_repeats,
        args.collectives,
        args.torchrun_tests,
        args.recorder_rounds,
        args.recorder_calls,
        args.kill_runs,
        args.first_test_runs,
        args.train_step_tests,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
