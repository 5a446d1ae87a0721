"""Which modules the test files of a pytest run import, read from their source (no import).

The rank forkserver preloads what the test files import (``forkserver.probe``), so that a
rank, which imports its test module again, finds the library under test already loaded. Under
``pytest -n N`` the server is started by the xdist controller before any worker has collected
a test, so what the test modules import is read here from their source instead: the files
pytest would collect from the run's arguments (``testpaths`` when none were given), walked as
pytest walks them (``python_files`` patterns, ``norecursedirs``, ``--ignore``,
``--ignore-glob``, virtualenvs skipped; a file named as an argument is collected whatever its
name), and in each one the imports at module level (also inside ``if``, ``try`` and ``with``
blocks, but not under ``if TYPE_CHECKING``; never inside a function or a class).

Left out: relative imports; pytest itself; the test modules and conftests (a rank loads its
test module with pytest's rewritten asserts: ``lookup``); what the run excludes
(``rank_preload_exclude``: a name and its submodules). ``from a import b`` is kept as the
statement is, module ``a`` with the names ``b``, so that importing it imports submodule
``a.b`` only where ``a`` has no attribute ``b``, as the statement does.

**What torch imports later.** A rank also imports what torch itself imports lazily, the first
time the test uses it: ``torch._dynamo`` (with sympy, some 800 modules, 1.3-1.9 s of CPU) is
imported by every optimizer's and ``DistributedDataParallel``'s constructor, by
``torch.compile``, FSDP and pipelining. So a file that names any of those (``LAZY``: a name, an
attribute or an imported module anywhere in it, or in a module of the project's that it imports:
the library under test that builds the optimizer) adds the module to the scan, and so does an
import of torch's own modules inside a function (a rank function's ``from
torch.distributed.tensor import DTensor``): probed and excludable like the rest. A file that
only runs collectives adds nothing. With the test files' imports off (``torch_only``), only
``LAZY``'s are read: what torch imports by itself. This module imports neither pytest nor
torch: the forkserver imports it.
"""

from __future__ import annotations

import ast
import fnmatch
import functools
import importlib.machinery
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_FILES = 2000  # a walk that finds more stops there: preloading is only a speed-up
MAX_BYTES = 2_000_000  # larger files are data, not tests
NEVER = {"__future__", "__main__", "pytest", "_pytest", "py", "conftest"}
# Torch's lazily imported modules, and the words in a test file that say its ranks will import
# them (measured: an optimizer's or DDP's constructor imports torch._dynamo, torch 2.13).
# A word is a name, an attribute or a part of a torch import anywhere in the file; the common
# words count only with their owner ("torch.compile", not "re.compile").
LAZY = {
    "torch._dynamo": frozenset(
        {"optim", "DistributedDataParallel", "nn.parallel", "FullyShardedDataParallel", "fsdp",
         "fully_shard", "_composable.replicate", "torch.compile", "pipelining",
         "ZeroRedundancyOptimizer"}
    ),
}  # fmt: skip


@dataclass
class Scan:
    """What the walk found: the modules to import and the directories pytest would put on
    ``sys.path`` (import mode ``prepend`` or ``append``) to import the test files."""

    imports: dict[str, list[str]] = field(default_factory=dict)  # module -> names it gives
    paths: list[str] = field(default_factory=list)
    files: int = 0


def scan(plan: dict[str, Any]) -> Scan:
    """The imports of every test file the run described by ``plan`` collects (see
    ``preload.plan``), in the order pytest meets the files."""
    found = Scan()
    patterns = list(plan["python_files"])
    exclude = tuple(plan.get("exclude", ()))
    torch_only = plan.get("torch_only", False)  # rank_preload_test_imports = false
    roots, libraries = [plan["invocation_dir"]], []
    for file in test_files(plan):
        found.files += 1
        base = str(_basedir(file))
        roots += [base] if base not in roots else []
        if base not in found.paths and not torch_only:
            found.paths.append(base)
        tree = _read(file)
        every = [] if tree is None else list(_statements(tree.body)) + _torch_later(tree)
        libraries += _imported_anywhere(tree)
        for module, names in [(m, n) for m, n in every if m in LAZY] if torch_only else every:
            if _wanted(module, patterns, exclude):
                kept = found.imports.setdefault(module, [])
                kept += [n for n in names if n not in kept and _wanted(f"{module}.{n}", patterns)]
    for lazy in _lazy_in_libraries(libraries, roots, set(found.imports)):
        if _wanted(lazy, patterns, exclude):
            found.imports[lazy] = []
    return found


def _lazy_in_libraries(modules: list[str], roots: list[str], known: set[str]) -> list[str]:
    """``LAZY``'s modules that the project's own modules imported by the test files (a
    library under test that builds the optimizer: found under ``roots``, read, not imported,
    one level deep) will have torch import; none already ``known``."""
    found: list[str] = []
    for module in dict.fromkeys(modules):
        if set(LAZY) <= known | set(found):
            break
        path = _local_source(module, roots)
        if path is not None:
            found += [m for m, _ in imports_of(path) if m in LAZY and m not in known | set(found)]
    return found


def _local_source(module: str, roots: list[str]) -> Path | None:
    """The file of ``module`` under one of ``roots`` (the project's directories), or None
    (torch's, pytest's: installed elsewhere)."""
    relative = Path(*module.split("."))
    for root in roots:
        for path in (Path(root, f"{relative}.py"), Path(root, relative, "__init__.py")):
            if path.is_file():
                return path
    return None


def test_files(plan: dict[str, Any]) -> Iterator[Path]:
    """The ``*.py`` files pytest would collect from ``plan["args"]``, at most ``MAX_FILES``."""
    count = 0
    for arg in plan["args"]:
        path = Path(os.path.abspath(os.path.join(plan["invocation_dir"], arg.split("::")[0])))
        if path.is_file():
            walked: Iterator[Path] = iter([path] if path.suffix == ".py" else [])
        elif path.is_dir():
            walked = _walk(path, plan)
        else:
            continue  # --pyargs names, or a path that does not exist: pytest reports it
        for file in walked:
            count += 1
            if count > MAX_FILES:
                return
            yield file


def _walk(top: Path, plan: dict[str, Any]) -> Iterator[Path]:
    for here, dirs, files in os.walk(top):
        dirs[:] = sorted(d for d in dirs if _recurse(Path(here, d), plan))
        for name in sorted(files):
            path = Path(here, name)
            matches = any(_fnmatch_ex(p, path) for p in plan["python_files"])
            if name.endswith(".py") and matches and not _ignored(path, plan):
                yield path


def _recurse(path: Path, plan: dict[str, Any]) -> bool:
    """Whether pytest would collect inside directory ``path`` (``_pytest.main``'s rules)."""
    if path.name == "__pycache__" or _ignored(path, plan):
        return False
    if any(_fnmatch_ex(p, path) for p in plan["norecursedirs"]):
        return False
    venv = (path / "pyvenv.cfg").is_file() or (path / "conda-meta" / "history").is_file()
    return plan.get("collect_in_virtualenv", False) or not venv


def _ignored(path: Path, plan: dict[str, Any]) -> bool:
    if str(path) in plan.get("ignore", ()):
        return True
    return any(fnmatch.fnmatch(str(path), glob) for glob in plan.get("ignore_glob", ()))


def _fnmatch_ex(pattern: str, path: Path) -> bool:
    """pytest's ``fnmatch_ex``: a pattern without a separator matches the file's name, one
    with a separator the end of its path."""
    if os.sep not in pattern:
        return fnmatch.fnmatch(path.name, pattern)
    if path.is_absolute() and not os.path.isabs(pattern):
        pattern = f"*{os.sep}{pattern}"
    return fnmatch.fnmatch(str(path), pattern)


def _basedir(file: Path) -> Path:
    """The directory pytest's ``prepend`` mode puts on ``sys.path`` for ``file``: the first
    one above it that is not a package."""
    here = file.parent
    while (here / "__init__.py").is_file() and here.parent != here:
        here = here.parent
    return here


def imports_of(file: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every absolute import at module level in ``file``, then torch's
    modules it imports anywhere and those it names a use of (``LAZY``); [] for a file that
    cannot be read or parsed (pytest reports it)."""
    tree = _read(file)
    return [] if tree is None else list(_statements(tree.body)) + _torch_later(tree)


def _read(file: Path) -> ast.Module | None:
    try:
        if file.stat().st_size > MAX_BYTES:
            return None
        return ast.parse(file.read_bytes(), str(file))
    except (OSError, SyntaxError, ValueError):
        return None


def _imported_anywhere(tree: ast.Module | None) -> list[str]:
    """Every absolute import's module, and each name it imports as a possible submodule:
    where a library under test may be (a rank function imports it inside itself)."""
    found: list[str] = []
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return found


def _torch_later(tree: ast.Module) -> list[tuple[str, list[str]]]:
    """Torch's modules a rank of this file will import as it runs: those imported anywhere
    in it (inside functions too), then ``LAZY``'s whose words it names."""
    found: dict[str, list[str]] = {}
    words: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            words.add(node.id)
        elif isinstance(node, ast.Attribute):  # its name, and "torch.compile", "nn.parallel"
            owner = node.value.id if isinstance(node.value, ast.Name) else ""
            words.update({node.attr, f"{owner}.{node.attr}"})
        elif isinstance(node, ast.Import | ast.ImportFrom) and not getattr(node, "level", 0):
            module = getattr(node, "module", None) or ""
            names = [alias.name for alias in node.names]
            for name in [module] if module else names:
                if name.split(".")[0] == "torch":
                    found.setdefault(name, names if module else [])
                    words.update(_said(name, names if module else []))
    found.update({lazy: [] for lazy, said in LAZY.items() if words & said})
    return list(found.items())


def _said(module: str, names: list[str]) -> set[str]:
    """The words an import from torch says: its parts, each two in a row ("nn.parallel"),
    and what it imports, with its module's last part ("torch.compile")."""
    parts = module.split(".")
    pairs = {f"{a}.{b}" for a, b in zip(parts, parts[1:], strict=False)}
    return {*parts, *pairs, *names, *(f"{parts[-1]}.{name}" for name in names)}


def _statements(body: list[ast.stmt]) -> Iterator[tuple[str, list[str]]]:
    for node in body:
        if isinstance(node, ast.Import):
            yield from ((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module, [alias.name for alias in node.names]
        elif isinstance(node, ast.If) and not _type_checking(node.test):
            yield from _statements(node.body)
            yield from _statements(node.orelse)
        elif isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
            for block in (node.body, node.orelse, node.finalbody):  # type: ignore[attr-defined]
                yield from _statements(block)
            for handler in node.handlers:  # type: ignore[attr-defined]
                yield from _statements(handler.body)
        elif isinstance(node, ast.With):
            yield from _statements(node.body)


def _type_checking(test: ast.expr) -> bool:
    """``if TYPE_CHECKING:`` or ``if typing.TYPE_CHECKING:``: imports for type checkers."""
    name = test.attr if isinstance(test, ast.Attribute) else getattr(test, "id", None)
    return name == "TYPE_CHECKING"


def _wanted(module: str, test_patterns: list[str], exclude: tuple[str, ...] = ()) -> bool:
    """Neither pytest, nor a test module or conftest, nor excluded (a name or its parent). A
    module named like a test file (``*_test.py``) of an installed library is the library's,
    not a test file of this run: torch's ``distributed_test`` suite, left out, was imported
    again by every rank (about 3.5 s of CPU each)."""
    parts = module.split(".")
    if parts[0] in NEVER or parts[-1] == "conftest":
        return False
    named = any(fnmatch.fnmatch(parts[-1] + ".py", p) for p in test_patterns if os.sep not in p)
    if named and not _installed(parts[0]):
        return False
    return not any(module == name or module.startswith(name + ".") for name in exclude)


@functools.cache
def _installed(top: str) -> bool:
    """Whether top-level package ``top`` is found (not imported) in a ``site-packages`` or
    ``dist-packages`` folder of ``sys.path``."""
    try:
        spec = importlib.machinery.PathFinder.find_spec(top)
    except (ImportError, ValueError):
        return False
    where = spec.origin if spec else None  # None too for a namespace package: not counted
    return bool(where) and bool({"site-packages", "dist-packages"} & set(Path(where).parts))
