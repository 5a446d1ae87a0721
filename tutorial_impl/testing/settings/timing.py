"""Every deadline, grace and margin of the harness, and the one rule that orders them.

A multi-rank test can end in several clocks at once: the harness's deadline (its own,
``rank_timeout``), the process group's timeout (gloo or NCCL raise when a collective waits
longer), pytest-timeout (the backstop that kills the test), and, under torchrun, the
watchdog of a test phase and the waits on the job's store. Which one fires first decides
what the user reads: only the harness's deadline takes every rank's stacks *while the
ranks are still in their collective*, so it must come first. The rule, for every way of
starting ranks (forked, warm, under torchrun):

    harness deadline  <  process-group timeout = deadline + GROUP_GRACE
                      <  pytest-timeout >= deadline + BACKSTOP_MARGIN

``group_timeout`` is the one place the second line is computed; ``config.under_backstop``
and the plugin keep the third.
"""

from __future__ import annotations

import math
from datetime import timedelta

# --- the deadline -----------------------------------------------------------------------
DEFAULT_DEADLINE = 60.0  # seconds a run_ranks call may take before stacks are taken
# The process group's own timeout stays this far behind the deadline, so that at the
# deadline the ranks are still blocked in their collective, not raising gloo's timeout.
GROUP_GRACE = 10.0
# pytest-timeout must fire only after the harness has reported: kept this far above it.
BACKSTOP_MARGIN = 30.0

# The longest deadline a run may have: the parent's waits poll in milliseconds held in a C
# int (24.8 days; 1e9 s raised OverflowError there), and the process group's and the
# store's timeouts are this plus a grace. A week is far above any test, far below those.
MAX_DEADLINE = 7 * 24 * 3600.0
SECONDS = f"a positive number of seconds, at most {MAX_DEADLINE:.0f} (a week)"


def usable_seconds(value: object) -> bool:
    """Whether ``value`` is a deadline the harness can wait for (``SECONDS``): a finite
    number, not a bool, above 0 and at most ``MAX_DEADLINE``."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 < value <= MAX_DEADLINE
    )


# --- the parent's waits -----------------------------------------------------------------
# A rank that died is the cause of its peers' "Connection closed" errors, and the news of a
# death can come a moment after those errors: this long is waited for it.
CRASH_GRACE = 0.2
# After a rank skipped (or xfailed), how long the others may take to end by themselves: a
# failure anywhere beats a skip, so a skip is only the verdict once every rank has ended.
SKIP_GRACE = 5.0
# A rank whose function forked waits this long for those copies of itself to end before it
# reports: one that came back from the function reports first (a failure of the rank).
FORK_GRACE = 1.0
# Threads a rank function started (non-daemon) that still run when it returns are waited for
# this long before the rank reports: one that raises meanwhile fails the rank (``caught``).
THREAD_GRACE = 1.0
DUMP_BUDGET = 1.0  # seconds the parent may wait for the ranks' stack dumps, at most
STACK_POLL = 0.05  # how often the stack files are looked at while they are written

# --- warm worlds ------------------------------------------------------------------------
CHECK_DEADLINE = 2.0  # seconds the ranks have to prove a warm world is still good

# --- under torchrun -----------------------------------------------------------------------
ANSWER_GRACE = 10.0  # seconds past its own deadline a rank may take to publish its outcome
# After another rank failed: how long this rank's function may take to end by itself.
FINISH_GRACE = 0.2
STORE_POLL_MIN, STORE_POLL_MAX = 0.001, 0.02  # polling the job's store, growing while idle
HEARTBEAT = 0.5  # every worker marks itself alive in the job's store this often
# A worker whose mark is this old has exited (or is frozen): it is named, not waited for.
HEARTBEAT_LOST = 5.0
COLLECT_TIMEOUT = 300.0  # seconds the ranks wait for each other's collection
PHASE_GRACE = 1.0  # a test phase may run this long past its deadline before the watchdog
REPORT_MARGIN = 60.0  # a finished rank waits this long (past deadlines) for the slowest
GIVE_UP = 10.0  # after the others gave up on it, a stuck rank waits this long, then exits
STATUS_TIMEOUT = 30.0  # the ranks agree on the exit status within this
REPORT_WAIT = 60.0  # the other ranks wait at exit this long for rank 0's report
# After a SIGTERM a worker reports and exits within this (torchrun's agent kills at 30 s).
STOP_BUDGET = 20.0


def group_timeout(deadline: float) -> timedelta:
    """The process group's timeout for a run with this harness deadline (the rule above)."""
    return timedelta(seconds=deadline + GROUP_GRACE)
