"""The multi-rank test harness: one call in, one verdict out.

A test's markers and options become one checked ``call.Call``; a strategy runs it (``forked``:
fresh ranks, ``warm``: a warm world, ``torchrun``: this worker of a torchrun job, all behind
``strategies.protocol``); each rank's result is caught by ``rank.outcome.capture`` and
``verdict.decision.decide`` turns every rank's report into the results or the one error.
``plugin`` is the pytest glue (options and hooks; the fixtures are in ``fixtures``). The
module map, with what flows between the modules: ``docs/architecture.md``.

Importing this package does not import torch; running ranks does.
"""

from tutorial_impl.testing.assertions import (
    assert_close_across_ranks,
    assert_equal_across_ranks,
)
from tutorial_impl.testing.faults.inject import FaultNotFired, InjectedFault, fault_point
from tutorial_impl.testing.faults.plan import Close, Delay, Exit, Fault, Hang, Kill, Raise
from tutorial_impl.testing.rank.caught import RankThreadWarning
from tutorial_impl.testing.rank.leftovers import LeftoverProcessWarning
from tutorial_impl.testing.rank.stores import shared_store
from tutorial_impl.testing.strategies.forked import run_ranks
from tutorial_impl.testing.verdict.errors import (
    RankCrashed,
    RankError,
    RankExited,
    RankFailed,
    RankResults,
    RankSkipped,
    RankTimeout,
)

__all__ = [
    "Close",
    "Delay",
    "Exit",
    "Fault",
    "FaultNotFired",
    "Hang",
    "InjectedFault",
    "Kill",
    "LeftoverProcessWarning",
    "Raise",
    "RankCrashed",
    "RankError",
    "RankExited",
    "RankFailed",
    "RankResults",
    "RankSkipped",
    "RankThreadWarning",
    "RankTimeout",
    "assert_close_across_ranks",
    "assert_equal_across_ranks",
    "fault_point",
    "run_ranks",
    "shared_store",
]
