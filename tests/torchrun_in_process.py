"""How the lessons on torchrun run a learner's ``torchrun`` command inside the suite.

Bookkeeping only. The lessons (``tests/dist_tuto/test_07_torchrun.py``,
``tests/dist_tuto/test_09_elastic.py``, ``tests/rpc/test_hybrid_cli.py``) say what torchrun
does and what the job proves; this module holds how the suite starts such a job cheaply and
makes sure that no process of it outlives its test.

Both ways call torchrun's own ``main`` (``torch.distributed.run.main(ARGS)``, what ``python -m
torch.distributed.run ARGS`` runs) in a rank the harness forked, torch already imported: a
fresh interpreter per agent would import it again (about 1.6 s of CPU each). Everything an
agent does is then torchrun's: its rendezvous, its store, the variables it gives each worker,
its monitoring, stopping and restarting. They differ in the workers:

* ``agents_with_fresh_workers``: the workers are exactly what the learner's torchrun starts,
  fresh ``python -u ...`` interpreters, each in a session of its own. They inherit a mark in
  their environment; after a clean exit "nothing left" is checked against the whole process
  table, and whatever happens every process carrying the mark is killed.
* ``torchrun_with_forked_workers``: torchrun hands ``elastic_launch`` the command each worker
  would run (``python -u -m PACKAGE ARGS``); here it is handed a function instead, ``Entry.call``
  with ``ARGS``, which the agent starts by ``--start-method=fork``: each worker a copy of the
  agent, its imports included. ``Entry.head`` says which command the function stands for, and
  the job fails if torchrun built another. The workers stay in the process group their rank
  leads, which the harness kills when the rank ends; each writes down its pid, and the rank
  waits for all of them to be gone before it returns.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import torch
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from tutorial_impl.testing import proctable

REPO = Path(__file__).resolve().parents[1]
MARK = "TUTORIAL_TORCHRUN_JOB"  # in the agents' environment, inherited by every worker
_AGENT_PID = None  # set in the agent before it forks: a forked worker sees it, a fresh one not


# --- Agents whose workers are fresh interpreters ------------------------------------------


def agent(rank: int, world_size: int, args: list[str], repo: str) -> None:
    """One agent: ``torchrun ARGS`` in this rank, from the repository's root. Its workers'
    output goes to this rank's; it raises if a worker failed, as the command exits non-zero."""
    os.chdir(repo)
    torchrun.main(args)


def agents_with_fresh_workers(
    run_ranks, args: list[str], agents: int, tmp: Path, deadline: float, sitecustomize: str = ""
) -> list[str]:
    """Run ``agents`` torchrun agents on ``args`` together, one harness rank each; return each
    agent's output (its worker's included). ``sitecustomize``: Python run at the start of every
    process of the job (an observer, planted on ``PYTHONPATH``; the command stays the
    learner's). The first agent to fail ends the run (the harness stops its peers, which would
    sit in the rendezvous until its join timeout)."""
    job = uuid.uuid4().hex
    (observer := tmp / "sitecustomize").mkdir()
    (observer / "sitecustomize.py").write_text(sitecustomize)
    path = os.pathsep.join(p for p in (str(observer), os.environ.get("PYTHONPATH")) if p)
    env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", MARK: job, "PYTHONPATH": path}
    try:
        results = run_ranks(
            agent, args, str(REPO), world_size=agents, backend=None, env=env, timeout=deadline
        )
        # A clean exit must leave nothing behind: no worker outlives its agent.
        left = proctable.wait_until_unmarked(MARK, job, timeout=10.0)
        assert not left, f"processes outlived their torchrun agents: {left}"
        return results.outputs
    finally:
        proctable.kill_marked(MARK, job)


# --- One agent whose workers are forks of it -----------------------------------------------


@dataclass(frozen=True)
class Entry:
    """What a forked worker runs in place of a command: ``head``, the start of the command as
    torchrun builds it (``("-u", "-m", "tutorial_impl")``), and ``call``, the function that
    does what the rest of it would (``tutorial_impl.__main__.main``), given the rest as strings."""

    head: tuple[str, ...]
    call: Callable[..., object]


@dataclass(frozen=True)
class ForkedJob:
    """What the agent saw: its pid, the last attempt's return values by rank, and the
    workers still alive when it looked, after the job (name -> pid; ``{}`` if none); for a
    job that failed (``may_fail``), the exit code of each of this agent's workers that failed
    (global rank -> code)."""

    agent: int
    returned: dict[int, object]
    left: dict[str, int]
    failed: dict[int, int] = field(default_factory=dict)


def _forked_worker(pids: str, call: Callable[..., object], *argv: str) -> object:
    """One worker: its pid written down under a name saying which attempt and rank it is,
    and whose copy it is (the agent's pid as its memory holds it, its parent, its process
    group); then ``call(*argv)``, whose return value the agent reads back."""
    name = f"attempt{os.environ['TORCHELASTIC_RESTART_COUNT']}_rank{os.environ['RANK']}"
    proctable.record_self(pids, name)
    Path(pids, f"{name}.agent").write_text(f"{_AGENT_PID} {os.getppid()} {os.getpgid(0)}")
    # A fresh worker makes torch's intra-op thread pool when it first needs one; a fork has the
    # agent's, dead, and torch replaces it at its first use, unguarded: two threads using it
    # at once (a parameter server's RPC threads, each in an EmbeddingBag) can find none, "pool
    # INTERNAL ASSERT FAILED ... Invalid thread pool!" (seen once in about 30 full runs). Here,
    # on the only thread there is yet, it is replaced before the worker's code runs.
    torch.set_num_threads(torch.get_num_threads())
    return call(*argv)


def torchrun_with_forked_workers(
    args: Sequence[str], entry: Entry, pids: str, may_fail: bool = False
) -> ForkedJob:
    """``torchrun ARGS`` in this rank (``ARGS`` must say ``--start-method=fork``), each worker a
    fork of this process running ``entry``; see the module's docstring. A worker that fails
    fails the agent (torchrun's ``ChildFailedError``, as the command exits non-zero); with
    ``may_fail`` the failure is returned instead (``ForkedJob.failed``)."""
    global _AGENT_PID
    _AGENT_PID = os.getpid()
    # The harness starts its ranks as daemonic processes, and multiprocessing gives a daemonic
    # process no children: lifted in this rank alone.
    multiprocessing.current_process().daemon = False
    returned: dict[int, object] = {}

    def launch(config: LaunchConfig, entrypoint: str):
        assert entrypoint == sys.executable and config.start_method == "fork", entrypoint

        def run_workers(*cmd: str) -> None:
            assert cmd[: len(entry.head)] == entry.head, cmd
            argv = cmd[len(entry.head) :]
            returned.update(elastic_launch(config, _forked_worker)(pids, entry.call, *argv))

        return run_workers

    failed: dict[int, int] = {}
    try:
        with mock.patch.object(torchrun, "elastic_launch", launch):
            torchrun.main(list(args))
    except ChildFailedError as failure:
        if not may_fail:
            raise
        failed = {rank: f.exitcode for rank, f in failure.failures.items()}
    # The job is over: none of its workers may outlive it (asked here, before this rank
    # ends: the harness kills whatever its rank leaves behind).
    left = proctable.wait_until_gone(pids, timeout=10.0)
    return ForkedJob(os.getpid(), returned, left, failed)


def assert_forks_of(pids: Path, agent: int, names: list[str]) -> None:
    """The workers recorded in ``pids`` are exactly ``names``, each a fork of ``agent``: its
    memory (the agent's pid, set before the fork), its child, in its process group."""
    assert sorted(proctable.recorded(pids)) == sorted(names)
    for name in names:
        assert (pids / f"{name}.agent").read_text() == f"{agent} {agent} {agent}", name
