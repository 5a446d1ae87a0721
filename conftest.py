"""Root conftest: name the harness plugin (markers, options, ``run_ranks``) explicitly.

Installing the package already loads it through its ``pytest11`` entry point; pytest
registers it under this same module name, so this line adds no second copy. It keeps the
suite working where plugin autoloading is off (``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``).
"""

pytest_plugins = ["tutorial_impl.testing.plugin"]
