"""DDP's buckets during backward, drawn from the buckets lesson's own record.

``ddp/buckets.py`` records, in two training iterations, the order in which autograd wrote
the gradients (a hook on every parameter) and every all_reduce DDP launched (its comm hook:
the bucket's parameters, its size, how many gradients were still missing at that moment).
The picture puts both on one axis, backward's progress: an all_reduce drawn after k
gradients started when k gradients existed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tutorial_impl.ddp.buckets import BucketCall
from tutorial_impl.pictures.canvas import README_WIDTH, Canvas, Drawn

X0, X1 = 40.0, 820.0  # the progress axis, in pixels
TITLES = (
    "iteration 0: DDP does not know the order yet, so every gradient is in one bucket",
    "iteration 1: buckets rebuilt by bucket_cap_mb, in the order iteration 0 recorded",
)
BUCKET_COLOURS = ("#cfe3f7", "#fde2b8", "#d5efd0", "#e5d8ef", "#f7d4d4", "#e0e0e0")


def _iteration(c: Canvas, y: float, title: str, ready: list[str], calls: list[BucketCall]) -> float:
    """One iteration: launches stacked above the gradients (each later one higher, each
    label left of its arrow), the gradients in the order written, each bucket under its own.
    Returns the y below it."""
    total = len(ready)
    slot = (X1 - X0) / total
    c.text(X0, y + 8, title, ha="left", weight="bold")
    slots_y = y + 26 + 22 * len(calls)
    for k, call in enumerate(calls):
        x = X0 + (total - call.missing) * slot
        row = slots_y - 12 - 22 * k
        c.arrow([(x, row - 6), (x, slots_y - 2)], colour="#b35806", width=1.2)
        to_go = (
            f"{call.missing} of {total} gradients still to come"
            if call.missing
            else ("backward is over")
        )
        c.text(
            x - 6,
            row - 4,
            f"all_reduce of bucket {call.index} starts: {to_go}",
            ha="right",
            color="#b35806",
        )
    where = {name: i for i, name in enumerate(ready)}
    for k, call in enumerate(calls):
        first, last = min(where[n] for n in call.names), max(where[n] for n in call.names)
        colour = BUCKET_COLOURS[k % len(BUCKET_COLOURS)]
        for i in range(first, last + 1):
            c.box(X0 + i * slot + 2, slots_y, slot - 4, 24, facecolor=colour)
            c.text(X0 + (i + 0.5) * slot, slots_y + 12, ready[i])
        c.text(
            X0 + (first + last + 1) / 2 * slot,
            slots_y + 38,
            f"bucket {call.index}: {call.numel} floats",
        )
    return slots_y + 56


def draw_buckets(
    plt: Any, calls: list[list[BucketCall]], ready: list[list[str]], cap_mb: float, path: Path
) -> Drawn:
    """Both iterations, one above the other."""
    launches = sum(len(c) for c in calls)
    c = Canvas(plt, README_WIDTH, int(70 + 82 * len(calls) + 22 * launches))
    y = c.heading(
        [
            f"DDP's buckets during backward (bucket_cap_mb = {cap_mb * 2**20:g} bytes), "
            "recorded by buckets.py's hooks",
            "Boxes: the gradients, in the order autograd wrote them; an arrow: an all_reduce "
            "launched by DDP's comm hook",
        ],
    )
    for i, (these, order) in enumerate(zip(calls, ready, strict=True)):
        y = _iteration(c, y, TITLES[min(i, 1)], order, these)
    return c.save(path)
