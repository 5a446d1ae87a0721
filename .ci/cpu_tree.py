"""The CPU time of a command and of every process it starts, however far they wander.

    python .ci/cpu_tree.py python -m pytest -p no:randomly tests/dist_tuto/test_09_elastic.py

``/usr/bin/time`` counts a child and the descendants each parent reaped, so it misses the
harness's ranks: their parent is the forkserver, which outlives pytest and is reaped by
nobody of the command. Machine-wide ``/proc/stat`` deltas count the other users of the
machine too. Here this process becomes a child subreaper (``PR_SET_CHILD_SUBREAPER``): every
descendant orphaned on the way (the forkserver, a torchrun worker) is re-parented to it, and
it reaps them all before reading ``getrusage(RUSAGE_CHILDREN)``. A process that exits
unreaped by its own parent is counted when this one reaps it. Prints one line on stderr and
exits with the command's status.
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def main(argv: list[str]) -> int:
    if not argv:
        raise SystemExit("usage: python .ci/cpu_tree.py COMMAND [ARGS...]")
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise SystemExit(f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(ctypes.get_errno())}")
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            os.execvp(argv[0], argv)
        finally:
            os._exit(127)
    code = 1
    while True:  # until no descendant is left: the command's and every orphan's
        try:
            reaped, status = os.wait()
        except ChildProcessError:
            break
        if reaped == pid:
            code = os.waitstatus_to_exitcode(status)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = usage.ru_utime + usage.ru_stime
    wall = time.monotonic() - start
    print(
        f"cpu_tree: {cpu:.2f} s of CPU (user {usage.ru_utime:.2f}, sys {usage.ru_stime:.2f}), "
        f"{wall:.1f} s of wall time, exit status {code}",
        file=sys.stderr,
    )
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
