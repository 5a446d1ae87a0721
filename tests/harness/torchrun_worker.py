"""A pytest session as one worker of a torchrun job, without a fresh interpreter.

torchrun gives each worker its place in the job through the environment (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` of the store its agent hosts) and starts
``python -m pytest``; what makes a process a worker is that environment. A harness rank is a
fork of a server that has imported torch and pytest (a fresh ``python -m pytest`` imports
both again: about 2 s of CPU per worker, and as much per agent), so these cost a fraction:

* ``pytest_as_a_torchrun_worker``: a harness rank is the worker, given torchrun's variables
  here. What it leaves out is the agent: nothing restarts or tears down the job's workers
  (the tests that use it prove what the workers do among themselves).
* ``torchrun_agent_of_pytest``: a harness rank is an agent, torchrun's own ``main`` (its
  rendezvous, store, variables, monitoring and teardown); its worker is a fork of it
  (``--start-method=fork``, ``tests/torchrun_in_process.py``) that runs what
  ``python -u -m pytest ARGS`` would. Its output goes where the agent's goes.
"""

from __future__ import annotations

import contextvars
import os
import signal
import uuid
from typing import Any

import pytest

from tests.torchrun_in_process import Entry, ForkedJob, torchrun_with_forked_workers


def job_environment(store: Any, world_size: int) -> dict[str, str]:
    """What torchrun's agent puts in every worker's environment, for a job whose store
    (``rendezvous.agents_store``) the test hosts, as the agent hosts its own."""
    return {
        "TORCHELASTIC_RUN_ID": uuid.uuid4().hex,
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }


def pytest_as_a_torchrun_worker(
    rank: int, world_size: int, job: dict, project: str, args: list[str]
) -> None:
    """One worker of the job: ``pytest ARGS`` in ``project``, with torchrun's variables. The
    session ends the process itself, with the status the ranks agreed on (``os._exit``)."""
    os.environ.update({**job, "RANK": str(rank), "LOCAL_RANK": str(rank)})
    os.chdir(project)
    _pytest_session(*args)


def _pytest_session(*args: str) -> None:
    """``pytest ARGS`` in a worker of a job; the session ends the process itself, with the
    status the ranks agreed on (``os._exit``)."""
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_CURRENT_TEST"):  # not a worker of ours
        os.environ.pop(name, None)
    # What a fresh worker starts without, and a harness rank has: SIGUSR2 blocked (its
    # records' thread waits for it; the session's watchdog interrupts a test with it), and
    # context variables set (``outcome.IN_RANK``: a run_ranks call would be a nested one).
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    contextvars.Context().run(pytest.main, list(args))
    raise AssertionError("the session returned instead of ending the worker")


# What torchrun starts for ``-m pytest``, and what a forked worker runs in its place.
PYTEST_WORKER = Entry(("-u", "-m", "pytest"), _pytest_session)


def torchrun_agent_of_pytest(
    rank: int, world_size: int, args: list[str], project: str, workers: str
) -> ForkedJob:
    """One agent: ``torchrun ARGS`` (``--start-method=fork ... -m pytest ...``) in
    ``project``, its worker a fork of this rank running pytest; each worker's pid is recorded
    in ``workers``. The job fails when a worker fails, which is returned, not raised."""
    os.chdir(project)
    return torchrun_with_forked_workers(args, PYTEST_WORKER, workers, may_fail=True)
