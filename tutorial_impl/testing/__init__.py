"""The multi-rank test harness, in layers.

``rendezvous``  race-free stores and init methods (the parent owns the store)
``ranks``       starting rank processes fast (forkserver) and the rank's own main
``supervisor``  ``run_ranks``: waiting with deadlines, fail-fast, stack dumps, no orphans
``plugin``      pytest glue: markers, options, the ``run_ranks`` fixture, collection skips
"""

from tutorial_impl.testing.supervisor import (
    RankCrashed,
    RankError,
    RankFailed,
    RankResults,
    RankSkipped,
    RankTimeout,
    run_ranks,
)

__all__ = [
    "RankCrashed",
    "RankError",
    "RankFailed",
    "RankResults",
    "RankSkipped",
    "RankTimeout",
    "run_ranks",
]
