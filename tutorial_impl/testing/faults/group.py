"""A gloo process group that counts every collective, and injects the armed inject.

Faults must strike collectives wherever they come from: a direct ``dist.all_reduce``, DDP's
gradient buckets (its C++ reducer), a functional collective, DTensor. Wrapping
``torch.distributed``'s Python functions would miss all but the first, so the injector sits
at the process-group level: ``FaultyGroup``, a Python subclass of ``dist.ProcessGroup``,
registered as the backend ``"faulty"`` (``register``; ``init_process_group`` and
``dist.new_group(backend="faulty")`` then make one). Inside it, an ordinary
``ProcessGroupGloo`` is registered as its CPU backend, so the group has a name
(``group.group_name``, which functional collectives and DTensor resolve it by) and torch's
flight recorder records its collectives as gloo's own (``recorder``). Each intercepted
method (``METHODS``) counts the call (``inject.INJECTOR.reached``: a fault fires here), then
hands it to the same method of a plain ``ProcessGroup`` holding the same gloo backend: from
there on, the call takes the path of any gloo group's (torch's dispatcher, then gloo).

What reaches the Python methods (torch 2.13, proven in tests/harness/faults/test_harness_faults.py):
every ``dist.*`` collective and point-to-point call (Python calls the method by name), and,
from C++, the methods torch's trampoline (``PyProcessGroup``) forwards: ``TRAMPOLINED``,
which are the ones DDP's reducer (``allreduce``; ``allgather`` and ``broadcast`` at its
start), functional collectives and DTensor (``allreduce``, ``broadcast``, ``all_to_all_single``
and the ``*_coalesced`` forms of all-gather and reduce-scatter, even for one tensor) call.
Not caught: a C++ caller of another method (``reduce``, ``gather``, ``scatter``,
``alltoall``, ...: none in torch 2.13's DDP, functional collectives or DTensor);
``dist.monitored_barrier`` (refuses any backend not named "gloo"); code that asks
``dist.get_backend()`` (it answers "faulty").

Why a plain group's methods and never the base class's (``super().allreduce``): torch's
trampoline holds the GIL while it runs a Python override, and through the base class's
method too, when the override calls it (pybind11 recognises that call by the frame's name).
gloo's worker thread frees a finished work's tensors, which takes the GIL, while it holds
the lock that enqueueing the next work waits for: a deadlock, seen once in about three
thousand small all_reduces here. A plain ``ProcessGroup`` (not a Python subclass: no
trampoline) lets go of the GIL before it enqueues, as every gloo group's call does.

Nothing here imports torch at import time; ``group_class`` builds the class on first use.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from typing import Any

from tutorial_impl.testing.faults import inject
from tutorial_impl.testing.faults.plan import P2P, Plan, Point

BACKEND = "faulty"


# Each ProcessGroup method the group intercepts, and the collective it is (``inject.plan.OPS``).
METHODS: dict[str, str] = {
    "allreduce": "all_reduce",
    "allreduce_coalesced": "all_reduce_coalesced",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "allgather": "all_gather",
    "_allgather_base": "all_gather_into_tensor",
    "all_gather_single": "all_gather_into_tensor",
    "allgather_coalesced": "all_gather_coalesced",
    "all_gather_single_coalesced": "all_gather_into_tensor_coalesced",
    "allgather_into_tensor_coalesced": "all_gather_into_tensor_coalesced",
    "gather": "gather",
    "scatter": "scatter",
    "reduce_scatter": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor_coalesced",
    "alltoall": "all_to_all",
    "alltoall_base": "all_to_all_single",
    "all_to_all_single": "all_to_all_single",
    "barrier": "barrier",
    "send": "send",
    "recv": "recv",
    "recv_anysource": "recv",
}
# The methods torch 2.13's trampoline forwards from C++ callers to a Python override.
TRAMPOLINED = frozenset(
    "allreduce allreduce_coalesced broadcast allgather all_gather_single_coalesced "
    "reduce_scatter reduce_scatter_single_coalesced all_to_all_single barrier send recv".split()
)


def register() -> None:
    """Make ``"faulty"`` a backend torch.distributed knows (once per process; CPU only)."""
    import torch.distributed as dist

    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])


def init_process_group(rank: int, world_size: int, plan: Plan | None = None, **kwargs: Any) -> None:
    """Join the default group on the faulty backend (``init_method`` default ``env://``:
    what ``run_ranks(..., backend=None)`` gives a rank), with ``plan`` armed first. None:
    the plan this process has armed already (a harness rank's, or ``fault_launch``'s),
    kept as it is, its counts too; where none is, the one in ``TUTORIAL_IMPL_FAULTS``
    (checked against the world). A harness rank has no such variable: re-arming from it
    there dropped the harness's plan."""
    import torch.distributed as dist

    if plan is not None:
        inject.arm(plan, rank, world_size)
    elif not inject.INJECTOR.plan:
        inject.arm_from_env(rank, world_size)
    register()
    kwargs.setdefault("init_method", "env://")
    dist.init_process_group(BACKEND, rank=rank, world_size=world_size, **kwargs)


def _create(options: Any, pg_options: Any) -> Any:
    """The backend's creator (torch's extended form: the options name the group)."""
    return group_class()(options)


def _sockets() -> dict[int, str]:
    """This process's socket fds, each with its ``socket:[inode]``."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile (or the listing's own fd)
        if link.startswith("socket:"):
            found[int(name)] = link
    return found


def _closed(names: tuple[str, str] | None) -> None:
    """A collective of a group whose sockets this rank's ``Close`` shut: it fails here, as
    gloo's would ("Connection closed by peer"), at once. Handed to gloo, the closing rank's
    own collective could wait out the group's timeout (under load, once in a run)."""
    import torch.distributed as dist

    name = f"group {names[0]}" if names else "its group"
    raise dist.DistBackendError(
        f"Connection closed by peer: an injected Close on this rank shut the sockets of {name} "
        "(every later collective of the group fails: docs/inject.md)"
    )


def _intercept(method: str, op: str) -> Callable[..., Any]:
    """``method`` of the faulty group: count the point (a fault fires here), then the plain
    group's ``method`` (see the module's doc)."""
    p2p = op in P2P

    def intercept(self: Any, *args: Any, **kwargs: Any) -> Any:
        self._reached(op, p2p)
        if self._born != inject.INJECTOR.closes:
            _closed(self._names)
        return getattr(self._plain, method)(*args, **kwargs)

    intercept.__name__ = intercept.__qualname__ = method
    return intercept


@functools.cache
def group_class() -> type:
    """``FaultyGroup``, built on first use (it subclasses torch's ``ProcessGroup``)."""
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import ProcessGroupGloo

    gloo_type = dist.ProcessGroup.BackendType.GLOO

    class FaultyGroup(dist.ProcessGroup):
        """A gloo group whose collectives pass ``inject.INJECTOR`` first."""

        def __init__(self, options: Any) -> None:
            super().__init__(options.group_rank, options.group_size)
            before = _sockets()
            gloo = ProcessGroupGloo(
                options.store, options.group_rank, options.group_size, timeout=options.timeout
            )
            # Its sockets: what it opened (for ``inject.Close``; the store's are older).
            inject.INJECTOR.sockets.extend(sorted(_sockets().items() - before.items()))
            gloo.options.global_ranks_in_group = options.global_ranks_in_group
            gloo.options.group_name = options.group_id
            gloo._set_sequence_number_for_group()
            cpu = torch.device("cpu")
            self._plain = dist.ProcessGroup(options.group_rank, options.group_size)
            for group in (self, self._plain):
                group._set_default_backend(gloo_type)
                group._register_backend(cpu, gloo_type, gloo)
            self._seq = [0, 0]  # collectives, point-to-point: counted apart, as torch does
            self._base = (0, 0, 0)  # (injector epoch, seq, p2p seq) at the last arming
            self._names: tuple[str, str] | None = None
            self._born = inject.INJECTOR.closes  # a later Close shuts this group
            self._lock = threading.Lock()

        def getBackendName(self) -> str:  # noqa: N802 - the trampoline's name
            return BACKEND

        def _reached(self, op: str, p2p: bool) -> None:
            if self._names is None:  # set by torch once the group is made; fixed since
                self._names = (self.group_name, self.group_desc)
            with self._lock:
                self._seq[p2p] += 1
                epoch = inject.INJECTOR.epoch
                if self._base[0] != epoch:  # armed again since: a new test counts from 1
                    self._base = (epoch, self._seq[0] - (not p2p), self._seq[1] - p2p)
                seq = self._seq[p2p] - self._base[1 + p2p]
            name, desc = self._names
            inject.INJECTOR.reached(Point(op, seq, name, desc))

    for method, op in METHODS.items():
        setattr(FaultyGroup, method, _intercept(method, op))
    return FaultyGroup
