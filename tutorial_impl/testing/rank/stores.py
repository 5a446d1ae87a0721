"""``shared_store()``: a store every rank of a call shares, for a process group of its own.

PyTorch's ``MultiProcessTestCase`` gives each test ``self.file_name``, a fresh file every rank
names, and many of its tests build their own group on it (``ProcessGroupGloo(FileStore(
self.file_name, world_size), rank, world_size)``). A port needs the same: a store that is
empty for this call and the same on every rank, forked, in a warm world and under torchrun.
A file would do forked and warm (the call's directory is shared), but under torchrun each
worker has a directory of its own; the store of the harness's group is shared in all three.
So ``shared_store()`` is a ``PrefixStore`` over that store, under a prefix no other call uses:
the test's pytest id (the same on every rank: a warm rank and a torchrun worker read it from
their environment) and how many stores this test asked for before on this rank. Every rank
must therefore call it the same number of times, in the same order, as they would open
``self.file_name``; a rank that asks for one more waits at its group's rendezvous, which
then ends at the test's deadline.
"""

from __future__ import annotations

import os
from typing import Any

_asked: dict[str, int] = {}  # this rank's stores so far, by test


def shared_store() -> Any:
    """A store of this call's ranks, empty at first, in a rank function (not the test body).

    Needs the harness's own group (a call without ``backend=None``), whose store it shares.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError(
            "shared_store() shares the store of the harness's process group, and this rank "
            "has none: call it in a rank function of a run_ranks call without backend=None"
        )
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0] or "no test"
    count = _asked[test] = _asked.get(test, -1) + 1
    base = dist.distributed_c10d._get_default_store()
    return dist.PrefixStore(f"tutorial-impl-shared-store/{test}/{count}/", base)
