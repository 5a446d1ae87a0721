"""The repository's own rules, checked by reading its files (no process starts).

Data flows one way. A test asks the harness to run a rank function; the harness never
imports a tutorial module; tutorial code never imports the harness, because a learner copies
tutorial code into a script of their own, where ``tutorial_impl.testing`` does not exist. The
one exception is a demo's ``main``, which may import the CLI's launcher (``tutorial_impl.cli``,
built on the harness) inside its own body. And a lesson reads in one file: rank functions that
exist only for a test live in that test module, so no test imports a ``*_checks`` module.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "tutorial_impl"
TUTORIALS = sorted([*(PACKAGE / "dist_tuto").glob("*.py"), *(PACKAGE / "rpc").glob("*.py")])
HARNESS = sorted((PACKAGE / "testing").glob("*.py"))


def imports(path: Path, skip_functions: tuple[str, ...] = ()) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``, except inside the named functions."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef) and child.name in skip_functions:
                continue
            if isinstance(child, ast.Import):
                found.extend((child.lineno, alias.name) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module:
                found.append((child.lineno, child.module))
                found.extend((child.lineno, f"{child.module}.{a.name}") for a in child.names)
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def test_there_are_tutorial_and_harness_modules_to_check():
    assert len(TUTORIALS) >= 12 and len(HARNESS) >= 6  # a moved folder must not pass vacuously


@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_tutorial_code_never_imports_the_harness(path):
    """Outside a demo's ``main``, no tutorial module imports the harness or the CLI."""
    bad = [
        f"line {line}: {module}"
        for line, module in imports(path, skip_functions=("main",))
        if module.startswith(("tutorial_impl.testing", "tutorial_impl.cli"))
    ]
    assert not bad, f"{path.relative_to(REPO)} imports the harness: {bad}"


@pytest.mark.parametrize("path", HARNESS, ids=lambda p: p.name)
def test_the_harness_never_imports_a_tutorial(path):
    prefixes = ("tutorial_impl.dist_tuto", "tutorial_impl.rpc", "tutorial_impl.bench")
    bad = [f"line {line}: {m}" for line, m in imports(path) if m.startswith(prefixes)]
    assert not bad, f"{path.relative_to(REPO)} imports tutorial code: {bad}"


def test_no_test_imports_rank_functions_from_a_helpers_module():
    """A lesson reads in one file: its rank functions sit above the tests that run them."""
    bad = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        for line, module in imports(path):
            last = module.rsplit(".", 1)[-1]
            if last.endswith("_checks") or last == "selftest_ranks":
                bad.append(f"{path.relative_to(REPO)}:{line}: {module}")
    assert not bad, bad


def test_the_readme_names_every_module_and_test_file():
    """The learning path must lead to every file a reader may need."""
    readme = (REPO / "README.md").read_text()
    files = [
        p
        for p in [*PACKAGE.rglob("*.py"), *(REPO / "tests").rglob("test_*.py")]
        if p.name not in ("__init__.py", "__main__.py")
    ]
    missing = sorted(str(p.relative_to(REPO)) for p in files if p.name not in readme)
    assert not missing, f"README.md never names: {missing}"


def test_every_tests_path_named_in_code_and_readme_exists():
    """A comment or README line that sends a learner to a test file must name a real one.
    (The README's ``tests/test_averaging.py`` is in the reader's own project, an example.)"""
    named = set()
    for path in PACKAGE.rglob("*.py"):
        named |= {(path, m) for m in re.findall(r"tests/[\w/]*test_\w+\.py", path.read_text())}
    readme = (REPO / "README.md").read_text()
    named |= {(REPO / "README.md", m) for m in re.findall(r"tests/\w+/test_\w+\.py", readme)}
    missing = sorted(f"{p.relative_to(REPO)}: {m}" for p, m in named if not (REPO / m).exists())
    assert not missing, missing


def test_the_readmes_test_count_is_true(request):
    """The README says how many tests the suite has; the collected count must agree (±10%).

    Only a run of the whole suite can tell (under ``pytest -n auto`` every worker collects
    every test), so a run of some files, or one filtered by -k/-m, skips this.
    """
    claimed = int(re.search(r"about (\d+) tests", (REPO / "README.md").read_text()).group(1))
    items = request.session.items
    files = {Path(item.path) for item in items}
    everything = set((REPO / "tests").rglob("test_*.py"))
    options = request.config.option
    if files != everything or options.keyword or options.markexpr:
        pytest.skip("the test count is checked only when the whole suite is collected")
    assert abs(len(items) - claimed) <= claimed / 10, (
        f"README.md says about {claimed} tests; the suite has {len(items)}: update the README"
    )
