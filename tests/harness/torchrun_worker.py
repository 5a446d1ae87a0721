"""A pytest session as one worker of a torchrun job, run in a harness rank.

torchrun gives each worker its place in the job through the environment (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` of the store its agent hosts) and starts
``python -m pytest``; what makes a process a worker is that environment. A harness rank is a
fork of a server that has imported torch and pytest (a fresh ``python -m pytest`` imports
both again: about 2 s of CPU per worker), so these workers cost a fraction of torchrun's.
What they leave out is the agent: nothing here restarts or tears down the job's workers
(``test_harness_conformance``'s main job has the agents; the tests that use this prove what
the workers do among themselves).
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import pytest


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
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_CURRENT_TEST"):  # not a worker of ours
        os.environ.pop(name, None)
    os.chdir(project)
    pytest.main(args)
    raise AssertionError("the session returned instead of ending the worker")
