"""What the rank forkserver imports before any rank: the test files' imports, found and guarded.

A fresh rank imports its test module again; the forkserver imports what the collected test
files import first, with no setting (``preload``, ``importscan``, ``forkserver.probe``), so
the library under test is loaded once per session instead of in every rank. Proven here without
starting a rank (each piece on its own, cheaply): which files and which imports the scan finds,
as pytest would collect them; what the server does with a module that imports fine, that is
missing, that raises, starts a thread, ends the process or hangs (in a subprocess without
torch, as the server would, module by module); ``rank_preload`` given twice with ``-o``;
pytest's summary line; the plan reaching the server's environment and no further, set once when
threads start the server together; and a test module the server imported plainly running with
pytest's rewritten asserts in a rank. The whole path, a fresh pytest session whose forkserver
imports what its test file imports and two ``-o rank_preload`` values, is in
``test_harness_isolation.py`` (its one fresh session), and a library's suite run fresh and warm
is the library benchmark (``tests/bench/test_bench_library.py``).
"""

from __future__ import annotations

import dataclasses
import errno
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import types
from pathlib import Path

import fresh_server
import pytest

from tutorial_impl.testing import proctable
from tutorial_impl.testing.forkserver import importscan
from tutorial_impl.testing.forkserver import plan as preload
from tutorial_impl.testing.forkserver import server as forkserver
from tutorial_impl.testing.forkserver.server import PLAN_ENV
from tutorial_impl.testing.rank import lookup

pytest_plugins = ["pytester"]

DEFAULTS = {  # pytest's own, as preload.plan reads them from a session
    "python_files": ["test_*.py", "*_test.py"],
    "norecursedirs": ["*.egg", ".*", "_darcs", "build", "CVS", "dist", "node_modules", "venv"],
    "importmode": "prepend",
}


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


SCANNED = """
import json, os.path as osp
import pytest
from _pytest import nodes
from . import sibling
from mylib.metrics import Mean, test_helper
from torch.testing._internal.distributed.distributed_test import DistributedTest
import torch.testing._internal.distributed.rpc_test
from mylib import conftest
import test_other, conftest
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    import only_for_types
try:
    import optional_dep
except ImportError:
    optional_dep = None
with open(__file__):
    import in_a_with
import excluded.sub

def f():
    import inside_a_function

class C:
    import inside_a_class
"""


def test_the_scan_reads_the_files_pytest_would_collect_and_their_module_imports(tmp_path):
    write(
        tmp_path,
        {
            "tests/test_a.py": SCANNED,
            "tests/helpers.py": "import not_a_test_file\n",  # not matched by python_files
            "tests/pkg/__init__.py": "",
            "tests/pkg/b_test.py": "from mylib.metrics import Sum\n",
            "tests/build/test_x.py": "import in_norecursedirs\n",
            "tests/.hidden/test_y.py": "import in_a_hidden_dir\n",
            "tests/env/pyvenv.cfg": "",
            "tests/env/test_z.py": "import in_a_virtualenv\n",
            "tests/skipped/test_i.py": "import ignored\n",
            "tests/test_broken.py": "import (\n",
            "check_me.py": "import named_as_an_argument\n",
        },
    )
    plan = {
        **DEFAULTS,
        "args": ["tests", "check_me.py::test_x", "no/such/path"],
        "invocation_dir": str(tmp_path),
        "ignore": [str(tmp_path / "tests" / "skipped")],
        "ignore_glob": [],
        "exclude": ["excluded"],
    }
    found = importscan.scan(plan)
    assert found.imports == {
        "json": [],
        "os.path": [],
        "mylib.metrics": ["Mean", "Sum"],  # not test_helper: a test module is the rank's
        "mylib": [],  # nor conftest
        # an installed library's modules named like tests are the library's (torch's suites)
        "torch.testing._internal.distributed.distributed_test": ["DistributedTest"],
        "torch.testing._internal.distributed.rpc_test": [],
        "typing": ["TYPE_CHECKING"],
        "optional_dep": [],
        "in_a_with": [],
        "named_as_an_argument": [],
    }
    assert found.files == 4  # test_a, test_broken, pkg/b_test, check_me
    # What pytest's prepend mode puts on sys.path: for pkg/b_test.py the directory above
    # the package, tests/ (as for test_a.py); for check_me.py its own.
    assert found.paths == [str(tmp_path / "tests"), str(tmp_path)]


LAZY_FILES = {
    "test_plain.py": "import mylib, re, torch\nimport torch.distributed as dist\n\n"
    "def f():\n    dist.all_reduce(x)\n    re.compile(mylib.parallel, mylib.replicate)\n",
    "test_compile.py": "from torch import compile\n",
    "test_nn.py": "from torch import nn\n\ndef f(m):\n    return nn.parallel\n",
    "test_replicate.py": "from torch.distributed._composable import replicate\n",
    "test_parallel.py": "import torch.nn.parallel\n",
    "test_reexported.py": "from mylib import *\n\ndef f(m):\n    FullyShardedDataParallel(m)\n",
    "test_optim.py": "import torch\n\ndef f(m):\n    torch.optim.AdamW(m.parameters())\n",
    "test_ddp.py": "from torch.nn.parallel import DistributedDataParallel as DDP\n",
    "test_inside.py": "def f():\n    from torch.distributed.tensor import DTensor\n"
    "    import torch.distributed.fsdp\n    import mylib\n",
}


@pytest.mark.parametrize(
    "name, expected",
    [
        # collectives: nothing more (mylib: the user's, not with test imports off)
        ("test_plain.py", {"mylib": [], "re": [], "torch": [], "torch.distributed": []}),
        ("test_compile.py", {"torch": ["compile"], "torch._dynamo": []}),  # not re.compile
        ("test_nn.py", {"torch": ["nn"], "torch._dynamo": []}),
        ("test_replicate.py", {"torch.distributed._composable": ["replicate"],
                               "torch._dynamo": []}),
        ("test_parallel.py", {"torch.nn.parallel": [], "torch._dynamo": []}),
        ("test_reexported.py", {"mylib": ["*"], "torch._dynamo": []}),  # a name, from anywhere
        ("test_optim.py", {"torch": [], "torch._dynamo": []}),  # what AdamW() will import
        ("test_ddp.py", {"torch.nn.parallel": ["DistributedDataParallel"], "torch._dynamo": []}),
        # torch's own modules a rank function imports, and what FSDP will: not the user's
        ("test_inside.py", {"torch.distributed.tensor": ["DTensor"], "torch.distributed.fsdp": [],
                            "torch._dynamo": []}),
    ],
)  # fmt: skip
def test_the_scan_adds_what_torch_imports_once_a_rank_uses_it(tmp_path, name, expected):
    """torch imports ``torch._dynamo`` (1.3-1.9 s of CPU) at the first optimizer, DDP, FSDP
    or compile in a process: a file that names one gets it preloaded; one that only runs
    collectives does not; ``rank_preload_exclude`` still keeps it out."""
    write(tmp_path, {name: LAZY_FILES[name]})
    plan = {**DEFAULTS, "args": [name], "invocation_dir": str(tmp_path)}
    assert importscan.scan(plan).imports == expected
    excluded = importscan.scan({**plan, "exclude": ["torch._dynamo"]}).imports
    assert excluded == {m: n for m, n in expected.items() if m != "torch._dynamo"}
    # rank_preload_test_imports = false: what torch will import by itself, nothing else
    torch_only = importscan.scan({**plan, "torch_only": True})
    assert torch_only.imports == {m: [] for m in expected if m == "torch._dynamo"}
    assert torch_only.paths == []  # nor are the test files' directories put on sys.path


def test_the_scan_reads_the_library_under_test_for_what_torch_will_import(tmp_path):
    """A test that calls the project's ``fit``, which builds the optimizer: the file names no
    optimizer, its library does (read one level deep, never imported)."""
    write(
        tmp_path,
        {
            "mylib/__init__.py": "",
            "mylib/train.py": "import torch\n\ndef fit(m):\n    torch.optim.SGD(m.parameters())\n",
            "mylib/plain.py": "import torch.distributed as dist\n",
            "tests/test_fit.py": "from mylib import train\n",
            "tests/test_plain.py": "import mylib.plain\n",
        },
    )
    plan = {**DEFAULTS, "args": ["tests"], "invocation_dir": str(tmp_path)}
    assert importscan.scan(plan).imports == {"mylib": ["train"], "mylib.plain": [],
                                             "torch._dynamo": []}  # fmt: skip
    torch_only = importscan.scan({**plan, "torch_only": True})
    assert torch_only.imports == {"torch._dynamo": []}
    plain = importscan.scan({**plan, "args": ["tests/test_plain.py"]})
    assert plain.imports == {"mylib.plain": []}  # a library that only runs collectives


GOOD = "import os\nIMPORTED_IN = os.getpid()\nprint('a banner nobody should see')\n"
THREADER = (
    "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"  # noqa: E501
)
RAISER = "raise RuntimeError('not in a forkserver')\n"
EXITER = "import os\nos._exit(3)\n"
SLEEPER = "import time\ntime.sleep(60)\n"
SPAWNER = "import subprocess\nCHILD = subprocess.Popen(['sleep', '1'])\n"  # gone in 1 s
SERVER_SIDE = """
import json, os, sys, threading
import tutorial_impl.testing.forkserver.probe  # what the forkserver imports: runs the plan
import good_module
print(json.dumps({"pid": os.getpid(), "good": good_module.IMPORTED_IN,
                  "threads": threading.active_count(), "tasks": len(os.listdir("/proc/self/task")),
                  "plan_left": os.environ.get(sys.argv[1])}))
"""


def test_the_forkserver_imports_what_is_safe_and_names_what_it_will_not(tmp_path):
    """Run as the server runs it, in a fresh interpreter without torch: one module of each
    kind, imported by a test file, two more named in ``rank_preload``."""
    modules = {"good_module": GOOD, "threader": THREADER, "raiser": RAISER}
    modules |= {"exiter": EXITER, "sleeper": SLEEPER, "spawner": SPAWNER}
    write(tmp_path / "lib", {f"{name}.py": text for name, text in modules.items()})
    imports = "".join(f"import {name}\n" for name in modules) + "import missing_module\n"
    write(tmp_path, {"tests/test_lib.py": imports})
    plan = {
        "rank_preload": ["json", "named_but_missing"],
        "test_files": {**DEFAULTS, "args": ["tests"], "invocation_dir": str(tmp_path)},
        "report": str(tmp_path / "report.json"),
        "probe_timeout": 1.0,
        "sys_path": [str(tmp_path / "lib"), *sys.path],  # the parent's: lib/ is only there
    }
    env = {**os.environ, PLAN_ENV: json.dumps(plan)}
    code = [sys.executable, "-c", SERVER_SIDE, PLAN_ENV]
    done = subprocess.run(code, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "banner" not in done.stdout  # the server's output is its parent's terminal
    facts = json.loads(done.stdout)
    assert facts["good"] == facts["pid"]  # imported by the server itself...
    assert facts["threads"] == 1 and facts["tasks"] == 1  # ... which has one thread still
    assert facts["plan_left"] is None  # and no rank will see the plan
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["preloaded"] == ["json", "good_module"]
    assert report["files"] == 1
    assert report["unsafe"] == {}
    assert set(report["failed"]) == {"missing_module"}  # a test file's: said only here
    dropped = report["dropped"]
    assert set(dropped) == {
        "named_but_missing",
        "threader",
        "raiser",
        "exiter",
        "sleeper",
        "spawner",
    }
    assert dropped["spawner"] == "started a process at import"
    assert dropped["named_but_missing"].startswith("ModuleNotFoundError")
    assert dropped["threader"].startswith("started a thread at import")
    assert dropped["raiser"] == "raised RuntimeError at import: not in a forkserver"
    assert dropped["exiter"] == "its import ended the process (exit status 3)"
    assert dropped["sleeper"] == "its import did not end within 1 s"


def test_rank_preload_given_twice_with_o_keeps_both_and_the_plan_follows_the_ini(pytester):
    pytester.makeini("[pytest]\nrank_preload = from_the_file\nrank_preload_exclude = mylib.gpu\n")
    assert preload.explicit(pytester.parseconfig()) == ["from_the_file"]
    config = pytester.parseconfig("-o", "rank_preload=a b", "-o", "rank_preload=c")
    assert config.getini("rank_preload") == ["c"]  # pytest's own reading: the last -o only
    assert preload.explicit(config) == ["a", "b", "c"]
    plan = preload.plan(config)
    assert plan["rank_preload"] == ["a", "b", "c"]
    assert plan["test_files"]["exclude"] == ["mylib.gpu"]
    assert plan["test_files"]["invocation_dir"] == str(pytester.path)
    off = pytester.parseconfig("-o", "rank_preload_test_imports=false")
    assert preload.plan(off)["test_files"]["torch_only"] is True  # torch's lazy ones still
    assert "torch_only" not in plan["test_files"]


def test_the_summary_names_what_the_server_of_this_session_left_out(pytester, monkeypatch):
    config = pytester.parseconfig()
    report = pytester.path / "report.json"
    dropped = {"threader": "started a thread at import (t)"}
    report.write_text(json.dumps({"dropped": dropped, "unsafe": {"mylib": "started a process"}}))
    server = forkserver.RankServer()
    server.report_path = str(report)
    started = {**preload.plan(config), "report": str(report), "sys_path": sys.path}
    server.server = types.SimpleNamespace(plan=started)
    monkeypatch.setattr(forkserver, "SERVER", server)
    assert preload.summary(config) == [
        "not preloaded: threader: started a thread at import (t)",
        "preloaded, but mylib started a process",
    ]
    other = pytester.parseconfig("-o", "rank_preload=another")
    assert preload.summary(other) == []  # the server was started for another session


def test_the_plan_is_in_the_environment_only_while_the_server_starts(monkeypatch):
    seen = []
    monkeypatch.setattr(
        forkserver._mp_forkserver.ForkServer,
        "ensure_running",
        lambda self: seen.append(os.environ.get(PLAN_ENV)),
    )
    server = forkserver._PlannedForkServer()
    server.plan = {"rank_preload": ["x"], "test_files": None, "report": "r.json"}
    server.ensure_running()
    assert json.loads(seen[0]) == server.plan and PLAN_ENV not in os.environ
    server._forkserver_pid = 12345  # started: later calls only check on it
    server.ensure_running()
    assert seen[1] is None


def test_threads_that_find_no_server_yet_start_it_once_with_the_plan(monkeypatch):
    """``run_ranks`` from several threads before the server exists (the stress test's
    start): the first starts it with the plan in the environment, the others wait and then
    find it running. (They used to set the plan too, and the second to remove it raised.)"""
    seen, entered, errors = [], threading.Event(), []

    def start(self):  # multiprocessing's: starting takes a while, then the server runs
        seen.append(os.environ.get(PLAN_ENV))
        entered.set()
        if self._forkserver_pid is None:
            time.sleep(0.3)  # the other threads arrive meanwhile
            self._forkserver_pid = 12345

    def call():
        try:
            server.ensure_running()
        except Exception as exc:  # reported below, from the test's own thread
            errors.append(exc)

    monkeypatch.setattr(forkserver._mp_forkserver.ForkServer, "ensure_running", start)
    server = forkserver._PlannedForkServer()
    server.plan = {"rank_preload": ["x"], "test_files": None, "report": "r.json"}
    threads = [threading.Thread(target=call) for _ in range(3)]
    threads[0].start()
    assert entered.wait(10)
    for thread in threads[1:]:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
    assert json.loads(seen[0]) == server.plan and seen[1:] == [None, None]
    assert PLAN_ENV not in os.environ


PRELOADED_TEST_MODULE = """
def compares(rank, world_size):
    assert [rank, 2] == [rank, 3]
"""


def test_a_test_module_the_server_imported_plainly_runs_with_rewritten_asserts(tmp_path):
    """``-o rank_preload=test_mod`` imports the test file plainly in the server, where pytest's
    rewriting does not reach; the rank then runs the rewritten code the parent sent."""
    file = tmp_path / "test_preloaded_mod.py"
    file.write_text(PRELOADED_TEST_MODULE)
    name = "test_preloaded_mod"
    spec = importlib.util.spec_from_file_location(name, file)
    plain = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plain)  # as the forkserver has it: no rewritten asserts
    code = lookup._rewritten_code(str(file))
    assert code is not None and "@pytest_ar" not in vars(plain)
    sys.modules[name] = plain
    try:
        ref = lookup.FunctionRef(name, "compares", str(file), code)
        fn = lookup.resolve(ref)
        with pytest.raises(AssertionError, match=r"assert \[0, 2\] == \[0, 3\]"):
            fn(0, 1)
        assert sys.modules[name] is not plain and "@pytest_ar" in vars(sys.modules[name])
        plain_ref = lookup.FunctionRef(name, "compares", str(file), None)
        assert lookup.resolve(plain_ref) is fn  # no code sent: the loaded module as it is
    finally:
        sys.modules.pop(name, None)


# The forkserver started behind collection (``preload.start_early``), as a stranger meets it:
# a project with the installed package only, run in fresh pytest sessions. In-process (the
# pytest process's startup and torch import are not the claim: what the session's server does
# is), each with a fresh, unstarted rank server of its own as a new process has (in this one the
# server has started long ago). One project, four sessions, shared by the tests below (each one
# claim). Each session notes what it saw in EARLY_DIR; the project counts the forkservers among
# this process's children, those it had before the session (EARLY_BEFORE) left out.
EARLY_PROJECT = """
import os, time
import pytest
from tutorial_impl.testing import proctable

NOTES = os.environ["EARLY_DIR"]
BEFORE = {int(pid) for pid in os.environ["EARLY_BEFORE"].split()}


def note(name, value):
    with open(os.path.join(NOTES, name), "a") as f:
        f.write(f"{value}\\n")


def forkservers():  # this session's forkserver children, from the OS process table
    mine = set(proctable.children(os.getpid())) - BEFORE
    return [p for p in sorted(mine) if "forkserver" in proctable.command(p)]


def started(pid):  # the kernel's start time of ``pid``, seconds since boot
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")


for pid in forkservers():
    proctable.record(NOTES, f"at_import{pid}", pid)
note("at_import", len(forkservers()))
time.sleep(float(os.environ["EARLY_IMPORT_S"]))  # a test module's heavy import (torch's, say):
# the server starts meanwhile
IMPORTED = time.clock_gettime(time.CLOCK_BOOTTIME)


def who(rank, world_size):
    proctable.record_self(NOTES, f"rank{rank}-{world_size}")
    return os.getppid()


def test_first(run_ranks):
    (server,) = forkservers()
    proctable.record(NOTES, "forkserver", server)
    note("lead", IMPORTED - started(server))  # > 0: started before this module was imported
    assert run_ranks(who, world_size=2) == [server, server]


@pytest.mark.warm_world
def test_warm(run_ranks):
    assert run_ranks(who, world_size=3) == forkservers() * 3


def test_plain():
    note("plain", len(forkservers()))
"""
PLAIN_PROJECT = """
import os
from tutorial_impl.testing import proctable

BEFORE = {int(pid) for pid in os.environ["EARLY_BEFORE"].split()}


def note():  # no process at all started for this session: at its import (collection) ...
    with open(os.path.join(os.environ["EARLY_DIR"], "plain_only"), "a") as f:
        f.write(f"{sorted(set(proctable.children(os.getpid())) - BEFORE)}\\n")


note()


def test_only_plain():  # ... and in its test
    note()
"""


@dataclasses.dataclass
class EarlySession:
    """One session of the project: its exit code, the tests it collected and deselected, each
    outcome by test name, its notes, and the forkservers it left behind when it ended."""

    exit_code: int
    collected: int
    deselected: int
    outcomes: dict[str, str]
    notes: Path
    left: list[int]


class _Outcomes:
    """A plugin of the inner session: what it collected, deselected and ran."""

    def __init__(self) -> None:
        self.collected = self.deselected = 0
        self.outcomes: dict[str, str] = {}

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.collected = len(session.items)

    def pytest_deselected(self, items: list[pytest.Item]) -> None:
        self.deselected += len(items)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call" or report.outcome != "passed":
            self.outcomes[report.nodeid.rsplit("::", 1)[-1]] = report.outcome


def _children() -> set[int]:
    return set(proctable.children(os.getpid()))


def _forkservers(pids: set[int]) -> list[int]:
    return sorted(p for p in pids if "forkserver" in proctable.command(p))


def _session(root: Path, name: str, args: list[str], import_s: float = 0.0) -> EarlySession:
    """Run one session of the project in this process, as a new pytest process would: a fresh
    rank server, this process's children noted first, its test modules forgotten after. The
    server it kept (the process's, until the process ends) is stopped then, as that end would.
    ``import_s``: how long the test module's import lasts (the server starts meanwhile)."""
    notes = root / f"notes-{name}"
    notes.mkdir()
    before = _children()
    modules, path = set(sys.modules), list(sys.path)
    outcomes = _Outcomes()
    with pytest.MonkeyPatch.context() as mp, fresh_server.swapped(mp):
        mp.setenv("EARLY_DIR", str(notes))
        mp.setenv("EARLY_BEFORE", " ".join(map(str, before)))
        mp.setenv("EARLY_IMPORT_S", str(import_s))
        mp.delenv("PYTEST_XDIST_WORKER", raising=False)
        mp.chdir(root)
        try:
            # (pytest's unraisable-exception plugin collects garbage twice at the end, over
            # this process's heap, torch's included: most of a session's CPU, no claim's)
            plain = ["-q", "-p", "no:cacheprovider", "-p", "no:unraisableexception"]
            code = pytest.main([*plain, *args], plugins=[outcomes])
            left = _forkservers(_children() - before)
        finally:
            sys.path[:] = path
            for module in set(sys.modules) - modules:
                if module.startswith("test_"):
                    del sys.modules[module]
    return EarlySession(
        int(code), outcomes.collected, outcomes.deselected, outcomes.outcomes, notes, left
    )


@pytest.fixture(scope="module")
def early_sessions(tmp_path_factory):
    """The project's sessions: the whole file; ``--collect-only``; ``-k plain`` (only plain
    tests selected); a plain project. By name. Only the whole file's module import lasts
    (0.3 s): the server's lead over it is that session's claim; in ``-k plain`` the server
    would spend that time importing torch, only to be killed. (In-process, the four cost
    3-4 s of CPU where torch is already imported, as in the suite, against 8-9 s as four fresh
    pytest processes: ``.ci/suite_profile.py``, back to back, issue 37.)"""
    root = tmp_path_factory.mktemp("early")
    write(root, {"test_mixed.py": EARLY_PROJECT, "plain/test_plain_only.py": PLAIN_PROJECT})
    runs = {
        "whole": ["test_mixed.py"],
        "collect": ["test_mixed.py", "--collect-only"],
        "plain": ["test_mixed.py", "-k", "plain"],
        "plain_only": ["plain"],
    }
    return {
        name: _session(root, name, args, 0.3 if name == "whole" else 0.0)
        for name, args in runs.items()
    }


def _notes(notes: Path, name: str) -> list[str]:
    path = notes / name
    return path.read_text().split() if path.exists() else []


@pytest.mark.xdist_group("early_forkserver")
def test_the_first_test_finds_the_forkserver_started_behind_collection(early_sessions):
    whole = early_sessions["whole"]
    assert whole.exit_code == 0, whole.outcomes
    assert whole.outcomes == dict.fromkeys(["test_first", "test_warm", "test_plain"], "passed")
    # Started at the session's start, before its test module's import ended (0.3 s long).
    assert float(_notes(whole.notes, "lead")[0]) > 0.05
    assert _notes(whole.notes, "plain") == ["1"]  # kept for the session, one for forked and warm
    assert len(whole.left) == 1  # and after it: the process's, until the process ends


@pytest.mark.xdist_group("early_forkserver")
def test_no_forkserver_starts_for_collect_only_or_plain_test_files(early_sessions):
    collect = early_sessions["collect"]
    assert collect.exit_code == 0 and collect.collected == 3 and not collect.outcomes
    assert _notes(collect.notes, "at_import") == ["0"] and collect.left == []
    plain_only = early_sessions["plain_only"]
    assert plain_only.exit_code == 0 and plain_only.outcomes == {"test_only_plain": "passed"}
    assert _notes(plain_only.notes, "plain_only") == ["[]", "[]"]  # none in collection, test
    assert plain_only.left == []  # nor at the end


@pytest.mark.xdist_group("early_forkserver")
def test_a_selection_of_plain_tests_kills_the_forkserver_collection_started(early_sessions):
    plain = early_sessions["plain"]
    assert plain.exit_code == 0 and plain.outcomes == {"test_plain": "passed"}
    assert plain.deselected == 2
    assert _notes(plain.notes, "at_import") == ["1"]  # the files name run_ranks: started early
    assert _notes(plain.notes, "plain") == ["0"]  # no test selected needs it: gone before the first
    assert plain.left == []


@pytest.mark.xdist_group("early_forkserver")
def test_no_process_of_the_early_forkserver_outlives_its_session(early_sessions):
    whole, plain = early_sessions["whole"], early_sessions["plain"]
    names = {*proctable.recorded(whole.notes), *proctable.recorded(plain.notes)}
    assert {"forkserver", "rank0-2", "rank1-2", "rank2-3"} <= names
    assert any(name.startswith("at_import") for name in proctable.recorded(plain.notes))
    assert proctable.wait_until_gone(whole.notes, 10.0) == {}
    assert proctable.wait_until_gone(plain.notes, 10.0) == {}


FAILING_START = """
def one(rank, world_size):
    return rank


def test_first(run_ranks):
    assert run_ranks(one, world_size=2) == [0, 1]


def test_plain():
    pass
"""


def test_a_forkserver_that_cannot_start_fails_the_first_test_that_needs_it(pytester, monkeypatch):
    """The server a session starts behind collection cannot start (here the kernel refuses
    it a file): the session goes on, and the first test that needs ranks fails, saying so."""

    def refused(self):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(forkserver, "SERVER", forkserver.RankServer())  # none started yet
    monkeypatch.setattr(forkserver._PlannedForkServer, "ensure_running", refused)
    pytester.makepyfile(test_start=FAILING_START)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    said = [line for line in result.outlines if line.startswith("E ") and "ForkServer" in line]
    assert said == [
        "E           tutorial_impl.testing.forkserver.server.ForkServerStartError: "
        "the rank forkserver could not be started when the session started: "
        "OSError: [Errno 24] Too many open files"
    ]  # once, the first failure itself (not one of starting again after it)


def test_a_session_inside_another_keeps_the_outer_sessions_plan(pytester, monkeypatch):
    """An in-process pytester run inside a session whose server has not started yet (it may
    start it) must not replace the outer session's plan: the server is the process's, and
    the outer session's ranks come from it after."""
    server = forkserver.RankServer()
    monkeypatch.setattr(forkserver, "SERVER", server)
    outer = pytester.parseconfig("-o", "rank_preload=outer_module")
    preload.configure(outer, [])
    inner = pytester.parseconfig("-o", "rank_preload=inner_module")
    preload.configure(inner, [])
    assert server.plan["rank_preload"] == ["outer_module"]
    inner._ensure_unconfigure()
    assert server.plan["rank_preload"] == ["outer_module"]
    outer._ensure_unconfigure()
    assert server.plan is None


def test_a_server_the_files_did_not_announce_starts_after_collection(pytester, monkeypatch):
    """A test reaches ``run_ranks`` through a conftest fixture, so its file does not name it:
    the server starts when collection shows the test, before the test. (Started here by a
    stand-in that records it: the real one would cost a torch import.)"""
    starts = []

    def started(self):
        starts.append(self.plan["rank_preload"])
        self._forkserver_pid = os.getpid()  # "running": later calls only check on it

    monkeypatch.setattr(forkserver, "SERVER", forkserver.RankServer())
    monkeypatch.setattr(forkserver._PlannedForkServer, "ensure_running", started)
    pytester.makeconftest("import pytest\n\n@pytest.fixture\ndef ranks(run_ranks):\n    return 1\n")
    test = (
        "from tutorial_impl.testing.forkserver import server as forkserver\n\ndef test_it(ranks):\n"
    )
    pytester.makepyfile(test_unannounced=test + "    assert forkserver.SERVER.started\n")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-o", "rank_preload=x")
    result.assert_outcomes(passed=1)
    assert starts == [["x"]]  # once, with this session's plan


def test_a_session_with_no_rank_test_leaves_a_running_server_alone(pytester, monkeypatch):
    """The process's server, started before this session (by an outer one), serves on:
    only a server the session itself started early is killed for want of rank tests."""
    stand_in = subprocess.Popen(["sleep", "60"])  # the running server, as far as pids go
    try:
        server = forkserver.RankServer()
        server.server = forkserver._PlannedForkServer()
        server.server._forkserver_pid = stand_in.pid
        server._context = object()
        monkeypatch.setattr(forkserver, "SERVER", server)
        pytester.makepyfile(test_plain="def test_plain():\n    pass\n")
        pytester.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)
        assert stand_in.poll() is None and server.started
    finally:
        stand_in.kill()
        stand_in.wait()


def test_a_stopped_server_is_killed_reaped_and_forgotten(tmp_path):
    """``stop`` (the server a session started early, no test needing it): the process is
    killed and reaped at once, its pipe and socket file are gone, and the process has no
    server any more: the next rank starts a new one. (A ``sleep`` stands in for the server.)"""
    stand_in = subprocess.Popen(["sleep", "60"])
    alive_read, alive_write = os.pipe()
    address = tmp_path / "listener"
    address.touch()
    server = forkserver.RankServer()
    server.server = forkserver._PlannedForkServer()
    server.server._forkserver_pid = stand_in.pid
    server.server._forkserver_alive_fd = alive_write
    server.server._forkserver_address = str(address)
    server._context = object()
    try:
        server.stop()
        with pytest.raises(ChildProcessError):  # reaped: no zombie left
            os.waitpid(stand_in.pid, os.WNOHANG)
        assert os.read(alive_read, 1) == b""  # every write end closed
        assert not address.exists() and not server.started and server.server is None
    finally:
        os.close(alive_read)
        if stand_in.poll() is None:
            stand_in.kill()
