"""D18's pipeline schedules, drawn from the orders the ranks recorded.

``ddp/pipeline_schedules.py`` records, on each rank, the order in which its stages ran their
forwards (F) and backwards (B; zero bubble's split into B, the input's gradient, and W, the
weights'). ``replay`` places every action at its start, one time unit each, as soon as the
rank is free and its input exists; the picture draws those replays, one row a rank, and the
white between the boxes is the bubble the lesson measures.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tutorial_impl.ddp.pipeline_schedules import STAGES, Action, bubble, replay
from tutorial_impl.pictures.canvas import README_WIDTH, Canvas, Drawn

X0, X1 = 70.0, 826.0  # the time axis of every schedule, in pixels
ROW, GAP = 24.0, 4.0  # a rank's row of boxes, and the space between two rows
# Per kind: the rank's first stage, then its second (interleaved: rank r holds r and r + 2).
COLOURS = {
    "F": ("#cfe3f7", "#8fbce6"),
    "B": ("#fde2b8", "#f5b463"),
    "W": ("#d5efd0", "#9fd693"),
}
TITLES = {
    "1F1B": "1F1B: one stage a rank, 2 layers each",
    "Interleaved1F1B": "Interleaved 1F1B: two stages a rank, 1 layer each",
    "InterleavedZeroBubble": "Zero bubble (ZB-1P): backward split into B and W, W's fill gaps",
}


def _schedule(c: Canvas, y: float, name: str, orders: list[list[Action]]) -> float:
    """One schedule: its title with the bubble, then one row a rank. Returns the y below."""
    stages = len(orders) if name == "1F1B" else STAGES
    starts = replay(orders, stages)
    length = max(s + 1 for row in starts for s in row)
    unit = (X1 - X0) / length
    c.text(X0, y + 8, f"{TITLES[name]}: bubble {bubble(orders, stages):.0%}", ha="left",
           weight="bold")  # fmt: skip
    y += 20
    for rank, (order, times) in enumerate(zip(orders, starts, strict=True)):
        c.text(X0 - 8, y + ROW / 2, f"rank {rank}", ha="right")
        mine = sorted({stage for stage, _, _ in order})
        for (stage, kind, mb), start in zip(order, times, strict=True):
            colour = COLOURS[kind][mine.index(stage)]
            c.box(X0 + start * unit, y, unit, ROW, facecolor=colour, linewidth=0.6)
            c.text(X0 + (start + 0.5) * unit, y + ROW / 2, f"{kind}{mb}")
        y += ROW + GAP
    return y + 10


def draw_schedules(plt: Any, schedules: dict[str, list[list[Action]]], path: Path) -> Drawn:
    """Every schedule, one above the other (``schedules``: name -> each rank's order)."""
    rows = sum(len(orders) for orders in schedules.values())
    c = Canvas(plt, README_WIDTH, int(86 + 30 * len(schedules) + (ROW + GAP) * rows))
    y = c.heading(
        [
            "Pipeline schedules, 2 ranks, 4 micro-batches: the order each rank recorded, replayed",
            "A box: one unit of work, a stage's forward (F), backward (B) or weight gradient "
            "(W), of micro-batch n",
            "Light: the rank's first stage, dark: its second; white: idle. Each schedule in "
            "its own units",
        ]
    )
    for name, orders in schedules.items():
        y = _schedule(c, y, name, orders)
    return c.save(path)
