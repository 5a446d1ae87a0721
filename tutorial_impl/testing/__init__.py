"""The multi-rank test harness, in layers.

``rendezvous``  race-free stores and init methods (the parent owns the store)
``ranks``       starting rank processes fast (forkserver) and the rank's own main
``forkserver_init`` / ``forkserver_ready``  run inside the forkserver only: no main-script
                re-runs in ranks, rank groups killed when the server exits, heap frozen
``supervisor``  ``run_ranks``: waiting with deadlines, fail-fast, stack dumps, no orphans
``errors``      what ``run_ranks`` returns and raises, and the text of its failure reports
``plugin``      pytest glue: markers, options, the ``run_ranks`` fixture, collection skips
``proctable``   "is that process really gone?" asked of the kernel, for leak tests
``selftest_ranks``  rank functions the harness's own tests use (one per way a rank ends)
"""

from tutorial_impl.testing.errors import (
    RankCrashed,
    RankError,
    RankExited,
    RankFailed,
    RankResults,
    RankSkipped,
    RankTimeout,
)
from tutorial_impl.testing.supervisor import run_ranks

__all__ = [
    "RankCrashed",
    "RankError",
    "RankExited",
    "RankFailed",
    "RankResults",
    "RankSkipped",
    "RankTimeout",
    "run_ranks",
]
