"""Groups the user's code makes itself, as a library's own tests make them.

A library's test helper often starts its own group: torchmetrics' ``setup_ddp`` destroys
whatever group there is, sets ``MASTER_ADDR``/``MASTER_PORT`` to a port of its own and calls
``init_process_group`` (``env://``). In the harness's ranks that must behave as in plain
torch: rank 0 hosts the store on that port, the others connect. What the harness sets in a
rank's environment (``rendezvous``; the table in docs/harness.md) changes nothing of that:
its own group met at the parent's store, with ``TORCHELASTIC_USE_AGENT_STORE`` set only
meanwhile, and the ``MASTER_PORT`` the user's code finds is a port reserved for rank 0.

1. ``setup_ddp`` on its own port passes in fresh ranks (the harness's group destroyed first)
   and in a warm world, which is then replaced (its default group is not the harness's).
2. Under ``backend=None`` every way of meeting forms a group, one after another in the same
   ranks: ``env://`` and ``tcp://`` on ports of the user's own, and ``file://`` (on the
   ``MASTER_PORT`` the harness gave: ``test_harness_basics``).
3. A group that cannot form says why on its first line.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tutorial_impl.testing import call
from tutorial_impl.testing.rendezvous import reserve_port
from tutorial_impl.testing.strategies import protocol
from tutorial_impl.testing.strategies.warm import pool as warm
from tutorial_impl.testing.verdict.errors import RankTimeout


def setup_ddp(rank: int, world_size: int, port: int) -> None:
    """A library's own helper (torchmetrics' shape): its own port, env://."""
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def summed(rank: int) -> float:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def library_test(rank: int, world_size: int, port: int) -> dict[str, object]:
    had = dist.is_initialized()  # the harness's group, which setup_ddp destroys
    seen = os.environ.get("TORCHELASTIC_USE_AGENT_STORE")
    setup_ddp(rank, world_size, port)
    return {"had_group": had, "agent_store": seen, "sum": summed(rank)}


@pytest.fixture
def own_ports():
    """Ports of the test's own, as a library would pick them, but kept bound (as the
    harness keeps MASTER_PORT: ``reserve_port``) so that no other test takes them meanwhile."""
    sockets = [reserve_port() for _ in range(2)]
    yield [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()


def test_a_librarys_setup_ddp_on_its_own_port_passes(run_ranks, own_ports):
    results = run_ranks(library_test, own_ports[0])
    assert results == [{"had_group": True, "agent_store": None, "sum": 3.0}] * 2


def test_in_a_warm_world_too_which_is_then_replaced(own_ports):
    pool = warm.WarmPool()
    try:
        results = protocol.run(pool, call.build(library_test, (own_ports[0],), world_size=2))
        assert results == [{"had_group": True, "agent_store": None, "sum": 3.0}] * 2
        [world] = pool.worlds.values()  # its answer to "as good as new?", as the next test's
        problem = warm.checked(world)
        assert problem is not None
        assert problem.endswith("the default process group was destroyed or replaced")
    finally:
        pool.close()


def every_way(rank: int, world_size: int, ports: list[int], tmp: str) -> list[float]:
    """One group after another, each made, used and destroyed by the function: env:// on a
    MASTER_PORT of its own (setup_ddp), tcp:// on another port, then a file of its own.
    (env:// and tcp:// on the MASTER_PORT the harness gave: ``test_harness_basics``.)"""
    setup_ddp(rank, world_size, ports[0])
    sums = [summed(rank)]
    dist.destroy_process_group()
    for url in (f"tcp://127.0.0.1:{ports[1]}", f"file://{tmp}/own-group"):
        dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world_size)
        sums.append(summed(rank))
        dist.destroy_process_group()
    return sums


def test_backend_none_forms_groups_every_way(run_ranks, own_ports, tmp_path):
    results = run_ranks(every_way, own_ports, str(tmp_path), backend=None)
    assert results == [[3.0] * 3] * 2


def never_comes(rank: int, world_size: int, port: int) -> None:
    if rank == 0:  # rank 1 leaves: rank 0 waits for it as the store's host
        setup_ddp(rank, world_size, port)


def test_a_group_that_cannot_form_says_why_first(run_ranks, own_ports):
    with pytest.raises(RankTimeout) as caught:
        run_ranks(never_comes, own_ports[0], backend=None, timeout=1.5)
    line = caught.value.headline
    assert line.startswith("rank(s) 0 still running after the harness deadline of 1.5 s: ")
    assert "rank 0 in init_process_group at test_harness_own_groups.py:" in line
    assert line.endswith(
        "; rank 1 had returned: "
        "the group did not form in init_process_group(env://): rank(s) 1 never joined"
    )
