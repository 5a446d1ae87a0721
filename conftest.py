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
"""

import os

import pytest

os.environ.setdefault("RES_OPTIONS", "use-vc")

pytest_plugins = ["tutorial_impl.testing.plugin"]


def pytest_configure(config: pytest.Config) -> None:
    # Only for xdist's "load" mode (the default of -n) and only when not given on the
    # command line; the option does not exist without xdist.
    if getattr(config.option, "maxschedchunk", "absent") is None:
        config.option.maxschedchunk = 1


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Slow tests first, each group in collection order (a stable sort); every xdist worker
    # sorts the same way, so their collections still agree.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
