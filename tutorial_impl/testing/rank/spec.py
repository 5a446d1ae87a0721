"""What one rank is given: its ``RankSpec`` (sent by pickle, the function by name) and where
its files are (``RankFiles``), the same paths for the parent and the rank. ``call.rank_spec``
builds a spec from a ``Call``; the rank (``rank.main``, ``strategies.warm.loop``) reads it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from tutorial_impl.testing.faults import plan
from tutorial_impl.testing.rank.caught import Filters
from tutorial_impl.testing.rank.lookup import FunctionRef
from tutorial_impl.testing.settings.config import (
    DEFAULT_BACKEND,
    DEFAULT_DEADLINE,
    DEFAULT_INIT_METHOD,
)


@dataclass(frozen=True)
class RankFiles:
    """Where one rank's files are, in its run's directory: the same paths for the parent
    (``supervise.Proc``) and the rank (``RankSpec``), named here only. As text: pathlib's
    objects cost every fresh rank ~0.3 ms of CPU to unpickle and join (copying pages)."""

    directory: str  # given as a str or a Path; kept as text
    rank: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "directory", os.fspath(self.directory))

    def _named(self, suffix: str) -> str:
        return os.path.join(self.directory, f"rank{self.rank}{suffix}")

    @property
    def log(self) -> str:
        """Everything the rank writes to fd 1 and 2."""
        return self._named(".log")

    @property
    def stacks(self) -> str:
        """``faulthandler``'s stacks: at a fatal signal, or asked by SIGUSR1
        (``diagnose.stacks``)."""
        return self._named(".stacks")

    @property
    def records(self) -> str:
        """Its flight-recorder dump when asked (``records``)."""
        return self._named(".fr")

    @property
    def fault(self) -> str:
        """Each fault that fires in it (``faults.read_fired``)."""
        return self._named(".fault")

    @property
    def debugging(self) -> str:
        """Present while its debugger waits (``debugging``)."""
        return self._named(".debugging")


@dataclass
class RankSpec:
    """Everything one rank needs, sent to it by pickle. The function travels *by name*."""

    rank: int
    world_size: int
    function: FunctionRef
    payload: bytes  # see Call.payload: unpickled inside the rank, errors reported
    env: dict[str, str]
    files: RankFiles
    backend: str | None = DEFAULT_BACKEND  # None: the function initialises what it needs
    init_method: str = DEFAULT_INIT_METHOD
    tmp_dir: str | None = None
    timeout: float = DEFAULT_DEADLINE
    # The parent's environment, import path and working directory at the call (the
    # forkserver's date from its start: a variable a test set since then, or the directory
    # of a test file pytest put on sys.path since then, would otherwise be missing).
    parent_env: dict[bytes, bytes] | None = None  # as os.environb: see rank.main
    parent_path: list[str] | None = None
    parent_cwd: str | None = None
    coverage: dict[str, Any] | None = None  # the parent's coverage settings, if measuring
    owner_pid: int | None = None  # the process that asked for the rank: it dies with it
    rank_params: int = 2  # how many of (rank, world_size) the function takes first
    # The rendezvous of the harness's own group, set only while it joins (``rendezvous``).
    harness_env: dict[str, str] = field(default_factory=dict)
    faults: plan.Plan = ()  # armed in the rank before its group is made
    warning_filters: Filters | None = None  # see Call.warning_filters
    # The forkserver that forked the rank (``forkserver.RankServer.address``): a nested
    # ``run_ranks`` in the rank takes its ranks from it too, as an xdist worker does.
    forkserver: dict[str, Any] | None = None
    start_method: str | None = None  # multiprocessing's default in the parent (None: unset)
