"""torch's ``MultiProcContinuousTest`` classes, unmodified, on the harness's warm worlds.

torch's continuous class keeps one set of processes for all of a class's tests: its ``setUp``
spawns ``world_size`` interpreters the first time (``_ensure_processes_spawned``), each makes
the default group once (``_init_pg``) and then waits on a queue for the next test to run
(``_run_test_given_id``: a fresh instance, the same seed on every rank, the test method); the
test method in the pytest process only waits for every rank's answer. A failure "poisons" the
class: torch's ``setUp`` skips every later test of it.

Here the ranks are a warm world's (``strategies.warm``): kept between the class's tests as
torch keeps its processes, their default group the harness's (gloo: the class's own backend on
a CPU host), and each test one ``run_ranks`` call of ``rank.torchcase.continuous_rank``, which
runs the test as torch's worker does. What is better: a failed test ends its world and the
next test gets a fresh one, so nothing after a failure is skipped; the failure's first line
names the raising rank; a hang ends at the harness deadline (torch's ``get_timeout`` unless
the user gave one) with every rank's stack; nothing is left running. ``warm_world(False)`` on
the class runs each test on fresh ranks instead; ``torch_harness`` switches the class back to
torch's own harness (``torchcase``). The verdicts are torch's worker's (``continuous_rank``).

What torch's own code decides stays its: ``setUp`` and ``_ensure_processes_spawned`` run as
they are, with the class's ``_spawn_processes`` replaced while the test runs by one that only
notes the world size, so the size (a property, a class value or the device count) and the
"backend not available" skip are torch's. The class is left as it was after each test.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from tutorial_impl.testing.rank.lookup import defined_by, function_ref
from tutorial_impl.testing.rank.torchcase import continuous_rank

if TYPE_CHECKING:  # the plugin's side imports pytest; a module a rank may import does not
    import pytest

# How torch starts, feeds and judges its processes, and how its group is made: a class that
# defines any of them for itself runs under torch's own harness.
OWN_MACHINERY = (
    "_spawn_processes",
    "_ensure_processes_spawned",
    "_worker_loop",
    "_init_pg",
    "_run_test_given_id",
    "_worker_run_main_wait",
    "opts",
)
# What ``_ensure_processes_spawned`` and our ``_Spawn`` set on the class: put back after a test.
CLASS_STATE = ("_spawn_processes", "_processes_spawned", "world_size", "processes")
CLASS_STATE += ("task_queues", "completion_queues")
_MISSING = object()


def cannot(cls: type, base: type) -> str | None:
    """Why continuous class ``cls`` must run under torch's own harness; None if it can run
    here (torchrun is ``torchcase.cannot``'s)."""
    own = [name for name in OWN_MACHINERY if defined_by(cls, name) is not base]
    if own:
        return f"{cls.__qualname__} defines {', '.join(own)} for itself"
    if cls.timeout != base.timeout:
        return f"{cls.__qualname__} sets its group's timeout ({cls.timeout})"
    device, backend = _device_type(cls), cls.backend_str()
    if device != "cpu" or backend not in (None, "gloo"):
        return f"{cls.__qualname__} runs on {device} with backend {backend!r} (here: gloo on cpu)"
    return None


def _device_type(cls: type) -> str:
    """The class's device type, read as torch's ``_ensure_processes_spawned`` reads it."""
    attr = inspect.getattr_static(cls, "device_type")
    if isinstance(attr, classmethod):
        return str(attr.__func__(cls))
    if isinstance(attr, property):
        return str(attr.fget(cls))  # type: ignore[misc] - torch passes the class too
    return str(attr() if callable(attr) else attr)


@dataclasses.dataclass
class _Spawn:
    """The class's ``_spawn_processes`` while a test runs here: the world size torch asked
    for, and empty lists where torch's ``setUp`` feeds its processes."""

    world_size: int | None = None

    def __call__(self, cls: type, world_size: int) -> None:
        self.world_size = int(world_size)
        cls.processes, cls.task_queues, cls.completion_queues = [], [], []  # type: ignore[attr-defined]


@contextmanager
def taken_over(item: pytest.Item, case: Any, deadline_given: bool) -> Iterator[None]:
    """While ``item``'s test runs: its ranks are a warm world's (``run``), its deadline
    torch's timeout unless the user gave one (``deadline_given``)."""
    from tutorial_impl.testing import fixtures

    cls, spawn = type(case), _Spawn()
    saved = {name: cls.__dict__.get(name, _MISSING) for name in CLASS_STATE}
    session = item.config.stash[fixtures.SESSION]
    settings = fixtures._settings_of(item, session)
    if settings.warm is None:  # warm unless the class or test says warm_world(False)
        item.stash[fixtures.SETTINGS] = dataclasses.replace(settings, warm=True)
    original = item.obj  # torch's dispatcher (its queues would be empty here)
    cls._spawn_processes = classmethod(spawn)  # type: ignore[attr-defined]
    item.obj = functools.partial(run, case, spawn, original, deadline_given)
    try:
        yield
    finally:
        item.obj = original
        for name, value in saved.items():
            if value is _MISSING:
                if name in cls.__dict__:
                    delattr(cls, name)
            else:
                setattr(cls, name, value)


def run(case: Any, spawn: _Spawn, original: Any, deadline_given: bool) -> None:
    """The test method in the pytest process: the ranks run it (torch's worker's rules)."""
    __tracebackhide__ = True
    if spawn.world_size is None:  # setUp never asked for processes: torch's dispatcher runs
        original()
        return
    from torch.testing._internal.common_distributed import get_timeout

    from tutorial_impl.testing.fixtures import reported
    from tutorial_impl.testing.strategies.forked import run_ranks
    from tutorial_impl.testing.verdict.errors import RankError

    options: dict[str, Any] = {"world_size": spawn.world_size, "backend": "gloo"}
    if not deadline_given:
        options["timeout"] = float(get_timeout(case.id()))
    try:
        run_ranks(continuous_rank, function_ref(type(case)), case._testMethodName, **options)
    except RankError as error:
        reported(error)
