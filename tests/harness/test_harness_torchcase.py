"""torch's own ``MultiProcessTestCase`` classes, unmodified, on the harness's forked ranks.

A stranger's project (no conftest, only the installed plugin) holds a small test class written
against torch's harness as PyTorch's own are (``STRANGER``: gloo, world 2, a group on
``self.file_name``). With the plugin, ``pytest`` runs it on ranks forked from the harness's
forkserver, with torch's verdict test by test (``TORCH``, what torch's own harness gave for every
test: ``pytest --torch-harness`` on this file, recorded in docs/benchmarks.md), the raising
rank named first, every rank's stack at a hang, nothing left running, no store's file left
(``test_fails_holding_its_store``: torch's last rank deletes it); ``--torch-harness``
hands a test back to torch's harness, whose verdict is the same (one test here, its processes
started by torch's harness from a fork context: a spawned interpreter costs ~6 s of CPU here).
Old code (before ``torchcase``): every test ran under torch's harness, so the first lines below
("rank 1 raised ...") were torch's ("Process 1 exited with error code 10 ...") and the run took
minutes.
"""

from __future__ import annotations

import os
import re
import types

import porting_preload  # noqa: F401 - torch's TestCase module, preloaded (it says why)
import pytest
import torch.testing._internal.common_distributed  # noqa: F401 - the ranks' import, preloaded

from tutorial_impl.testing import proctable, torchcase
from tutorial_impl.testing.rank.torchcase import exit_code

pytest_plugins = ["pytester"]
ARGS = ["-p", "no:cacheprovider", "-p", "no:randomly", "-p", "no:xdist", "-rA"]

STRANGER = """\
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing._internal import common_distributed
from torch.testing._internal.common_distributed import (
    TEST_SKIPS,
    MultiProcessTestCase,
    requires_gloo,
    skip_if_lt_x_gpu,
)

common_distributed.TIMEOUT_OVERRIDE["test_hang"] = 4  # torch's own way to a shorter timeout


class GlooTest(MultiProcessTestCase):
    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        test = getattr(self, self._testMethodName).__wrapped__  # what join_or_run wrapped
        if self._testMethodName == "test_special_code":
            self.special_return_code_checks = {test: 3}
        if self._testMethodName == "test_any_code":
            self.skip_return_code_checks = [test]
        self._spawn_processes()

    def _group(self):
        store = dist.FileStore(self.file_name, self.world_size)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size)

    @requires_gloo()
    def test_all_reduce(self):
        self._group()
        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        self.assertEqual(t, torch.tensor([3.0]))

    def test_raises(self):
        self._group()
        if self.rank == 1:
            raise ValueError("boom on rank one")
        dist.barrier()

    @skip_if_lt_x_gpu(2)
    def test_needs_gpus(self):
        self._group()

    def test_exit_skip(self):
        Path(__file__).with_name("unused-store").write_text(self.file_name)
        sys.exit(TEST_SKIPS["small_worldsize"].exit_code)

    def test_hang(self):
        Path(__file__).with_name(f"pid-{self.rank}").write_text(str(os.getpid()))
        self._group()
        if self.rank == 0:
            dist.barrier()
        else:
            time.sleep(60)

    def test_early_return(self):
        self._group()
        if self.rank == 0:
            dist.barrier()

    def test_wrong_value(self):
        self._group()
        t = torch.tensor([float(self.rank)])
        dist.all_reduce(t)
        self.assertEqual(t.item(), 1.0 if self.rank == 0 else 2.0)

    def test_special_code(self):
        sys.exit(3 if self.rank == 0 else 0)

    def test_any_code(self):
        os._exit(7)

    def test_rank_one_exits(self):
        if self.rank == 1:
            sys.exit(3)

    def test_knows_its_rank(self):
        assert (self.rank, self.world_size, self.file_name) == (
            int(os.environ["RANK"]), 2, self.file_name
        )

    def test_fails_holding_its_store(self):
        Path(__file__).with_name("store").write_text(self.file_name)
        self._group()
        dist.barrier()
        self.assertEqual(self.rank, -1)  # every rank fails, its default group still open
"""

# A module off the harness, one class of it back on; a class that spawns in a way of its own.
SWITCH = """\
from pathlib import Path

import pytest
from torch.testing._internal.common_distributed import MultiProcessTestCase

pytestmark = pytest.mark.torch_harness


@pytest.mark.torch_harness(False)
class Back(MultiProcessTestCase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def _check_return_codes(self, fn, elapsed_time):  # a class's own check is honoured
        assert 0 <= elapsed_time < 600, elapsed_time
        print(f"checked codes {[p.exitcode for p in self.processes]}")
        super()._check_return_codes(fn, elapsed_time)

    def test_on_the_harness(self):
        import sys
        assert "tutorial_impl.testing.rank.main" in sys.modules


class NeverSpawns(MultiProcessTestCase):  # its setUp never spawns: torch runs nothing, passes
    @pytest.mark.torch_harness(False)
    def test_not_run(self):
        raise AssertionError("never runs: no rank was started")


@pytest.mark.torch_harness(False)
class NoDevices(MultiProcessTestCase):  # FSDPTest's world on a CPU host: min(8, GPU count)
    @property
    def world_size(self):
        return 0

    def setUp(self):
        super().setUp()
        Path(__file__).with_name("none-store").write_text(self.file_name)
        self._spawn_processes()

    def test_a_world_of_none(self):
        raise AssertionError("never runs: torch starts no rank, and passes")


@pytest.mark.torch_harness(False)
class OneRank(MultiProcessTestCase):  # a world of one is a world: its rank runs the test
    @property
    def world_size(self):
        return 1

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def test_a_world_of_one(self):
        Path(__file__).with_name("one-rank").write_text(str(self.rank))


@pytest.mark.torch_harness(False)
class OwnSpawn(MultiProcessTestCase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def _spawn_processes(self):
        pass  # torch's join then finds no process: it passes, saying so

    def test_nothing_spawned(self):
        raise AssertionError("never runs: no rank was started")
"""

# torch's own harness, test by test (``pytest --torch-harness`` on STRANGER): outcome, and
# for a skip its reason. A rank other than 0 that exits with a code of its own passes
# (torch reads rank 0's code only); os._exit in every rank passes where the test says that
# any code will do.
TORCH = {
    "test_all_reduce": ("passed", ""),
    "test_raises": ("failed", ""),
    "test_needs_gpus": ("skipped", "Need at least 2 CUDA devices"),
    "test_exit_skip": ("skipped", "Skipped due to small world size."),
    "test_hang": ("failed", ""),
    "test_early_return": ("failed", ""),
    "test_wrong_value": ("failed", ""),
    "test_special_code": ("passed", ""),
    "test_any_code": ("passed", ""),
    "test_rank_one_exits": ("passed", ""),
    "test_knows_its_rank": ("passed", ""),
    "test_fails_holding_its_store": ("failed", ""),
}
# What the harness says first (patterns) where torch says "Process 0 exited with error code
# 10 ..." (the victim first) or "Process 0 terminated or timed out after 4.1 seconds".
FIRST_LINES = {
    "test_raises": r"rank 1 raised ValueError: boom on rank one$",
    "test_wrong_value": r"rank 1 raised AssertionError: Scalars are not close!",
    "test_hang": r"rank\(s\) 0, 1 still running after the harness deadline of 4 s: rank 0 "
    r"waits in barrier #1 at test_stranger.py:\d+; rank 1 never reached #1",
    # the early return, seen as a hang that cannot resolve or as the echo of rank 1's exit
    "test_early_return": r"rank\(s\) 1 had returned|which rank 1 never entered",
}


def verdicts(result: pytest.RunResult) -> dict[str, tuple[str, str]]:
    """Each test's outcome and its first line (a skip's reason, a failure's headline)."""
    found = {}
    for rep in result.reprec.getreports("pytest_runtest_logreport"):  # type: ignore[attr-defined]
        if rep.when == "call" or rep.outcome != "passed":
            crash = getattr(rep.longrepr, "reprcrash", None)
            line = crash.message if crash else rep.longrepr[2] if rep.skipped else ""
            found[rep.nodeid.rpartition("::")[2]] = (rep.outcome, line)
    return found


@pytest.mark.slow
@pytest.mark.timeout(600)  # ~40 s on a quiet 2-core machine; minutes when it is overloaded
def test_an_unmodified_torch_class_runs_on_forked_ranks_with_torchs_verdicts(pytester):
    pytester.makepyfile(test_stranger=STRANGER, test_switch=SWITCH)
    result = pytester.runpytest_inprocess(*ARGS)
    got = verdicts(result)
    mine = {k: v for k, v in got.items() if k in TORCH}
    assert {k: v[0] for k, v in mine.items()} == {k: v[0] for k, v in TORCH.items()}
    for name, (outcome, reason) in TORCH.items():
        if outcome == "skipped":
            assert mine[name][1].endswith(reason), name
    for name, first in FIRST_LINES.items():
        assert re.search(first, mine[name][1]), (name, mine[name])
    assert "Process 1 exited with error code 10" not in result.stdout.str()
    text = result.stdout.str()
    sleep = STRANGER.splitlines().index("            time.sleep(60)") + 1
    stacks = text.partition("Python stacks of rank 1")[2]  # every live rank's, at the hang
    assert f'test_stranger.py", line {sleep} in test_hang' in stacks
    assert "Started process" not in text  # torch's spawn log: no interpreter was spawned
    # The switch: the module is off, its class marked back on ran on forked ranks.
    assert got["test_on_the_harness"][0] == "passed"
    assert got["test_nothing_spawned"][0] == "passed"  # torch's harness: nothing was started
    assert got["test_not_run"][0] == "passed"  # on the harness: nothing started either
    assert got["test_a_world_of_none"][0] == "passed"  # torch's join: no process, a pass
    assert not os.path.exists(pytester.path.joinpath("none-store").read_text())
    assert got["test_a_world_of_one"][0] == "passed"
    assert pytester.path.joinpath("one-rank").read_text() == "0"  # its rank ran it
    assert "checked codes [0, 0, 0, 0]" in text  # Back's own check had the codes (world 4)
    assert re.search(
        r"TorchHarnessWarning: \S+test_nothing_spawned ran under torch's own "
        r"harness: OwnSpawn defines _spawn_processes for itself",
        text,
    )
    pids = [int(pytester.path.joinpath(f"pid-{r}").read_text()) for r in range(2)]
    assert pids and not [pid for pid in pids if proctable.running(pid)]  # killed at the hang
    # torch's last rank out deletes the FileStore's file, a failed test's too; the harness
    # kills its ranks, so it does that for them (before: the file stayed, one per failure)
    store = pytester.path.joinpath("store").read_text()
    assert store and not os.path.exists(store), store
    unused = pytester.path.joinpath("unused-store").read_text()  # torch's harness leaves it
    assert unused and not os.path.exists(unused), unused


# The same class, its processes started by torch's own ``_start_processes`` from a fork
# context instead of ``_spawn_processes``: torch's harness still starts, joins and judges them,
# without two spawned interpreters importing torch and its test utilities (13 s of CPU of the
# suite's ~280, against about 1 s forked).
FORKED_BY_TORCH = STRANGER.replace(
    "self._spawn_processes()",
    'self._start_processes(torch.multiprocessing.get_context("fork").Process)',
)


@pytest.mark.slow
@pytest.mark.timeout(600)  # two processes forked by torch: seconds quiet, a minute overloaded
def test_switched_off_torchs_own_harness_gives_the_same_verdict(pytester):
    """The smallest slice both ways: torch starts its own processes and names a failed one."""
    assert FORKED_BY_TORCH != STRANGER
    pytester.makepyfile(test_stranger=FORKED_BY_TORCH)
    result = pytester.runpytest_inprocess(*ARGS, "--torch-harness", "-k", "test_raises")
    got = verdicts(result)
    assert {k: v[0] for k, v in got.items()} == {"test_raises": TORCH["test_raises"][0]}
    # torch names the first process its join loop finds failed: rank 1, which raised, or rank
    # 0, whose barrier broke when rank 1 exited (forked processes start fast enough for either).
    assert re.match(r"RuntimeError: Process [01] exited with error code 10", got["test_raises"][1])
    assert "Started process 1" in result.stdout.str()  # torch's own start of its processes


def _item(marker=None, option=None, ini=False):
    marks = {"torch_harness": marker} if marker is not None else {}
    config = types.SimpleNamespace(
        getoption=lambda name: {"--torch-harness": option}[name],
        getini=lambda name: {"torch_harness": ini}[name],
    )
    return types.SimpleNamespace(get_closest_marker=marks.get, config=config)


def _mark(*args, **kwargs):
    return types.SimpleNamespace(args=args, kwargs=kwargs)


@pytest.mark.parametrize(
    ("item", "off"),
    [
        (_item(), False),
        (_item(ini=True), True),
        (_item(option=True), True),
        (_item(option=False, ini=True), False),  # the command line over the ini
        (_item(_mark()), True),
        (_item(_mark(False), option=True), False),  # a marker over the session
        (_item(_mark(enabled=False), ini=True), False),
        (_item(_mark(True)), True),
    ],
)
def test_one_switch_for_a_class_a_file_or_the_session(item, off):
    assert torchcase._switched_off(item) is off


@pytest.mark.parametrize(
    ("marked", "option", "set_"), [(False, None, False), (True, None, True), (False, 30.0, True)]
)
def test_torchs_timeout_is_the_deadline_unless_the_user_gave_one(marked, option, set_):
    marks = {"rank_timeout": _mark(30)} if marked else {}
    config = types.SimpleNamespace(getoption={"--rank-timeout": option}.get)
    item = types.SimpleNamespace(get_closest_marker=marks.get, config=config)
    assert torchcase._deadline_set(item) is set_


def test_what_cannot_run_here_is_named():
    from torch.testing._internal.common_distributed import (
        DistributedTestBase,
        MultiProcessTestCase,
    )

    class OwnRun(MultiProcessTestCase):
        def run_test(self, test_name, parent_pipe):
            pass

        def _join_processes(self, fn):
            pass

    assert torchcase.cannot(DistributedTestBase, MultiProcessTestCase, False) is None
    assert torchcase.cannot(OwnRun, MultiProcessTestCase, False) == (
        "test_what_cannot_run_here_is_named.<locals>.OwnRun defines _join_processes, "
        "run_test for itself"
    )
    assert "torchrun" in torchcase.cannot(DistributedTestBase, MultiProcessTestCase, True)


@pytest.mark.parametrize(
    ("code", "expected"), [(None, 0), (0, 0), (3, 3), (256 + 7, 7), (-1, 255), ("bye", 1)]
)
def test_a_sys_exit_becomes_the_exit_code_torch_would_read(code, expected):
    assert exit_code(code) == expected


def test_the_table_covers_every_test_of_the_stranger_file():
    assert set(TORCH) == set(re.findall(r"def (test_\w+)\(self\)", STRANGER))
