"""The first tutorial's pictures: the p2p timeline, the collectives, both rings.

Each is drawn from a recording of the lesson's own code (``pictures/record.py``), never from
numbers typed here: the spans of ``p2p_trace``, the tensors of ``collectives_trace``, the
steps of ``ring_trace``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tutorial_impl.dist_tuto.collectives_trace import SIGNATURES, Collective
from tutorial_impl.dist_tuto.p2p_trace import LATE, Span
from tutorial_impl.dist_tuto.ring_trace import Step
from tutorial_impl.pictures.canvas import README_WIDTH, Canvas, Drawn

RANK_COLOURS = ("#9ecae1", "#fdae6b", "#a1d99b", "#bcbddc", "#fdd0a2", "#c7e9c0")
MIXED = "#bdbdbd"  # a number no single rank brought: a reduction's result


# --- The rings ------------------------------------------------------------------------------


def _who(ranks: frozenset[int], size: int) -> str:
    return "all" if len(ranks) == size else "+".join(str(r) for r in sorted(ranks))


def _sent_text(pieces: tuple, size: int) -> str:
    if len(pieces) == size and len({who for _, who in pieces}) == 1:
        return f"all {size} chunks ({_who(pieces[0][1], size)})"
    return ", ".join(f"chunk {c} ({_who(who, size)})" for c, who in pieces)


RING_PANEL = 195  # pixels per panel: 4 chunks of 40, and the sent line under them
RING_ROW = 46  # pixels per rank: the chunks, the sent line, a gap


def _ring_panel(c: Canvas, x: float, y: float, title: str, steps: list[Step | None]) -> None:
    """One panel: each rank's chunks (a start panel when ``steps`` are None)."""
    from matplotlib import colormaps

    size = len(steps)
    shades = colormaps["Blues"]
    c.text(x + RING_PANEL / 2, y + 12, title, weight="bold")
    for rank, step in enumerate(steps):
        top = y + 30 + rank * RING_ROW
        if step is None:
            holds = tuple((k, frozenset({rank})) for k in range(size))
            arrived: set[int] = set()
        else:
            holds, arrived = step.holds, {k for k, _ in step.received}
        for k, who in holds:
            share = len(who) / size
            c.box(
                x + 4 + 45 * k,
                top,
                42,
                22,
                facecolor=shades(0.15 + 0.7 * share),
                linewidth=2.4 if k in arrived else 0.6,
            )
            c.text(
                x + 25 + 45 * k,
                top + 11,
                _who(who, size),
                color="white" if share > 0.6 else "black",
            )
        if step is not None:
            c.text(
                x + RING_PANEL / 2,
                top + 31,
                f"sent {_sent_text(step.sent, size)} → {step.send_to}",
                color="firebrick",
            )


def draw_ring(plt: Any, traces: list[dict], name: str, title: str, path: Path) -> Drawn:
    """Each rank's chunks at the start and after each step, shaded by how many ranks' data
    they sum; what arrived that step outlined thick; what left written under it. Four
    panels a row: the optimal ring's reduce-scatter on one, its all-gather on the next."""
    size = len(traces)
    steps = [trace[name] for trace in traces]
    count = len(steps[0])
    panels: list[tuple[str, list[Step | None]]] = [
        (f"start: chunks 0 to {size - 1}", [None] * size)
    ]
    for k in range(count):
        label = f"step {k}"
        if name == "optimal":
            phase = "reduce-scatter" if k < size - 1 else "all-gather"
            label = f"{phase} step {k % (size - 1)}"
        panels.append((label, [steps[r][k] for r in range(size)]))
    if name == "optimal":  # the all-gather on a row of its own, under the reduce-scatter
        panels.insert(size, ("", []))
    rows = -(-len(panels) // 4)
    sent = sum(len(s.sent) for s in steps[0])
    c = Canvas(plt, README_WIDTH, int(46 + rows * (36 + size * RING_ROW)))
    top = c.heading(
        [
            f"{title} on {size} ranks: {count} steps; each rank sends {sent} chunks, "
            f"{sent / size:g}x the tensor",
            "A box: one of a rank's chunks after the step, labelled with the ranks whose data it "
            "sums; thick: arrived in that step",
        ],
    )
    for i, (label, column) in enumerate(panels):
        row, col = divmod(i, 4)
        x, y = 50 + col * RING_PANEL, top + row * (36 + size * RING_ROW)
        if col == 0:
            for rank in range(size):
                c.text(44, y + 41 + rank * RING_ROW, f"rank {rank}", ha="right")
        if column:
            _ring_panel(c, x, y, label, column)
    if name == "optimal":
        x, y = 50 + RING_PANEL / 2, top + 36 + size * RING_ROW + 30
        c.text(
            x,
            y + 60,
            "After the reduce-scatter\nrank r alone holds\nchunk r+1 complete;\n"
            "the all-gather hands\nthe complete chunks\nround the ring.",
            linespacing=1.5,
        )
    return c.save(path)


# --- The p2p timeline -----------------------------------------------------------------------

SPAN_COLOURS = {"late": "#e0e0e0", "wait": "#fdae6b"}  # the calls themselves: blue
SPAN_TEXT = {
    "send": "send(to {peer}): returns once rank {peer} receives",
    "late": "arrives late: sleeps {ms:.0f} ms before receiving",
    "wait": "wait(): rank 0 waits here until rank 1 receives",
}
T0, T1 = 80.0, 790.0  # the time axis, in pixels
CHAR = 6.2  # about how wide a character of 8 pt is, in pixels: which labels fit in a bar


def _lane(c: Canvas, spans: list[Span], t0: float, scale: float, y: float, post: float) -> None:
    """One rank's spans as bars at height ``y``: a label inside a bar wide enough for it, on
    one side of the dotted line at ``post`` (a send that returns late, on a busy machine, runs
    on past it), else in the strip above the bar, joined to a neighbour it would run into."""
    above: list[list[Any]] = []  # [x, text], left to right
    for span in spans:
        x0, x1 = T0 + (span.start - t0) * scale, T0 + (span.end - t0) * scale
        colour = SPAN_COLOURS.get(span.call, "#9ecae1")
        c.box(x0, y, max(x1 - x0, 2.0), 20, facecolor=colour, linewidth=0.6)
        ms = (span.end - span.start) * 1000
        text = SPAN_TEXT.get(span.call, span.call).format(peer=span.peer, ms=ms)
        sides = [(x0, post), (post, x1)] if x0 < post < x1 else [(x0, x1)]
        room = [(a, b) for a, b in sides if len(text) * CHAR + 10 < b - a]
        if room:
            c.text((room[0][0] + room[0][1]) / 2, y + 10, text)
        elif above and above[-1][0] + len(above[-1][1]) * CHAR + 8 > x0:
            above[-1][1] += f", {span.call}"
        else:
            above.append([x0, f"{span.call} ({ms:.1f} ms)" if ms >= 0.1 else span.call])
    for x, text in above:  # one that would run past the time axis ends at its end
        c.text(min(x + 5, T1 - len(text) * CHAR), y - 8, text, ha="left")


def draw_p2p(plt: Any, p2p: list[dict[str, list[Span]]], path: Path) -> Drawn:
    """Ranks 0 and 1 on one clock, blocking then non-blocking, rank 1 arriving late."""
    modes = {
        "blocking": "2.1 blocking: send / recv",
        "nonblocking": "2.2 non-blocking: isend / irecv, then wait()",
    }
    starts = {m: min(s.start for r in p2p[:2] for s in r[m]) for m in modes}
    longest = max(s.end - starts[m] for m in modes for r in p2p[:2] for s in r[m])
    span = 0.025 * -(-longest // 0.025)  # the axis: whole 25 ms, ticks every 50
    scale = (T1 - T0) / span
    c = Canvas(plt, README_WIDTH, 334)
    y = c.heading(
        [
            "Point-to-point on a clock: rank 0 sends to rank 1, which arrives "
            f"{LATE * 1000:.0f} ms late",
            "Recorded from p2p.py's run_blocking and run_nonblocking; one bar per call, from the "
            "moment it was made to the moment it returned",
        ],
    )
    for mode, title in modes.items():
        c.text(T0, y + 8, title, ha="left", weight="bold")
        posted = next(s.start for s in p2p[1][mode] if s.call in ("recv", "irecv"))
        x = T0 + (posted - starts[mode]) * scale
        for rank in (0, 1):
            lane_y = y + 34 + rank * 44
            c.text(T0 - 8, lane_y + 10, f"rank {rank}", ha="right")
            _lane(c, p2p[rank][mode], starts[mode], scale, lane_y, x)
            # Through the lane's bars, not the strip of labels above them.
            c.line([(x, lane_y - 1), (x, lane_y + 22)], linestyle=":", color="dimgrey")
        y += 112
    c.line([(T0, y - 14), (T1, y - 14)], linewidth=0.8)
    for k in range(int(span / 0.05 + 1e-9) + 1):
        x = T0 + k * 0.05 * scale
        c.line([(x, y - 17), (x, y - 11)], linewidth=0.8)
        c.text(x, y, f"{k * 50} ms", va="center")
    c.text(
        c.width / 2,
        y + 22,
        "Dotted: rank 1 posts its receive. Blocking: rank 0 is stuck in send until then "
        "(gloo moves the data only then).",
    )
    c.text(
        c.width / 2,
        y + 40,
        "Non-blocking: isend returns at once; rank 0 could work on, "
        "and waits in wait() only when it needs the buffer back.",
    )
    return c.save(path)


# --- The collectives ------------------------------------------------------------------------

CELL, GAP, LABEL, ARROW = 24, 6, 46, 28  # pixels: a number, between tensors, "rank 0", "->"


def _tensors_width(tensors: list[list[float]] | None) -> int:
    if not tensors:
        return 2 * CELL
    return sum(len(t) for t in tensors) * CELL + (len(tensors) - 1) * GAP


def _origin(value: float, inputs: list[list[list[float]] | None]) -> str:
    """The colour of a number: the one rank whose inputs hold it, else a reduction's grey."""
    ranks = [r for r, given in enumerate(inputs) if any(value in t for t in given or [])]
    return RANK_COLOURS[ranks[0]] if len(ranks) == 1 else MIXED


def _tensors(c: Canvas, x: float, y: float, tensors: list[list[float]] | None, inputs) -> None:
    """A rank's tensors as rows of numbers, each coloured by the rank it came from."""
    if tensors is None:
        c.text(x + CELL, y + 10, "none", color="grey", style="italic")
        return
    for t in tensors:
        for value in t:
            c.box(x, y, CELL, 20, facecolor=_origin(value, inputs), linewidth=0.5)
            c.text(x + CELL / 2, y + 10, f"{value:g}")
            x += CELL
        x += GAP


def _call_text(call: Collective) -> str:
    root = SIGNATURES[call.name][2]
    if root == "all" and call.root is not None:
        root = "src"
    return f"{call.name}({root}={call.root})" if call.root is not None else f"{call.name}"


def _collective(c: Canvas, x: float, y: float, calls: list[Collective]) -> None:
    """One collective: per rank, what it gave (left) and what it got (right)."""
    inputs = [call.inputs for call in calls]
    left = max(_tensors_width(call.inputs) for call in calls)
    c.text(x + LABEL, y + 8, _call_text(calls[0]), ha="left", weight="bold")
    for rank, call in enumerate(calls):
        row = y + 22 + rank * 26
        c.text(x + LABEL - 6, row + 10, f"rank {rank}", ha="right")
        _tensors(c, x + LABEL, row, call.inputs, inputs)
        a = x + LABEL + left + 6
        c.arrow([(a, row + 10), (a + ARROW - 12, row + 10)], colour="dimgrey", width=1.0)
        _tensors(c, a + ARROW - 6, row, call.outputs, inputs)


def _width(calls: list[Collective]) -> int:
    given = max(_tensors_width(call.inputs) for call in calls)
    got = max(_tensors_width(call.outputs) for call in calls)
    return LABEL + given + ARROW + got + 16


def draw_collectives(plt: Any, recorded: list[list[Collective]], path: Path) -> Drawn:
    """Every collective of lesson 3 on 4 ranks, in the order of ``SIGNATURES``: each rank's
    tensors before (left) and after (right), rows packed as the README's width allows."""
    by_name = {
        name: [[c for c in calls if c.name == name][0] for calls in recorded] for name in SIGNATURES
    }
    rows: list[list[str]] = [[]]
    for name in SIGNATURES:
        used = sum(_width(by_name[n]) + 10 for n in rows[-1])
        if rows[-1] and used + _width(by_name[name]) > README_WIDTH - 10:
            rows.append([])
        rows[-1].append(name)
    size = len(recorded)
    height = 30 + 26 * size
    c = Canvas(plt, README_WIDTH, int(78 + len(rows) * (height + 12)))
    y = c.heading(
        [
            f"What each collective does to each rank's tensors ({size} ranks; the root is rank "
            f"{size - 1})",
            "Recorded from collectives.py's tour and all_reduce: left, what a rank gave; right, "
            "what it got. Colour: the rank a number",
            "came from; grey: a reduction's result (a sum over ranks); none: the call has no such "
            "tensor on that rank",
        ],
    )
    for row in rows:
        x = 5.0
        for name in row:
            _collective(c, x, y, by_name[name])
            x += _width(by_name[name]) + 10
        y += height + 12
    return c.save(path)
