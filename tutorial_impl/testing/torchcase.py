"""torch's own ``MultiProcessTestCase`` classes, unmodified, on the harness's fresh ranks.

A test class derived from ``torch.testing._internal.common_distributed.MultiProcessTestCase``
(``DistributedTestBase``, ``DTensorTestBase``, ``FSDPTest`` and PyTorch's own suites are) is a
``unittest`` class: pytest runs each test method through unittest, on an instance made in
the pytest process. torch's ``setUp`` makes ``self.file_name`` and calls
``self._spawn_processes()`` (one fresh interpreter per rank, each importing torch); the test
method, wrapped by ``join_or_run``, then calls ``self._join_processes(fn)``, which polls the
processes until they end or torch's timeout (``get_timeout``), and
``self._check_return_codes(fn, elapsed)`` turns their exit codes into the verdict.

While such a test runs (``pytest_runtest_call``), the instance's ``_spawn_processes`` only
notes that it was asked for, and its ``_join_processes`` is ``join`` below: the ranks are
forked from the harness's forkserver through the test's ``run_ranks`` (fresh per test; its
deadline, stacks at a hang, early-return detection, the first line naming the raising rank,
nothing left behind), each running ``rank.torchcase.torch_rank``: the class's ``_run`` and
the test method, as torch's rank does. A test body's exception fails the test at once (where
torch's rank exits 10 and its parent fails the test); every other way a rank ends is an exit
code, and ``join`` hands the codes to the class's own ``_check_return_codes`` in place of
its processes: torch's rules decide (``TEST_SKIPS`` codes, ``special_return_code_checks``,
``skip_return_code_checks``, rank 0's code), so the verdicts are torch's.

Off for a class or a module with the ``torch_harness`` marker, for the session with
``--torch-harness`` or ``torch_harness = true`` (``torch_harness(False)`` puts a class back).
A class this cannot run as torch would (one that overrides how torch starts or joins its
processes, or runs its own ``run_test``), or any such class under torchrun, runs under
torch's harness, with a ``TorchHarnessWarning`` saying why.

torch's module is imported only when a test module already imported it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import time
from typing import Any

import pytest

from tutorial_impl.testing import torchcase_continuous
from tutorial_impl.testing.rank.lookup import defined_by, function_ref
from tutorial_impl.testing.rank.torchcase import torch_rank

TORCH_MODULE = "torch.testing._internal.common_distributed"
MARKER = "torch_harness"
OPTION = "--torch-harness"
HELP_OPTION = (
    "run torch MultiProcessTestCase classes under torch's own harness (a spawned interpreter "
    "per rank), not on the harness's forked ranks; the torch_harness marker does it for a "
    "class or module"
)
HELP_INI = "true: as --torch-harness, for every session of this project"
# What a class may not define for itself and still run here: how torch starts, joins and
# runs its ranks (``_run``, the rank's setup, and ``_check_return_codes`` may be its own).
OWN_MACHINERY = ("_spawn_processes", "_start_processes", "_join_processes", "run_test")
UNDER_TORCHRUN = "this pytest is one worker of a torchrun job, which has no forked ranks"


class TorchHarnessWarning(UserWarning):
    """A ``MultiProcessTestCase`` test ran under torch's own harness, and why."""


def addoption(group: Any, parser: pytest.Parser) -> None:
    """The session's switch (the plugin's ``pytest_addoption``)."""
    group.addoption(OPTION, action="store_true", default=None, help=HELP_OPTION)
    parser.addini("torch_harness", HELP_INI, type="bool", default=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    """A ``MultiProcessTestCase`` test's ranks are the harness's while its body runs; a
    ``MultiProcContinuousTest``'s are a warm world's (``torchcase_continuous``)."""
    case = _continuous_case(item)
    if case is not None:
        with torchcase_continuous.taken_over(item, case, _deadline_set(item)):
            return (yield)
    case = _torch_case(item)
    if case is not None:
        _take_over(item, case)
    return (yield)


def _continuous_case(item: pytest.Item) -> Any:
    """``item``'s unittest instance, if it is a ``MultiProcContinuousTest`` to run here."""
    module = sys.modules.get(TORCH_MODULE)
    base = getattr(module, "MultiProcContinuousTest", None)  # torch 2.9 and later
    case = getattr(item, "instance", None) if base is not None else None
    if case is None or not isinstance(case, base) or _switched_off(item):
        return None
    if _under_torchrun(item):
        reason: str | None = UNDER_TORCHRUN
    else:
        reason = torchcase_continuous.cannot(type(case), base)
    if reason is not None:
        item.warn(TorchHarnessWarning(f"{item.nodeid} ran under torch's own harness: {reason}"))
        return None
    return case


def _torch_case(item: pytest.Item) -> Any:
    """``item``'s unittest instance, if it is a ``MultiProcessTestCase`` to run here."""
    module = sys.modules.get(TORCH_MODULE)
    case = getattr(item, "instance", None) if module is not None else None
    if case is None or not isinstance(case, module.MultiProcessTestCase):
        return None
    if _switched_off(item):
        return None
    reason = cannot(type(case), module.MultiProcessTestCase, _under_torchrun(item))
    if reason is not None:
        item.warn(TorchHarnessWarning(f"{item.nodeid} ran under torch's own harness: {reason}"))
        return None
    return case


def _switched_off(item: pytest.Item) -> bool:
    marker = item.get_closest_marker(MARKER)
    if marker is not None:
        return bool(marker.args[0] if marker.args else marker.kwargs.get("enabled", True))
    option = item.config.getoption(OPTION)
    return bool(item.config.getini("torch_harness") if option is None else option)


def _under_torchrun(item: pytest.Item) -> bool:
    from tutorial_impl.testing.fixtures import SESSION

    session = item.config.stash.get(SESSION, None)
    return session is not None and not session.own_ranks


def cannot(cls: type, base: type, under_torchrun: bool) -> str | None:
    """Why ``cls`` must run under torch's own harness; None if the harness can run it."""
    if under_torchrun:
        return UNDER_TORCHRUN
    own = [name for name in OWN_MACHINERY if defined_by(cls, name) is not base]
    if own:
        return f"{cls.__qualname__} defines {', '.join(own)} for itself"
    return None


@dataclasses.dataclass
class _Spawn:
    """What the instance's ``_spawn_processes`` does here: remember that it was asked."""

    asked: bool = False

    def __call__(self) -> None:
        self.asked = True


def _take_over(item: pytest.Item, case: Any) -> None:
    spawn = _Spawn()
    case._spawn_processes = spawn  # on the instance: the class is the user's, untouched
    case._join_processes = functools.partial(join, item, case, spawn)


def join(item: pytest.Item, case: Any, spawn: _Spawn, fn: Any) -> None:
    """The parent's side of one test (torch's ``_join_processes``): the ranks on the
    harness, their exit codes to the class's own ``_check_return_codes``."""
    __tracebackhide__ = True
    if not spawn.asked or int(case.world_size) < 1:
        # torch would start no process (setUp never spawned, or a world of none: FSDPTest's
        # GPU count on a CPU host), and its join finds none: torch's own join decides
        try:
            type(case)._join_processes(case, fn)
        finally:
            release_store(case.file_name)
        return
    from torch.testing._internal.common_distributed import get_timeout

    from tutorial_impl.testing.fixtures import reported
    from tutorial_impl.testing.strategies.forked import run_ranks
    from tutorial_impl.testing.verdict.errors import RankError, RankExited

    world_size = int(case.world_size)
    options: dict[str, Any] = {"world_size": world_size, "backend": None}
    options["may_exit"] = range(world_size)  # torch reads exit codes; so does join
    if not _deadline_set(item):
        options["timeout"] = float(get_timeout(case.id()))
    kwargs = {"fake_pg": getattr(case, "fake_pg", False)}  # what torch's _start_processes gives
    name, started = case._current_test_name(), time.time()
    try:
        results = run_ranks(
            torch_rank, function_ref(type(case)), name, case.file_name, kwargs, **options
        )
    except RankError as error:
        reported(error)
    finally:
        release_store(case.file_name)
    codes = [r.exitcode if isinstance(r, RankExited) else r for r in results]
    case.processes = [Ended(rank, code) for rank, code in enumerate(codes)]
    case.pid_to_pipe = {p.pid: NoPipe(p.pid) for p in case.processes}
    case._check_return_codes(fn, time.time() - started)


def release_store(path: str) -> None:
    """What the last of torch's ranks does on its way out: a ``FileStore`` deletes its file
    when its last user is destroyed, and torch's ranks end their interpreters, a failed
    test's too. The harness's ranks are killed instead (a failed rank's frames, or its
    default group, still held the store), so the file is deleted here, once they are gone;
    also the empty one of a test no rank made a group for, which torch's ``setUp`` made and
    its harness leaves behind."""
    with contextlib.suppress(OSError):  # gone already: the ranks' stores deleted it
        os.remove(path)


def _deadline_set(item: pytest.Item) -> bool:
    """Whether the user gave this test a harness deadline (else torch's timeout is its)."""
    return bool(item.get_closest_marker("rank_timeout") or item.config.getoption("--rank-timeout"))


@dataclasses.dataclass
class Ended:
    """A rank in place of torch's ``Process``, for ``_check_return_codes`` and ``tearDown``:
    its exit code; its ``pid`` is the rank's number (the process is gone)."""

    pid: int
    exitcode: int | None

    def terminate(self) -> None:
        pass  # ended already: the harness killed whatever it left


@dataclasses.dataclass
class NoPipe:
    """torch's pipe from a rank that exited with its error code of its own accord (10 by
    ``sys.exit``, not by an exception, which fails the test before): nothing was sent."""

    rank: int

    def recv(self) -> str:
        return f"(rank {self.rank} sent no traceback: it exited with this code itself)"

    def close(self) -> None:
        pass
