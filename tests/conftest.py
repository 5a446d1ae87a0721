"""Work done once per test session, even when pytest-xdist splits a module over workers.

Under ``pytest -n auto`` xdist hands tests out one at a time, so the tests of one module land
on several workers, and a module-scoped fixture runs once on each (seen: three of eight RPC
worlds twice in one ``-n 2`` run, about a second each). ``once_per_session.run(name, make)``
calls ``make()`` at most once per session: the first worker that needs it runs it and leaves
the pickled result in the directory every worker of the session shares (xdist's own recipe
for session-wide fixtures); a worker that needs it meanwhile waits for that, with a
deadline. Used by the RPC lessons (``tests/rpc/conftest.py``: one world each), the hybrid
lesson's probing worlds (``tests/rpc/test_hybrid_parity.py``) and the pictures
(``tests/test_pictures.py``: one run of the command).
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


class OncePerSession:
    """Runs each named piece of work once per session and hands out its result."""

    def __init__(self, root: Path, shared: bool) -> None:
        self.root = root  # shared by every worker of this session when ``shared``
        self.shared = shared

    def directory(self, name: str) -> Path:
        """A directory of this session that every worker sees (for pid records, say)."""
        path = self.root / name
        path.mkdir(exist_ok=True)
        return path

    def run(self, name: str, make: Callable[[], Any], timeout: float) -> Any:
        """``make()``, or the result of the call another worker made; ``timeout``: how long
        to wait for another worker's call to finish."""
        if not self.shared:
            return make()
        results = self.root / f"{name}.pickle"
        with open(self.root / f"{name}.lock", "w") as lock:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"no result of {name} from another worker") from None
                    time.sleep(0.02)
            if results.exists():
                return pickle.loads(results.read_bytes())
            value = make()
            results.write_bytes(pickle.dumps(value))
            return value


@pytest.fixture(scope="session")
def once_per_session(tmp_path_factory: pytest.TempPathFactory) -> OncePerSession:
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return OncePerSession(tmp_path_factory.mktemp("once"), shared=False)
    root = tmp_path_factory.getbasetemp().parent / "once"  # the session's, not gwN's
    root.mkdir(exist_ok=True)
    return OncePerSession(root, shared=True)
