"""Imported once, inside the rank forkserver only (it is the first module of its preload).

Every child of a multiprocessing forkserver re-runs the parent's *main script* as
``__mp_main__`` before it runs its target, so that functions pickled from ``__main__`` can be
found. Ranks never need that (``ranks.function_ref`` refuses ``__main__`` functions), and it
costs or breaks things:

* under ``pytest`` (the ``bin/pytest`` script) every rank would import pytest again;
* a script that calls ``run_ranks`` at module level, without an ``if __name__ == "__main__"``
  guard, would call it again in every rank, and each rank would die during start-up.

So in this process, and in every rank forked from it, the two main-module fix-ups are
no-ops. Nothing else imports this module: the parent's own ``multiprocessing`` is untouched.
"""

from __future__ import annotations

from multiprocessing import spawn


def _no_main_fixup(_main: str) -> None:
    """Leave ``__main__`` alone: ranks find their function by module and name instead."""


spawn._fixup_main_from_name = _no_main_fixup  # type: ignore[attr-defined]
spawn._fixup_main_from_path = _no_main_fixup  # type: ignore[attr-defined]
