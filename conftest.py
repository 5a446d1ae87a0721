"""Root conftest: name the harness plugin (markers, options, ``run_ranks``) explicitly.

Installing the package already loads it through its ``pytest11`` entry point; pytest
registers it under this same module name, so this line adds no second copy. It keeps the
suite working where plugin autoloading is off (``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``).

Our own subprocesses (torchrun, the CLI demos) get the DNS workaround the harness applies to
its own processes (``rendezvous.avoid_reverse_dns_stalls``) through the environment.

Scheduling under ``pytest -n auto`` (this suite's own, nothing a user of the plugin gets):
the tests marked ``slow`` (seconds each: torchrun jobs, pytest runs in a subprocess) are
collected first, and xdist hands out tests one at a time (``--maxschedchunk 1`` unless given),
so the long tests start at once, on whichever worker is free, and the hundreds of short
ones fill in behind them: the workers end together. xdist's default hands each worker a
quarter of its share in one consecutive chunk, which left a long test to start near the
end on one worker while the other sat idle (14 s of 82 in one measured run).

``-n auto`` starts one worker more than there are cores: a worker spends part of a test
waiting (for its ranks to start and rendezvous, for a deadline, for a subprocess to import
torch), and with 2 workers the 2-core machine sat idle 15-20 s of an 80-100 s run; with 3,
about 9 s. The gain in wall time is small and hard to see beside other jobs on the machine
(one quiet alternating pair, all of the above against neither: 76 s against 78 s); 4 workers
were slower than 2 (each worker imports torch and collects every test module, seconds of
CPU: the suite is mostly CPU-bound; the rank forkserver is one for all workers, started by the
controller). Ranks keep one intra-op thread each, so more processes
do not multiply threads. ``PYTEST_XDIST_AUTO_NUM_WORKERS`` or ``-n N`` still decide when given.
"""

import os

import pytest

os.environ.setdefault("RES_OPTIONS", "use-vc")

pytest_plugins = ["tutorial_impl.testing.plugin"]


@pytest.hookimpl(optionalhook=True)  # xdist's hook: without xdist (-p no:xdist) never called
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own implementation reads it
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (cores or 1) + 1


def pytest_configure(config: pytest.Config) -> None:
    # Only for xdist's "load" mode (the default of -n) and only when not given on the
    # command line; the option does not exist without xdist.
    if getattr(config.option, "maxschedchunk", "absent") is None:
        config.option.maxschedchunk = 1


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Slow tests first, each group in collection order (a stable sort); every xdist worker
    # sorts the same way, so their collections still agree.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
