"""The RPC framework's pictures: the RRef protocol, and distributed autograd's graph.

Both drawn from recordings of the lessons' own code (``pictures/record.py``): the RRef
bookkeeping of three workers after each step of ``rref_lifetime`` (``rpc/rref_trace.py``),
and the graph the design note's forward left on two workers (``rpc/autograd_graph.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tutorial_impl.pictures.canvas import README_WIDTH, Canvas, Drawn
from tutorial_impl.rpc.autograd_graph import Node
from tutorial_impl.rpc.rref_trace import CALLS, MESSAGES, ROLES, ProtocolStep

# --- The RRef protocol ----------------------------------------------------------------------

LIFELINES = {"creator": 140.0, "owner": 440.0, "third": 740.0}
HEADS = {"creator": "worker0: creator", "owner": "worker1: owner", "third": "worker2: third"}
SAYS = {
    "remote": "rpc.remote(owner, Tracked)",
    "remote's reply": "reply: the creator's user RRef is confirmed",
    "rpc_sync(hold)": "rpc_sync(third, hold, args=(rref,)): a fork",
    "fork request": "fork request: a user the owner must count",
    "ack": "ack: the third's RRef is confirmed",
    "child accept": "child accept: the creator may let go",
    "user delete": "user delete",
    "rpc_sync(release)": "rpc_sync(third, release)",
}
STEP_TITLES = {
    "created": "1. The creator makes a Tracked on the owner",
    "shared with the third": "2. The creator passes its RRef to a third worker",
    "creator dropped its rref": "3. The creator drops its RRef (del rref)",
    "third dropped its rref": "4. The third drops its RRef",
}
PROTOCOL_COLOUR = "#b35806"


def _message(c: Canvas, y: float, sender: str, receiver: str, message: str) -> None:
    """One message as an arrow between lifelines; its label above it, next to the sender."""
    a, b = LIFELINES[sender], LIFELINES[receiver]
    call = message in CALLS
    colour = "black" if call else PROTOCOL_COLOUR
    c.arrow([(a, y), (b, y)], colour=colour, dashed=not call)
    step = 1 if b > a else -1
    near = LIFELINES[ROLES[ROLES.index(sender) + step]]
    c.text((a + near) / 2, y - 10, SAYS[message], color=colour)


def _states(c: Canvas, y: float, step: ProtocolStep) -> None:
    """What the recording says after the step: the owner's books, and a confirmation."""
    owner = step.books["owner"]
    text = f"objects alive: {step.alive}\nusers it knows of: {owner['num_forks']}"
    c.box(LIFELINES["owner"] - 80, y, 160, 36, facecolor="#d5efd0", linewidth=0.6)
    c.text(LIFELINES["owner"], y + 18, text)
    if step.confirmed is not None:
        role = "creator" if step.step == "created" else "third"
        unconfirmed = step.books[role]["num_pending_users"]
        words = "its RRef: confirmed" if step.confirmed and not unconfirmed else "unconfirmed"
        c.box(LIFELINES[role] - 80, y + 6, 160, 24, facecolor="#d5efd0", linewidth=0.6)
        c.text(LIFELINES[role], y + 18, words)


def draw_rref_protocol(plt: Any, steps: list[ProtocolStep], path: Path) -> Drawn:
    """A sequence diagram of ``rref_lifetime``: the lesson's calls (solid), the protocol's
    messages (dashed, as the design note names them), the recorded state after each step."""
    rows = sum(len(MESSAGES[s.step]) for s in steps)
    c = Canvas(plt, README_WIDTH, int(108 + 80 * len(steps) + 30 * rows))
    y = c.heading(
        [
            "The RRef protocol between three workers: rrefs.py's rref_lifetime, recorded",
            "Solid: the lesson's calls; dashed: the protocol's messages (the design note's "
            "names); green: each worker's RRef",
            "bookkeeping, read from torch (_rref_context_get_debug_info) once no message was "
            "in flight",
        ],
    )
    for role, x in LIFELINES.items():
        c.box(x - 80, y, 160, 24, facecolor="#cfe3f7")
        c.text(x, y + 12, HEADS[role], weight="bold")
    top, y = y + 24, y + 30
    for step in steps:
        c.text(
            10,
            y + 10,
            STEP_TITLES.get(step.step, step.step),
            ha="left",
            weight="bold",
            backgroundcolor="white",
        )
        y += 30
        for sender, receiver, message in MESSAGES[step.step]:
            y += 30
            _message(c, y - 8, sender, receiver, message)
        _states(c, y + 4, step)
        y += 50
    for x in LIFELINES.values():
        c.line([(x, top), (x, y)], checked=False, color="grey", linewidth=0.8, zorder=0)
    return c.save(path)


# --- Distributed autograd's graph -----------------------------------------------------------

REGIONS = {"worker0": (10.0, 410.0), "worker1": (430.0, 830.0)}  # x ranges of the workers
NODE_W, NODE_H, LEVEL = 190, 24, 50
NODE_COLOURS = {"send": "#fdd0a2", "recv": "#fdd0a2", "leaf": "#d5efd0", None: "#e3ecf7"}


def levels(nodes: list[Node]) -> dict[str, int]:
    """Each node's depth in backward's order: the longest path to it from a root, along
    ``next`` and from each recv function to the send function with its message id."""
    sends = {n.message: n.key for n in nodes if n.rpc == "send"}
    edges = {n.key: [*n.next, *([sends[n.message]] if n.rpc == "recv" else [])] for n in nodes}
    depth = {n.key: 0 for n in nodes}
    for _ in nodes:  # relax as often as there are nodes: enough for any acyclic graph
        for key, targets in edges.items():
            for t in targets:
                depth[t] = max(depth[t], depth[key] + 1)
    return depth


def message_id(m: int) -> str:
    """An autograd message id as torch builds it: the worker's id, then a 48-bit counter."""
    return f"{m >> 48}:{m & (2**48 - 1)}"


def _node_text(n: Node) -> str:
    if n.rpc:
        return f"{n.name}, id {message_id(n.message)}"
    return f"{n.name} ({n.leaf})" if n.leaf else n.name


def _places(nodes: list[Node], top: float) -> dict[str, tuple[float, float]]:
    """Each node's centre: its worker's column, its level's row, spread within the cell."""
    depth = levels(nodes)
    cells: dict[tuple[str, int], list[str]] = {}
    for n in nodes:
        cells.setdefault((n.worker, depth[n.key]), []).append(n.key)
    places = {}
    for (worker, level), keys in cells.items():
        x0, x1 = REGIONS[worker]
        for i, key in enumerate(keys):
            places[key] = (x0 + (i + 0.5) * (x1 - x0) / len(keys), top + level * LEVEL)
    return places


def draw_autograd_graph(plt: Any, nodes: list[Node], path: Path) -> Drawn:
    """The graph of both workers, backward running down: local edges solid, the hop from a
    recv function to the send function with its id (over RPC) dashed."""
    depth = max(levels(nodes).values())
    c = Canvas(plt, README_WIDTH, int(108 + (depth + 1) * LEVEL))
    y = c.heading(
        [
            "Distributed autograd's graph of the design note's forward, recorded on both workers",
            't3 = rpc_sync("worker1", torch.add, args=(t1, t2)); loss = (t3 * t4).sum(). '
            "Backward runs down from the loss;",
            "dashed: it crosses to the other worker, from a recv function to the send "
            "function with the same message id",
        ],
    )
    for worker, (x0, x1) in REGIONS.items():
        c.box(x0, y, x1 - x0, (depth + 1) * LEVEL + 28, facecolor="#f7f7f7", edgecolor="grey")
        c.text((x0 + x1) / 2, y + 12, worker, weight="bold")
    places = _places(nodes, y + 44)
    by_key = {n.key: n for n in nodes}
    sends = {n.message: n.key for n in nodes if n.rpc == "send"}
    for n in nodes:
        x, ny = places[n.key]
        for target in dict.fromkeys(n.next):  # an edge drawn once, however many inputs
            tx, ty = places[target]
            c.arrow([(x, ny + NODE_H / 2), (tx, ty - NODE_H / 2)], width=1.0)
        if n.rpc == "recv":
            tx, ty = places[sends[n.message]]
            c.arrow(
                [(x, ny + NODE_H / 2), (tx, ty - NODE_H / 2)], colour=PROTOCOL_COLOUR, dashed=True
            )
        kind = "leaf" if n.leaf else n.rpc
        c.box(x - NODE_W / 2, ny - NODE_H / 2, NODE_W, NODE_H, facecolor=NODE_COLOURS[kind])
        c.text(x, ny, _node_text(by_key[n.key]))
    return c.save(path)
