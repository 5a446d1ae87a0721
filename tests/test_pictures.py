"""``python -m tutorial_impl pictures``: the course's images, one command, from real runs.

The command runs the lessons' own code on local ranks, recording it, and draws each picture
from the recording (``tutorial_impl/pictures/``). The claims, in reading order:

1. The command writes every image the docs show, each readable at the README's width: no
   wider than it, no text under 11 pixels, no label crossed by an arrow or another label.
2. What each picture shows is what the code did, checked against an independent
   reference: the p2p timeline against gloo's rule (a blocking send waits for the receive),
   the collectives against torch's operations in one process, the RRef protocol against the
   design note's counting rule, the autograd graph against plain autograd's, DDP's buckets
   against the rule that fills them, the pipeline schedules against D18's closed-form
   bubbles. (The rings' trace is checked against each algorithm's
   schedule in ``tests/dist_tuto/test_06_ring.py``.)
3. Without matplotlib (an optional extra) the command says what to install.

One run of the command serves every test (``command``: once per session, even when xdist
spreads this module over workers): about 5 s of CPU with the rank forkserver already
running, about 1 s more than the command cost when it drew only the rings and the layout.
Under ``pytest -n auto`` the module goes to one worker (``xdist_group``), with the
benchmark's box plot (``tests/bench/test_bench_stats.py``): the suite's only other user of
matplotlib, whose import costs about a second of CPU in each worker that makes it.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import re
import struct
import sys
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tutorial_impl import __main__ as entry
from tutorial_impl import pictures
from tutorial_impl.ddp import pipeline_schedules as schedules
from tutorial_impl.ddp import toy
from tutorial_impl.dist_tuto import collectives
from tutorial_impl.dist_tuto.collectives_trace import SIGNATURES
from tutorial_impl.dist_tuto.p2p_trace import LATE
from tutorial_impl.pictures import draw_dist_tuto, draw_pipeline, record
from tutorial_impl.pictures.canvas import MIN_FONT_PT, README_WIDTH, Canvas, crossings, px
from tutorial_impl.rpc.rref_trace import MESSAGES

# The group of the suite's matplotlib users (see the docstring): one worker imports it once.
pytestmark = pytest.mark.xdist_group("matplotlib")

REPO = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
IMAGE_LINK = re.compile(r"\]\(((?:\.\./)?docs/images/|images/)([^)]+)\)")


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's header, read here without matplotlib."""
    assert data.startswith(PNG_SIGNATURE)
    return struct.unpack(">II", data[16:24])


@dataclass
class Command:
    """One run of the command: its exit status, what it printed, what it recorded and drew."""

    status: int
    printed: list[str]  # its stdout's lines: the ranks' live output too (the CLI streams it)
    recorded: record.Recordings
    drawn: list[Any]
    sizes: dict[str, tuple[int, int]]


def run_the_command(out: Path) -> Command:
    """``python -m tutorial_impl pictures --out OUT`` as a learner runs it, with what the
    command recorded and measured kept on the way (its own functions, wrapped)."""
    kept: dict[str, Any] = {}
    real_record, real_draw = record.record, pictures.draw

    def keep_record(*args: Any) -> record.Recordings:
        kept["recorded"] = real_record(*args)
        return kept["recorded"]

    def keep_draw(*args: Any) -> list[Any]:
        kept["drawn"] = real_draw(*args)
        return kept["drawn"]

    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.setattr(record, "record", keep_record)
        patch.setattr(pictures, "draw", keep_draw)
        status = entry.main(["pictures", "--out", str(out), "--timeout", "60"])
    sizes = {name: png_size((out / name).read_bytes()) for name in pictures.IMAGES}
    return Command(status, printed.getvalue().splitlines(), kept["recorded"], kept["drawn"], sizes)


@pytest.fixture(scope="module")
def command(once_per_session) -> Command:
    pytest.importorskip("matplotlib")
    out = once_per_session.directory("pictures")
    return once_per_session.run("pictures", lambda: run_the_command(out), timeout=180)


# --- 1. Every image, readable at the README's width -----------------------------------------


def test_the_command_writes_every_image(command):
    """It prints the path of each image it wrote, in order. The ranks' own output shares that
    stdout (the CLI streams it live): a rank's warning under load, say, is not a path."""
    assert command.status == 0, command.printed
    paths = [Path(line) for line in command.printed if line.endswith(".png")]
    assert [p.name for p in paths] == list(pictures.IMAGES), command.printed
    assert all(p.is_file() for p in paths)
    assert [d.path.name for d in command.drawn] == list(pictures.IMAGES)


@pytest.mark.parametrize("name", pictures.IMAGES)
def test_each_picture_is_readable_at_the_readmes_width(command, name):
    """The PNG's own header says how wide it is; the canvas measured its fonts and what
    crosses what with matplotlib's font metrics, after drawing."""
    drawn = next(d for d in command.drawn if d.path.name == name)
    width, height = command.sizes[name]
    assert (width, height) == (drawn.width, drawn.height)
    assert width <= README_WIDTH
    assert drawn.min_font_px >= 11
    assert drawn.crossings == []


def test_the_crossing_check_sees_a_crossed_label_an_overlap_and_a_cut_text():
    """The check the pictures pass, failing where it must: an arrow through a label (the
    old hybrid picture's fault), two labels on top of each other, a text off the edge."""
    plt = pictures._pyplot() or pytest.skip("needs matplotlib")
    c = Canvas(plt, 300, 100)
    c.text(150, 30, "crossed")
    c.arrow([(150, 5), (150, 60)])
    c.text(60, 80, "one")
    c.text(66, 80, "two")
    c.text(295, 80, "cut off", ha="left")
    c.text(220, 30, "alone")
    found = crossings(c)
    plt.close(c.fig)
    assert len(found) == 3, found
    assert "crosses 'crossed'" in found[2] and "'one' and 'two' overlap" in found[1]
    assert "'cut off' leaves the picture" in found[0]
    with pytest.raises(ValueError, match="unreadable"):
        c.text(0, 0, "tiny", size=MIN_FONT_PT - 1)
    assert px(MIN_FONT_PT) >= 11


def test_the_docs_show_only_images_the_command_makes():
    """The README and docs/ show each committed image, none the command does not make, and
    every committed one fits the README."""
    shown = set()
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        shown |= {name for _, name in IMAGE_LINK.findall(page.read_text())}
    assert shown == set(pictures.IMAGES)
    for name in pictures.IMAGES:
        width, _ = png_size((REPO / "docs" / "images" / name).read_bytes())
        assert width <= README_WIDTH, name


def test_the_p2p_timeline_stays_readable_when_rank_0_returns_late(command, tmp_path):
    """On a busy machine rank 0 may return from send (or wait) long after rank 1 posted its
    receive: its bar then runs on past the dotted line, and the axis stretches. The same
    recording with rank 0's calls ending 50, 100, 200 and 400 ms later still draws with no
    text crossed (a label centred in the longer bar sat on the dotted line, once in a suite
    run under load)."""
    plt = pictures._pyplot()
    for extra in (0.05, 0.1, 0.2, 0.4):
        late = [dict(ranks) for ranks in command.recorded.p2p[:2]]
        for mode, call in (("blocking", "send"), ("nonblocking", "wait")):
            late[0][mode] = [
                replace(s, end=s.end + extra) if s.call == call else s for s in late[0][mode]
            ]
        drawn = draw_dist_tuto.draw_p2p(plt, late, tmp_path / f"late{extra}.png")
        plt.close("all")
        assert drawn.crossings == [], (extra, drawn.crossings)


# --- 2. What each picture shows is what the code did ----------------------------------------


def test_p2p_a_blocking_send_waits_for_the_receive_an_isend_does_not(command):
    def one(rank: int, mode: str, call: str):
        return next(s for s in command.recorded.p2p[rank][mode] if s.call == call)

    late, recv, send = (
        one(1, "blocking", "late"),
        one(1, "blocking", "recv"),
        one(0, "blocking", "send"),
    )
    assert late.end - late.start >= LATE
    assert send.start < recv.start  # rank 0 was in send while rank 1 slept
    assert send.end >= recv.start  # ... and left it only once rank 1 had posted its receive
    isend, irecv = one(0, "nonblocking", "isend"), one(1, "nonblocking", "irecv")
    wait = one(0, "nonblocking", "wait")
    assert isend.end < irecv.start  # isend returned before rank 1 posted its receive
    assert wait.end >= irecv.start  # rank 0 waited in wait() instead
    assert command.recorded.p2p[2:] == [{}, {}]  # the other ranks only met the barriers


def expected_outputs(name: str, root: int | None, given: list[list[torch.Tensor]]) -> list:
    """What ``name`` gives each rank, computed here with torch's operations in one process
    from every rank's recorded inputs; None where the output is defined on the root only."""
    n = len(given)
    first = [g[0] if g else None for g in given]
    total = torch.stack(first).sum(0) if None not in first else None
    outputs = {
        "broadcast": lambda r: [first[root]],
        "reduce": lambda r: [total] if r == root else None,
        "all_reduce": lambda r: [total],
        "scatter": lambda r: [given[root][r]],
        "gather": lambda r: first if r == root else None,
        "all_gather": lambda r: first,
        "all_to_all": lambda r: [given[j][r] for j in range(n)],
        "reduce_scatter": lambda r: [torch.stack([given[j][r] for j in range(n)]).sum(0)],
    }[name]
    return [outputs(r) for r in range(n)]


def test_collectives_each_one_gave_what_torch_computes_in_one_process(command):
    recorded = command.recorded.collectives
    names = [c.name for c in recorded[0]]
    assert sorted(names) == sorted(SIGNATURES)
    for i, name in enumerate(names):
        calls = [rank_calls[i] for rank_calls in recorded]
        given = [[torch.tensor(t) for t in c.inputs or []] for c in calls]
        if name not in ("scatter", "all_to_all", "reduce_scatter"):  # the lesson's inputs
            assert [g[0].tolist() for g in given] == [
                collectives.rank_tensor(r).tolist() for r in range(len(calls))
            ]
        for rank, (call, want) in enumerate(
            zip(calls, expected_outputs(name, calls[0].root, given), strict=True)
        ):
            assert call.outputs == (None if want is None else [t.tolist() for t in want]), (
                name,
                rank,
            )


def test_the_collectives_picture_shows_every_number_each_rank_took_and_gave(command):
    """Every number of every rank's recorded inputs and outputs is a cell of the picture,
    and no other number is: the picture is the recording, checked above against torch."""
    drawn = next(d for d in command.drawn if d.path.name == "collectives.png")
    wanted = Counter(
        f"{value:g}"
        for rank_calls in command.recorded.collectives
        for call in rank_calls
        for tensors in (call.inputs, call.outputs)
        for tensor in tensors or []
        for value in tensor
    )
    assert Counter(t for t in drawn.texts if re.fullmatch(r"-?[\d.]+", t)) == wanted


def test_the_collectives_picture_names_each_root_as_torch_does(command):
    """A collective with a root rank is titled with the argument torch's own function takes
    for it (``broadcast(src=0)``, ``reduce(dst=0)``) and the rank the recording holds."""
    drawn = next(d for d in command.drawn if d.path.name == "collectives.png")
    titled = {m[1]: (m[2], int(m[3])) for t in drawn.texts if (m := ROOTED.fullmatch(t))}
    rooted = {c.name: c.root for c in command.recorded.collectives[0] if c.root is not None}
    assert rooted and sorted(titled) == sorted(rooted)
    for name, (argument, rank) in titled.items():
        assert argument in inspect.signature(getattr(dist, name)).parameters, (name, argument)
        assert rank == rooted[name], name


ROOTED = re.compile(r"(\w+)\((\w+)=(\d+)\)")


def test_rref_protocol_the_owner_counts_the_users_the_messages_say(command):
    """The design note's rule: the owner counts one user per ``remote`` it serves and per
    fork request it receives, forgets one per user delete, and frees the object when it
    knows of none. Applied to the messages the picture draws, it must give the counts torch
    kept on the owner, step by step."""
    steps = command.recorded.rref
    known, counted = 0, []
    for step in steps:
        for _, receiver, message in MESSAGES[step.step]:
            if receiver == "owner":
                known += {"remote": 1, "fork request": 1, "user delete": -1}.get(message, 0)
        counted.append(known)
    owner = [s.books["owner"] for s in steps]
    assert [b["num_forks"] for b in owner] == counted == [1, 2, 1, 0]
    assert [b["num_owner_rrefs"] for b in owner] == [1, 1, 1, 0]
    assert [s.alive for s in steps] == [1, 1, 1, 0]
    assert [s.confirmed for s in steps] == [True, True, None, None]
    for s in steps:  # every state read once nothing was in flight
        assert all(
            b["num_pending_futures"] == b["num_pending_users"] == 0 for b in s.books.values()
        )
    # "User Share RRef with User", in the design note's order
    fork = [m for _, _, m in MESSAGES["shared with the third"]]
    assert fork == ["rpc_sync(hold)", "fork request", "ack", "child accept"]


def _edges_without_rpc(nodes: list) -> set[tuple[str, str]]:
    """The graph's edges between labelled functions, each send/recv pair taken out: from a
    function into a recv function continues at the send function with its id, and on."""
    by_key = {n.key: n for n in nodes}
    sends = {n.message: n.key for n in nodes if n.rpc == "send"}

    def label(n) -> str:
        return f"{n.name}({n.leaf})" if n.leaf else n.name

    def beyond(key: str) -> list[str]:
        n = by_key[key]
        if n.rpc == "recv":
            return beyond(sends[n.message])
        if n.rpc == "send":
            return [k for nxt in n.next for k in beyond(nxt)]
        return [key]

    return {
        (label(n), label(by_key[k]))
        for n in nodes
        if not n.rpc
        for nxt in n.next
        for k in beyond(nxt)
    }


def local_edges(loss: torch.Tensor, leaves: dict[str, torch.Tensor]) -> set[tuple[str, str]]:
    """The same labelled edges of a graph plain autograd built in this process."""
    names = {id(t): name for name, t in leaves.items()}

    def label(fn) -> str:
        short = fn.name().rsplit("::", 1)[-1]
        variable = getattr(fn, "variable", None)
        return f"{short}({names[id(variable)]})" if variable is not None else short

    edges, pending = set(), [loss.grad_fn]
    while pending:
        fn = pending.pop()
        for nxt, _ in fn.next_functions:
            if nxt is not None:
                edges.add((label(fn), label(nxt)))
                pending.append(nxt)
    return edges


def test_autograd_graph_one_send_and_one_recv_per_rpc_and_else_plain_autograds(command):
    nodes = command.recorded.autograd
    for worker in ("worker0", "worker1"):  # one RPC: its request and its reply
        mine = [n.rpc for n in nodes if n.worker == worker and n.rpc]
        assert sorted(mine) == ["recv", "send"], worker
    pairs = {}
    for n in nodes:
        if n.rpc:
            pairs.setdefault(n.message, set()).add((n.worker, n.rpc))
    assert sorted(map(sorted, pairs.values())) == [
        [("worker0", "recv"), ("worker1", "send")],  # the reply, t3
        [("worker0", "send"), ("worker1", "recv")],  # the request, t1 and t2
    ]
    t1, t2, t4 = record.design_note_inputs()
    loss = (torch.add(t1, t2) * t4).sum()  # the design note's forward, in one process
    assert _edges_without_rpc(nodes) == local_edges(loss, {"t1": t1, "t2": t2, "t4": t4})


def expected_buckets(cap_bytes: int) -> list[list[str]]:
    """DDP's rule, from sizes alone: the parameters from last to first (the order backward
    writes their gradients), a bucket closed once it holds ``cap_bytes``."""
    found: list[list[str]] = [[]]
    filled = 0
    for name, p in reversed(list(toy.mlp(0).named_parameters())):
        if filled >= cap_bytes:
            found.append([])
            filled = 0
        found[-1].append(name)
        filled += p.numel() * p.element_size()
    return found


def test_ddp_buckets_one_all_reduce_per_bucket_launched_during_backward(command):
    first, second = command.recorded.bucket_calls
    order = command.recorded.ready
    names = [name for name, _ in toy.mlp(0).named_parameters()]
    assert order == [names[::-1], names[::-1]]  # backward: the last layer's gradients first
    assert len(first) == 1 and sorted(first[0].names) == sorted(names)
    assert first[0].missing == 0  # one bucket: it waits for the end of backward
    expected = expected_buckets(int(record.BUCKET_CAP_MB * 2**20))
    assert [c.names for c in second] == expected and len(expected) == 3
    assert second[0].missing > 0  # the first all_reduce starts before backward ends
    for call in second:  # ... exactly when its last gradient was written
        last = max(order[1].index(n) for n in call.names)
        assert call.missing == len(names) - 1 - last


def test_pipeline_schedules_every_action_once_the_bubble_in_closed_form_each_box_drawn(command):
    """Each rank ran every micro-batch's F and B (zero bubble: F, B and W) once on each of
    its stages; the replayed orders' bubbles are D18's closed forms (p = 2 ranks, m = 4,
    v = 2 stages a rank), and the picture says them and labels one box per action."""
    p, m, v = 2, record.MICROBATCHES, schedules.STAGES // 2
    expected = {
        "1F1B": (p - 1) / (m + p - 1),
        "Interleaved1F1B": (p - 1) / (v * m + p - 1),
        "InterleavedZeroBubble": (p - 1) / (3 * v * m + p - 1),
    }
    recorded = command.recorded.schedules
    assert list(recorded) == list(expected) == list(record.SCHEDULES)
    drawn = next(d for d in command.drawn if d.path.name == "pipeline_schedules.png")
    labels = Counter(t for t in drawn.texts if re.fullmatch(r"[FBW]\d", t))
    actions: Counter[str] = Counter()
    for name, orders in recorded.items():
        kinds = "FBW" if "ZeroBubble" in name else "FB"
        for rank, order in enumerate(orders):
            mine = schedules.stages_of(rank, p, name)
            assert sorted(order) == sorted((s, k, b) for s in mine for k in kinds for b in range(m))
            actions.update(f"{k}{b}" for _, k, b in order)
        stages = p if name == "1F1B" else schedules.STAGES
        measured = schedules.bubble(orders, stages)
        assert measured == pytest.approx(expected[name]), name
        assert any(t.endswith(f"bubble {measured:.0%}") for t in drawn.texts), name
    assert labels == actions  # one label a box, one box an action
    assert Counter(t for t in drawn.texts if t.startswith("rank ")) == {"rank 0": 3, "rank 1": 3}
    # The boxes: one an action, inside the picture, none over another, and each schedule's
    # replay across the whole time axis (its own units: first box at X0, last ending at X1).
    assert len(drawn.boxes) == sum(actions.values())
    assert all(0 <= x and x + w <= drawn.width and 0 <= y and y + h <= drawn.height
               for x, y, w, h in drawn.boxes)  # fmt: skip
    for i, (x, y, w, h) in enumerate(drawn.boxes):
        for x2, y2, w2, h2 in drawn.boxes[i + 1 :]:
            assert min(x + w, x2 + w2) - max(x, x2) < 0.5 or min(y + h, y2 + h2) - max(y, y2) < 0.5
    start = 0
    for orders in recorded.values():
        mine = drawn.boxes[start : start + sum(map(len, orders))]
        start += len(mine)
        left, right = min(x for x, *_ in mine), max(x + w for x, _, w, _ in mine)
        assert (left, right) == pytest.approx((draw_pipeline.X0, draw_pipeline.X1))


# --- 3. Without matplotlib ------------------------------------------------------------------


def test_without_matplotlib_the_command_says_what_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    out = tmp_path / "images"
    assert entry.main(["pictures", "--out", str(out)]) == 2
    assert 'pip install -e ".[plot]"' in capsys.readouterr().err
    assert not out.exists()  # refused before anything was started or written
