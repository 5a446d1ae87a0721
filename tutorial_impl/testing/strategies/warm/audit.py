"""``--warm-audit``: every warm call is run fresh too, and a verdict that differs fails the test.

A warm world promises that a test passes warm if and only if it passes fresh, for everything
the harness can see (``strategies.warm.loop``, ``reuse``). What it cannot see (``docs/harness.md``
lists it) is where a CI job that wants proof turns this on: each call of a warm test runs in
its warm world and then on fresh ranks, and the two verdicts (passed, skipped, xfailed, or
failed with how every rank ended) must agree. Which failing rank's report arrived first is
not compared: that is a race, and the same test fresh twice may differ in it. It costs a
fresh run per call (``python -m tutorial_impl bench harness`` measures it). ``Audited`` is the
warm strategy wrapped so; ``protocol.run`` decides both runs and ``verdict.agree`` compares
them.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from tutorial_impl.testing.call import Call
from tutorial_impl.testing.verdict.decision import Finished

if TYPE_CHECKING:
    from tutorial_impl.testing.strategies.protocol import Strategy


class Audited:
    """``--warm-audit``: the warm strategy ``warm``, each call gathered on ``fresh`` ranks too
    (in ``fresh/`` under the call's directory); ``protocol.run`` compares the two verdicts."""

    def __init__(self, warm: Strategy, fresh: Strategy) -> None:
        self.warm, self.fresh = warm, fresh
        self.name, self.cannot = warm.name, warm.cannot

    def gather(self, call: Call) -> Finished:
        finished = self.warm.gather(call)
        fresh = dataclasses.replace(
            call,
            log_dir=call.log_dir / "fresh" if call.log_dir is not None else None,
            home=call.home / "fresh" if call.home is not None else None,
        )
        return dataclasses.replace(finished, audit=self.fresh.gather(fresh))

    # What the face asks is the warm strategy's: the audit only adds a fresh run.
    @property
    def size(self) -> int | None:
        return self.warm.size

    @property
    def serial(self) -> bool:
        return self.warm.serial

    @property
    def own_ranks(self) -> bool:
        return self.warm.own_ranks

    def why_not_here(self, settings: Any) -> str | None:
        return self.warm.why_not_here(settings)

    def test_ended(self, failed: bool) -> None:
        self.warm.test_ended(failed)

    def close(self) -> None:
        self.warm.close()
