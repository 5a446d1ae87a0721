"""The world-size matrix: ``@pytest.mark.world_size(1, 2, 4)`` makes one test per size.

pytest turns one test function into several *items* through parametrization: during
collection it calls every ``pytest_generate_tests`` hook with a ``metafunc`` (the function
about to be collected), and each ``metafunc.parametrize`` call multiplies the items. A
parameter must belong to a fixture the test uses, so the sizes go to a private fixture,
``_world_size_matrix``, on which the ``run_ranks`` and ``world_size`` fixtures depend
(``indirect=True``: the fixture receives each size as ``request.param``).

Each item gets the id ``[world_sizeN]`` and a marker ``world_size(n=N)``, so both ways of
selecting tests reach one size: ``-k world_size4`` (a ``-k`` expression cannot contain
``=``, hence no ``world_size=4`` id) and ``-m "world_size(n=4)"`` (pytest >= 8.3 matches
marker keyword arguments). A single size, ``@pytest.mark.world_size(4)``, is not a matrix:
one item, as before.
"""

from __future__ import annotations

import os
import resource
from typing import Any

DEFAULT_WORLD_SIZE = 2
FIXTURE = "_world_size_matrix"  # the private fixture the sizes parametrize

# The most ranks one call may have (docs/harness.md): every rank is a process with its own
# threads and a full mesh of gloo connections, and the parent holds files and pipes for
# each; far more than a test of distributed code needs. Lower on a host whose limits say
# so (``world_size_limit``).
MAX_WORLD_SIZE = 256
RANK_THREADS = 16  # threads a gloo rank may run (RLIMIT_NPROC counts threads on Linux)
RANK_FILES = 8  # files and pipes the parent holds per rank (RLIMIT_NOFILE)
RANK_MEMORY = 64 << 20  # bytes a forked rank needs of its own at least (its heap, gloo's buffers)


def world_size_limit() -> tuple[int, str]:
    """The largest world size this host can start, and what sets it: the smallest of the
    harness's cap, RLIMIT_NPROC / ``RANK_THREADS``, RLIMIT_NOFILE / ``RANK_FILES`` and the
    host's memory / ``RANK_MEMORY``."""
    found = [(MAX_WORLD_SIZE, f"the harness's cap, MAX_WORLD_SIZE = {MAX_WORLD_SIZE}")]
    for name, per in (("RLIMIT_NPROC", RANK_THREADS), ("RLIMIT_NOFILE", RANK_FILES)):
        soft = resource.getrlimit(getattr(resource, name))[0]
        if soft != resource.RLIM_INFINITY:
            found.append((soft // per, f"{name} {soft} / {per} per rank"))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    found.append((memory // RANK_MEMORY, f"{memory >> 20} MiB of memory / 64 MiB per rank"))
    return min(found)


def check_world_size(size: Any, what: str = "world_size") -> int:
    """``size`` if it is a world size this host can start, else ``ValueError`` naming
    ``what``, the value and the limit (before any rank starts)."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"{what} must be a positive integer, got {size!r}")
    limit, why = world_size_limit()
    if size > limit:
        raise ValueError(
            f"{what} {size} is more ranks than this host can start: at most {limit} ({why})"
        )
    return size


def sizes(marker: Any) -> list[int] | None:
    """The sizes of a matrix marker (two or more positional sizes), else None.

    Raises ``ValueError`` for sizes that are not distinct positive integers.
    """
    if marker is None or len(marker.args) < 2:
        return None
    found = list(marker.args)
    bad = [n for n in found if not isinstance(n, int) or isinstance(n, bool) or n < 1]
    if bad:
        raise ValueError(f"world_size{tuple(found)}: sizes must be positive integers, got {bad}")
    if len(set(found)) != len(found):
        raise ValueError(f"world_size{tuple(found)}: each size may appear only once")
    for n in found:
        check_world_size(n, f"world_size{tuple(found)}: size")
    return found


def item_id(size: int) -> str:
    """The id of one entry of the matrix, as it appears in ``test_x[world_size2]``."""
    return f"world_size{size}"
