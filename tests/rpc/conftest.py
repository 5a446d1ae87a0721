"""One RPC world per lesson, even when pytest-xdist splits a lesson's tests over workers.

Each ``test_rpc_*`` module runs its lesson once, in a module-scoped fixture, and its tests
read the report. Under ``pytest -n auto`` xdist hands tests out in chunks, so the tests of one
module can land on two workers, and each would start the same world again (seen: three of
eight worlds twice in one ``-n 2`` run, about a second each). ``rpc_worlds.run`` starts a
world at most once per test session: the first worker that needs it runs it and leaves the
pickled results in the directory every worker of the session shares (xdist's own recipe for
session-wide fixtures); a worker that needs it meanwhile waits for that, with a deadline.
"""

from __future__ import annotations

import fcntl
import os
import pickle
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tutorial_impl.testing import run_ranks


class Worlds:
    """Runs each rank function's world once per session and hands out its results."""

    def __init__(self, root: Path, shared: bool) -> None:
        self.root = root  # shared by every worker of this session when ``shared``
        self.shared = shared

    def directory(self, name: str) -> Path:
        """A directory of this session that every worker sees (for pid records, say)."""
        path = self.root / name
        path.mkdir(exist_ok=True)
        return path

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float, **options: Any) -> list:
        """``run_ranks(fn, *args, ...)``, or the results of the run another worker made."""
        if not self.shared:
            return list(run_ranks(fn, *args, timeout=timeout, **options))
        name = f"{fn.__module__}.{fn.__qualname__}"
        results = self.root / f"{name}.pickle"
        with open(self.root / f"{name}.lock", "w") as lock:
            deadline = time.monotonic() + timeout + 30  # the holder's run has its own deadline
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"no results of {name} from another worker") from None
                    time.sleep(0.02)
            if results.exists():
                return pickle.loads(results.read_bytes())
            values = list(run_ranks(fn, *args, timeout=timeout, **options))
            results.write_bytes(pickle.dumps(values))
            return values


@pytest.fixture(scope="session")
def rpc_worlds(tmp_path_factory: pytest.TempPathFactory) -> Worlds:
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return Worlds(tmp_path_factory.mktemp("rpc-worlds"), shared=False)
    root = tmp_path_factory.getbasetemp().parent / "rpc-worlds"  # the session's, not gwN's
    root.mkdir(exist_ok=True)
    return Worlds(root, shared=True)
