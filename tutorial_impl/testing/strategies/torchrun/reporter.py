"""Under torchrun: which worker writes the job's report, and the quiet of the others.

Rank 0 reports for the job: its terminal shows the session, it writes the junit XML. The
other workers are quiet (``Reporter``: their terminal writes to ``os.devnull``, their junit
XML goes to ``os.devnull``), but they keep everything a report needs: every rank reaches the
same verdicts (``phases.agree``), and their terminal reporter and junit plugin see every one.
So when rank 0 is lost in the middle of the session (a segfault, the OOM killer), the lowest
rank still there takes over (``after_loss``): its terminal and junit XML are given back, and
the summary, the results of every test so far and the junit XML come from it.
"""

from __future__ import annotations

import os
from typing import Any

import pytest


class Reporter:
    """The rank that reports for the job (``current``), and this rank's muted outputs."""

    def __init__(self, config: pytest.Config, rank: int) -> None:
        self.config = config
        self.rank = rank
        self.current = 0
        self.took_over: str | None = None  # why this rank reports instead of rank 0
        self._terminal: Any = None  # the terminal writer a quiet rank put aside
        self._logfile: str | None = None  # the junit XML's path a quiet rank put aside
        if rank != 0:
            self._mute()

    def is_me(self) -> bool:
        return self.current == self.rank

    def after_loss(self, lost: set[int], world_size: int, how: dict[int, str]) -> None:
        """Ranks ``lost`` are gone (``how``: rank -> how it ended): if the reporter is among
        them, the lowest rank still there reports from now on."""
        if self.current not in lost:
            return
        gone = self.current
        self.current = min((r for r in range(world_size) if r not in lost), default=gone)
        if self.is_me():
            self.took_over = (
                f"rank {gone}, which reports for the job, {how.get(gone, 'is gone')}; rank "
                f"{self.rank} reports in its place (the results of every test so far included)"
            )
            self._unmute()

    def _mute(self) -> None:
        from _pytest.junitxml import xml_key
        from _pytest.terminal import TerminalWriter

        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            self._terminal = reporter._tw
            reporter._tw = TerminalWriter(open(os.devnull, "w"))  # noqa: SIM115
        xml = self.config.stash.get(xml_key, None)
        if xml is not None:
            self._logfile, xml.logfile = xml.logfile, os.devnull

    def _unmute(self) -> None:
        from _pytest.junitxml import xml_key

        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None and self._terminal is not None:
            reporter._tw = self._terminal
        xml = self.config.stash.get(xml_key, None)
        if xml is not None and self._logfile is not None:
            xml.logfile = self._logfile
