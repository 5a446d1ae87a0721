"""D9. torchrun: who sets RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE, and to what.

Every lesson before this one started its ranks itself. In practice one runs

    torchrun --nnodes=2 --node-rank=N --nproc-per-node=2 \\
             --master-addr=HOST --master-port=29500 train.py

once on each of two machines (``--node-rank`` 0 on one, 1 on the other). Each ``torchrun``
is an *agent*: it meets the other agents (the **rendezvous**, here "static": node 0's agent
hosts a store at ``HOST:29500``), then starts ``--nproc-per-node`` copies of ``train.py``,
the *workers*, each with these variables set. Nobody else sets them; a worker only reads:

``RANK``               this worker's place among all workers, 0 .. WORLD_SIZE-1
``WORLD_SIZE``         the number of workers in the job, over every node
``LOCAL_RANK``         its place among the workers of *its own node* (pick the GPU with it)
``LOCAL_WORLD_SIZE``   the number of workers on its node (``--nproc-per-node``)
``GROUP_RANK``         its node's (agent's) index, 0 .. GROUP_WORLD_SIZE-1
``GROUP_WORLD_SIZE``   the number of nodes (agents) that met in the rendezvous
``ROLE_RANK``, ``ROLE_WORLD_SIZE``   the same as RANK and WORLD_SIZE for a one-role job
``MASTER_ADDR``, ``MASTER_PORT``     where the workers' own rendezvous store lives
``TORCHELASTIC_RESTART_COUNT``       how many times the agents restarted the workers
``TORCHELASTIC_RUN_ID``              the job's id (``--rdzv-id``), the same on every worker

``init_process_group()`` (``env://``, the default) reads RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT, never ``LOCAL_RANK``; that one is mostly for you
(``torch.cuda.set_device(local_rank)``), but two corners of ``torch.distributed`` read it
too: ``dist.get_node_local_rank()`` returns it, and ``init_device_mesh`` on a GPU (any
non-CPU device not yet chosen) takes ``LOCAL_RANK`` as this process's device. Agents number
workers node by node, so with the same ``--nproc-per-node`` everywhere ``RANK = GROUP_RANK *
LOCAL_WORLD_SIZE + LOCAL_RANK``; RANK and LOCAL_RANK differ as soon as there is a second
node.

This file is also the worker: run as a script (``torchrun ... tutorial_impl/ddp/torchrun_env.py
[--out DIR]``) it prints, or writes to ``DIR/rank<RANK>.json``, what its agent gave it. It
imports no torch, so a worker starts in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_RUN_ID",
)


@dataclass(frozen=True)
class WorkerEnv:
    """What torchrun told one worker, as numbers."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    group_rank: int  # the node
    group_world_size: int  # the nodes
    master: str  # MASTER_ADDR:MASTER_PORT
    restart_count: int
    run_id: str

    @classmethod
    def read(cls, env: Mapping[str, str] = os.environ) -> WorkerEnv:
        missing = [name for name in VARIABLES if name not in env]
        if missing:
            raise KeyError(f"not started by torchrun? missing {', '.join(missing)}")
        return cls(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env["LOCAL_RANK"]),
            local_world_size=int(env["LOCAL_WORLD_SIZE"]),
            group_rank=int(env["GROUP_RANK"]),
            group_world_size=int(env["GROUP_WORLD_SIZE"]),
            master=f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}",
            restart_count=int(env["TORCHELASTIC_RESTART_COUNT"]),
            run_id=env["TORCHELASTIC_RUN_ID"],
        )

    def problems(self) -> list[str]:
        """How this environment breaks torchrun's rules (same ``--nproc-per-node`` on every
        node); empty when it keeps them all."""
        found = []
        if not 0 <= self.local_rank < self.local_world_size:
            found.append(f"LOCAL_RANK {self.local_rank} outside 0..{self.local_world_size - 1}")
        if not 0 <= self.rank < self.world_size:
            found.append(f"RANK {self.rank} outside 0..{self.world_size - 1}")
        if self.world_size != self.group_world_size * self.local_world_size:
            found.append(
                f"WORLD_SIZE {self.world_size} != {self.group_world_size} nodes x "
                f"{self.local_world_size} workers"
            )
        if self.rank != self.group_rank * self.local_world_size + self.local_rank:
            found.append(
                f"RANK {self.rank} != GROUP_RANK {self.group_rank} x {self.local_world_size} "
                f"+ LOCAL_RANK {self.local_rank}"
            )
        return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="torchrun ... tutorial_impl/ddp/torchrun_env.py",
        description="D9. A torchrun worker that reports the variables its agent set.",
    )
    parser.add_argument("--out", type=Path, help="write rank<RANK>.json here (else print)")
    args = parser.parse_args(argv)
    given = {name: os.environ.get(name) for name in VARIABLES}
    env = WorkerEnv.read()
    report = {"environ": given, "parsed": asdict(env), "problems": env.problems()}
    if args.out is None:
        print(json.dumps(report), flush=True)
    else:
        (args.out / f"rank{env.rank}.json").write_text(json.dumps(report))
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
