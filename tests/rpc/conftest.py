"""One RPC world per lesson, even when pytest-xdist splits a lesson's tests over workers.

Each ``test_rpc_*`` module runs its lesson once, in a module-scoped fixture, and its tests
read the report. ``rpc_worlds.run`` starts a world at most once per test session, through
``once_per_session`` (``tests/conftest.py``, which says how and why).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tutorial_impl.testing import run_ranks


class Worlds:
    """Runs each rank function's world once per session and hands out its results."""

    def __init__(self, once: Any) -> None:
        self.once = once

    def directory(self, name: str) -> Path:
        """A directory of this session that every worker sees (for pid records, say)."""
        return self.once.directory(name)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float, **options: Any) -> list:
        """``run_ranks(fn, *args, ...)``, or the results of the run another worker made."""
        name = f"{fn.__module__}.{fn.__qualname__}"
        return self.once.run(
            name,
            lambda: list(run_ranks(fn, *args, timeout=timeout, **options)),
            timeout + 30,  # the holder's run has its own deadline
        )


@pytest.fixture(scope="session")
def rpc_worlds(once_per_session: Any) -> Worlds:
    return Worlds(once_per_session)
