"""Many short groups at once, and not one failed rendezvous.

This is where harnesses that "find a free port" break: two groups starting at the same
moment pick the same port. Here every group's store is bound to port 0 by its parent, and
file:// uses a fresh file, so nothing can collide. One run (a module-scoped fixture) starts
``GROUPS_PER_METHOD`` groups of each init method, interleaved, from ``THREADS`` threads at
once: nine groups starting together all the time, three of each init method (a collision
needs only two), and env:// and tcp:// groups drawing their ports side by side. Each init
method's groups are then checked by a test of its own.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from tutorial_impl.testing import run_ranks
from tutorial_impl.testing.rendezvous import INIT_METHODS

GROUPS_PER_METHOD = 12
THREADS = 9  # groups alive at the same time
WORLD_SIZE = 2


def group_sum(rank: int, world_size: int, base: int) -> int:
    """Every rank contributes ``base + rank``; the sum tells which group a rank joined."""
    t = torch.tensor([base + rank], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t.item())


def expected_sum(base: int) -> int:
    return WORLD_SIZE * base + sum(range(WORLD_SIZE))


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, list[tuple[int, object]]]:
    """Every group's base and what its ``run_ranks`` returned (or raised), by init method.
    Group ``n`` (over all methods) sums ``n * 1000 + rank`` over its ranks, so a rank that
    joined the wrong group (a collided rendezvous) or a group that lost a member gives a
    wrong sum."""
    work = tmp_path_factory.mktemp("groups")
    jobs = [(method, i) for i in range(GROUPS_PER_METHOD) for method in INIT_METHODS]

    def one_group(n: int) -> tuple[str, int, object]:
        method, i = jobs[n]
        base = n * 1000
        try:
            got: object = run_ranks(
                group_sum,
                base,
                world_size=WORLD_SIZE,
                init_method=method,
                timeout=60,
                log_dir=work / f"{method}{i}",
            )
        except Exception as exc:  # reported by the test of its init method
            got = exc
        return method, base, got

    with ThreadPoolExecutor(THREADS) as pool:
        done = list(pool.map(one_group, range(len(jobs))))
    by_method: dict[str, list[tuple[int, object]]] = {method: [] for method in INIT_METHODS}
    for method, base, got in done:
        by_method[method].append((base, got))
    return by_method


@pytest.mark.slow
@pytest.mark.xdist_group("stress-groups")
@pytest.mark.parametrize("init_method", ["env", "tcp", "file"])
def test_many_concurrent_groups_all_rendezvous(outcomes, init_method):
    """Every group of this init method, started among groups of all three, summed exactly
    its own ranks' contributions."""
    groups = outcomes[init_method]
    assert len(groups) == GROUPS_PER_METHOD
    for base, got in groups:
        assert got == [expected_sum(base)] * WORLD_SIZE, f"group {base // 1000}: {got!r}"
