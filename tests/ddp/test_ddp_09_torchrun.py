"""D9. torchrun sets the workers' variables (``tutorial_impl/ddp/torchrun_env.py``).

The claim: torchrun's agents, not the workers and not the caller's environment, give each
worker ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` and the
rest: with 2 nodes of 2 workers, ranks 0..3 numbered node by node, local ranks 0 and 1 on
each node, one run id, one master. Checked against real agents: torchrun's own ``main``
(``torch.distributed.run``) runs in two forked ranks, one "node" each, with the static
rendezvous a two-machine job would use; the workers are this lesson's script, which imports
no torch, so the whole job costs about what two agents' rendezvous costs.

The expected values are the job's shape, fixed here (``NODES``, ``PER_NODE``), and what the
ranks ran with: the harness's ranks carry a torchrun-like environment of their own
(``WORLD_SIZE=2``...), so a worker that merely inherited it would fail every check.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch.distributed as dist

from tutorial_impl.ddp import torchrun_env

# A fresh world: the agent renames its process's main thread, installs signal handlers and
# rewrites the environment; none of that may reach another test.
pytestmark = pytest.mark.warm_world(False)

NODES, PER_NODE = 2, 2
SCRIPT = Path(torchrun_env.__file__)


def agent(rank: int, size: int, out: str) -> dict[str, str]:
    """Be node ``rank``'s torchrun: meet the other agent, start PER_NODE workers, wait."""
    # Node 0's agent hosts the agents' store on --master-port. A port probed free and then
    # let go could be taken by another test's process before the agent binds it (it was,
    # under pytest -n auto: EADDRINUSE). So node 0 binds the store itself first, on a port
    # the kernel picks, and keeps it: torchrun's static rendezvous makes its TCPStore with
    # ``multi_tenant=True``, which in this process finds the one listening there and uses it.
    port, held = [None], None
    if rank == 0:
        held = dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True)
        port = [held.port]
    dist.broadcast_object_list(port, src=0)
    inherited = {k: v for k, v in os.environ.items() if k in torchrun_env.VARIABLES}
    for name in list(os.environ):  # an agent must not itself look like a torchrun worker
        if name in torchrun_env.VARIABLES or name.startswith("TORCHELASTIC_"):
            del os.environ[name]
    from torch.distributed import run as torchrun

    torchrun.main(
        [
            f"--nnodes={size}",
            f"--node-rank={rank}",
            f"--nproc-per-node={PER_NODE}",
            "--master-addr=127.0.0.1",
            f"--master-port={port[0]}",
            "--max-restarts=0",
            f"--log-dir={out}/agent{rank}",  # not a torchelastic_* directory left in /tmp
            str(SCRIPT),
            "--out",
            out,
        ]
    )
    del held  # the job is over: node 0's store may go
    return inherited


def test_torchrun_numbers_workers_node_by_node(run_ranks, tmp_path: Path) -> None:
    results = run_ranks(agent, str(tmp_path), world_size=NODES)
    reports = {int(p.stem[4:]): json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}
    assert sorted(reports) == list(range(NODES * PER_NODE)), sorted(reports)
    for rank, report in reports.items():
        env = report["environ"]
        node, local = divmod(rank, PER_NODE)  # node by node
        assert env["WORLD_SIZE"] == str(NODES * PER_NODE), env
        assert env["LOCAL_RANK"] == str(local) and env["LOCAL_WORLD_SIZE"] == str(PER_NODE)
        assert env["GROUP_RANK"] == str(node) and env["GROUP_WORLD_SIZE"] == str(NODES)
        assert env["ROLE_RANK"] == env["RANK"] == str(rank)
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert report["problems"] == []  # the lesson's own checks agree
    # One job: one run id and one master (node 0's address and the port the agents met on).
    assert len({r["environ"]["TORCHELASTIC_RUN_ID"] for r in reports.values()}) == 1
    assert len({r["parsed"]["master"] for r in reports.values()}) == 1
    # What the agents' own processes carried was not what their workers got.
    assert all(inherited["WORLD_SIZE"] == str(NODES) for inherited in results)


def test_the_checks_catch_a_broken_environment() -> None:
    """``WorkerEnv.problems`` on hand-made environments: one torchrun could give, and
    two it could not."""
    good = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2",
        "ROLE_RANK": "3",
        "ROLE_WORLD_SIZE": "4",
        "MASTER_ADDR": "node0",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_RUN_ID": "job",
    }
    assert torchrun_env.WorkerEnv.read(good).problems() == []
    assert torchrun_env.WorkerEnv.read({**good, "RANK": "1"}).problems() == [
        "RANK 1 != GROUP_RANK 1 x 2 + LOCAL_RANK 1"
    ]
    assert len(torchrun_env.WorkerEnv.read({**good, "LOCAL_RANK": "2"}).problems()) == 2
    with pytest.raises(KeyError, match="not started by torchrun"):
        torchrun_env.WorkerEnv.read({})


def test_two_corners_of_torch_distributed_read_local_rank(monkeypatch) -> None:
    """``init_process_group`` never reads ``LOCAL_RANK``, but ``dist.get_node_local_rank``
    returns it (and ``init_device_mesh`` on a GPU picks ``LOCAL_RANK``'s device: read in
    ``torch/distributed/device_mesh.py``, it needs a GPU to run)."""
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert dist.get_node_local_rank() == 3
    monkeypatch.delenv("LOCAL_RANK")
    assert dist.get_node_local_rank(fallback_rank=7) == 7  # not set: the caller's fallback
    with pytest.raises(RuntimeError, match="LOCAL_RANK is not in the environment"):
        dist.get_node_local_rank()
