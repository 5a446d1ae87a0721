"""The torchrun lessons' bookkeeping (``tests/torchrun_in_process.py``) refuses a wrong job.

A forked worker runs ``Entry.call`` in place of the command torchrun built; that is a stand-in
only for the command it names, and only as a fork of the agent. Anything else must fail the
job before a worker starts, not run something the lesson did not ask for and pass. (What the
helper does right, the lessons that use it prove: ``test_09_elastic.py``,
``test_hybrid_cli.py``, ``test_07_torchrun.py``.) torchrun's ``main`` runs here, in the test's
own process: the stand-in refuses in its first call, before any agent, store or worker.
"""

from __future__ import annotations

import os
import sys

import pytest

from tests.torchrun_in_process import Entry, torchrun_with_forked_workers

COMMAND = ["--standalone", "--nproc_per_node=2", "-m", "tutorial_impl", "train"]


def test_a_command_other_than_the_stand_ins_or_not_forked_is_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "environ", dict(os.environ))  # torchrun sets OMP_NUM_THREADS
    calls = []
    entry = Entry(("-u", "-m", "tutorial_impl"), lambda *argv: calls.append(argv))
    other = Entry(("-u", "-m", "some_other_package"), entry.call)
    with pytest.raises(AssertionError, match="'tutorial_impl', 'train'"):
        torchrun_with_forked_workers(["--start-method=fork", *COMMAND], other, str(tmp_path))
    with pytest.raises(AssertionError, match=sys.executable):  # torchrun's default: spawn
        torchrun_with_forked_workers(COMMAND, entry, str(tmp_path))
    assert calls == [] and list(tmp_path.iterdir()) == []  # no worker ever started
