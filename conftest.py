"""Root conftest: load the multi-rank harness plugin (markers, options, ``run_ranks``)."""

pytest_plugins = ["tutorial_impl.testing.plugin"]
