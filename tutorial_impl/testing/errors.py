"""What ``run_ranks`` returns and raises, and the text of its reports.

A failure report is built for a reader who was not there: which rank, what it raised (its own
traceback), and what every rank printed, each line prefixed ``[rank N]`` so interleaved output
can still be told apart. Everything here is plain formatting over ``{rank: output}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

OUTPUT_TAIL_LINES = 200  # per rank, in error messages


class RankError(Exception):
    """Base of everything ``run_ranks`` raises about its ranks."""

    def __init__(self, message: str, outputs: dict[int, str]) -> None:
        super().__init__(message)
        self.outputs = outputs


class RankFailed(RankError):
    """A rank raised an exception; ``rank`` and ``traceback`` say which and where.

    ``stacks`` maps every other rank that was still running to its Python stacks at that
    moment (see ``forensics``).
    """

    def __init__(
        self,
        rank: int,
        tb: str,
        message: str,
        outputs: dict[int, str],
        stacks: dict[int, str] | None = None,
    ) -> None:
        super().__init__(message, outputs)
        self.rank = rank
        self.traceback = tb
        self.stacks = stacks or {}


class RankCrashed(RankError):
    """A rank process ended (signal, ``os._exit``) without reporting a result.

    ``stacks``: the other ranks still running then, as for ``RankFailed``.
    """

    def __init__(
        self,
        rank: int,
        exitcode: int | None,
        message: str,
        outputs: dict[int, str],
        stacks: dict[int, str] | None = None,
    ) -> None:
        super().__init__(message, outputs)
        self.rank = rank
        self.exitcode = exitcode
        self.stacks = stacks or {}


class RankTimeout(RankError):
    """The deadline passed; ``stacks`` maps each rank still alive to its Python stacks."""

    def __init__(self, stacks: dict[int, str], message: str, outputs: dict[int, str]) -> None:
        super().__init__(message, outputs)
        self.stacks = stacks


class RankSkipped(RankError):
    """A rank called ``pytest.skip``; the pytest plugin turns this into a skipped test."""

    def __init__(self, rank: int, reason: str, outputs: dict[int, str]) -> None:
        super().__init__(f"rank {rank} skipped: {reason}", outputs)
        self.rank = rank
        self.reason = reason


@dataclass(frozen=True)
class RankExited:
    """How a rank of ``run_ranks(..., may_exit={rank})`` ended without reporting a result.

    It stands in that rank's place in the results: ``exitcode`` is the process's exit code,
    negative for a signal (``-9`` for SIGKILL), and ``how`` says it in words.
    """

    rank: int
    exitcode: int | None
    how: str


class RankResults(list):  # type: ignore[type-arg]
    """The ranks' return values in rank order, plus what each rank printed (``outputs``)."""

    outputs: list[str]


def prefixed(rank: int, text: str, limit: int = OUTPUT_TAIL_LINES) -> str:
    """``text`` with every line prefixed ``[rank N]``, keeping only the last ``limit`` lines."""
    lines = text.rstrip("\n").splitlines()
    cut = len(lines) - limit
    shown = [f"[rank {rank}] {line}" for line in lines[-limit:]]
    if cut > 0:
        shown.insert(0, f"[rank {rank}] ... ({cut} earlier lines cut)")
    return "\n".join(shown)


def outputs_section(outputs: dict[int, str]) -> str:
    """The section of a report that shows what each rank printed (empty if nothing)."""
    parts = [prefixed(rank, out) for rank, out in sorted(outputs.items()) if out.strip()]
    if not parts:
        return ""
    return "\n\n----- output of the ranks (stdout and stderr) -----\n" + "\n".join(parts)


def stacks_section(stacks: dict[int, str]) -> str:
    """Each rank's stack dump under its own heading, in rank order."""
    return "\n\n".join(
        f"----- Python stacks of rank {rank} -----\n"
        + (text.rstrip() or "(no answer: the rank was still starting, or had just died)")
        for rank, text in sorted(stacks.items())
    )


def _others_section(failed: int, stacks: dict[int, str]) -> str:
    if not stacks:
        return ""
    names = ", ".join(str(r) for r in sorted(stacks))
    return (
        f"\n\n===== where the other running rank(s) {names} were when rank {failed} failed "
        "=====\n" + stacks_section(stacks)
    )


def timeout_error(
    pending: list[int], timeout: float, stacks: dict[int, str], outputs: dict[int, str]
) -> RankTimeout:
    """The deadline passed with ``pending`` ranks unfinished; ``stacks`` are their dumps."""
    names = ", ".join(str(r) for r in sorted(pending))
    body = stacks_section(stacks)
    return RankTimeout(
        stacks,
        f"rank(s) {names} still running after the harness deadline of {timeout:g} s "
        "(raise it with @pytest.mark.rank_timeout(SECONDS) or --rank-timeout)\n\n"
        + body
        + outputs_section(outputs),
        outputs,
    )


def outcome_error(
    rank: int,
    kind: str,
    detail: Any,
    fatal_stack: str,
    outputs: dict[int, str],
    stacks: dict[int, str] | None = None,
) -> RankError:
    """The exception for one rank's bad outcome: ``skip``, ``error`` or ``crash``.

    The failing rank comes first (its traceback, or how it died), then ``stacks``: where
    each other running rank was at that moment, then what every rank printed.
    """
    stacks = stacks or {}
    if kind == "skip":
        return RankSkipped(rank, detail, outputs)
    others = _others_section(rank, stacks)
    if kind == "error":
        message = f"rank {rank} raised:\n\n{detail.rstrip()}" + others + outputs_section(outputs)
        return RankFailed(rank, detail, message, outputs, stacks)
    code, how = detail
    extra = ""
    if fatal_stack.strip():
        extra = f"\n\n----- fatal-signal stack of rank {rank} -----\n{fatal_stack}"
    message = (
        f"rank {rank} {how} before returning a result" + extra + others + outputs_section(outputs)
    )
    return RankCrashed(rank, code, message, outputs, stacks)
