"""Checking for leftover processes through the OS process table, not the harness.

A test that wants to prove "no rank outlived me" must not ask the harness, which could be
wrong about its own children. Instead each process writes down its pid *and* its kernel start
time (``/proc/<pid>/stat`` field 22) while it runs; afterwards the test asks the kernel whether
a process with that pid and that start time still exists. The start time guards against the
pid having been reused by an unrelated process in between.
"""

from __future__ import annotations

import os
import time
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


def session_members(sid: int) -> list[int]:
    """Every live process of session ``sid``: a command started with ``start_new_session``
    and everything it started, unless something left the session on purpose."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        if fields[0] not in ("Z", "X") and int(fields[3]) == sid:  # field 6: session id
            members.append(int(entry))
    return members
