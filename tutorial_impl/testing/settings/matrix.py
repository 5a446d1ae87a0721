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

from typing import Any

DEFAULT_WORLD_SIZE = 2
FIXTURE = "_world_size_matrix"  # the private fixture the sizes parametrize


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
    return found


def item_id(size: int) -> str:
    """The id of one entry of the matrix, as it appears in ``test_x[world_size2]``."""
    return f"world_size{size}"
