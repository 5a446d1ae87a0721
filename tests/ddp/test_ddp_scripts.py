"""How every DDP lesson runs as a script: one line, ``toy.run_as_script(main)`` (``ddp/toy.py``).

Run as ``python -m tutorial_impl.ddp.<lesson>`` (or as a file), a lesson is the module
``__main__``, where the demo's ranks cannot look its rank function up by name. The claims:
run as ``__main__``, a lesson hands ``run_main`` the ``main`` of its copy imported under the
package's name, with ``-m`` (``__spec__`` set) and as a file (no ``__spec__``); a function of
an ordinary module is its own package copy; and every lesson with a demo ends with that one
line (no copy of a workaround). The lesson is executed here as ``__main__`` from its source,
with ``run_main`` replaced by a list that records what it was handed: no rank starts.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from tutorial_impl.ddp import buckets, toy

LESSONS = sorted(
    p
    for p in Path(toy.__file__).parent.glob("*.py")
    if p.stem not in ("__init__", "toy", "torchrun_env")  # torchrun_env: a worker script
)


def run_as_main(path: Path, with_spec: bool, monkeypatch) -> tuple[list, dict]:
    """Execute ``path`` as ``__main__`` (as ``python -m`` would, or as a file); what
    ``run_main`` was handed, and the module's namespace."""
    handed: list = []
    monkeypatch.setattr(toy, "run_main", handed.append)
    spec = importlib.util.find_spec(f"tutorial_impl.ddp.{path.stem}") if with_spec else None
    namespace = {"__name__": "__main__", "__spec__": spec, "__file__": str(path)}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    return handed, namespace


@pytest.mark.parametrize("with_spec", [True, False], ids=["python -m", "as a file"])
def test_a_lesson_run_as_main_runs_its_package_copy(monkeypatch, with_spec) -> None:
    handed, namespace = run_as_main(Path(buckets.__file__), with_spec, monkeypatch)
    assert namespace["main"].__module__ == "__main__"  # the copy ranks cannot look up...
    assert handed == [buckets.main]  # ...was not the one run: the package's copy was
    assert buckets.main.__module__ == "tutorial_impl.ddp.buckets"
    assert toy.package_copy(buckets.main) is buckets.main  # not __main__'s: itself


def test_every_lesson_ends_with_the_one_line() -> None:
    assert len(LESSONS) >= 15  # D1-D8, D10-D16 (a moved folder must not pass vacuously)
    for path in LESSONS:
        guards = [
            node
            for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'"
        ]
        assert [[ast.unparse(s) for s in g.body] for g in guards] == [
            ["toy.run_as_script(main)"]
        ], path.name
