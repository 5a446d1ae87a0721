"""3. seen tensor by tensor: what each collective of ``collectives.py`` took and gave, per rank.

``tour`` (every collective of the tutorial's 3.2, once) and the lesson's checked
``all_reduce`` run here exactly as they always do; only the ``dist`` they call is swapped, for
the length of the run, for a recording stand-in (``RecordingDist``) that passes every call on
to ``torch.distributed`` and copies, for each collective, the tensors it was given before the
call and the tensors it filled after it.

Which arguments carry data in and which carry it out is each collective's signature
(``SIGNATURES``): ``scatter`` reads ``scatter_list`` (on ``src``) and fills ``tensor``;
``gather`` reads ``tensor`` and fills ``gather_list`` (on ``dst``). An output defined only on
one rank (``reduce``, ``gather``) is recorded there only. The picture
(``tutorial_impl/pictures/draw_dist_tuto.py``) is drawn from the record, and
``tests/test_pictures.py`` checks every output against the same operation done in one
process on the recorded inputs.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tutorial_impl.dist_tuto import collectives

# name -> (arguments read, arguments written, where the output is defined: "all" or the
# argument naming the one rank that receives it)
SIGNATURES: dict[str, tuple[str, str, str]] = {
    "broadcast": ("tensor", "tensor", "all"),
    "reduce": ("tensor", "tensor", "dst"),
    "all_reduce": ("tensor", "tensor", "all"),
    "scatter": ("scatter_list", "tensor", "all"),
    "gather": ("tensor", "gather_list", "dst"),
    "all_gather": ("tensor", "tensor_list", "all"),
    "all_to_all": ("input_tensor_list", "output_tensor_list", "all"),
    "reduce_scatter": ("input_list", "output", "all"),
}
ROOTS = ("src", "dst")  # the arguments that name a root rank


@dataclass(frozen=True)
class Collective:
    """One collective on one rank: its name, its root (``src``/``dst``, or None), and the
    tensors it read and wrote, each a list of tensors as lists of numbers (``None``: this
    rank has no such tensors, like ``scatter_list`` off the root)."""

    name: str
    root: int | None
    inputs: list[list[float]] | None
    outputs: list[list[float]] | None


def _values(value: Any) -> list[list[float]] | None:
    if value is None:
        return None
    tensors = [value] if isinstance(value, torch.Tensor) else list(value)
    return [t.detach().cpu().reshape(-1).tolist() for t in tensors]


class RecordingDist:
    """``torch.distributed`` for ``collectives.py``, copying each collective's data."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.calls: list[Collective] = []

    def __getattr__(self, name: str) -> Any:
        real = getattr(dist, name)
        if name not in SIGNATURES:
            return real

        def recorded(*args: Any, **kwargs: Any) -> Any:
            bound = inspect.signature(real).bind(*args, **kwargs)
            bound.apply_defaults()
            given = bound.arguments
            read, written, where = SIGNATURES[name]
            before = _values(given[read])
            result = real(*args, **kwargs)
            root = next((given[r] for r in ROOTS if given.get(r) is not None), None)
            mine = where == "all" or given[where] == self.rank
            after = _values(given[written]) if mine else None
            self.calls.append(Collective(name, root, before, after))
            return result

        return recorded


def trace_collectives(rank: int, size: int) -> list[Collective]:
    """Every collective of the lesson on this rank, in order: ``all_reduce`` of
    ``rank_tensor(rank)``, then the ``tour``. A rank function (a gloo process group)."""
    tracer = RecordingDist(rank)
    real = collectives.dist
    collectives.dist = tracer  # type: ignore[assignment]  # looked up at call time
    try:
        collectives.all_reduce(collectives.rank_tensor(rank))
        collectives.tour(rank, size, verbose=False)
    finally:
        collectives.dist = real
    return tracer.calls
