"""The harness's shape, checked by reading its files (no import, no process starts).

``tutorial_impl/testing/`` is read by a newcomer as a house: a concept is a folder, a role is
a file (``docs/architecture.md`` is the map). These bars keep it so: few entries at the top,
no module over 400 lines, no function over 60, no import circle, every sentence of a
report's first line written in one module (``words.py``), and a map that names every
module and no other. Each bar is pure: the files are parsed, never imported.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HARNESS = REPO / "tutorial_impl" / "testing"
PACKAGE = "tutorial_impl.testing"
MODULES = sorted(HARNESS.rglob("*.py"))
MAP = REPO / "docs" / "architecture.md"

TOP_ENTRIES = 20
MODULE_LINES = 400
FUNCTION_LINES = 60
# What is over a bar, each with why it may be for now: none since issue 36's splits. An entry
# that is no longer over its bar fails the test below, so the list cannot go stale.
OVER_BAR: dict[str, str] = {}


def name(path: Path) -> str:
    return path.relative_to(HARNESS).as_posix()


def dotted(path: Path) -> str:
    parts = path.relative_to(HARNESS).with_suffix("").parts
    return ".".join([PACKAGE, *(parts[:-1] if parts[-1] == "__init__" else parts)])


TREES = {dotted(p): ast.parse(p.read_text(), str(p)) for p in MODULES}


def test_there_are_modules_to_check():
    assert len(MODULES) > 40 and f"{PACKAGE}.words" in TREES


def test_the_top_of_the_harness_has_few_entries():
    """A newcomer reads the top as a table of contents: folders for concepts, a few files."""
    entries = sorted(p.name for p in HARNESS.iterdir() if p.name != "__pycache__")
    assert 8 <= len(entries) <= TOP_ENTRIES, entries


def test_every_folder_is_a_package_with_its_concept_said():
    """A folder without ``__init__.py`` is left out of the installed package; its docstring
    says what it holds (the map's first column)."""
    folders = [p for p in HARNESS.rglob("*") if p.is_dir() and p.name != "__pycache__"]
    assert folders
    bad = [name(f) for f in folders if not (f / "__init__.py").exists()]
    bad += [
        name(f)
        for f in folders
        if (f / "__init__.py").exists() and not ast.get_docstring(TREES[dotted(f / "__init__.py")])
    ]
    assert not bad, f"folders without an __init__.py that says what they hold: {bad}"


def over_the_bars() -> dict[str, int]:
    """Every module over MODULE_LINES lines and function over FUNCTION_LINES, with its length."""
    over = {}
    for path in MODULES:
        lines = path.read_text().count("\n")
        if lines > MODULE_LINES:
            over[name(path)] = lines
        for node in ast.walk(TREES[dotted(path)]):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > FUNCTION_LINES:
                    over[f"{name(path)}:{node.name}"] = length
    return over


def test_no_module_or_function_is_over_its_bar():
    over = over_the_bars()
    new = {k: v for k, v in over.items() if k not in OVER_BAR}
    assert not new, (
        f"over {MODULE_LINES} lines a module or {FUNCTION_LINES} a function: {new} "
        "(split it by role: a module per role, a function per step)"
    )
    gone = sorted(set(OVER_BAR) - set(over))
    assert not gone, f"no longer over a bar, take them off OVER_BAR: {gone}"


def imports(tree: ast.AST, known: set[str]) -> set[str]:
    """The harness modules ``tree`` imports, anywhere in it (a lazy import inside a function
    is still an arrow). ``from pkg import sub`` is an arrow to the submodule; importing a
    submodule is not counted as an arrow to its package's ``__init__``. An import under
    ``if TYPE_CHECKING:`` is for the type checker only, never run: not an arrow."""
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for inner in ast.walk(stmt)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            subs = {f"{node.module}.{a.name}" for a in node.names} & known
            found |= subs or {node.module}
            if len(subs) < len(node.names):
                found.add(node.module)
    return found & known


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph`` (its strongly connected parts of two or more)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            part = []
            while not part or part[-1] != node:
                part.append(stack.pop())
            if len(part) > 1:
                found.append(sorted(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_circle_finder_finds_circles():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set(), "c": {"c"}}) == []
    known = {"p.a", "p.b", "p"}
    tree = ast.parse("from p import a, x\nimport p.b\ndef f():\n    from p.b import y\n")
    assert imports(tree, known) == {"p", "p.a", "p.b"}


# Folders (and top-level modules) of the harness that import each other, each with why: a
# folder is a layer, and an arrow back up is a debt. An entry that no longer holds fails the
# test below, so the list can only shrink.
MUTUAL_FOLDERS: dict[tuple[str, str], str] = {
    (
        "diagnose",
        "faults",
    ): "the recorder names a collective as a fault plan does (collective_name); "
    "a fired fault says where it fired (stacks.place)",
    ("forkserver", "rank"): "the server and what it forks are two halves of one start",
    ("forkserver", "strategies"): "a warm rank's reuse is imported by the server (6 ms a rank)",
}


def folder_of(module: str) -> str:
    """The harness's first-level entry that holds ``module``: its folder, or itself."""
    parts = module.removeprefix(PACKAGE + ".").split(".")
    return parts[0] if module != PACKAGE else ""


def mutual_folders() -> set[tuple[str, str]]:
    known = set(TREES)
    arrows = {
        (folder_of(module), folder_of(target))
        for module, tree in TREES.items()
        for target in imports(tree, known)
    }
    arrows = {(a, b) for a, b in arrows if a != b and a and b}
    return {tuple(sorted((a, b))) for a, b in arrows if (b, a) in arrows}  # type: ignore[misc]


def test_folders_are_layers_but_for_the_listed_arrows_back():
    """No folder imports one that imports it back, but those ``MUTUAL_FOLDERS`` lists with
    why (at most four); the list holds no pair that has gone."""
    found = mutual_folders()
    assert found <= MUTUAL_FOLDERS.keys(), (
        f"new arrows back: {sorted(found - MUTUAL_FOLDERS.keys())}"
    )
    assert MUTUAL_FOLDERS.keys() <= found, f"gone, drop: {sorted(MUTUAL_FOLDERS.keys() - found)}"
    assert len(MUTUAL_FOLDERS) <= 4


def test_no_import_circle_inside_the_harness():
    """Data flows one way (plugin -> settings -> call -> strategy -> rank -> verdict -> report):
    no module imports, even lazily, one that imports it back."""
    known = set(TREES)
    graph = {module: imports(tree, known) - {module} for module, tree in TREES.items()}
    assert sum(map(len, graph.values())) > 100  # the reader reads the imports
    assert not circles(graph)


# The sentences of a report's first line: each is written once, in ``words.py``.
SENTENCES = [
    "still running after the harness deadline",
    "was killed by signal",
    "exited with code",
    "had returned",
    "before returning a result",
    "failed too",
    "never joined",
    "the group did not form in",
    "the ranks are in different collectives",
    "a skip must be taken by every rank",
    "a hang that cannot resolve",
    "did not fire",
    "cannot be honoured",
    "the warm world's verdict",
    "harness configuration: ",
    "the session stops here",
    "phase within the harness deadline",
    "not run: ",
]


@functools.cache
def literals(module: str) -> list[str]:
    """Every string literal of ``module`` but docstrings (an f-string's constant parts too),
    read once for all the sentences."""
    tree = TREES[module]
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
    ]


@pytest.mark.parametrize("sentence", SENTENCES)
def test_each_sentence_of_a_first_line_is_written_in_one_module(sentence):
    homes = sorted(
        name(path) for path in MODULES if any(sentence in text for text in literals(dotted(path)))
    )
    assert homes == ["words.py"], f"{sentence!r} is written in {homes}"


LINKED = re.compile(r"\]\(\.\./tutorial_impl/testing/([\w/]+?\.py|[\w/]+/)\)")


def test_the_map_names_every_module_and_folder_and_nothing_else():
    """docs/architecture.md is the harness's map: every module and folder is linked from it
    (a folder's ``__init__.py`` by its folder), and every link leads to one that exists."""
    linked = set(LINKED.findall(MAP.read_text()))
    there = {name(p) for p in MODULES if p.name != "__init__.py" or p.parent == HARNESS}
    there |= {
        name(p.parent) + "/" for p in MODULES if p.name == "__init__.py" and p.parent != HARNESS
    }
    assert len(linked) > 40, "the map's links are not read: is the link pattern broken?"
    assert not there - linked, f"docs/architecture.md does not name: {sorted(there - linked)}"
    assert not linked - there, f"docs/architecture.md names what is gone: {sorted(linked - there)}"
