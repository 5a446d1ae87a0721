"""Debugging one rank: its ``breakpoint()`` and its post-mortem, at your terminal.

A rank is a forked process whose stdin is not your terminal and whose output goes to a log
file, so ``pdb`` inside it has nobody to talk to. Name one rank to debug (``pytest
--rank-pdb 1``, or ``run_ranks(fn, debug_rank=1)``) and in that rank:

* ``breakpoint()`` opens a pdb that listens on a local TCP port instead of the terminal;
* an exception that would fail the run first opens a post-mortem pdb there.

In every other rank ``breakpoint()`` raises an error that says so (a plain pdb there would wait,
unseen, for a terminal it does not have), unless ``PYTHONBREAKPOINT=0`` turns it off.

The rank announces the port on the terminal (``/dev/tty``, when there is one), in its log and
in the file ``rank<N>.debugging`` of the run's log directory, which the parent watches and
announces too (under pytest on its terminal, capture or not), and waits, for the run's deadline
at most (``ATTACH_WINDOW`` at least): nobody attached by then, the rank's breakpoint raises an
error that says so. Attach
with::

    python -m tutorial_impl.testing.attach PORT

and debug as usual (``p``, ``n``, ``s``, ``bt``...). Meanwhile nothing kills the run: the other
ranks are held where they wait (their process group's own timeout is lifted for the run), and
the harness deadline is paused for as long as the debugged rank has a debugger (the
``rank<N>.debugging`` file exists: see ``Deadline``). ``c`` lets the rank go on and the run end
as it would have, and so does Ctrl-D in ``attach`` (after whatever commands were typed
before it: a later stop of that rank waits for a new ``attach``); ``q`` ends the rank with
``bdb.BdbQuit``, which fails the test, and the harness kills every rank as always. Limits:
one rank per run; the deadline stays paused until that rank ends once its debugger has
started (so a rank that hangs *after* ``c`` waits for pytest-timeout, if any, or Ctrl-C);
pytest-timeout keeps counting (run with ``--timeout 0``).
"""

from __future__ import annotations

import contextlib
import os
import pdb
import socket
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tutorial_impl.testing.rank.outcome import skip_kind

# The rank to debug, as the ranks see it: set by run_ranks(debug_rank=N) and --rank-pdb N.
ENV = "TUTORIAL_IMPL_RANK_PDB"
# A process-group timeout that holds the other ranks while one is debugged (a day).
HOLD = 24 * 3600.0
ATTACH = "python -m tutorial_impl.testing.attach"
ATTACH_WINDOW = 2.0  # seconds a debugger waits to be attached to, at least (else: deadline)


def debug_rank() -> int | None:
    """The rank this run debugs, read from the environment (inside a rank)."""
    value = os.environ.get(ENV)
    return int(value) if value not in (None, "") else None


class RemotePdb(pdb.Pdb):
    """A pdb whose terminal is a TCP connection from ``attach``, accepted on 127.0.0.1."""

    def __init__(self, rank: int, marker: str, attach_within: float) -> None:
        marker_file = Path(marker)
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        message = f"rank {rank} waits for a debugger: {ATTACH} {port}"
        marker_file.write_text(f"{port}\n")  # from now on the harness deadline is paused
        _announce(message)
        listener.settimeout(attach_within)
        try:
            connection, _ = listener.accept()
        except TimeoutError:
            marker_file.unlink(missing_ok=True)  # the deadline counts again
            raise RuntimeError(
                f"rank {rank}: nobody attached to its debugger (port {port}) within "
                f"{attach_within:g} s"
            ) from None
        finally:
            listener.close()
        connection.settimeout(None)
        self._connection = connection
        self._io = connection.makefile("rw", buffering=1, encoding="utf-8", errors="replace")
        super().__init__(stdin=self._io, stdout=self._io)
        self.use_rawinput = False  # read commands from the socket, not from input()
        self.prompt = f"(rank {rank} Pdb) "
        self.rank = rank
        self.detached = False  # attach closed its end (Ctrl-D): a later stop waits anew

    def do_EOF(self, arg: str) -> bool | None:
        """Attach's end closed (Ctrl-D, or the terminal went away): the rank goes on, as
        ``c`` would, rather than pdb's quit (``bdb.BdbQuit`` would fail the test)."""
        self.message(f"the debugger detached: rank {self.rank} goes on")
        self.detached = True
        with contextlib.suppress(OSError):
            self._io.close()
            self._connection.close()  # attach, draining our output, then sees the end
        return self.do_continue(arg)


def _announce(message: str) -> None:
    """Say where to attach: on stderr (the rank's log) and on the terminal, if any."""
    print(message, file=sys.stderr, flush=True)
    try:
        with open("/dev/tty", "w") as tty:
            tty.write(f"\n{message}\n")
    except OSError:
        pass  # no controlling terminal (CI, a pytester run): the log and the file remain


class Debugging:
    """What a rank does about debugging: nothing, unless it is the debugged rank."""

    def __init__(self, rank: int, marker: str, attach_within: float) -> None:
        self.rank = rank
        self.attach_within = max(attach_within, ATTACH_WINDOW)
        self.marker = marker  # ``RankFiles.debugging``
        self.active = debug_rank() == rank
        self._pdb: RemotePdb | None = None
        # Any other rank has no terminal: its stdin is pytest's, its output a log file, so a
        # plain pdb would wait unseen until the deadline. It fails at once, saying what to do.
        sys.breakpointhook = self.breakpoint if self.active else self.no_terminal

    def _debugger(self) -> RemotePdb:
        if self._pdb is None or self._pdb.detached:
            self._pdb = RemotePdb(self.rank, self.marker, self.attach_within)
        return self._pdb

    def breakpoint(self, *args: Any, **kwargs: Any) -> None:
        self._debugger().set_trace(sys._getframe(1))

    def no_terminal(self, *args: Any, **kwargs: Any) -> None:
        if os.environ.get("PYTHONBREAKPOINT") == "0":
            return  # breakpoints switched off, as Python's own hook would have them
        raise RuntimeError(
            f"breakpoint() in rank {self.rank}, which has no terminal: rerun with "
            f"--rank-pdb {self.rank} (pytest) or run_ranks(..., debug_rank={self.rank}) and "
            "attach to the port it prints with python -m tutorial_impl.testing.attach PORT"
        )

    def post_mortem(self, exc: BaseException) -> None:
        """Open the post-mortem debugger on ``exc`` (not for skips or a quit debugger)."""
        if not self.active or type(exc).__name__ == "BdbQuit" or skip_kind(exc) is not None:
            return
        debugger = self._debugger()
        debugger.message("".join(traceback.format_exception(exc)).rstrip())
        debugger.reset()
        debugger.interaction(None, exc.__traceback__)


def forget(log_dir: str | os.PathLike[str]) -> None:
    """Remove the debugger files an earlier run left in ``log_dir`` (before ranks start)."""
    for marker in Path(log_dir).glob("rank*.debugging"):
        marker.unlink(missing_ok=True)


# Trace functions that mean "a person is stepping through this process" (pytest-timeout
# looks for the same): pdb and its base bdb, and PyCharm's/VS Code's pydevd.
DEBUGGER_MODULES = ("bdb", "pdb", "pydevd", "_pydevd_bundle", "pydevd_frame_evaluator")


def parent_in_debugger() -> bool:
    """True while this process runs under a debugger's trace function (pdb's ``s``/``n``
    through ``run_ranks``, an IDE's debugger): its deadline must not count that time."""
    trace = sys.gettrace()
    module = getattr(trace, "__module__", None) or ""
    return trace is not None and module.split(".")[0] in DEBUGGER_MODULES


class Deadline:
    """A run's deadline that stands still while someone is debugging.

    ``remaining()`` is what is left of ``timeout`` seconds, not counting the time during
    which a ``rank<N>.debugging`` file exists in ``log_dir`` (a rank has a debugger) or the
    parent itself runs under a debugger (``parent_in_debugger``); meanwhile it answers a
    short poll interval, so the caller's wait comes back to look again.
    """

    POLL = 0.5

    def __init__(
        self,
        timeout: float,
        log_dir: str | os.PathLike[str],
        announce: Callable[[str], None] | None = None,
    ) -> None:
        self.end = time.monotonic() + timeout
        self.log_dir = Path(log_dir)
        self.announce = announce  # says where to attach, once per debugger that waits
        self.announced: set[str] = set()
        self.poll = self.POLL if announce is not None else None  # how often to look

    def debugging(self) -> bool:
        return any(self.log_dir.glob("rank*.debugging"))

    def remaining(self) -> float:
        if self.announce is not None:
            for marker in self.log_dir.glob("rank*.debugging"):
                try:
                    port = marker.read_text().strip()
                except FileNotFoundError:  # its window ended between the glob and the read
                    continue
                if port and port not in self.announced:
                    self.announced.add(port)
                    rank = marker.name[len("rank") : -len(".debugging")]
                    self.announce(f"rank {rank} waits for a debugger: {ATTACH} {port}")
        left = self.end - time.monotonic()
        if left <= self.POLL and (self.debugging() or parent_in_debugger()):
            self.end = time.monotonic() + self.POLL * 2  # paused: push the end on
            return self.POLL
        return left


def check_rank(debug_rank: int | None, world_size: int) -> dict[str, str]:
    """The ranks' environment for ``run_ranks(debug_rank=...)``; a ValueError if it is no
    rank of this world."""
    if debug_rank is None:
        return {}
    if type(debug_rank) is not int or not 0 <= debug_rank < world_size:
        raise ValueError(
            f"debug_rank must be a rank of this world (0 to {world_size - 1}), got {debug_rank!r}"
        )
    return {ENV: str(debug_rank)}
