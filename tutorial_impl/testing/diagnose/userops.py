"""The collective a user called, where torch records it under another name.

torch's flight recorder names the backend's work, not the user's call: on gloo a
``reduce_scatter_tensor`` is recorded as an ``all_reduce``, an ``all_gather_into_tensor`` as an
``all_gather``, ``broadcast_object_list`` as two ``broadcast``s (measured on torch 2.13 by
``test_harness_stranded.py``, which calls each and reads the records). A waiting rank's stack
says what the user called (``diagnose.stacks.Place.call``); ``user_op`` says whether that call can
be the recorded op, so a hang's first line can use the user's word: ``reduce_scatter_tensor
#1`` where the recorder says ``all_reduce #1``.
"""

from __future__ import annotations

from collections.abc import Sequence

from tutorial_impl.testing.diagnose.stacks import Frame

# torch.distributed's call -> the ops gloo records for it, where they differ from its name.
IMPLEMENTED_BY: dict[str, frozenset[str]] = {
    "all_gather_into_tensor": frozenset({"all_gather"}),
    "all_gather_object": frozenset({"all_gather"}),
    "all_reduce_coalesced": frozenset({"all_reduce"}),
    "all_to_all_single": frozenset({"all_to_all"}),
    "broadcast_object_list": frozenset({"broadcast"}),
    "gather_object": frozenset({"all_gather", "gather"}),
    "reduce_scatter": frozenset({"all_reduce"}),
    "reduce_scatter_tensor": frozenset({"all_reduce"}),
    "scatter_object_list": frozenset({"broadcast", "scatter"}),
}


# torch.distributed's collective calls: what a rank's stack may show it waiting in.
COLLECTIVE_CALLS = frozenset(
    {
        "all_gather",
        "all_reduce",
        "all_to_all",
        "barrier",
        "broadcast",
        "gather",
        "reduce",
        "scatter",
        *IMPLEMENTED_BY,
    }
)


def can_be(call: str | None, op: str) -> bool:
    """Whether the user's ``call`` (a stack's ``Place.call``) may be waiting in the recorded
    ``op``: the same name, or one torch implements it with."""
    return call is not None and (call == op or op in IMPLEMENTED_BY.get(call, ()))


def user_op(call: str | None, op: str) -> str:
    """The name a headline should use for recorded ``op``: the user's ``call`` where torch
    implements it with ``op``, else ``""`` (``op`` stands)."""
    return call if call is not None and call != op and can_be(call, op) else ""


# Where a functional collective's work is waited for (``torch.ops._c10d_functional
# .wait_tensor``, behind DTensor's ``redistribute`` and an ``AsyncCollectiveTensor``'s first
# use): the user's call there is not the collective's name, and any collective may be waited.
FUNCTIONAL = "/torch/distributed/_functional_collectives.py"
FUNCTIONAL_WAIT = "wait_tensor"


def in_functional_wait(frames: Sequence[Frame]) -> bool:
    """Whether a thread's ``frames`` (most recent first) are inside the wait for a
    functional collective's work."""
    return any(func == FUNCTIONAL_WAIT and FUNCTIONAL in path for path, _, func in frames)
