"""Root conftest: name the harness plugin (markers, options, ``run_ranks``) explicitly.

Installing the package already loads it through its ``pytest11`` entry point; pytest
registers it under this same module name, so this line adds no second copy. It keeps the
suite working where plugin autoloading is off (``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``).

Our own subprocesses (torchrun, the CLI demos) get the DNS workaround the harness applies to
its own processes (``rendezvous.avoid_reverse_dns_stalls``) through the environment.
"""

import os

os.environ.setdefault("RES_OPTIONS", "use-vc")

pytest_plugins = ["tutorial_impl.testing.plugin"]
