"""What the warm worlds of a session did, in its terminal summary (``warm``).

Without it a user cannot tell whether ``--warm-worlds`` does anything: a suite whose every
test calls ``destroy_process_group()`` retires its world after each test and runs as fresh,
in silence. ``WarmStats`` counts the worlds a ``WarmPool`` started, the tests they served
again (reuses) and the worlds retired, by reason, each reason with the first test after which
it was found; ``WarmSummary`` (a pytest plugin the harness registers) writes one line, e.g.::

    warm worlds: 3 started, 41 reuses, 2 retired (1 a test failed; 1 rank 0: 1 process
    group(s) left behind (destroy_process_group), after test_x.py::test_y)

Under pytest-xdist each worker has its own pool: a worker hands its counts to the
controller (``workeroutput``), which writes the sum.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # not at run time: a script's ``run_ranks`` (and each rank that imports
    import pytest  # the pool) would import pytest for nothing, ~160 ms of CPU

hookimpl = pluggy.HookimplMarker("pytest")  # ``pytest.hookimpl`` itself

KEY = "tutorial_impl_warm_stats"  # in an xdist worker's workeroutput
# Why a world was retired with its test (``pool.WarmPool.test_ended``), counted per test.
FAILED = "a test failed"  # the first world a failed test retired
FAILED_TOO = "another world of a failed test"
CAUGHT = "a run_ranks call failed in a test that passed (pytest.raises)"
SKIPPED = "a test skipped or xfailed in its ranks"
CALL_FAILED = "a run_ranks call failed"  # outside pytest: no test said how it ended
_BY_TEST = {FAILED, FAILED_TOO, CAUGHT, SKIPPED, CALL_FAILED}  # the test named is no news
_RANK = re.compile(r"^rank \d+: ")


@dataclass
class WarmStats:
    """Counts of one pool (or the sum over xdist workers)."""

    started: int = 0  # worlds started
    reuses: int = 0  # tests served by a world that had served one before
    retired: dict[str, int] = field(default_factory=dict)  # reason -> worlds
    after: dict[str, str] = field(default_factory=dict)  # reason -> the first test it followed

    def retire(self, reason: str, test: str | None) -> None:
        """One world retired: ``reason`` as the pool says it, ``test`` the last it served."""
        reason = _RANK.sub("", reason)  # every rank finds the same: counted once
        self.retired[reason] = self.retired.get(reason, 0) + 1
        if test and reason not in _BY_TEST:
            self.after.setdefault(reason, test)

    def add(self, other: WarmStats) -> None:
        self.started += other.started
        self.reuses += other.reuses
        for reason, count in other.retired.items():
            self.retired[reason] = self.retired.get(reason, 0) + count
        for reason, test in other.after.items():
            self.after.setdefault(reason, test)

    def line(self) -> str:
        retired = sum(self.retired.values())
        text = f"warm worlds: {self.started} started, {self.reuses} reuses, {retired} retired"
        if not retired:
            return text
        ranked = sorted(self.retired.items(), key=lambda item: (-item[1], item[0]))
        reasons = [  # "2 x <reason>": a reason may start with a count of its own
            f"{count} x {reason}"
            + (
                f", {'first ' if count > 1 else ''}after {self.after[reason]}"
                if reason in self.after
                else ""
            )
            for reason, count in ranked
        ]
        return f"{text} ({'; '.join(reasons)})"


class WarmSummary:
    """The plugin that writes the line: where a pool was used, or ``--warm-worlds`` asked."""

    def __init__(self, stats: WarmStats, asked: bool, config: pytest.Config) -> None:
        self.stats = stats
        self.asked = asked  # --warm-worlds / ini warm_worlds: say so even when nothing ran warm
        self.worker = hasattr(config, "workerinput")  # an xdist worker: the controller writes

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        output = getattr(session.config, "workeroutput", None)
        if output is not None:  # an xdist worker: the controller writes the line
            output[KEY] = asdict(self.stats)

    @hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        found = getattr(node, "workeroutput", {}).get(KEY)
        if found is not None:
            self.stats.add(WarmStats(**found))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.worker and (self.stats.started or self.asked):
            terminalreporter.write_line(self.stats.line())


def register(config: pytest.Config, stats: WarmStats, asked: bool) -> None:
    """Write ``stats`` in this session's summary (``asked``: --warm-worlds was given)."""
    config.pluginmanager.register(WarmSummary(stats, asked, config), "tutorial-impl-warm-summary")
