"""Benchmark: the tutorial's ring vs the bandwidth-optimal ring vs gloo's own allreduce.

    python -m tutorial_impl bench ring [--sizes 4K 64K 1M 16M 64M] [--world-sizes 2 4]
                                       [--repeats 7] [--json PATH]

For each world size one group of local gloo ranks runs every size and algorithm. A measurement
is one call, timed on every rank between a barrier and the end of the call; the call's time is
the *slowest* rank's (an allreduce is finished when the last rank has its result). Repetitions
interleave the algorithms, so a burst of load on a shared machine hurts all three alike. We
print the median, the algorithmic bandwidth (bytes / time, as nccl-tests' "algbw") and the
ratio to gloo measured in the same run.

Beside the time, each call's CPU time (``time.process_time``: every thread of the rank, gloo's
included), summed over the ranks: what the call cost the machine. On a machine with fewer
cores than busy processes, time follows CPU; two algorithms that cost the same CPU finish,
on average, together, and what decides between them is when each rank gets a core.

What theory predicts: per rank the tutorial's ring sends (N-1)*K bytes, a bandwidth-optimal
ring 2(N-1)/N * K, so for large K the tutorial ring should take N/2 times as long as the
bandwidth-optimal one: no worse at N=2, twice as long at N=4. gloo's CPU allreduce is a ring too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tutorial_impl.dist_tuto.ring import allreduce, ring_allreduce
from tutorial_impl.testing import RankError, run_ranks

ALGORITHMS = ("gloo", "ring", "tutorial")
DEFAULT_SIZES = ("4K", "64K", "1M", "16M", "64M")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """'4K' -> 4096, '16M' -> 16 MiB, '100' -> 100 bytes; a multiple of 4 (float32)."""
    number, unit = text.upper().rstrip("IB"), ""
    if number and number[-1] in _UNITS:
        number, unit = number[:-1], number[-1]
    try:
        size = int(number) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 4K, 16M)") from None
    if size <= 0 or size % 4:
        raise argparse.ArgumentTypeError(f"size must be a positive multiple of 4 bytes: {text!r}")
    return size


def format_size(size: int) -> str:
    for unit in ("G", "M", "K"):
        if size >= _UNITS[unit] and size % _UNITS[unit] == 0:
            return f"{size // _UNITS[unit]} {unit}iB"
    return f"{size} B"


def expected_tutorial_ratio(world_size: int) -> float:
    """Bytes sent by the tutorial ring over bytes sent by the optimal one: (N-1)/(2(N-1)/N)."""
    if world_size < 2:
        return 1.0
    return (world_size - 1) / (2 * (world_size - 1) / world_size)


def algbw_gbps(size: int, median_ms: float) -> float:
    """Algorithmic bandwidth in GB/s (10^9 bytes a second): the tensor's size over the time."""
    return size / (median_ms / 1e3) / 1e9


# What we time. "ring" is the bandwidth-optimal ring as users call it, with its layout check;
# "unchecked" is the same ring without the check (reported as an extra key of the ring rows),
# to show what the check's synchronisation costs.
_TIMED = (*ALGORITHMS, "unchecked")


def _one_call(algorithm: str, tensor: torch.Tensor, out: torch.Tensor) -> Callable[[], Any]:
    # gloo and the ring work in place on the same tensor, so they pay for the same copies.
    if algorithm == "gloo":
        return lambda: dist.all_reduce(tensor)
    if algorithm == "ring":
        return lambda: ring_allreduce(tensor)
    if algorithm == "unchecked":
        return lambda: ring_allreduce(tensor, check=False)
    return lambda: allreduce(tensor, out)


def bench_rank(rank: int, world_size: int, sizes: list[int], repeats: int) -> list[dict]:
    """Time every algorithm at every size on this group; rank 0 returns the rows."""
    rows = []
    slowest = torch.zeros(1, dtype=torch.float64)
    cpu = torch.zeros(1, dtype=torch.float64)
    for size in sizes:
        # Zeros keep the sums at zero however often we add (no overflow, no denormals).
        tensor = torch.zeros(size // 4, dtype=torch.float32)
        out = torch.empty_like(tensor)
        times: dict[str, list[float]] = {name: [] for name in _TIMED}
        cpu_times: dict[str, list[float]] = {name: [] for name in _TIMED}
        for rep in range(repeats + 1):  # the first round warms up and is not counted
            shift = rep % len(_TIMED)
            order = _TIMED[shift:] + _TIMED[:shift]
            for name in order:
                call = _one_call(name, tensor, out)
                dist.barrier()
                cpu_start, start = time.process_time(), time.perf_counter()
                call()
                slowest[0] = time.perf_counter() - start
                cpu[0] = time.process_time() - cpu_start
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                dist.all_reduce(cpu)  # the machine's cost: every rank's CPU, summed
                if rep:
                    times[name].append(slowest.item() * 1e3)
                    cpu_times[name].append(cpu.item() * 1e3)
        for name in ALGORITHMS:
            rows.append(
                {
                    "world_size": world_size,
                    "bytes": size,
                    "algorithm": name,
                    "median_ms": statistics.median(times[name]),
                    "min_ms": min(times[name]),
                    "cpu_ms": statistics.median(cpu_times[name]),
                    "repeats": repeats,
                }
            )
            if name == "ring":
                rows[-1]["unchecked_median_ms"] = statistics.median(times["unchecked"])
                rows[-1]["unchecked_cpu_ms"] = statistics.median(cpu_times["unchecked"])
    return rows if rank == 0 else []


def add_ratios(rows: list[dict]) -> list[dict]:
    """Add algbw (GB/s) and the ratio of each median to gloo's at the same size and world."""
    gloo = {(r["world_size"], r["bytes"]): r["median_ms"] for r in rows if r["algorithm"] == "gloo"}
    for r in rows:
        r["algbw_gbps"] = algbw_gbps(r["bytes"], r["median_ms"])
        r["ratio_to_gloo"] = r["median_ms"] / gloo[(r["world_size"], r["bytes"])]
        if "unchecked_median_ms" in r:
            r["unchecked_ratio_to_gloo"] = (
                r["unchecked_median_ms"] / gloo[(r["world_size"], r["bytes"])]
            )
    return rows


def tutorial_vs_ring(rows: list[dict]) -> list[tuple[int, int, float, float]]:
    """(world, bytes, expected, measured) ratio of the tutorial ring's time to the optimal's."""
    by = {(r["world_size"], r["bytes"], r["algorithm"]): r["median_ms"] for r in rows}
    out = []
    for world, size, name in by:
        if name == "tutorial":
            measured = by[(world, size, "tutorial")] / by[(world, size, "ring")]
            out.append((world, size, expected_tutorial_ratio(world), measured))
    return out


def format_table(rows: list[dict]) -> str:
    lines = [
        f"{'world':>5} {'size':>8} {'algorithm':>9} {'median ms':>10} {'algbw GB/s':>10} "
        f"{'x gloo':>7} {'CPU ms':>7}   (ring without its layout check: ms, x gloo, CPU ms)"
    ]
    for r in rows:
        line = (
            f"{r['world_size']:>5} {format_size(r['bytes']):>8} {r['algorithm']:>9} "
            f"{r['median_ms']:>10.3f} {r['algbw_gbps']:>10.3f} {r['ratio_to_gloo']:>7.2f} "
            f"{r.get('cpu_ms', float('nan')):>7.2f}"
        )
        if "unchecked_median_ms" in r:
            line += f"   ({r['unchecked_median_ms']:.3f}, {r['unchecked_ratio_to_gloo']:.2f}"
            line += f", {r.get('unchecked_cpu_ms', float('nan')):.2f})"
        lines.append(line)
    lines.append(
        "\ntutorial ring / bandwidth-optimal ring. Expected from the bytes each rank sends: N/2."
        "\nThe tutorial ring also moves each step's whole tensor before adding it (no"
        "\npipelining) and clones the input three times a call; for small tensors both are"
        "\nbound by the 2(N-1) or N-1 message latencies, not by bytes."
        "\nCPU ms: CPU time of a call, all ranks summed (gloo's threads included)."
    )
    for world, size, expected, measured in tutorial_vs_ring(rows):
        lines.append(
            f"  world {world}, {format_size(size):>8}: expected {expected:.2f}x, "
            f"measured {measured:.2f}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tutorial_impl bench ring",
        description="tutorial ring vs bandwidth-optimal ring vs dist.all_reduce (gloo, float32)",
    )
    parser.add_argument(
        "--sizes", nargs="+", type=parse_size, default=[parse_size(s) for s in DEFAULT_SIZES],
        help="tensor sizes in bytes, with K/M/G suffixes (default: 4K 64K 1M 16M 64M)",
    )  # fmt: skip
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per case (median)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON here")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per world size")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if any(w < 1 for w in args.world_sizes):
        parser.error("--world-sizes must all be at least 1")

    rows: list[dict] = []
    for world in args.world_sizes:
        print(f"world size {world}: timing {len(args.sizes)} sizes ...", file=sys.stderr)
        try:
            results = run_ranks(
                bench_rank, args.sizes, args.repeats, world_size=world, timeout=args.timeout
            )
        except RankError as exc:
            print(f"benchmark failed at world size {world}:\n{exc}", file=sys.stderr)
            return 1
        rows += results[0]
    add_ratios(rows)
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"\nwrote {len(rows)} rows to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
