"""T7. torchrun: the training demo as a job of two agents, one worker each, as two nodes.

The idea. ``torchrun`` (``python -m torch.distributed.run``) is how the tutorial's ``run.py``
grows up. Instead of one script starting every rank, you run one torchrun per machine, its
*agent*; the agents meet at a *rendezvous* (a store all of them can reach) and agree on who
is who; then each agent starts its machine's workers, a fresh ``python -u YOUR COMMAND``
each, with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set
for it (lesson D9 lists them all); watches them; and exits 0 only if every worker did. A
worker is an ordinary process: ``dist.init_process_group("gloo")``, with no rank, no world
size and no address, reads those variables and joins. ``cli.launch`` notices it runs under
an agent (TORCHELASTIC_RUN_ID and RANK are set) and runs just this worker's rank, so the very
same ``python -m tutorial_impl train`` works both ways. On two machines:

    torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d \\
             --rdzv-endpoint=HOST:PORT --rdzv-id=JOB -m tutorial_impl train

Read in this order:

1. ``test_a_worker_joins_from_the_variables_and_its_threads_outlive_destroy`` (plain torch):
   a worker joins with ``init_process_group("gloo")`` alone, and both ranks hold the sum of
   one all-reduce; then how a worker ends. ``destroy_process_group`` forgets the group, but
   gloo's threads stop only when the last reference to the group goes. A worker that then
   returns from ``main`` lets the interpreter shut down around threads that may still touch
   Python objects: up to Python 3.13 it aborts ("terminate called without an active
   exception") after all its work was done; from 3.14 such a thread hangs instead (CPython
   gh-87135), which can deadlock the exit. The test shows the threads outliving the group
   (no timing involved: a reference we hold keeps them for certain). So our workers end with
   ``process.exit_process``: flush, then ``os._exit``, no finalization.
2. ``test_torchrun_two_agents_form_a_two_node_job``: two agents meet, number their workers 0
   and 1, and the workers train in lockstep to the same parameters; each worker ended with
   exit status 0 and without interpreter finalization; none outlived its agent.
3. At the bottom, the machinery of that job (you need not read it to follow the lesson).

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
How each worker ended is seen by an observer planted through ``sitecustomize``: an ``atexit``
hook that prints if the interpreter finalizes. The one-node form (``--standalone``: the
agent hosts the store itself) runs in ``tests/rpc/test_hybrid_cli.py``.
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


# ---- The idea: a worker is a process given five variables; how it must end --------------


def thread_count() -> int:
    """Threads of this process, as the kernel lists them (gloo's own are C++ threads)."""
    return len(os.listdir("/proc/self/task"))


def leave_while_holding_the_group(rank: int, world_size: int) -> tuple[float, int, int, int, int]:
    """A worker's life in plain torch: join from the variables alone (the harness set them
    as torchrun would: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), all-reduce,
    keep a reference to the group, leave it; count threads at each step."""
    before = thread_count()
    dist.init_process_group("gloo")  # no rank, no world size, no address: all from env://
    world = dist.group.WORLD  # a reference, as a DDP model (or torch._dynamo) keeps one
    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total)  # 1 + 2: only if both workers found the same group
    in_group = thread_count()
    dist.destroy_process_group()
    after_destroy = thread_count()  # the group is forgotten, but ``world`` still holds it
    del world
    gc.collect()
    return total.item(), before, in_group, after_destroy, thread_count()


def test_a_worker_joins_from_the_variables_and_its_threads_outlive_destroy(run_ranks):
    """A worker joins from the variables alone: both ranks must now hold 1 + 2 = 3. And
    leaving the group is not the end of gloo: its threads stop with the last reference.

    Had this rank returned from ``main`` right after ``destroy_process_group``, those threads
    would have been running while the interpreter shut down, which is how a torchrun worker
    aborted at exit. Here the reference is ours; in the training demo it is taken by a
    library imported after ``init_process_group`` (``torch._dynamo``, which the first
    optimizer imports), and no amount of care in the demo's own code can release it.
    """
    for total, before, in_group, after_destroy, after_release in run_ranks(
        leave_while_holding_the_group, backend=None
    ):
        assert total == 3.0  # both workers joined one group, from the environment alone
        assert in_group > before  # gloo runs threads of its own while we are in the group
        assert after_destroy == in_group  # every one of them is still there after destroy
        assert after_release == before  # dropping the last reference joins them


# ---- The real thing: two torchrun agents, as two nodes --------------------------------


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
    store = agents_store(DEADLINE)  # the rendezvous, on a port the kernel chose (see below)
    args = two_node_args(store.port)  # what each machine's torchrun is given
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


# ---- Machinery: the job's command line, and the observer planted in its workers ---------


def two_node_args(port: int) -> list[str]:
    """What each machine's torchrun is given: the learner's two-node command, with the
    rendezvous at the test's own store (``port``) and what the suite adds."""
    return [
        "--nnodes=2",
        "--nproc_per_node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id=test-{uuid.uuid4().hex[:8]}",
        "--rdzv-conf=is_host=0,join_timeout=120",  # the store is the test's, not an agent's
        "--local-addr=127.0.0.1",  # what the workers use to reach the rank-0 node
        "--max-restarts=0",
        "--monitor-interval=0.1",  # the suite's: notice the end sooner
        *TRAIN,
    ]


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
