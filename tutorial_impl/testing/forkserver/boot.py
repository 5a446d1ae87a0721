"""Imported once, inside the rank forkserver only (it is the first module of its preload).

Two things about multiprocessing's forkserver need changing for ranks, and nothing else
imports this module, so the parent's own ``multiprocessing`` stays untouched.

**The main script.** Every child of a forkserver re-runs the parent's main script as
``__mp_main__`` before its target, so that functions pickled from ``__main__`` can be found.
Ranks never need that (``ranks.function_ref`` refuses ``__main__`` functions), and it costs or
breaks things: under the ``pytest`` script every rank would import pytest again, and a script
that calls ``run_ranks`` without an ``if __name__ == "__main__"`` guard would call it again in
every rank. So here the two main-module fix-ups are no-ops.

**No collector passes during the preload.** The modules after this one (torch and what the
session adds) make hundreds of thousands of objects, and the collector walks them again and
again meanwhile: 704 collections and 0.8 s of CPU while importing torch, ``torch._dynamo``
and the RPC modules (counted by ``gc.callbacks``, 2 cores). It is off from here;
``forkserver.ready``, imported last, collects once, freezes the lot and turns it back on, so a
rank starts with the collector on, as a process does.

**Dying with the test run.** The forkserver exits when the process that owns it (pytest) is
gone, even after a SIGKILL: it sees EOF on its "alive" pipe. (That only works because ranks
close their inherited copy of that pipe: see ``ranks.release_forkserver``.) Ranks have asked
the kernel to SIGKILL them when the forkserver exits (``PR_SET_PDEATHSIG``), but that would
not reach the processes *they* started. So on its way out the forkserver kills the process
group of every rank it forked, which takes the ranks' children with them.
"""

from __future__ import annotations

import atexit
import gc
import os
import signal
from multiprocessing import spawn

from tutorial_impl.testing import proctable

_SERVER_PID = os.getpid()


def _no_main_fixup(_main: str) -> None:
    """Leave ``__main__`` alone: ranks find their function by module and name instead."""


gc.disable()  # until ``forkserver.ready``: see above

spawn._fixup_main_from_name = _no_main_fixup  # type: ignore[attr-defined]
spawn._fixup_main_from_path = _no_main_fixup  # type: ignore[attr-defined]


@atexit.register
def _kill_rank_groups() -> None:
    """Kill every rank still alive, with its process group (the rank leads its own)."""
    if os.getpid() != _SERVER_PID or not os.path.isdir("/proc"):
        return  # a rank's own forked child inherits this hook; it must do nothing
    for pid in proctable.children(_SERVER_PID):
        for kill, target in ((os.killpg, pid), (os.kill, pid)):
            try:
                kill(target, signal.SIGKILL)
            except OSError:
                pass
