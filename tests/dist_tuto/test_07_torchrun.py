"""The training demo under ``torchrun``: two agents, one worker each, as two nodes.

``torchrun`` (``python -m torch.distributed.run``) is how the tutorial's ``run.py`` grows up:
instead of our launcher forking ranks, an *agent* per machine starts the workers, and the
agents meet at a *rendezvous* to agree on ranks. ``cli.launch`` notices it runs under an
agent (TORCHELASTIC_RUN_ID and RANK are set) and runs just this worker's rank, so the very same
``python -m tutorial_impl train`` works both ways.

Ports, race-free under ``pytest -n auto``:

* one node: ``--standalone`` makes the agent host the rendezvous store on port 0, so the
  kernel picks a free port while binding; nothing to race for. That form runs in
  ``tests/rpc/test_hybrid_cli.py`` (four workers, one agent); here one two-agent job proves
  the rest, since each torchrun job costs seconds.
* two agents: a c10d rendezvous needs one endpoint that *both* agents know in advance, and a
  port cannot be handed from one process to another while it stays bound. So we do not let an
  agent host it at all: the test process binds a ``TCPStore`` to port 0 (atomic, like the
  harness's own store), and both agents join it as clients (``--rdzv-conf is_host=0``). That is
  the "external rendezvous store" setup of a real cluster (etcd or a TCPStore on a login
  node). The store the *workers* use is then created by the rank-0 agent, again on port 0.

Each agent is torchrun's own ``main`` (``torch.distributed.run``), called in a rank the
harness forked, torch already imported: ``python -m torch.distributed.run ARGS`` would import
it again for each (about 1.6 s of CPU). Everything an agent does is torchrun's, and each
worker is the fresh ``python -u -m tutorial_impl train ...`` it starts, whose end is the
lesson below. Each worker imports torch (about 2 s here), so the job trains on 256 samples
for one epoch: the point is the plumbing, not the learning.

How a worker ends is a lesson of its own, and it comes first. ``destroy_process_group``
forgets the group, but gloo's threads stop only when the last reference to the group goes;
a worker that then returns from ``main`` lets the interpreter shut down around threads that
may still touch Python objects: up to Python 3.13 it aborts ("terminate called without an
active exception") after all its work was done; from 3.14 such a thread hangs instead
(CPython gh-87135), which can deadlock the exit. The first test shows the threads outliving
the group (no timing involved: a reference we hold keeps them for certain); the torchrun job
then shows how our workers end instead (``process.exit_process``: flush, then ``os._exit``, no
finalization): an ``atexit`` hook, planted in every worker through the environment, never
runs.
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
from torch.distributed import run as torchrun

from tutorial_impl.testing import proctable
from tutorial_impl.testing.rendezvous import agents_store

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[2]
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


MARK = "TUTORIAL_TORCHRUN_JOB"  # in the agents' environment, inherited by every worker


# Planted in every process of the job through PYTHONPATH (Python imports ``sitecustomize`` at
# start-up, if one is on the path): a worker (torchrun gives it LOCAL_RANK, the agent has
# none) that goes through interpreter finalization prints this line. The command itself
# stays exactly what a learner types.
FINALIZED = "the interpreter finalized"
WATCHING = "observer watching a worker"  # proves the hook was planted, so its silence counts
OBSERVER = f"""
import atexit, os
if "LOCAL_RANK" in os.environ:
    print("{WATCHING}", flush=True)
    atexit.register(print, "{FINALIZED}", flush=True)
"""


def agent(rank: int, world_size: int, args: list[str], repo: str) -> None:
    """One agent of the job: torchrun's own ``main``, in this rank, as ``python -m
    torch.distributed.run ARGS`` runs it (a fresh interpreter would import torch for it
    again: about 1.6 s of CPU an agent). Its worker is what a learner's torchrun starts, a
    fresh ``python -u -m tutorial_impl train ...``, whose output goes to this rank's. It
    raises if its worker failed, as the command exits non-zero."""
    os.chdir(repo)
    torchrun.main(args)


def _run_agents(run_ranks, args: list[str], log_dir: Path) -> list[str]:
    """Run two torchrun agents together, in two harness ranks; return their outputs.

    torchrun starts each worker in a session of its own, so neither the agent's session nor
    its process group reaches the workers. The environment does: every worker of this job
    inherits a mark (``proctable.marked``), so after a clean exit "nothing left" is checked
    against the whole process table, and whatever happens (failure, deadline, Ctrl-C) the
    ``finally`` kills every process carrying the mark. The first agent to fail ends the run
    (the harness stops its peer, which would sit in the rendezvous until its join timeout).
    """
    job = uuid.uuid4().hex
    observer = log_dir / "observer"
    observer.mkdir()
    (observer / "sitecustomize.py").write_text(OBSERVER)
    path = os.pathsep.join(p for p in (str(observer), os.environ.get("PYTHONPATH")) if p)
    env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", MARK: job, "PYTHONPATH": path}
    try:
        results = run_ranks(
            agent, args, str(REPO), world_size=2, backend=None, env=env, timeout=DEADLINE
        )
        # A clean exit must leave nothing behind: no worker outlives its agent.
        left = proctable.wait_until_unmarked(MARK, job, timeout=10.0)
        assert not left, f"processes outlived their torchrun agents: {left}"
        return results.outputs
    finally:
        proctable.kill_marked(MARK, job)


def _check_training(output: str, world_size: int) -> None:
    """Every rank trained one epoch and ended with the same parameters as every other rank."""
    losses = {int(r): float(loss) for r, loss in EPOCH_LINE.findall(output)}
    assert sorted(losses) == list(range(world_size)), output
    # An untrained 10-class classifier starts near ln(10) = 2.30; two steps barely move it.
    assert all(1.5 < loss < 3.0 for loss in losses.values()), losses
    digests = dict(DIGEST_LINE.findall(output))
    assert sorted(int(r) for r in digests) == list(range(world_size)), output
    assert len(set(digests.values())) == 1, f"replicas diverged: {digests}"


@pytest.mark.slow
@pytest.mark.warm_world(False)  # the agents install signal handlers and rewrite os.environ
def test_torchrun_two_agents_form_a_two_node_job(run_ranks, tmp_path: Path) -> None:
    """Two agents, one worker each, meet at a c10d rendezvous and train as ranks 0 and 1.

    One job proves what a single-node run would too: the workers train in lockstep with
    the world size torchrun gave them, and none outlives its agent. And how each worker
    ended: with its output flushed and exit status 0 (the agents exit 0 only if every
    worker did), but without interpreter finalization (the planted ``atexit`` hook never
    printed). (The one-node form, ``--standalone``, runs in
    ``tests/rpc/test_hybrid_cli.py``: four workers, one agent.)
    """
    # The test owns the rendezvous store, bound to a port the kernel chose (see the module
    # docstring); the agents are clients, so no process has to guess a free port.
    store = agents_store(DEADLINE)
    args = [
        "--monitor-interval=0.1",
        "--nnodes=2",
        "--nproc_per_node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{store.port}",
        f"--rdzv-id=test-{uuid.uuid4().hex[:8]}",
        "--rdzv-conf=is_host=0,join_timeout=120",
        "--local-addr=127.0.0.1",  # what the workers use to reach the rank-0 node
        "--max-restarts=0",
        *TRAIN,
    ]
    outputs = _run_agents(run_ranks, args, tmp_path)
    # Each agent's output holds its own worker's lines; together they form the 2-rank job.
    _check_training("\n".join(outputs), world_size=2)
    assert "2 ranks on cpu" in "\n".join(outputs)  # rank 0 saw the world size torchrun set
    ranks = [sorted(int(r) for r, _ in EPOCH_LINE.findall(out)) for out in outputs]
    assert sorted(ranks) == [[0], [1]], "each agent should run exactly one of the two ranks"
    assert "\n".join(outputs).count(WATCHING) == 2, "the observer was not planted in both workers"
    assert FINALIZED not in "\n".join(outputs), "a worker went through interpreter shutdown"
