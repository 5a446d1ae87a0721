"""The runs the pictures are drawn from: the lessons' own code, recorded, in two local worlds.

* A gloo world of ``WORLD`` ranks runs, one after the other: both rings
  (``dist_tuto/ring_trace.py``), lesson 2's blocking and non-blocking send on ranks 0 and 1
  (``dist_tuto/p2p_trace.py``), every collective of lesson 3
  (``dist_tuto/collectives_trace.py``), and DDP's buckets through two iterations
  (``ddp/buckets.py``'s comm hook and gradient hooks, buckets of ``BUCKET_CAP_MB``).
* A gloo world of 2 ranks runs D18's three pipeline schedules, one step each, the order
  of every rank's actions recorded (``ddp/pipeline_schedules.py``).
* An RPC world of 3 workers runs the RRef lifetime lesson, observed
  (``rpc/rref_trace.py``), and the distributed autograd design note's forward, its graph
  walked on both workers (``rpc/autograd_graph.py``).

Each recorder swaps nothing but what it watches, so the code that ran is the lesson's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tutorial_impl.ddp import buckets, pipeline_schedules, toy
from tutorial_impl.dist_tuto.collectives_trace import Collective, trace_collectives
from tutorial_impl.dist_tuto.p2p_trace import Span, trace_p2p
from tutorial_impl.dist_tuto.ring_trace import Step, trace_rings
from tutorial_impl.rpc.autograd_graph import Node, record_design_note_graph
from tutorial_impl.rpc.rref_trace import ProtocolStep, record_protocol
from tutorial_impl.rpc.workers import init_worker, shutdown_worker

WORLD = 4  # gloo ranks: the rings and the collectives on 4 (p2p uses ranks 0 and 1)
RPC_WORKERS = 3  # creator, owner, third (the autograd example uses the first two)
RPC_TIMEOUT = 20.0
# 656 bytes: exactly the last three gradients of the lesson's model, so that iteration 1
# has three buckets (tests/ddp/test_ddp_02_buckets.py explains the value).
BUCKET_CAP_MB = 656 / 2**20
# Modules every rank imports anyway: the forkserver imports them once, before any rank.
PRELOAD = [*buckets.PRELOAD, *pipeline_schedules.PRELOAD, "torch.distributed.rpc", __name__]
SCHEDULES = ("1F1B", "Interleaved1F1B", "InterleavedZeroBubble")
MICROBATCHES = 4


@dataclass
class Recordings:
    """Everything the pictures are drawn from."""

    rings: list[dict[str, list[Step]]]  # per rank: {"tutorial": steps, "optimal": steps}
    p2p: list[dict[str, list[Span]]]  # per rank: {"blocking": spans, "nonblocking": spans}
    collectives: list[list[Collective]]  # per rank, in call order
    bucket_calls: list[list[buckets.BucketCall]]  # rank 0's, per iteration
    ready: list[list[str]]  # rank 0's parameters in the order backward wrote their gradients
    rref: list[ProtocolStep]
    autograd: list[Node]
    schedules: dict[str, list[list[pipeline_schedules.Action]]]  # per schedule, per rank


def record_gloo(rank: int, size: int) -> dict[str, Any]:
    """A rank function (gloo): the recordings of lessons 2, 3, 4.5 and DDP's buckets."""
    log = buckets.watched_run(rank, size, BUCKET_CAP_MB)
    return {
        "rings": trace_rings(rank, size),
        "p2p": trace_p2p(rank, size),
        "collectives": trace_collectives(rank, size),
        "bucket_calls": log.per_iteration(),
        "ready": log.ready_order(),
    }


def record_schedules(rank: int, size: int) -> dict[str, list[pipeline_schedules.Action]]:
    """A rank function (gloo, 2 ranks): this rank's order under each schedule, one step."""
    x, y = toy.batch(2 * MICROBATCHES, sizes=pipeline_schedules.SIZES)
    return {
        s: pipeline_schedules.run_schedule(rank, size, s, x, y, MICROBATCHES)["actions"]
        for s in SCHEDULES
    }


def design_note_inputs() -> tuple[torch.Tensor, ...]:
    """t1, t2, t4 of the design note's example: 2x2 tensors that require grad."""
    return tuple(torch.full((2, 2), float(v), requires_grad=True) for v in (1, 2, 4))


def record_rpc(rank: int, size: int) -> dict[str, Any]:
    """A rank function (no process group: it joins RPC itself): worker0 records."""
    init_worker(rank, size, RPC_TIMEOUT)
    out: dict[str, Any] = {}
    if rank == 0:
        out["rref"] = record_protocol("worker1", "worker2")
        out["autograd"] = record_design_note_graph("worker1", *design_note_inputs())
    shutdown_worker(RPC_TIMEOUT)
    return out


def record(timeout: float) -> Recordings:
    """Both worlds, on local ranks started by the CLI's launcher."""
    from tutorial_impl import cli

    cli.add_preload(PRELOAD)
    gloo = cli.launch(record_gloo, WORLD, "gloo", timeout)
    pipes = cli.launch(record_schedules, 2, "gloo", timeout)
    rpc = cli.run_local(record_rpc, world_size=RPC_WORKERS, timeout=timeout)[0]
    return Recordings(
        rings=[r["rings"] for r in gloo],
        p2p=[r["p2p"] for r in gloo],
        collectives=[r["collectives"] for r in gloo],
        bucket_calls=gloo[0]["bucket_calls"],
        ready=gloo[0]["ready"],
        rref=rpc["rref"],
        autograd=rpc["autograd"],
        schedules={s: [ranks[s] for ranks in pipes] for s in SCHEDULES},
    )
