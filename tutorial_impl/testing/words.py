"""Every sentence of a report's first line, written once: the verdict's words.

A failure's first line is its cause (``rank 1 raised ValueError: boom``, ``rank 1 was killed
by signal SIGKILL``, ``rank(s) 0, 1 still running after the harness deadline of 5 s: ...``),
what pytest's ``-ra``, junit XML and CI summaries show. The modules that decide what happened
(``rank.outcome``, ``verdict.errors``, ``verdict.echo``, ``verdict.decision``) call these
functions for the words; a test checks that each sentence is written here only. Pure text:
no torch, nothing imported from the harness (a leaf: every folder may import it).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol


class Place(Protocol):
    """Where a rank was, as these sentences read it (``diagnose.stacks.Place``): its text,
    the call it sits in, the group-forming call it waits in."""

    call: str | None
    joining: str | None


# torch.distributed's communication calls, as a rank's stack names them: two ranks of one
# hang in two different ones are in different collectives.
COLLECTIVES = frozenset(
    "all_reduce all_gather all_gather_into_tensor all_gather_object all_to_all "
    "all_to_all_single barrier monitored_barrier broadcast broadcast_object_list gather "
    "gather_object reduce reduce_scatter reduce_scatter_tensor scatter scatter_object_list "
    "send recv isend irecv batch_isend_irecv".split()
)
# The advice a hang between different collectives gets (``--check-collectives`` is the option
# that turns on torch's collective fingerprint checks; see the README).
CHECK_COLLECTIVES = (
    "rerun with --check-collectives (or @pytest.mark.check_collectives) to have torch "
    "compare every collective across ranks and fail at the first mismatch"
)
# Said of a hang whose ranks wait in different collectives, by their stacks or their records.
DIFFERENT_COLLECTIVES = "the ranks are in different collectives"
# Why ranks that all wait in one group-forming call never meet (the parent cannot see which).
NEVER_MET = (
    "every rank waits there, so they disagree on where to meet (MASTER_ADDR/MASTER_PORT, the "
    "tcp:// or file:// address) or on the world size, or no rank hosts the store "
    "(TORCHELASTIC_USE_AGENT_STORE=True makes rank 0 a client too)"
)

# How a rank's process ended without a result (``rank.outcome``'s ``how``). Forked or warm,
# the parent saw the process end; under torchrun a worker its peers found gone is ``Lost``.
EXITED_UNKNOWN = "closed its result pipe but is still running"
EXITED = "exited with code {} (os._exit or a crash)"
LOST_UNKNOWN = "exited (its worker process is gone: no heartbeat in the job's store)"
LOST = "exited with code {} (os._exit)"


def ranks(numbers: Iterable[int]) -> str:
    """``0, 1``: rank numbers as a report lists them, in order."""
    return ", ".join(str(r) for r in sorted(numbers))


# The first line of one rank's failure, and of the others' sections below it (``.format``).
RAISED = "rank {rank} raised {summary}"
DIED = "rank {rank} {how} before returning a result"
KILLED = "was killed by signal {}"
SKIPPED = "rank {rank} skipped: {reason}"
XFAILED = "rank {rank} xfailed: {reason}"
ALSO_FAILED = "\n\n----- rank {rank} failed too: {how} -----\n"
# A thread's exception after the rank function returned, said as the rank's failure.
AFTER_RETURN = "{message} (in thread {thread!r}, after the rank function had returned)"


def failed_too(own: Iterable[int]) -> str:
    """`` (rank(s) 1, 2 failed too)``: the others that failed of their own accord."""
    own = list(own)
    return f" (rank(s) {ranks(own)} failed too)" if own else ""


def peers_returned(returned: Iterable[int]) -> str:
    """What an echo's headline says in place of gloo's advice that a remote worker crashed."""
    return (
        f"(rank(s) {ranks(returned)} had returned and closed the connection, while this rank "
        "was still in a collective with it: no rank crashed)"
    )


def skip_outlived(
    skipped_rank: int, reason: str, pending: list[int], waited: float, where: dict[int, Place]
) -> str:
    """Rank ``skipped_rank`` skipped while ``pending`` ran on ``waited`` s: a failure."""
    places = ", ".join(f"rank {r} {where[r]}" for r in sorted(pending) if where.get(r))
    return (
        f"rank {skipped_rank} skipped ({reason}) but rank(s) {ranks(pending)} were still "
        f"running {waited:g} s later" + (f": {places}" if places else "") + "; a skip must be "
        "taken by every rank (or before the ranks start), so this test is failed, not skipped"
    )


def hang(
    pending: list[int],
    timeout: float,
    where: dict[int, Place],
    ended: dict[int, str] | None = None,
    explained: str | None = None,
    waiting: frozenset[int] = frozenset(),
) -> str:
    """``rank(s) 0, 1 still running after the harness deadline of 5 s: rank 0 in all_reduce
    at t.py:9, rank 1 in broadcast at t.py:11: the ranks are in different collectives (...)``;
    ``ended`` says how the ranks that were no longer running had ended (``returned``).
    ``explained``: where the ranks' collectives part, from their records (``desync``: ``rank
    0 waits in all_reduce #2 at t.py:9; rank 1 never reached #2``), in place of the stacks'
    guesses; the stacks say where the ranks not ``waiting`` in a collective were."""
    line = f"rank(s) {ranks(pending)} still running after the harness deadline of {timeout:g} s"
    places = [f"rank {r} {where[r]}" for r in sorted(pending) if where.get(r)]
    if explained:  # the records' line, then where the ranks outside a collective were
        outside = [
            r
            for r in sorted(pending)
            if where.get(r) and r not in waiting and where[r].call not in COLLECTIVES
        ]
        line += ": " + "; ".join([explained, *(f"rank {r} {where[r]}" for r in outside)])
    elif places:
        line += ": " + ", ".join(places)
    if ended:
        line += "; " + ", ".join(f"rank {r} had {how}" for r, how in sorted(ended.items()))
    calls = {where[r].call for r in pending if where.get(r) and where[r].call in COLLECTIVES}
    if len(calls) > 1 and not explained:
        line += f": {DIFFERENT_COLLECTIVES} ({CHECK_COLLECTIVES})"
    return line + unformed_group(pending, where, ended or {})


def unformed_group(pending: list[int], where: dict[int, Place], ended: dict[int, str]) -> str:
    """``: the group did not form in init_process_group(env://): rank(s) 1 never joined``
    when ranks hang in a call that forms a group (``Place.joining``), else empty. A rank
    that had ended, or hangs elsewhere, never joined it; if every rank is in it, they do not
    agree on where to meet."""
    joining = [r for r in pending if where.get(r) and where[r].joining]
    if not joining:
        return ""
    calls = ", ".join(sorted({str(where[r].joining) for r in joining}))
    absent = sorted([*ended, *(r for r in pending if where.get(r) and r not in joining)])
    if absent:
        return f": the group did not form in {calls}: rank(s) {ranks(absent)} never joined"
    return f": the group did not form in {calls}: {NEVER_MET}"


# --- sentences of the strategies, the fault plan, the audit and the settings -------------


def stranded(gone: str, waits: str, who: str, deadline: float, early: bool) -> str:
    """``rank 1 returned after all_reduce #1; rank 0 waits in all_reduce #2 at t.py:9, which
    rank 1 never entered: a hang that cannot resolve (ended when seen, ...)`` (``stranded``)."""
    when = (
        f"ended when seen, not at the harness deadline of {deadline:g} s"
        if early
        else f"seen at the harness deadline of {deadline:g} s"
    )
    return f"{gone}; {waits}, which {who} never entered: a hang that cannot resolve ({when})"


def not_fired(unfired: Iterable[object]) -> str:
    """Planned faults that did not fire, each with what its rank did instead."""
    return "planned fault(s) did not fire (Fault(..., optional=True) if that may be so): " + (
        "; ".join(map(str, unfired))
    )


def refused(named: Iterable[str], where: str, reasons: str) -> str:
    """``may_exit cannot be honoured in a warm world (may_exit: ...)``: a strategy's refusal."""
    return f"{', '.join(named)} cannot be honoured {where} ({reasons})"


def audit_differs(warm: str, fresh: str) -> str:
    """``--warm-audit``'s verdict when a warm world and fresh ranks disagree."""
    return (
        f"--warm-audit: the warm world's verdict ({warm}) differs from fresh ranks' "
        f"({fresh}): the test depends on state a warm world carried over"
    )


def configuration(problem: object) -> str:
    """A test's markers or options the harness cannot honour: the test's error in setup."""
    return f"harness configuration: {problem}"


def phase_lost(ended: str, when: str) -> str:
    """Under torchrun: a worker ended during a test phase (``phases``)."""
    return f"{ended} during the {when} phase; {SESSION_STOPS}"


def phase_unfinished(silent: Iterable[int], when: str, places: str) -> str:
    """Under torchrun: ranks that did not finish a test phase in time (``phases``)."""
    return (
        f"rank(s) {ranks(silent)} did not finish the {when} phase within the harness deadline"
        + (f": {places}" if places else "")
    )


def not_run(why: object) -> str:
    """Under torchrun: a test after the session broke (a rank lost) is not run."""
    return f"not run: {why}"


SESSION_STOPS = "the session stops here"  # under torchrun: a rank lost or stuck ends the job
WORKERS_EXIT = f"{SESSION_STOPS}, and every worker exits non-zero"


def unfired(fault: object, rank: int, did: str, made: str, named: str) -> str:
    """One planned fault that did not fire, with what its rank did instead."""
    return f"{fault} did not fire on rank {rank}: {did}; its collectives: {made}; " + (
        f"its steps: {named}"
    )


def init_method_under_torchrun() -> str:
    """``--init-method`` given to a worker of a torchrun job (a usage error at start)."""
    return refused(
        ["--init-method"],
        "under torchrun",
        "the job has torchrun's own rendezvous; drop the option, or use --launcher fork",
    )
