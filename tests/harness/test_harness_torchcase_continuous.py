"""torch's ``MultiProcContinuousTest`` classes, unmodified, on the harness's warm worlds.

torch's continuous harness keeps one set of spawned processes for a whole class and feeds them
one test after another; a failure "poisons" the class, and torch skips every test after it.
A stranger's project (no conftest, only the installed plugin) holds two such classes
(``STRANGER``: gloo, world 2). Run once by torch's own harness, its processes started from a
fork context (``FORKED_BY_TORCH``: a spawned interpreter per rank costs seconds here), and once
with the plugin, whose ranks are a warm world's: the same verdicts test by test, but the test
after a failure, which torch skips and the plugin runs in a fresh world; the raising rank
named first; the class's tests served by one world while nothing fails; nothing left running.
Old code (before ``torchcase_continuous``): the plugin left these classes to torch's harness,
which took 193 s for this file (136 s of it rank 0 waiting out the group's 120 s timeout in a
barrier after rank 1 raised) where the plugin takes seconds.
"""

from __future__ import annotations

import os
import re
from datetime import timedelta

import porting_preload  # noqa: F401 - torch's TestCase module, preloaded (it says why)
import pytest
from test_harness_torchcase import ARGS, verdicts
from torch.testing._internal.common_distributed import MultiProcContinuousTest

from tutorial_impl.testing import proctable, torchcase_continuous

pytest_plugins = ["pytester"]

STRANGER = """\
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import TEST_SKIPS, MultiProcContinuousTest
from torch.testing._internal.common_utils import SEED

from tutorial_impl.testing import proctable


def note(test):
    proctable.record_self(Path(__file__).with_name("pids"), f"{test}-{dist.get_rank()}")


class Plain(MultiProcContinuousTest):
    world_size = 2

    def test_a_all_reduce(self):
        note("a")
        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        self.assertEqual(t, torch.tensor([3.0]))

    def test_b_knows_its_rank(self):
        note("b")
        assert (self.rank, self.world_size) == (dist.get_rank(), 2)
        assert os.environ["LOCAL_RANK"] == str(self.rank)
        seeded = torch.Generator().manual_seed(SEED)  # every rank starts from torch's seed
        assert torch.equal(torch.rand(2), torch.rand(2, generator=seeded))

    def test_c_exit_skip(self):
        sys.exit(TEST_SKIPS["small_worldsize"].exit_code)

    def test_d_skiptest_fails(self):
        self.skipTest("not here")


class Poisoned(MultiProcContinuousTest):
    world_size = 2

    def test_a_raises(self):
        note("raises")
        if self.rank == 1:
            raise ValueError("boom on rank one")

    def test_b_after_a_failure(self):
        note("after")
        dist.barrier()


class NeverAsks(MultiProcContinuousTest):
    def setUp(self):  # never asks for processes: torch's dispatcher runs the body right here
        pass

    def test_runs_in_the_pytest_process(self):
        Path(__file__).with_name("ran-in").write_text(str(os.getpid()))


def test_z_the_plugin_left_the_classes_as_they_were():  # torch's harness leaves its state
    for cls in (Plain, Poisoned):
        assert not {"_spawn_processes", "_processes_spawned", "task_queues"} & set(vars(cls))
"""

# The same classes, their processes started by a ``_spawn_processes`` of their own that forks
# (torch's spawns interpreters): torch's harness still feeds and judges them, and the plugin
# leaves such a class to torch's harness, saying why.
FORKING = """
    @classmethod
    def _spawn_processes(cls, world_size):
        context = torch.multiprocessing.get_context("fork")
        cls.rdvz_file = str(Path(__file__).with_name(f"store-{cls.__name__}"))
        cls.processes, cls.task_queues, cls.completion_queues = [], [], []
        for rank in range(world_size):
            tasks, done = context.Queue(), context.Queue()
            args = (rank, world_size, cls.rdvz_file, tasks, done)
            process = context.Process(target=cls._worker_loop, args=args, daemon=True)
            process.start()
            cls.processes.append(process)
            cls.task_queues.append(tasks)
            cls.completion_queues.append(done)
"""
FORKED_BY_TORCH = STRANGER.replace("    world_size = 2\n", "    world_size = 2\n" + FORKING)

# torch's own harness, test by test (the run below checks it every time): outcome, and for a
# skip its reason. A ``self.skipTest`` in a rank fails there (torch's worker sends it to the
# parent as an error); the test after a failure is skipped (the poison pill).
TORCH = {
    "test_a_all_reduce": ("passed", ""),
    "test_b_knows_its_rank": ("passed", ""),
    "test_c_exit_skip": ("skipped", "Skipped due to small world size."),
    "test_d_skiptest_fails": ("failed", ""),
    "test_a_raises": ("failed", ""),
    "test_b_after_a_failure": ("skipped", "Previous test failed, skipping "),
}
TORCH["test_runs_in_the_pytest_process"] = ("passed", "")
# Where the plugin does better: the world that saw a failure is replaced, nothing is skipped;
# and it leaves the user's classes as they were.
PLUGIN = {**TORCH, "test_b_after_a_failure": ("passed", "")}
PLUGIN["test_z_the_plugin_left_the_classes_as_they_were"] = ("passed", "")
FIRST_LINES = {  # where torch says "RuntimeError: Exception in worker process: ..."
    "test_a_raises": r"^rank 1 raised ValueError: boom on rank one$",
    "test_d_skiptest_fails": r"^rank \d raised \S*WorkerSkipTest: not here \(a SkipTest raised",
}


def outcomes(found: dict[str, tuple[str, str]]) -> dict[str, str]:
    return {name: outcome for name, (outcome, _) in found.items()}


@pytest.mark.slow
@pytest.mark.timeout(600)  # seconds quiet, a minute or two on an overloaded machine
def test_a_continuous_class_runs_on_warm_worlds_with_torchs_verdicts(pytester):
    (pytester.path / "pids").mkdir()
    pytester.makepyfile(test_stranger=FORKED_BY_TORCH)
    torch_run = verdicts(pytester.runpytest_inprocess(*ARGS, "--torch-harness", "-k", "not test_z"))
    # torch's verdicts, live: what the plugin is held to below.
    assert outcomes(torch_run) == outcomes(TORCH)
    for name, (_, reason) in TORCH.items():
        assert reason in torch_run[name][1], name

    pytester.makepyfile(test_stranger=STRANGER)
    for old in [*(pytester.path / "pids").iterdir(), pytester.path / "ran-in"]:
        old.unlink()
    result = pytester.runpytest_inprocess(*ARGS)
    mine = verdicts(result)
    assert outcomes(mine) == outcomes(PLUGIN)
    assert mine["test_c_exit_skip"][1].endswith(TORCH["test_c_exit_skip"][1])
    for name, first in FIRST_LINES.items():
        assert re.search(first, mine[name][1]), (name, mine[name])
    text = result.stdout.str()
    assert "Started process" not in text  # torch's spawn log: no interpreter was spawned
    assert "RuntimeError: Exception in worker process" not in text
    assert (pytester.path / "ran-in").read_text() == str(os.getpid())  # as torch ran it

    # One world served the class's tests while nothing failed; a fresh one after the failure.
    pids = {name: pid for name, (pid, _) in proctable.recorded(pytester.path / "pids").items()}
    assert [pids["a-0"], pids["a-1"]] == [pids["b-0"], pids["b-1"]]
    assert not {pids["raises-0"], pids["raises-1"]} & {pids["after-0"], pids["after-1"]}
    assert re.search(r"warm worlds: \d+ started, [1-9]\d* reuses?", text)
    assert not proctable.wait_until_gone(pytester.path / "pids")  # every rank ended with it


def test_what_a_continuous_class_cannot_run_here_is_named():
    class OwnGroup(MultiProcContinuousTest):
        @classmethod
        def _init_pg(cls, rank, world_size, rdvz_file):
            pass

    class Impatient(MultiProcContinuousTest):
        timeout = timedelta(seconds=5)

    class OnNccl(MultiProcContinuousTest):
        @classmethod
        def backend_str(cls):
            return "nccl"

    class Gloo(MultiProcContinuousTest):
        @classmethod
        def backend_str(cls):
            return "gloo"

    base = MultiProcContinuousTest
    assert torchcase_continuous.cannot(Gloo, base) is None
    assert torchcase_continuous.cannot(base, base) is None
    assert torchcase_continuous.cannot(OwnGroup, base).endswith("defines _init_pg for itself")
    assert "sets its group's timeout (0:00:05)" in torchcase_continuous.cannot(Impatient, base)
    assert "with backend 'nccl'" in torchcase_continuous.cannot(OnNccl, base)
