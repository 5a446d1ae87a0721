"""The one protocol every way of starting ranks follows: a checked ``Call`` in, one verdict out.

Three strategies, each in a module of its own:

``forked.Forked``     fresh ranks from the forkserver for every call (the default)
``warm.WarmPool``     ranks and process group kept between tests (the ``warm_world`` marker)
``torchrun.Launched`` this pytest is one rank of a torchrun job; the function runs here

Each gathers one ``outcome.Report`` per rank, captured in the rank by ``outcome.capture``,
and hands them to ``verdict.decide``: the rules of a verdict are written once. A strategy
that cannot honour a field the caller gave (``Call.given``) says so in ``refusal``, naming
the field; the caller then refuses the call (torchrun) or takes another strategy that can
(warm falls back to fresh ranks).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol

from tutorial_impl.testing.call import Call
from tutorial_impl.testing.verdict.errors import RankResults


class Runner(Protocol):
    name: str

    def refusal(self, call: Call) -> str | None:
        """Why this strategy cannot run ``call`` as asked (naming the field), or None."""

    def run(self, call: Call) -> RankResults:
        """The ranks' results in rank order, or raise the run's one ``RankError``."""


def refused_fields(used: Collection[str], strategy: str, fields: dict[str, str]) -> str | None:
    """The refusal for the fields of ``fields`` (name -> why) among ``used``."""
    named = [name for name in fields if name in used]
    if not named:
        return None
    why = "; ".join(f"{name}: {fields[name]}" for name in named)
    return f"{', '.join(named)} cannot be honoured {strategy} ({why})"
