"""Names a project's own fixtures cannot take over in silence: ``run_ranks`` and ``world_size``.

pytest serves a fixture name from the closest definition: a test module's, then its
conftests', then the plugins'. A project with a ``world_size`` fixture of its own (ignite's
conftest has one, defaulting to 1) therefore hands *its* value to the harness's
``run_ranks``, which depends on ``world_size``: a two-rank test would run one rank and pass,
proving nothing. A project's own ``run_ranks`` would replace the harness altogether, its
markers unread. So, for every test that uses ``run_ranks`` (the fixture, or the public
function from a helper during the test):

* a project's ``run_ranks`` fixture is refused (``run_ranks_refusal``, at collection; the
  test fails in setup), naming the fixture and where it is defined; one that requests
  ``run_ranks`` itself wraps the harness's and is left alone;
* a project's ``world_size`` fixture is refused (``size_refusal``: at collection when no
  value could help, else when the harness's ``run_ranks`` is set up, before any rank
  starts), unless the test sets its size with ``@pytest.mark.world_size(N)`` and the
  fixture gives that same N; the test's own ``@pytest.mark.parametrize("world_size", ...)``
  overrides every fixture and stays the documented way to set a size.

A test that does not use ``run_ranks`` keeps the project's fixtures, unread. The messages
say what to do: rename the fixture, or give the test its size.
"""

from __future__ import annotations

import contextlib
import inspect
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pytest

DIRECT_PARAM = "get_direct_param_fixture_func"  # pytest's stand-in for a test's parametrize


def shadowing(item: pytest.Item, name: str, ours: str) -> Any | None:
    """The fixture definition that serves ``name`` to ``item`` in place of the harness's
    (whose functions live in module ``ours``), or None: the harness's own, or the test's
    ``parametrize`` of ``name``."""
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.get(name) if info is not None else None
    if not defs:  # not in the test's closure (a helper's call): what the name would give
        defs = item.session._fixturemanager.getfixturedefs(name, item)  # type: ignore[attr-defined]
    if not defs:
        return None
    last = defs[-1]
    func = getattr(last, "func", None)
    if getattr(func, "__module__", None) == ours or getattr(func, "__name__", "") == DIRECT_PARAM:
        return None
    return last


def defined_at(fixturedef: Any, rootpath: Path) -> str:
    """Where a fixture is defined: ``conftest.py:12``, relative to ``rootpath`` if inside."""
    code = getattr(inspect.unwrap(fixturedef.func), "__code__", None)
    if code is None:
        return repr(fixturedef.func)
    path = Path(code.co_filename)
    with contextlib.suppress(ValueError):
        path = path.relative_to(rootpath)
    return f"{path}:{code.co_firstlineno}"


def run_ranks_refusal(item: pytest.Item, ours: str) -> str | None:
    """Why ``item`` cannot use the harness's ``run_ranks`` (a project's fixture took the
    name), or None."""
    found = shadowing(item, "run_ranks", ours)
    if found is None or "run_ranks" in found.argnames:
        return None
    return (
        f"fixture 'run_ranks' of {defined_at(found, item.config.rootpath)} shadows the "
        "harness's: this test would not run through the harness (its world_size and other "
        "markers unread); rename that fixture"
    )


UNKNOWN: Any = object()  # the value a fixture gives, before it is set up (at collection)


def size_refusal(
    item: pytest.Item, ours: str, given: Any = UNKNOWN, wanted: int | None = None
) -> str | None:
    """Why ``run_ranks`` cannot take its size from ``world_size`` when a project's fixture
    serves that name: ``given`` is its value (``UNKNOWN`` at collection: then only what is
    refused whatever the value), ``wanted`` the test's own size by its marker. None when
    the harness's fixture or the test's parametrize serves it, or the two agree."""
    found = shadowing(item, "world_size", ours)
    if found is None:
        return None
    marker = item.get_closest_marker("world_size")
    value = "" if given is UNKNOWN else f" ({given!r})"
    if marker is not None and len(marker.args) > 1:  # a matrix nobody could parametrize
        why = f"the sizes of world_size{tuple(marker.args)} cannot reach run_ranks"
    elif marker is None:
        why = f"run_ranks would run as many ranks as it gives{value}, and this test sets no size"
    elif given is UNKNOWN or given == wanted:
        return None
    else:
        why = f"it gives {given!r} where this test's marker asks for {wanted}"
    return (
        f"fixture 'world_size' of {defined_at(found, item.config.rootpath)} shadows the "
        f"harness's: {why}; rename that fixture, or set this test's size with "
        "@pytest.mark.world_size(N) (the fixture must then give N too) or "
        "@pytest.mark.parametrize('world_size', [N])"
    )
