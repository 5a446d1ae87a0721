"""Many short groups at once, and not one failed rendezvous.

This is where harnesses that "find a free port" break: two groups starting at the same
moment pick the same port. Here every group's store is bound to port 0 by its parent, and
file:// uses a fresh file, so nothing can collide. Three cases, one per init method (xdist
spreads them over its workers), each run 30 groups from three threads at once: 90 groups,
three of the same init method starting together all the time (a collision needs only two),
more alive across the cases.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from tutorial_impl.testing import run_ranks

GROUPS_PER_CASE = 30
THREADS = 3  # groups of one case alive at the same time, on top of xdist's parallelism


def group_sum(rank: int, world_size: int, base: int) -> int:
    """Every rank contributes ``base + rank``; the sum tells which group a rank joined."""
    t = torch.tensor([base + rank], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t.item())


@pytest.mark.slow
@pytest.mark.parametrize("init_method", ["env", "tcp", "file"])
def test_many_concurrent_groups_all_rendezvous(tmp_path, init_method):
    """Group i sums ``i * 1000 + rank`` over its ranks, so a rank that joined the wrong
    group (a collided rendezvous) or a group that lost a member gives a wrong sum."""

    world_size = 2

    def one_group(i: int) -> list[int]:
        return run_ranks(
            group_sum,
            i * 1000,
            world_size=world_size,
            init_method=init_method,
            timeout=60,
            log_dir=tmp_path / f"group{i}",
        )

    with ThreadPoolExecutor(THREADS) as pool:
        results = list(pool.map(one_group, range(GROUPS_PER_CASE)))
    for i, got in enumerate(results):
        expected = world_size * i * 1000 + sum(range(world_size))
        assert got == [expected] * world_size, f"group {i}"
