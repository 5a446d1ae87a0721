"""Environment variables torch reads once, at import: making them work in ranks anyway.

A rank is forked from the harness's forkserver, which imported torch when it started. A
variable that torch reads only while it is being imported was read *then*, with the
forkserver's environment: setting it later in the parent, or passing it through
``run_ranks(env=...)``, would change ``os.environ`` in the rank and nothing else. Silently
ignored settings are the worst kind, so every such variable is either re-applied in the
rank, before its process group is made, or refused with an error that says what to do.

* ``TORCH_DISTRIBUTED_DEBUG`` (``OFF``, ``INFO``, ``DETAIL``): re-applied through
  ``torch.distributed.set_debug_level_from_env()``. ``DETAIL`` is what makes
  ``init_process_group`` wrap the group in torch's ``ProcessGroupWrapper``, which checks
  before every collective that all ranks call the same one with the same shapes: a test
  where rank 0 calls ``all_reduce`` and rank 1 ``broadcast`` then fails in about a second
  with "Detected mismatch between collectives ... ALLREDUCE ... BROADCAST" instead of
  hanging until its deadline. The pytest option ``--check-collectives`` and the marker
  ``check_collectives`` turn that on (``CHECK_COLLECTIVES``); it costs a few times the
  price of a small collective (``python -m tutorial_impl bench harness`` measures it).
* ``IMPORT_ONLY`` (``TORCH_CPP_LOG_LEVEL``: c10's C++ logging level, set up when torch's
  extension loads, with no way to change it afterwards): asked for through
  ``run_ranks(env=...)`` with a value other than the one torch was imported with, it is
  refused with an error that says to set it before the first rank of the process starts
  (before running pytest, or at the top of a script). Changed in the parent's environment
  since then (by anything in the process: a benchmark's ``setdefault``, say), the rank's
  ``os.environ`` shows the value torch really uses, so that nothing in the rank is misled.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

# What --check-collectives and the check_collectives marker add to the ranks' environment.
CHECK_COLLECTIVES = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
# Read by torch only at import, and no API re-applies them: refused when they would differ.
IMPORT_ONLY = ("TORCH_CPP_LOG_LEVEL",)
DEBUG = "TORCH_DISTRIBUTED_DEBUG"  # read at import too, and re-applied (above)


def environ_bytes() -> dict[bytes, bytes]:
    """The environment as the OS holds it, bytes to bytes: ``os.environ``'s own table
    (CPython's, shared with ``os.environb``; not a copy), read without decoding a variable:
    what a parent sends its ranks, and what a rank compares it with (``rank.main``)."""
    return getattr(os.environb, "_data", None) or dict(os.environb)


def read_at_import() -> dict[str, str]:
    """The variables of this module as the environment has them now: in a rank, before its
    task's environment is set, the forkserver's, which torch was imported with."""
    return {name: os.environ[name] for name in (*IMPORT_ONLY, DEBUG) if name in os.environ}


def apply_in_rank(imported_with: Mapping[str, str], requested: Mapping[str, str]) -> None:
    """Make the rank's ``os.environ`` true for torch; ``imported_with`` is the environment
    torch was imported with (the forkserver's, which the rank inherited at fork) and
    ``requested`` what the caller asked for explicitly (``run_ranks(env=...)``).

    Called in the rank after its environment is set and before any process group exists.
    """
    for name in IMPORT_ONLY:
        had = imported_with.get(name)
        if name in requested and requested[name] != had:
            raise ValueError(
                f"{name}={requested[name]!r} cannot take effect in a rank: torch reads it "
                f"only at import, and the harness's forkserver imported torch with "
                f"{name}={had!r}. Set {name} in the environment before the first rank of "
                "this process starts (before running pytest, or at the top of your script), "
                "not through run_ranks(env=...)"
            )
        if had is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = had
    if os.environ.get(DEBUG) != imported_with.get(DEBUG):
        import torch.distributed as dist

        dist.set_debug_level_from_env()  # raises on a value torch does not know
