"""The arithmetic and the table of the DDP + RPC benchmark, kept apart from the workers.

The original script prints, for each trainer and for "All", the 50th/75th/90th/95th
percentile of its epoch times and, next to each, a column labelled ``epoch/sec`` that is
really ``samples of the LAST epoch / percentile epoch time``: the wrong unit, and one epoch
standing in for all of them. Here every row carries one throughput figure, labelled
``samples/s``, computed over *all* timed epochs: total samples divided by total time.

Nothing here needs torch or numpy, so the tests can check it against ``numpy.percentile``
as an independent reference.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

PERCENTILES = (50, 75, 90, 95)
ALL = "All"


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile by linear interpolation between closest ranks.

    This is ``numpy.percentile(values, q)`` with its default ``method="linear"``: the sorted
    values sit at positions 0 .. n-1, and the percentile is read off the straight line
    between the two values around position ``(n - 1) * q / 100``.
    """
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def throughput(samples: int, seconds: float) -> float:
    """Samples per second over a timed span (``samples`` processed in ``seconds``)."""
    if seconds <= 0:
        raise ValueError(f"a timed span must be positive, got {seconds} s")
    return samples / seconds


@dataclass(frozen=True)
class Row:
    """One line of the table: a trainer (or "All") and what it measured."""

    name: str
    epoch_seconds: tuple[float, ...]  # one entry per timed epoch (warm-up already dropped)
    samples: int  # samples over all those epochs
    seconds: float  # the wall time those samples took

    def percentiles(self) -> dict[str, float]:
        return {f"p{q}": percentile(self.epoch_seconds, q) for q in PERCENTILES}

    @property
    def samples_per_s(self) -> float:
        return throughput(self.samples, self.seconds)

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.percentiles(),
            "samples_per_s": self.samples_per_s,
            "epochs": len(self.epoch_seconds),
            "samples": self.samples,
            "seconds": self.seconds,
        }


def summarize(per_trainer: Mapping[str, tuple[Sequence[float], Sequence[int]]]) -> list[Row]:
    """Rows for each trainer, then "All", from ``name -> (epoch seconds, epoch samples)``.

    "All" pools every trainer's epochs for the percentiles, as the original does. Its
    throughput is the whole job's: all trainers' samples over the time the slowest trainer
    spent in its timed epochs. The trainers run side by side (DDP keeps them in step), so
    that is the wall time in which those samples were processed; adding up per-trainer
    rates would give nearly the same figure, never a smaller one.
    """
    if not per_trainer:
        raise ValueError("no trainer reported any measurement")
    rows = []
    for name, (seconds, samples) in per_trainer.items():
        if len(seconds) != len(samples) or not seconds:
            raise ValueError(f"{name}: {len(seconds)} epoch times but {len(samples)} counts")
        rows.append(Row(name, tuple(seconds), sum(samples), sum(seconds)))
    pooled = tuple(t for row in rows for t in row.epoch_seconds)
    total = sum(row.samples for row in rows)
    rows.append(Row(ALL, pooled, total, max(row.seconds for row in rows)))
    return rows


def format_table(rows: Sequence[Row]) -> str:
    """The original's layout: a row per trainer and "All", percentiles, then throughput."""
    cells = "".join(f"{'sec/epoch':>15}" for _ in PERCENTILES)
    lines = [f"{'':10}{cells}{'samples/s':>14}"]
    for row in rows:
        p = row.percentiles()
        text = "".join(f"  p{q}: {p[f'p{q}']:7.3f}s" for q in PERCENTILES)
        lines.append(f"{row.name:>9}:{text}{row.samples_per_s:12.1f}/s")
    lines.append("(samples/s: samples of all timed epochs / their total time; All: the job's)")
    return "\n".join(lines)
