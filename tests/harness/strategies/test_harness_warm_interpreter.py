"""A warm rank gives every test the interpreter a fresh rank has (``reuse``, ``interpreter``).

A stranger's project (only the installed package, no conftest) changes, in one test, a
process-wide setting (the garbage collector, the switch interval, the ``decimal`` context, a
submodule's train mode, ...), and checks, in the next, that its ranks see what the pytest
process itself sees at import: what a rank forked fresh from the forkserver has. Run forked,
those checks pass; they must pass as well with ``--warm-worlds``, where the second test runs in
the first one's ranks unless the world was retired, and the summary line must count the worlds
started, reused and retired, with each reason, as the ranks' own pids show them.
"""

from __future__ import annotations

import re

import torch  # noqa: F401 - before any in-process pytester run (test_harness_warm says why)

from tests.harness.strategies import warm_promise
from tutorial_impl.testing.strategies.warm import reuse

pytest_plugins = ["pytester"]

CARRY = """
import decimal, gc, locale, logging, logging.config, os, sys, threading
import pytest
import torch
import torch.distributed as dist
from tutorial_impl.testing import RankFailed

MODEL = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))
LOG = logging.getLogger("stranger")
CALL = torch.nn.Module.__call__


class Scaler:
    def scale(self, x):
        return x


def hook(*args):  # a trace, profile or except hook that does nothing
    return None


def umask():
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


STATE = {
    "gc": gc.isenabled,
    "gc_threshold": gc.get_threshold,
    "switch": sys.getswitchinterval,
    "decimal": lambda: decimal.getcontext().prec,
    "decimal_default": lambda: decimal.DefaultContext.rounding,
    "submodule": lambda: MODEL[1].training,
    "umask": umask,
    "locale": lambda: locale.setlocale(locale.LC_CTYPE),
    "logger": lambda: LOG.level,
    "dict_config": lambda: LOG.disabled,
    "cwd": os.getcwd,
    "path": lambda: sys.path[0],
    "recursion": sys.getrecursionlimit,
    "autocast": lambda: torch.is_autocast_enabled("cpu"),
    "multithreading": torch.autograd.is_multithreading_enabled,
    "group": dist.is_initialized,
    "trace": lambda: sys.gettrace() is hook,
    "thread_profile": lambda: threading.getprofile() is hook,
    "excepthook": lambda: sys.excepthook is hook,
    "module_hook": lambda: len(torch.nn.modules.module._global_forward_hooks),
    "tensor_method": lambda: "equal" in vars(torch.Tensor),
    "module_call": lambda: torch.nn.Module.__call__ is CALL,
    "user_method": lambda: Scaler().scale(1),
}
CHANGE = {
    "gc": gc.disable,
    "gc_threshold": lambda: gc.set_threshold(1, 1, 1),
    "switch": lambda: sys.setswitchinterval(0.5),
    "decimal": lambda: setattr(decimal.getcontext(), "prec", 3),
    "decimal_default": lambda: setattr(decimal.DefaultContext, "rounding", decimal.ROUND_DOWN),
    "submodule": lambda: MODEL[1].eval(),  # dropout off: the next test would not train
    "umask": lambda: os.umask(0o077 if umask() != 0o077 else 0o022),
    "locale": lambda: locale.setlocale(
        locale.LC_CTYPE, "C" if locale.setlocale(locale.LC_CTYPE) != "C" else "C.UTF-8"),
    "logger": lambda: LOG.setLevel(logging.DEBUG),
    "dict_config": lambda: logging.config.dictConfig({"version": 1}),  # disables LOG
    "cwd": lambda: os.chdir("/"),
    "path": lambda: sys.path.insert(0, "/nowhere"),
    "recursion": lambda: sys.setrecursionlimit(5000),
    "autocast": lambda: torch.set_autocast_enabled("cpu", True),
    "multithreading": lambda: torch.autograd.set_multithreading_enabled(False),
    # After a barrier: a rank that destroys its group while its peer is still in the group's
    # set-up (gloo's connectFullMesh) fails that peer ("Connection closed by peer").
    "group": lambda: (dist.barrier(), dist.destroy_process_group()),
    "trace": lambda: sys.settrace(hook),
    "thread_profile": lambda: threading.setprofile(hook),
    "excepthook": lambda: setattr(sys, "excepthook", hook),
    # A forgotten global hook, and no other setting changed: the reset's fast path.
    "module_hook": lambda: torch.nn.modules.module.register_module_forward_hook(hook),
    "tensor_method": lambda: setattr(torch.Tensor, "equal", lambda *a: True),
    "module_call": lambda: setattr(torch.nn.Module, "__call__", lambda *a, **k: CALL(*a, **k)),
    "user_method": lambda: setattr(Scaler, "scale", lambda self, x: 2 * x),
}
FRESH = {how: read() for how, read in STATE.items()}  # this process's, as a fresh rank's
FRESH["group"] = True


def note(rank, name):
    with open(os.path.join(os.environ["CARRY_PIDS"], f"{name}.{rank}"), "w") as f:
        f.write(str(os.getpid()))


def leave(rank, world_size, how):
    note(rank, f"leave-{how}")
    CHANGE[how]()
    assert STATE[how]() != FRESH[how], f"{how} did not change"


def find(rank, world_size, how, name=None):
    note(rank, name or f"find-{how}")
    assert STATE[how]() == FRESH[how], f"{how}: {STATE[how]()!r}, fresh {FRESH[how]!r}"


def find_each(rank, world_size):
    for how in STATE:
        find(rank, world_size, how)


def fails(rank, world_size):
    note(rank, "fails")
    raise ValueError("a failing test")


@pytest.mark.parametrize("how", list(CHANGE))
def test_a_leaves(run_ranks, how):
    run_ranks(leave, how)


@pytest.mark.parametrize("how", list(CHANGE))
def test_b_finds(run_ranks, how):
    run_ranks(find, how)


def test_b_finds_each_in_one_world(run_ranks):  # the forked reference: every check, fresh
    run_ranks(find_each)


def test_c_fails(run_ranks):
    run_ranks(fails)


def test_d_after(run_ranks):
    run_ranks(find, "gc", "after")


def caught(rank, world_size):
    note(rank, "caught")
    raise ValueError("a failure the test expects")


def test_e_catches_a_failed_call(run_ranks):  # passes: counted as no failed test
    with pytest.raises(RankFailed, match="a failure the test expects"):
        run_ranks(caught)
"""
HOW = re.findall(r'^    "(\w+)": ', CARRY.split("CHANGE = {")[1].split("}\n")[0], re.MULTILINE)
# What a warm rank cannot reset and detects instead, retiring its world (the next test then
# runs in fresh ranks); the reason each gives in the summary.
RETIRES = {
    "submodule": "the test changed module globals of test_carry: MODEL (its contents)",
    "group": "the default process group was destroyed or replaced",
    "tensor_method": "torch.Tensor.equal was added (monkeypatched)",
    "module_call": "torch.nn.Module.__call__ was replaced (monkeypatched)",
    "user_method": "the test changed module globals of test_carry: Scaler (its contents)",
}
CAUGHT = "1 x a run_ranks call failed in a test that passed (pytest.raises)"


def forked(rank: int, world_size: int) -> int:
    return rank


def test_a_warm_world_resets_or_retires_what_a_test_changed_and_says_so(
    pytester, tmp_path, run_ranks
):
    # This session's rank forkserver starts now, with this session's plan: started by the
    # first run below, it would preload that run's test files for the rest of this session.
    assert run_ranks(forked, world_size=1, backend=None) == [0]
    pytester.makepyfile(test_carry=CARRY)
    order = []
    for how in HOW:
        order += [f"test_carry.py::test_a_leaves[{how}]", f"test_carry.py::test_b_finds[{how}]"]
    order += ["test_carry.py::test_c_fails", "test_carry.py::test_d_after"]
    order += ["test_carry.py::test_e_catches_a_failed_call"]
    args = ["-p", "no:randomly", "-p", "no:cacheprovider", "-p", "no:xdist"]
    # Forked, the reference: each check passes in a fresh rank (``FRESH`` is what a fresh
    # rank sees). The changes are left out there: no forked rank serves two tests (the
    # conformance suite's forked run proves it), so a change dies with its ranks; warm, every
    # change comes before its check. The checks only read, so one fresh world runs them all,
    # each under its own name (``find_each``): 2 ranks where a world per check took 2 * 23.
    reference = ["test_carry.py::test_b_finds_each_in_one_world", *order[-3:]]
    runs = {
        "forked": (reference, 3),
        "warm": ([*order, "--warm-worlds"], 2 * len(HOW) + 2),
    }
    verdicts = {}
    for mode, (chosen, passing) in runs.items():
        pids = tmp_path / mode
        pids.mkdir()
        pytester._monkeypatch.setenv("CARRY_PIDS", str(pids))
        result = pytester.runpytest_inprocess(*args, *chosen)
        out = result.stdout.str()
        # Every change took, and the next test saw a fresh rank's value; one test fails.
        result.assert_outcomes(passed=passing, failed=1)
        verdicts[mode] = {pid.name: int(pid.read_text()) for pid in pids.iterdir()}
        lines = [line for line in out.splitlines() if line.startswith("warm worlds:")]
        if mode == "forked":
            assert lines == [], out  # nothing ran warm, nothing was asked
            continue
        # The ranks' pids: which tests one world served (rank 0's pid is its world's).
        order_0 = [f"{kind}-{how}.0" for how in HOW for kind in ("leave", "find")]
        worlds = [verdicts[mode][name] for name in [*order_0, "fails.0", "after.0", "caught.0"]]
        started = len(set(worlds))
        for how in HOW:  # a reset setting: its next test ran in the same world
            same = verdicts[mode][f"leave-{how}.0"] == verdicts[mode][f"find-{how}.0"]
            assert same == (how not in RETIRES), how
        retired = [
            f"1 x {RETIRES[how]}, after test_carry.py::test_a_leaves[{how}]" for how in RETIRES
        ]
        # A failed test counts once; e's failed call, in a test that passed, under its own.
        reasons = "; ".join(sorted(["1 x a test failed", CAUGHT, *retired]))
        expected = (
            f"warm worlds: {started} started, {2 * len(HOW) + 3 - started} reuses, "
            f"{len(RETIRES) + 2} retired ({reasons})"
        )
        assert lines == [expected], out
        assert started == len(RETIRES) + 2  # the first, one after each retired, one after c
        assert worlds[-1] == worlds[-2]  # e ran in d's world, and retired it
    # The same checks ran both ways, on every rank (the changes only warm).
    found = {name for name in verdicts["warm"] if not name.startswith("leave-")}
    assert set(verdicts["forked"]) == found and len(found) == 2 * (len(HOW) + 3)


def test_the_docs_list_what_a_warm_rank_resets_detects_and_cannot_see():
    """docs/harness.md's lists are the code's (``warm_promise.describe``), word
    for word."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[3] / "docs" / "harness.md").read_text()
    begin, end = "<!-- warm_promise.describe() -->\n", "<!-- end of warm_promise.describe() -->"
    assert begin in page and end in page, "the generated lists are gone from docs/harness.md"
    written = page.split(begin, 1)[1].split(end, 1)[0]
    assert written == warm_promise.describe(torch), (
        "docs/harness.md is out of date: paste warm_promise.describe(torch) between its markers "
        "(python -c 'import torch; from tests.harness.strategies import warm_promise as promise; "
        'print(promise.describe(torch), end="")\')'
    )
    # Every setting a warm rank resets is on the page, by its label (a backends flag by name).
    labels = [s.label for s in reuse._settings(torch)]
    assert len(labels) == len(set(labels)) and len(labels) > 40
    words = " ".join(written.split())
    missing = [
        label
        for label in labels
        if label.removeprefix("torch.backends.").removeprefix("cuda ") not in words
    ]
    assert missing == []


def test_xdist_workers_counts_are_summed_in_the_controllers_line():
    """Each xdist worker has its own pool: the controller writes the sum of their counts."""
    from types import SimpleNamespace

    from tutorial_impl.testing.strategies.warm.summary import FAILED, WarmStats, WarmSummary

    outputs = []
    for started, reuses, why in ((2, 5, FAILED), (1, 3, "rank 1: a thread was left")):
        stats = WarmStats(started=started, reuses=reuses)
        stats.retire(why, "test_a.py::test_x")
        stats.retire("rank 0: 1 process group(s) left behind", f"test_b.py::test_{started}")
        worker = SimpleNamespace(workerinput={}, workeroutput={})
        summary = WarmSummary(stats, asked=True, config=worker)
        summary.pytest_sessionfinish(SimpleNamespace(config=worker))
        written = []
        summary.pytest_terminal_summary(SimpleNamespace(write_line=written.append))
        assert written == []  # a worker writes nothing: its output is the controller's
        outputs.append(worker.workeroutput)
    controller = WarmSummary(WarmStats(), asked=False, config=SimpleNamespace())
    for output in outputs:
        controller.pytest_testnodedown(SimpleNamespace(workeroutput=output), None)
    controller.pytest_testnodedown(SimpleNamespace(), None)  # a worker that crashed
    written = []
    controller.pytest_terminal_summary(SimpleNamespace(write_line=written.append))
    assert written == [
        # Each reason once, with its count ("2 x", as a reason may start with a number of its
        # own) and the first test it followed: the first worker's.
        "warm worlds: 3 started, 8 reuses, 4 retired (2 x 1 process group(s) left behind, "
        "first after test_b.py::test_2; 1 x a test failed; 1 x a thread was left, "
        "after test_a.py::test_x)"
    ]
    idle = WarmSummary(WarmStats(), asked=False, config=SimpleNamespace())
    idle.pytest_terminal_summary(SimpleNamespace(write_line=written.append))
    assert len(written) == 1  # nothing ran warm, nothing asked: no line
