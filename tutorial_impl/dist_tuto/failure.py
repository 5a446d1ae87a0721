"""When a rank fails: what the others see, after how long, and how to read a hang.

The tutorial's programs assume that every rank lives and calls the same collectives with
the same tensors. The lesson ``tests/dist_tuto/test_08_failure.py`` breaks each assumption
on purpose and measures what torch 2.13 does on gloo: a dead peer is an error at once, a
missing peer an error at the group's ``timeout``, a size mismatch an abort or a silent
partial result. This module is the little a program of your own needs to look:

* ``what_it_raises(call)``: run a call that may fail; say what it raised and when.
* ``write_fr_dump(directory, rank)``: this rank's flight-recorder buffer (torch records
  every collective of every group, on gloo too, the last 2000 by default), written where
  torch's analyzer reads it::

      python -m torch.distributed.flight_recorder.fr_trace DIRECTORY

  The analyzer wants one file per rank, ``<prefix><rank>``, the prefix shared (here
  ``rank_``; ``-p PREFIX`` names it where the analyzer cannot guess it). It logs what it
  finds on stderr; ``-j``, which prints every entry instead, needs the ``tabulate`` package.
  On gloo, torch 2.13 leaves the dump's table of groups empty (one group named ``""``)
  while each entry names its group (``"0"``): the analyzer then stops with
  ``KeyError: ('0', 1)``. So the table is filled in from this process's own groups.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

PREFIX = "rank_"  # the dump files are rank_0, rank_1, ...: the analyzer strips the prefix


def what_it_raises(call: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[str, float]:
    """Run ``call(*args, **kwargs)``; return ``("RuntimeError: ...", seconds)``, or
    ``("returned", seconds)`` if it did not raise. The seconds are the lesson: an error at
    once and an error at the timeout read the same in a log."""
    started = time.monotonic()
    try:
        call(*args, **kwargs)
    except Exception as exc:  # the point is to see whatever torch raises
        return f"{type(exc).__name__}: {exc}", time.monotonic() - started
    return "returned", time.monotonic() - started


def group_table() -> dict[str, dict[str, str]]:
    """Every group this process is in, as the analyzer's ``pg_config`` wants it: by name,
    its description and its ranks (numbered as in the default group)."""
    table = {}
    for group, name in dist.distributed_c10d._world.pg_names.items():
        ranks = dist.get_process_group_ranks(group)
        table[name] = {"name": name, "desc": group.group_desc, "ranks": str(ranks)}
    return table


def write_fr_dump(directory: str | Path, rank: int, stacks: bool = False) -> dict[str, Any]:
    """Write this rank's flight-recorder buffer to ``directory/rank_<rank>``; return torch's
    dump as it was (unpickled), before its group table was filled in.

    A dump can be taken while this rank waits in a collective (from another thread, or
    between ``async_op=True`` and ``wait()``): take it before the wait ends, because once a
    gloo collective has timed out its record reads finished (``retired``) like any other.
    ``stacks``: with where each collective was called. torch's default, but the first dump
    with stacks in a process took 6 to 9 s here (about 1 s of it CPU), longer than the wait
    it was meant to catch; later ones, and any without stacks, took under a millisecond.
    """
    dump_fr_trace = torch._C._distributed_c10d._dump_fr_trace
    raw = dump_fr_trace(includeCollectives=True, includeStackTraces=stacks)
    trace = pickle.loads(raw)
    fixed = {**trace, "pg_config": group_table()}
    (Path(directory) / f"{PREFIX}{rank}").write_bytes(pickle.dumps(fixed))
    return trace
