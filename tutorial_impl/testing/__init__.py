"""The multi-rank test harness, in layers.

``rendezvous``  race-free stores and init methods (the parent owns the store)
``lookup``      how a rank finds its function: by module name, or by file (test files too)
``ranks``       starting rank processes fast (forkserver) and the rank's own main
``forkserver_init`` / ``forkserver_ready``  run inside the forkserver only: no main-script
                re-runs in ranks, rank groups killed when the server exits, heap frozen
``supervisor``  ``run_ranks``: waiting with deadlines, fail-fast, no orphans
``forensics``   the ranks' Python stacks, at the deadline and when one rank fails
``coverage``    coverage measured inside ranks when the parent measures coverage
``errors``      what ``run_ranks`` returns and raises, and the text of its failure reports
``assertions``  ``assert_equal_across_ranks`` / ``assert_close_across_ranks``, inside ranks
``matrix``      ``@pytest.mark.world_size(1, 2, 4)``: one test per world size
``launched``    under torchrun: ``run_ranks`` in this worker, outcomes agreed through the store
``launched_session``  the pytest side of a torchrun job: same tests, one verdict, one report
``plugin``      pytest glue: options, markers, hooks, fixtures (a ``pytest11`` entry point)
``proctable``   "is that process really gone?" asked of the kernel, for leak tests

Importing this package does not import torch; running ranks does.
"""

from tutorial_impl.testing.assertions import (
    assert_close_across_ranks,
    assert_equal_across_ranks,
)
from tutorial_impl.testing.errors import (
    RankCrashed,
    RankError,
    RankExited,
    RankFailed,
    RankResults,
    RankSkipped,
    RankTimeout,
)
from tutorial_impl.testing.forked import run_ranks

__all__ = [
    "RankCrashed",
    "RankError",
    "RankExited",
    "RankFailed",
    "RankResults",
    "RankSkipped",
    "RankTimeout",
    "assert_close_across_ranks",
    "assert_equal_across_ranks",
    "run_ranks",
]
