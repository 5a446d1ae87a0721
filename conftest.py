"""Root conftest: name the harness plugin (markers, options, ``run_ranks``) explicitly.

Installing the package already loads it through its ``pytest11`` entry point; pytest
registers it under this same module name, so this line adds no second copy. It keeps the
suite working where plugin autoloading is off (``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``).

Our own subprocesses (torchrun, the CLI demos) get the DNS workaround the harness applies to
its own processes (``rendezvous.avoid_reverse_dns_stalls``) through the environment.

Scheduling under ``pytest -n auto`` (this suite's own, nothing a user of the plugin gets):
the dearest tests are collected first, by the CPU the last serial profile measured
(``.ci/suite_order.json``, every test over 0.5 s, written by ``.ci/suite_profile.py
--update``; a group at its tests' sum), then the other tests marked ``slow`` (seconds each:
torchrun jobs, pytest runs in a subprocess), and xdist hands out tests one at a time
(``--maxschedchunk 1`` unless given), so the long tests start at once, on whichever worker is
free, and the hundreds of short ones fill in behind them: the workers end together. (The
``slow`` marker alone left 5-s tests it does not carry, D11's and D13's, warm worlds' reset,
to start among the short ones, in collection order.) xdist's default hands each worker a
quarter of its share in one consecutive chunk, which left a long test to start near the
end on one worker while the other sat idle (14 s of 82 in one measured run).
The scheduler is xdist's ``loadgroup`` (unless ``--dist`` is given): the same one-at-a-time
hand-out, except that tests marked ``xdist_group("name")``, which share one expensive run
(a module-scoped fixture, each claim its own test), go to one worker together (the workers
are told, and the group tag kept on pytest 9.2: ``tests/test_xdist_groups.py``), and xdist's
reorder of groups by their number of tests is off, so a group goes out where its cost says.

``-n auto`` starts two workers more than there are cores (4 on this 2-core machine): a worker
spends part of a test waiting (for its ranks to start and rendezvous, for a deadline, a group
timeout or a debugger's window, for a subprocess to import torch), and the cores sit idle when
most workers wait at once. With 3 workers about 17 s of a 110 s run had fewer than two cores
busy (a per-test timeline beside the CPU's use every 2 s: lesson 8's group timeouts beside the
debugger's windows, the last test alone). A fourth worker costs one more collection (each
worker imports torch and collects every test module: ~5 s of CPU) and gives the waits more to
overlap with: six alternated pairs of ``PYTEST_XDIST_AUTO_NUM_WORKERS=4`` against ``=3`` on
2026-11-28 gave wall ratios 0.895, 0.956, 1.008, 0.893, 0.904, 0.962 (median 0.93; the last
three 83.3-103.3 s against 93.3-107.4 s) for about 8% more CPU. (An earlier tree, two pairs:
1.01; with 2 workers the machine sat idle 15-20 s of a run.) Ranks keep one intra-op thread
each, so more processes do not multiply threads. ``PYTEST_XDIST_AUTO_NUM_WORKERS`` or ``-n N``
still decide when given.

CPU this suite does not spend (all of it measured with ``perf record -a`` over a whole
``pytest -n auto`` run, then each change alone):

* **The garbage collector's full passes in the pytest processes.** A worker holds torch and
  every lesson's imports, ~350,000 objects, and Python 3.11 walks them all at each full
  collection: 1.5-2.5 s of CPU a worker, 5.5 s a run. Collection runs with the collector
  off, and what it leaves is frozen (``gc.freeze``: never walked again), as the rank
  forkserver does for its ranks: 0.2-0.35 s a worker.
* **Busy BLAS threads.** numpy's OpenBLAS starts a thread per core that spins after each
  call; ``OPENBLAS_NUM_THREADS=1`` (inherited by the workers and the rank forkserver).
* **TensorPipe's shared-memory reactor**, which polls in a ``sched_yield`` loop while an
  RPC agent lives: this suite's ranks run RPC over TCP only (``tests/rpc_over_tcp.py``).
* **Compiling the repository again in every interpreter.** Some shells and images set
  ``PYTHONDONTWRITEBYTECODE``; then each of the suite's interpreters (the xdist workers, the
  rank forkserver, every pytest and torchrun it starts) compiles this repository's modules
  and pytest rewrites every test module anew, each time (130-137 s of CPU against
  114-117 s, measured at 1fb5478). This suite caches bytecode whatever the shell says: the
  variable is dropped here, before xdist starts its workers, so that every process the
  suite starts inherits the choice, and the README's time holds for a newcomer's shell too.
"""

import gc
import os
import sys

import pytest

if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
    sys.dont_write_bytecode = False
os.environ.setdefault("RES_OPTIONS", "use-vc")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

pytest_plugins = ["tutorial_impl.testing.plugin"]


@pytest.hookimpl(optionalhook=True)  # xdist's hook: without xdist (-p no:xdist) never called
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own implementation reads it
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (cores or 1) + 2


def pytest_configure(config: pytest.Config) -> None:
    # xdist registers its ``xdist_group`` marker; without it (``-p no:xdist``, the serial
    # profile's run) a grouped test would be refused by ``--strict-markers``.
    if not config.pluginmanager.hasplugin("xdist"):
        config.addinivalue_line("markers", "xdist_group(name): run with the group's tests")
    # Only for xdist's "load" mode (the default of -n) and only when not given on the
    # command line; the option does not exist without xdist.
    if getattr(config.option, "maxschedchunk", "absent") is None:
        config.option.maxschedchunk = 1
    # Tests that share one expensive end-to-end run (a module-scoped fixture, each claim its
    # own test) carry ``xdist_group``: "loadgroup" sends such a group to one worker, so the
    # run happens once; every other test is its own unit, handed out one at a time as "load"
    # with the chunk of 1 above does. Only when -n chose "load" and no --dist was given.
    if getattr(config.option, "dist", None) == "load" and not _dist_given(config):
        config.option.dist = "loadgroup"
        # xdist's default for it hands out first the groups with the most tests, whatever
        # they cost; the order of ``pytest_collection_modifyitems`` below (dearest first) is
        # the one to keep.
        config.option.loadscopereorder = False
    # A worker parses only the command line, so it does not see the switch above: without
    # ``loadgroup`` set here it would not tag its tests with their group, and the
    # controller would hand a group's tests out one by one (seen: a module's tests on two
    # workers). The controller says so in ``workerinput`` (``pytest_configure_node``).
    if getattr(config, "workerinput", {}).get(LOADGROUP_KEY):
        config.option.loadgroup = True


LOADGROUP_KEY = "tutorial_suite_loadgroup"  # workerinput: the controller schedules by group


@pytest.hookimpl(optionalhook=True)  # xdist's hook, in the controller, once per worker
def pytest_configure_node(node) -> None:  # noqa: ANN001 - xdist's WorkerController
    node.workerinput[LOADGROUP_KEY] = node.config.option.dist == "loadgroup"


def _dist_given(config: pytest.Config) -> bool:
    words = [*config.invocation_params.args, *os.environ.get("PYTEST_ADDOPTS", "").split()]
    return any(str(w) == "-d" or str(w).startswith("--dist") for w in words)


COSTS = ".ci/suite_order.json"  # test id -> CPU seconds, the dear ones (suite_profile --update)


@pytest.hookimpl(trylast=True)  # after xdist's worker has tagged each test with its group
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Dearest first, by the last serial profile's CPU (a group: its tests' sum, so that it
    # goes out where its cost says), then the other slow tests, then the rest, each in
    # collection order (a stable sort); every xdist worker sorts the same way, so their
    # collections still agree.
    costs = _measured_costs(config.rootpath / COSTS)
    groups: dict[str, float] = {}
    for item in items:
        if (group := _group(item)) is not None:
            groups[group] = groups.get(group, 0.0) + costs.get(_plain_id(item, group), 0.0)

    def key(item: pytest.Item) -> tuple[float, bool]:
        group = _group(item)
        cost = groups[group] if group is not None else costs.get(item.nodeid, 0.0)
        return -cost, item.get_closest_marker("slow") is None

    items.sort(key=key)
    for item in items:
        _keep_group_tag(item)


def _measured_costs(path) -> dict[str, float]:  # noqa: ANN001 - a pathlib.Path
    """The file's figures; none (collection order, slow first) where it is missing or bad."""
    import json

    try:
        costs = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(costs, dict):
        return {}
    return {k: float(v) for k, v in costs.items() if isinstance(v, (int, float))}


def _plain_id(item: pytest.Item, group: str) -> str:
    """The test's id without xdist's ``@group`` tag (a pytest that reads ``_nodeid``)."""
    return item.nodeid.removesuffix(f"@{group}")


def _group(item: pytest.Item) -> str | None:
    marker = item.get_closest_marker("xdist_group")
    if marker is None:
        return None
    return str(marker.args[0] if marker.args else marker.kwargs.get("name", "default"))


def _keep_group_tag(item: pytest.Item) -> None:
    """Make the group tag xdist's worker wrote (``nodeid@group``) the test's id.

    xdist (3.8) tells its "loadgroup" scheduler a test's group by writing ``item._nodeid``;
    pytest 9.2 reads a node's id from its structured ``_id`` instead, so the tag was lost and
    every group's tests were handed out one by one (pytest-xdist issue #1386, fix pending
    in PR #1388). Without a tag, or on a pytest that still reads ``_nodeid``: nothing to do.
    """
    tagged = item.__dict__.get("_nodeid")
    if not tagged or tagged == item.nodeid or not hasattr(item, "_id"):
        return
    from _pytest.nodeid import NodeId  # pytest 9.2's private id type, only where it exists

    item._id = NodeId.parse(tagged)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    gc.disable()  # collection imports torch and every lesson: no full pass over it meanwhile


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    gc.freeze()  # what collection left is never walked again (garbage in it is kept: little)
    gc.enable()
