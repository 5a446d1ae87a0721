"""The price of torch's flight recorder, and of the faulty group, per small all_reduce.

    python -m tutorial_impl.bench.recorder_cost [--rounds 9] [--calls 1000] [--json PATH]

Each round runs, in alternating order (reversed every other round, so that a drift of the
machine's load favours no side), one fresh world of ``--world-size`` ranks per condition:

* ``off``: a plain gloo group, the recorder off (``TORCH_FR_BUFFER_SIZE=0``);
* ``on``: a plain gloo group, the recorder on (2000 entries: torch 2.13's default);
* ``faulty``: the faulty group (``testing/faults/group.py``, an empty plan), recorder on;
* ``detail``: a plain gloo group under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (what
  ``--check-collectives`` turns on), the recorder at its default: not one of this command's
  conditions; ``bench harness`` measures ``off``, ``on`` and ``detail`` (``harness_figures``).

A world times ``--calls`` all_reduces of one float after a warm-up, in blocks of ``BLOCK``;
its figures are the slowest rank's wall-clock microseconds per call in its median block
(``<condition>_us``) and the ranks' mean CPU microseconds per call, all threads of the
process, in their median block (``<condition>_cpu_us``: what the recorder adds to a rank's
work, less disturbed than the wall clock by other jobs on the machine). The median block
leaves out the blocks another process preempted. The recorder's cost is the median over
rounds of each round's ``on / off`` (``recorder_ratio``, ``recorder_cpu_ratio``), the
faulty group's the median of ``faulty / on`` (``faulty_ratio``, ``faulty_cpu_ratio``),
DETAIL's the median of ``detail / off`` (``detail_ratio``, ``detail_cpu_ratio``); ``--json
PATH`` writes them, the medians per condition, every round and the load average.
The recorder can only be switched per process (torch reads the variable once), hence a
world per condition instead of alternating inside one. Figures: docs/faults.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

from tutorial_impl.testing.rank.torchenv import CHECK_COLLECTIVES

CONDITIONS = ("off", "on", "faulty")  # this command's
HARNESS_CONDITIONS = ("off", "on", "detail")  # bench harness's rows, and its JSON keys:
HARNESS_KEYS = [f"fr_{c}_{u}" for u in ("us", "cpu_us") for c in HARNESS_CONDITIONS]
HARNESS_KEYS += [f"fr_{n}{k}_ratio" for n in ("recorder", "detail") for k in ("", "_cpu")]
HARNESS_KEYS += ["fr_rounds"]
# Each ratio, and the two conditions it divides: a round's figure of the first by the second.
RATIOS = {"recorder": ("on", "off"), "faulty": ("faulty", "on"), "detail": ("detail", "off")}
BLOCK = 25  # all_reduces timed together; a world's figure is its median block's


def timed_all_reduces(
    rank: int, world_size: int, condition: str, calls: int
) -> tuple[float, float]:
    """Join a group as ``condition`` says, then the wall and CPU microseconds per all_reduce:
    of the median block of ``BLOCK`` calls (a block another process preempted is an
    outlier, not the recorder's price)."""
    import torch
    import torch.distributed as dist

    from tutorial_impl.testing.faults import group

    os.environ["TORCH_FR_BUFFER_SIZE"] = "0" if condition == "off" else "2000"
    # The harness applied the run's TORCH_DISTRIBUTED_DEBUG (``env_of``) before this call.
    detail = dist.get_debug_level() == dist.DebugLevel.DETAIL
    if detail != (condition == "detail"):
        raise RuntimeError(f"{condition}: torch's debug level is {dist.get_debug_level()}")
    timeout = timedelta(seconds=60)
    if condition == "faulty":
        group.init_process_group(rank, world_size, (), timeout=timeout)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)
    t = torch.ones(1)
    for _ in range(20):  # the group's first calls set up connections and buffers
        dist.all_reduce(t)
    dist.barrier()
    walls, cpus = [], []
    for _ in range(max(1, calls // BLOCK)):
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(BLOCK):
            dist.all_reduce(t)
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls) / BLOCK * 1e6, statistics.median(cpus) / BLOCK * 1e6


def env_of(condition: str) -> dict[str, str]:
    """The run's environment: DETAIL for ``detail``, as ``--check-collectives`` gives it,
    and explicitly off for the others (whatever the caller's environment says)."""
    return dict(CHECK_COLLECTIVES) if condition == "detail" else {"TORCH_DISTRIBUTED_DEBUG": "OFF"}


def summarize(
    rounds: Sequence[Mapping[str, float]], conditions: Sequence[str] = CONDITIONS
) -> dict[str, float]:
    """Medians per condition (keys ``<condition>_us``, ``<condition>_cpu_us``, as in each
    round) and the medians of the per-round ratios (``RATIOS`` whose conditions were run)."""
    out = {}
    for unit in ("us", "cpu_us"):
        for c in conditions:
            out[f"{c}_{unit}"] = statistics.median(r[f"{c}_{unit}"] for r in rounds)
        kind = "" if unit == "us" else "_cpu"
        for name, (a, b) in RATIOS.items():
            if a in conditions and b in conditions:
                ratios = (r[f"{a}_{unit}"] / r[f"{b}_{unit}"] for r in rounds)
                out[f"{name}{kind}_ratio"] = statistics.median(ratios)
    return out


def measure(
    rounds: int, calls: int, world_size: int, conditions: Sequence[str] = CONDITIONS
) -> list[dict[str, float]]:
    from tutorial_impl.testing import run_ranks

    measured = []
    for i in range(rounds):
        order = conditions if i % 2 == 0 else conditions[::-1]
        row: dict[str, float] = {}
        for condition in order:
            per_rank = run_ranks(
                timed_all_reduces,
                condition,
                calls,
                world_size=world_size,
                backend=None,
                timeout=120 + calls * world_size * 0.05,  # DETAIL: up to ~10 ms a call here
                env=env_of(condition),
            )
            row[f"{condition}_us"] = max(wall for wall, _ in per_rank)
            row[f"{condition}_cpu_us"] = statistics.mean(cpu for _, cpu in per_rank)
        print(
            f"world {world_size} round {i + 1}: "
            + "  ".join(
                f"{c} {row[c + '_us']:6.1f} us ({row[c + '_cpu_us']:5.1f} cpu)" for c in conditions
            ),
            flush=True,
        )
        measured.append(row)
    return measured


def harness_figures(world_size: int, rounds: int, calls: int) -> dict[str, Any]:
    """``bench harness``'s recorder rows at one world size: ``summarize`` of the
    ``HARNESS_CONDITIONS`` in alternating rounds, each key prefixed ``fr_`` (torch's name for
    its flight recorder), and the rounds themselves (``fr_rounds``); with no rounds, None."""
    if rounds == 0:
        return dict.fromkeys(HARNESS_KEYS)
    measured = measure(rounds, calls, world_size, HARNESS_CONDITIONS)
    summary = summarize(measured, HARNESS_CONDITIONS)
    return {**{f"fr_{k}": v for k, v in summary.items()}, "fr_rounds": measured}


def harness_line(world_size: int, fig: Mapping[str, Any]) -> str:
    """The row ``bench harness`` prints for ``harness_figures``."""
    if fig["fr_rounds"] is None:
        return f"world {world_size}: recorder: not run"
    return (
        f"world {world_size}: recorder off {fig['fr_off_us']:6.1f} us  "
        f"on {fig['fr_on_us']:6.1f} us  DETAIL {fig['fr_detail_us']:7.1f} us  "
        f"on/off {fig['fr_recorder_ratio']:5.3f}x  DETAIL/off {fig['fr_detail_ratio']:5.1f}x  "
        f"(CPU {fig['fr_recorder_cpu_ratio']:5.3f}x, {fig['fr_detail_cpu_ratio']:5.1f}x; "
        f"medians of {len(fig['fr_rounds'])} rounds)"
    )


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    rows = measure(args.rounds, args.calls, args.world_size)
    summary = summarize(rows)
    summary["load_average"] = os.getloadavg()[0]
    for unit, kind in (("us", ""), ("cpu_us", "_cpu")):
        print(
            f"median {unit} per all_reduce: "
            + ", ".join(f"{c} {summary[f'{c}_{unit}']:.1f}" for c in CONDITIONS)
            + f"; recorder on/off {summary[f'recorder{kind}_ratio']:.3f}x"
            + f", faulty/on {summary[f'faulty{kind}_ratio']:.3f}x"
        )
    print(f"load average {summary['load_average']:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": rows, **summary}, f, indent=2)
    return summary


if __name__ == "__main__":  # run by its module name: ranks look their function up there
    from tutorial_impl.bench.recorder_cost import main as _main

    _main()
