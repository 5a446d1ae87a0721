"""A rank forkserver not yet started, for an in-process pytest session that must start its own
as a new pytest process would (used by the isolation and early-forkserver tests).

``swapped(monkeypatch)`` puts a fresh ``RankServer`` in place of this process's (which stays
untouched) and, afterwards, stops it as that process's exit would (its "alive" pipe closed),
and multiprocessing's global forkserver too if the session started it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from multiprocessing import forkserver as mp_forkserver

import pytest

from tutorial_impl.testing.forkserver import server as forkserver


@contextlib.contextmanager
def swapped(monkeypatch: pytest.MonkeyPatch) -> Iterator[forkserver.RankServer]:
    server = forkserver.RankServer()
    monkeypatch.setattr(forkserver, "SERVER", server)
    global_running = mp_forkserver._forkserver._forkserver_pid is not None
    try:
        yield server
    finally:
        if server.server is not None:
            server.server._stop()
        if not global_running:
            mp_forkserver._forkserver._stop()
