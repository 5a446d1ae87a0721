"""3. The graph distributed autograd records for the design note's forward, on both workers.

``design_note_forward`` (``autograd.py``) runs here inside a context, exactly as the lesson
runs it; then each worker walks its part of the graph. The walk starts from the loss's
``grad_fn`` and from the context's *send* functions (``_send_functions()``: one per message
that carried tensors requiring grad out of this worker), follows ``next_functions`` (the
edges backward runs along), and writes down every function it meets: its name, the tensor
an ``AccumulateGrad`` feeds, and, for the context's send and *recv* functions
(``_recv_functions()``), the autograd message id they are filed under.

A message id is the same on both ends: the sender's send function and the receiver's recv
function of one RPC share it. That is how ``dist_autograd.backward`` crosses workers: at a
recv function, the gradient goes back over RPC to the send function with its id. The
picture (``tutorial_impl/pictures/draw_rpc.py``) draws the graph, and
``tests/test_pictures.py`` checks it: one send and one recv function per RPC on each side,
paired by id, and, with each pair taken out, the graph plain autograd builds in one process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

from tutorial_impl.rpc.autograd import design_note_forward


@dataclass(frozen=True)
class Node:
    """One autograd function: ``key`` names it (``worker0:2``) in ``next``, the keys of the
    functions backward goes to from it. ``rpc`` is ``send`` or ``recv`` for the context's
    send and recv functions (``message``: their id), None for the others; ``leaf``: the
    tensor an ``AccumulateGrad`` writes the gradient of."""

    key: str
    worker: str
    name: str
    rpc: str | None
    message: int | None
    leaf: str | None
    next: tuple[str, ...]


def _short(name: str) -> str:
    return name.rsplit("::", 1)[-1]  # torch::distributed::autograd::RecvRpcBackward


def graph_here(
    context_id: int, roots: Sequence[Any] = (), leaves: dict[str, torch.Tensor] | None = None
) -> list[Node]:
    """This worker's part of context ``context_id``'s graph, walked from ``roots`` and the
    context's send functions. ``leaves``: ``{name: tensor}``, to name ``AccumulateGrad``s."""
    context = dist_autograd._retrieve_context(context_id)
    worker = rpc.get_worker_info().name
    tagged = [("send", m, fn) for m, fn in context._send_functions().items()]
    tagged += [("recv", m, fn) for m, fn in context._recv_functions().items()]
    names = {id(t): name for name, t in (leaves or {}).items()}
    seen: list = []  # the functions, in the order met (kept alive: ids stay unique)

    def index(fn: object) -> int:
        for i, known in enumerate(seen):
            if known is fn:
                return i
        seen.append(fn)
        return len(seen) - 1

    pending = [*roots, *(fn for _, _, fn in tagged)]
    nodes: dict[int, Node] = {}
    while pending:
        fn = pending.pop(0)
        i = index(fn)
        if i in nodes:
            continue
        nexts = [n for n, _ in fn.next_functions if n is not None]
        tag = next(((kind, m) for kind, m, f in tagged if f is fn), (None, None))
        variable = getattr(fn, "variable", None)
        leaf = names.get(id(variable)) if variable is not None else None
        keys = tuple(f"{worker}:{index(n)}" for n in nexts)
        nodes[i] = Node(f"{worker}:{i}", worker, _short(fn.name()), *tag, leaf, keys)
        pending.extend(nexts)
    return [nodes[i] for i in sorted(nodes)]


def record_design_note_graph(
    callee: str, t1: torch.Tensor, t2: torch.Tensor, t4: torch.Tensor
) -> list[Node]:
    """The design note's forward in a context, and the graph it left on both workers."""
    with dist_autograd.context() as context_id:
        loss = design_note_forward(callee, t1, t2, t4)
        here = graph_here(context_id, [loss.grad_fn], {"t1": t1, "t2": t2, "t4": t4})
        there = rpc.rpc_sync(callee, graph_here, args=(context_id,))
        dist_autograd.backward(context_id, [loss])  # the graph is backward's: it runs
    return [*here, *there]
