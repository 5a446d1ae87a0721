"""Debugging one rank through a socket, as a user at ``attach`` would.

``run_ranks(fn, debug_rank=1)`` (``pytest --rank-pdb 1``) gives rank 1's ``breakpoint()`` and
post-mortem a pdb on a local port; the user attaches with ``python -m
tutorial_impl.testing.attach PORT``. Here a script plays the user: it starts the real
``attach`` command, types pdb commands into it and reads what comes back. The deadlines
are one second, and the script waits longer than that at the prompt: the run survives only
if the harness deadline stood still and the other rank was held meanwhile.
"""

from __future__ import annotations

import bdb
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tutorial_impl.testing import RankFailed, run_ranks
from tutorial_impl.testing.rank import debugging

pytest_plugins = ["pytester"]

DEADLINE = 1.0  # seconds: shorter than the user's pause at the prompt below


def stops_at_a_breakpoint(rank, world_size):
    x = 10 * (rank + 1)
    if rank == 1:
        breakpoint()  # noqa: T100 - the point of the test
    t = torch.tensor([float(x)])
    dist.all_reduce(t)  # rank 0 is held here while rank 1 is being debugged
    return t.item()


def fails_on_rank_one(rank, world_size):
    secret = 42 + rank
    if rank == 1:
        raise ValueError("boom on rank one")
    return secret


class User:
    """``python -m tutorial_impl.testing.attach PORT`` with a script at the keyboard."""

    def __init__(self, log_dir: Path, rank: int) -> None:
        marker = log_dir / f"rank{rank}.debugging"
        give_up = time.monotonic() + 60
        while not marker.exists() or not marker.read_text().strip():
            assert time.monotonic() < give_up, "the rank never offered a debugger"
            time.sleep(0.02)
        port = marker.read_text().strip()
        self.attach = subprocess.Popen(
            [sys.executable, "-m", "tutorial_impl.testing.attach", port],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self.seen = ""

    def until(self, text: str) -> str:
        """Read what pdb writes until ``text`` appears; return it."""
        give_up = time.monotonic() + 60
        fd = self.attach.stdout.fileno()
        while text not in self.seen:
            assert time.monotonic() < give_up, f"no {text!r} in {self.seen!r}"
            if select.select([fd], [], [], 0.5)[0]:
                chunk = os.read(fd, 4096).decode()
                assert chunk, f"attach ended before {text!r}: {self.seen!r}"
                self.seen += chunk
        before, _, self.seen = self.seen.partition(text)
        return before

    def type(self, line: str) -> None:
        self.attach.stdin.write(line.encode() + b"\n")
        self.attach.stdin.flush()


def debug_session(log_dir: Path, script) -> threading.Thread:
    """Run ``script(user)`` in a thread while the ranks run; its failures are kept."""

    def play() -> None:
        user = User(log_dir, rank=1)
        try:
            script(user)
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            session.error = exc
        finally:
            user.attach.stdin.close()
            user.attach.wait(timeout=60)

    session = threading.Thread(target=play, daemon=True)
    session.error = None
    session.start()
    return session


def test_a_breakpoint_in_one_rank_reaches_the_user_and_the_run_goes_on(tmp_path):
    prompt = "(rank 1 Pdb) "
    transcript = []

    def user_script(user: User) -> None:
        transcript.append(user.until(prompt))  # stopped at the breakpoint
        time.sleep(DEADLINE * 1.5)  # the user thinks: the deadline must not fire meanwhile
        user.type("p x")
        transcript.append(user.until(prompt))
        user.type("c")

    session = debug_session(tmp_path, user_script)
    results = run_ranks(stops_at_a_breakpoint, timeout=DEADLINE, debug_rank=1, log_dir=tmp_path)
    session.join(60)
    assert session.error is None
    assert results == [30.0, 30.0]  # both ranks finished their all_reduce after "c"
    assert "stops_at_a_breakpoint" in transcript[0]  # pdb shows where rank 1 stopped
    assert transcript[1].strip() == "20"  # rank 1's own x


def test_ctrl_d_after_a_command_runs_it_and_lets_the_rank_go_on(tmp_path):
    """A command typed, then Ctrl-D at once (attach's stdin ends): the command's answer is
    shown, the rank goes on as ``c`` would, and the run passes (not ``bdb.BdbQuit``)."""
    shown = []

    def user_script(user: User) -> None:
        user.until("(rank 1 Pdb) ")
        user.type("p x")
        user.attach.stdin.close()  # Ctrl-D, before pdb has answered
        shown.append(user.attach.stdout.read().decode())  # attach ends when the rank lets go

    session = debug_session(tmp_path, user_script)
    results = run_ranks(stops_at_a_breakpoint, timeout=DEADLINE, debug_rank=1, log_dir=tmp_path)
    session.join(60)
    assert session.error is None
    assert results == [30.0, 30.0]
    assert "20\n" in shown[0] and "rank 1 goes on" in shown[0], shown


def test_a_failing_rank_opens_a_post_mortem_and_quitting_ends_the_run(tmp_path):
    prompt = "(rank 1 Pdb) "
    transcript = []

    def user_script(user: User) -> None:
        transcript.append(user.until(prompt))
        user.type("p secret")
        transcript.append(user.until(prompt))
        user.type("q")

    session = debug_session(tmp_path, user_script)
    with pytest.raises(RankFailed, match="boom on rank one"):
        run_ranks(fails_on_rank_one, timeout=DEADLINE, debug_rank=1, log_dir=tmp_path)
    session.join(60)
    assert session.error is None
    assert "ValueError: boom on rank one" in transcript[0]
    assert transcript[1].strip() == "43"


def test_a_breakpoint_in_a_rank_nobody_debugs_fails_at_once_saying_what_to_do():
    """Without debug_rank, rank 1's pdb would wait unseen for a terminal until the deadline."""
    with pytest.raises(RankFailed, match="rerun with --rank-pdb 1"):
        run_ranks(stops_at_a_breakpoint, timeout=60)


@pytest.mark.parametrize("bad", [2, -1, "1", True])
def test_debug_rank_must_be_a_rank_of_the_world(bad):
    with pytest.raises(ValueError, match="debug_rank"):
        run_ranks(stops_at_a_breakpoint, debug_rank=bad)


# --rank-pdb N, as a stranger's project meets it: it reaches every run_ranks call.
OPTION_TESTS = """
import os


def debugged(rank, world_size):
    return os.environ.get("TUTORIAL_IMPL_RANK_PDB")


def test_the_option_names_the_rank(run_ranks):
    assert run_ranks(debugged) == ["1", "1"]


def stops(rank, world_size):
    if rank == 1:
        breakpoint()
    return rank


@pytest.mark.rank_timeout(1)
def test_nobody_attaches(run_ranks):
    run_ranks(stops)
"""


def test_rank_pdb_option_reaches_the_ranks_and_refuses_a_rank_outside_the_world(pytester):
    """Without a terminal (here: pytester, output captured) the port is still shown on
    pytest's own terminal, and a debugger nobody attaches to gives up at the deadline."""
    pytester.makepyfile("import pytest\n" + OPTION_TESTS)
    start = time.monotonic()
    ok = pytester.runpytest("-p", "no:cacheprovider", "--rank-pdb", "1")
    ok.assert_outcomes(passed=1, failed=1)
    ok.stdout.fnmatch_lines(
        [
            "rank 1 waits for a debugger: python -m tutorial_impl.testing.attach *",
            "*rank 1 raised RuntimeError: rank 1: nobody attached to its debugger (port *) "
            f"within {debugging.ATTACH_WINDOW:g} s*",
        ]
    )
    assert time.monotonic() - start < debugging.ATTACH_WINDOW + 20  # not a day (HOLD)
    outside = pytester.runpytest("-p", "no:cacheprovider", "--rank-pdb", "2")
    outside.assert_outcomes(failed=2)
    outside.stdout.fnmatch_lines(["*debug_rank must be a rank of this world (0 to 1), got 2*"])


def test_a_debugger_window_that_ends_as_the_parent_looks_is_no_error(tmp_path):
    """A rank removes its marker when nobody attached in time; the parent may have listed it
    a moment before (seen under load: the parent's FileNotFoundError failed the run)."""
    said: list[str] = []
    deadline = debugging.Deadline(10, tmp_path, said.append)
    (tmp_path / "rank1.debugging").symlink_to(tmp_path / "gone")  # listed, gone when read
    assert deadline.remaining() > 0 and said == []


def test_the_deadline_stands_still_while_the_parent_is_in_a_debugger(tmp_path, monkeypatch):
    """As pytest-timeout does: pdb's trace function in this process pauses the deadline."""
    deadline = debugging.Deadline(0.05, tmp_path)
    time.sleep(0.1)
    assert deadline.remaining() < 0  # nobody debugging: expired
    monkeypatch.setattr(sys, "gettrace", lambda: bdb.Bdb().trace_dispatch)
    assert debugging.parent_in_debugger()
    assert deadline.remaining() == debugging.Deadline.POLL  # paused, and asked again soon
    monkeypatch.undo()
    time.sleep(debugging.Deadline.POLL * 2.5)
    assert deadline.remaining() < 0  # the pause ends with the debugging
