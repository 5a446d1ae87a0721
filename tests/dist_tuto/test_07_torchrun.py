"""The training demo under ``torchrun``: two agents, one worker each, as two nodes.

What torchrun does. ``torchrun`` (``python -m torch.distributed.run``) is how the tutorial's
``run.py`` grows up. Instead of one script starting every rank, you run one torchrun per
machine, its *agent*; the agents meet at a *rendezvous* (a store all of them can reach)
and agree on who is who; then each agent starts its machine's workers, a fresh ``python -u
YOUR COMMAND`` each, with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT`` set for it (lesson D9 lists them all); watches them; and
exits 0 only if every worker did. ``cli.launch`` notices it runs under an agent
(TORCHELASTIC_RUN_ID and RANK are set) and runs just this worker's rank, so the very same
``python -m tutorial_impl train`` works both ways. On two machines:

    torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d \\
             --rdzv-endpoint=HOST:PORT --rdzv-id=JOB -m tutorial_impl train

What this module proves, on one machine standing for two:

1. How a worker ends, first: ``destroy_process_group`` forgets the group, but gloo's threads
   stop only when the last reference to the group goes. A worker that then returns from
   ``main`` lets the interpreter shut down around threads that may still touch Python
   objects: up to Python 3.13 it aborts ("terminate called without an active exception")
   after all its work was done; from 3.14 such a thread hangs instead (CPython gh-87135),
   which can deadlock the exit. ``test_gloo_threads_outlive_destroy_process_group_while_referenced``
   shows the threads outliving the group (no timing involved: a reference we hold keeps them
   for certain). So our workers end with ``process.exit_process``: flush, then ``os._exit``,
   no finalization.
2. ``test_torchrun_two_agents_form_a_two_node_job``: two agents meet, number their workers
   0 and 1, and the workers train in lockstep to the same parameters; each worker ended with
   exit status 0 and without interpreter finalization (an ``atexit`` hook, planted in every
   worker through the environment, never ran); none outlived its agent.

The workers are exactly what your torchrun starts: fresh interpreters running the command.
Each imports torch (about 2 s here), so the job trains on 256 samples for one epoch: the
point is torchrun, not the learning.

How the suite runs the job (bookkeeping, in ``tests/torchrun_in_process.py``): each agent is
torchrun's own ``main`` in a rank the harness forked, torch already imported (a fresh agent
would import it again: about 1.6 s of CPU each), and every process of the job carries a
mark, so that whatever happens none survives the test. The rendezvous needs one endpoint
both agents know in advance, and a port cannot be handed from one process to another
while it stays bound; so no agent hosts it: the test binds a ``TCPStore`` to port 0 (the
kernel picks a free one, nothing to race for under ``pytest -n auto``) and both agents join
it as clients (``--rdzv-conf is_host=0``), the "external rendezvous store" of a real
cluster. The store the *workers* use is then created by the rank-0 agent, again on port 0.
The one-node form (``--standalone``: the agent hosts the store itself) runs in
``tests/rpc/test_hybrid_cli.py``.
"""

from __future__ import annotations

import gc
import os
import re
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.torchrun_in_process import agents_with_fresh_workers
from tutorial_impl.testing.rendezvous import agents_store

pytestmark = pytest.mark.timeout(240)

DEADLINE = 150.0  # seconds for a whole torchrun job; generous, the machine is shared
TRAIN = ["-m", "tutorial_impl", "train", "--epochs", "1", "--samples", "256"]
EPOCH_LINE = re.compile(r"^Rank  (\d+) , epoch  0 :  (\d+\.\d+)$", re.MULTILINE)
DIGEST_LINE = re.compile(r"^Rank  (\d+)  parameters sha256  ([0-9a-f]{16})$", re.MULTILINE)


def thread_count() -> int:
    """Threads of this process, as the kernel lists them (gloo's own are C++ threads)."""
    return len(os.listdir("/proc/self/task"))


def leave_while_holding_the_group(rank: int, world_size: int) -> tuple[int, int, int, int]:
    """Join a gloo group, keep a reference to it, leave it: count threads at each step."""
    before = thread_count()
    dist.init_process_group("gloo")  # the harness gave us only the rendezvous environment
    world = dist.group.WORLD  # a reference, as a DDP model (or torch._dynamo) keeps one
    dist.all_reduce(torch.ones(1))
    in_group = thread_count()
    dist.destroy_process_group()
    after_destroy = thread_count()  # the group is forgotten, but ``world`` still holds it
    del world
    gc.collect()
    return before, in_group, after_destroy, thread_count()


def test_gloo_threads_outlive_destroy_process_group_while_referenced(run_ranks):
    """Leaving the group is not the end of gloo: its threads stop with the last reference.

    Had this rank returned from ``main`` right after ``destroy_process_group``, those threads
    would have been running while the interpreter shut down, which is how a torchrun worker
    aborted at exit. Here the reference is ours; in the training demo it is taken by a
    library imported after ``init_process_group`` (``torch._dynamo``, which the first
    optimizer imports), and no amount of care in the demo's own code can release it.
    """
    for before, in_group, after_destroy, after_release in run_ranks(
        leave_while_holding_the_group, backend=None
    ):
        assert in_group > before  # gloo runs threads of its own while we are in the group
        assert after_destroy == in_group  # every one of them is still there after destroy
        assert after_release == before  # dropping the last reference joins them


# Planted in every process of the job (Python imports ``sitecustomize`` at start-up, if one
# is on the path): a worker (torchrun gives it LOCAL_RANK, the agent has none) that goes
# through interpreter finalization prints FINALIZED. The command stays what a learner types.
FINALIZED = "the interpreter finalized"
WATCHING = "observer watching a worker"  # proves the hook was planted, so its silence counts
OBSERVER = f"""
import atexit, os
if "LOCAL_RANK" in os.environ:
    print("{WATCHING}", flush=True)
    atexit.register(print, "{FINALIZED}", flush=True)
"""


@pytest.mark.slow
@pytest.mark.warm_world(False)  # the agents install signal handlers and rewrite os.environ
def test_torchrun_two_agents_form_a_two_node_job(run_ranks, tmp_path: Path) -> None:
    """Two agents, one worker each, meet at a c10d rendezvous and train as ranks 0 and 1.

    One job proves what a single-node run would too: the workers train in lockstep with
    the world size torchrun gave them, and none outlives its agent. And how each worker
    ended: with its output flushed and exit status 0 (the agents exit 0 only if every
    worker did), but without interpreter finalization (the planted ``atexit`` hook never
    printed).
    """
    store = agents_store(DEADLINE)  # the rendezvous, on a port the kernel chose
    args = [  # what each machine's torchrun is given
        "--nnodes=2",
        "--nproc_per_node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{store.port}",
        f"--rdzv-id=test-{uuid.uuid4().hex[:8]}",
        "--rdzv-conf=is_host=0,join_timeout=120",  # the store is the test's, not an agent's
        "--local-addr=127.0.0.1",  # what the workers use to reach the rank-0 node
        "--max-restarts=0",
        "--monitor-interval=0.1",  # the suite's: notice the end sooner
        *TRAIN,
    ]
    outputs = agents_with_fresh_workers(run_ranks, args, 2, tmp_path, DEADLINE, OBSERVER)
    # Each agent's output holds its own worker's lines; together they form the 2-rank job.
    _check_training("\n".join(outputs), world_size=2)
    assert "2 ranks on cpu" in "\n".join(outputs)  # rank 0 saw the world size torchrun set
    ranks = [sorted(int(r) for r, _ in EPOCH_LINE.findall(out)) for out in outputs]
    assert sorted(ranks) == [[0], [1]], "each agent should run exactly one of the two ranks"
    assert "\n".join(outputs).count(WATCHING) == 2, "the observer was not planted in both workers"
    assert FINALIZED not in "\n".join(outputs), "a worker went through interpreter shutdown"


def _check_training(output: str, world_size: int) -> None:
    """Every rank trained one epoch and ended with the same parameters as every other rank."""
    losses = {int(r): float(loss) for r, loss in EPOCH_LINE.findall(output)}
    assert sorted(losses) == list(range(world_size)), output
    # An untrained 10-class classifier starts near ln(10) = 2.30; two steps barely move it.
    assert all(1.5 < loss < 3.0 for loss in losses.values()), losses
    digests = dict(DIGEST_LINE.findall(output))
    assert sorted(int(r) for r in digests) == list(range(world_size)), output
    assert len(set(digests.values())) == 1, f"replicas diverged: {digests}"
