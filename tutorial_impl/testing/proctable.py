"""Checking for leftover processes through the OS process table, not the harness.

A test that wants to prove "no rank outlived me" must not ask the harness, which could be
wrong about its own children. Instead each process writes down its pid *and* its kernel start
time (``/proc/<pid>/stat`` field 22) while it runs; afterwards the test asks the kernel whether
a process with that pid and that start time still exists. The start time guards against the
pid having been reused by an unrelated process in between.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # fields[0] is the state (field 3 of the file); a zombie has exited, it is only unreaped.
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]  # field 22: start time in clock ticks since boot


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie has: it is only unreaped)."""
    return _start_time(pid) is not None


def record_self(directory: str | os.PathLike[str], name: str) -> None:
    """Write ``<directory>/<name>.pid`` holding this process's pid and start time."""
    record(directory, name, os.getpid())


def record(directory: str | os.PathLike[str], name: str, pid: int) -> None:
    """Write ``<directory>/<name>.pid`` for ``pid`` (a child this process started, say)."""
    start = _start_time(pid)
    # Written aside, then renamed: a process polling the directory (a peer watching this
    # one) never reads a half-written record.
    tmp = Path(directory, f".{name}.pid.{os.getpid()}")
    tmp.write_text(f"{pid} {start}\n")
    os.replace(tmp, Path(directory, f"{name}.pid"))


def recorded(directory: str | os.PathLike[str]) -> dict[str, tuple[int, str]]:
    """Every ``*.pid`` record in ``directory``: name -> (pid, start time)."""
    out = {}
    for path in Path(directory).glob("*.pid"):
        pid, start = path.read_text().split()
        out[path.stem] = (int(pid), start)
    return out


def alive(directory: str | os.PathLike[str]) -> dict[str, int]:
    """The recorded processes that still exist (same pid, same start time, not a zombie)."""
    return {
        name: pid for name, (pid, start) in recorded(directory).items() if _start_time(pid) == start
    }


def wait_until_gone(directory: str | os.PathLike[str], timeout: float = 5.0) -> dict[str, int]:
    """Poll until no recorded process is alive or ``timeout`` passes; return the survivors."""
    deadline = time.monotonic() + timeout
    while True:
        left = alive(directory)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def _live_stats() -> Iterator[tuple[int, list[str]]]:
    """(pid, the fields of /proc/<pid>/stat after the command name) of every live process:
    field 3 of the file is fields[0] here (the state), the parent pid fields[1]."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        if fields[0] not in ("Z", "X"):
            yield int(entry), fields


def session_members(sid: int) -> list[int]:
    """Every live process of session ``sid``: a command started with ``start_new_session``
    and everything it started, unless something left the session on purpose."""
    return [pid for pid, fields in _live_stats() if int(fields[3]) == sid]  # field 6: session


def children(parent: int) -> list[int]:
    """The live child processes of ``parent``."""
    return [pid for pid, fields in _live_stats() if int(fields[1]) == parent]


def parent(pid: int) -> int | None:
    """Process ``pid``'s parent pid, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def own_children() -> list[int]:
    """This process's live children. Cheap in the common case, none at all: one system call
    (``waitid`` without waiting or reaping); else its tasks' ``children`` lists, or, on a
    kernel without them, a scan of every process."""
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return []
    return [pid for pid in _children_of(os.getpid()) if running(pid)]


def _children_of(parent: int) -> list[int]:
    """The children of ``parent`` (zombies too), from its tasks' ``children`` lists, or, on a
    kernel without them, a scan of every process (live ones only).

    A child belongs to the thread that started it; when that thread exits, the kernel hands
    its children to another thread of the process. Read while that happens, a child can
    be in neither list (the thread read first got it later, the one read later is gone):
    so the lists are read again until the threads were the same before and after."""
    try:
        tasks = os.listdir(f"/proc/{parent}/task")
    except OSError:
        return []  # gone
    while True:
        found, listed = set(), False
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    found.update(int(pid) for pid in f.read().split())
                listed = True
            except OSError:
                pass
        try:
            after = os.listdir(f"/proc/{parent}/task")
        except OSError:
            return []
        if after == tasks:
            return sorted(found) if listed else children(parent)
        tasks = after


def live_children(parent: int) -> list[int]:
    """The live children of ``parent``, from its tasks' ``children`` lists (no scan of every
    process, as ``children`` makes, where the kernel has them)."""
    return [pid for pid in _children_of(parent) if running(pid)]


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``, parents before their children: what it started,
    whatever session or process group each moved to (an exited process's own children have
    been handed to a subreaper or init already)."""
    found, todo = [], [pid]
    while todo:
        for child in _children_of(todo.pop(0)):
            if running(child):
                found.append(child)
                todo.append(child)
    return found


def command(pid: int, limit: int = 200) -> str:
    """Process ``pid``'s command line as one string (cut at ``limit`` characters), or its name
    in brackets when it has none to show (a process in the middle of an ``execve``)."""
    line = (_cmdline(pid) or b"").replace(b"\0", b" ").decode(errors="replace").strip()
    if not line:
        try:
            with open(f"/proc/{pid}/stat") as f:
                text = f.read()
            line = "[" + text[text.index("(") + 1 : text.rindex(")")] + "]"
        except (OSError, ValueError):
            line = "[gone]"
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _cmdline(pid: int) -> bytes | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return None


def wait_for_forked_copies(grace: float) -> None:
    """Wait, ``grace`` s at most, until no live child of this process is a copy of it (forked,
    not exec'd: the same command line): a child that came back from a rank function reports
    before the rank itself does, so its report cannot be overtaken."""
    me = _cmdline(os.getpid())
    stop = time.monotonic() + grace
    while any(_cmdline(pid) == me for pid in own_children()) and time.monotonic() < stop:
        time.sleep(0.01)


# A process in the middle of ``execve`` shows an empty environment: the kernel publishes the
# new one (``/proc/<pid>/stat`` field 51, env_end, leaves 0) only once the new program's stack
# is built, and that comes *after* the close-on-exec descriptors are closed, which is what
# ``subprocess.Popen`` waits for. So a child Popen has just returned is, most often, still
# there: read at once, 3 in 4 environments were empty here, and ``marked`` run right after a
# command started its last child missed it 5 times in 300 beside four busy processes.
EXEC_GRACE = 1.0  # seconds an execve in progress may take to publish its environment
_PF_KTHREAD = 0x00200000  # a kernel thread: no environment ever (stat field 9, the flags)


def _exec_in_progress(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    if fields[0] in ("Z", "X") or int(fields[6]) & _PF_KTHREAD or len(fields) < 49:
        return False
    return fields[48] == "0"  # field 51: the end of the environment, not yet set


def _environ(pid: int) -> bytes:
    """The environment block ``pid`` started with, waiting out an ``execve`` in progress
    (``EXEC_GRACE`` at most). Raises ``OSError`` for a process gone or not ours to read."""
    deadline = time.monotonic() + EXEC_GRACE
    while True:
        with open(f"/proc/{pid}/environ", "rb") as f:
            data = f.read()
        if data:
            return data
        if not _exec_in_progress(pid):  # empty for good, or published since the read
            with open(f"/proc/{pid}/environ", "rb") as f:
                return f.read()
        if time.monotonic() >= deadline:
            return data
        time.sleep(0.001)


def marked(name: str, value: str) -> list[tuple[int, str]]:
    """(pid, command line) of every live process whose environment holds ``name=value``.

    Sessions are not enough to find what a command left behind: torchrun starts each worker
    in a session of its own, so a worker orphaned by its agent is invisible to a session
    check. The environment is inherited by every descendant, whatever session or process
    group it moved to, so a mark put in a command's environment finds them all, also one
    still in the middle of its ``execve`` (``_environ``).
    """
    needle = f"{name}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if needle not in _environ(int(entry)).split(b"\0"):
                continue
            if _start_time(int(entry)) is None:
                continue  # dead, only not yet reaped
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                found.append((int(entry), f.read().replace(b"\0", b" ").decode(errors="replace")))
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return found


def kill_marked(name: str, value: str) -> None:
    """SIGKILL every live process that carries the mark ``name=value`` (see ``marked``)."""
    for pid, _ in marked(name, value):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_until_unmarked(name: str, value: str, timeout: float = 5.0) -> list[tuple[int, str]]:
    """Poll until no process carries the mark or ``timeout`` passes; return the survivors."""
    deadline = time.monotonic() + timeout
    while True:
        left = marked(name, value)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)
