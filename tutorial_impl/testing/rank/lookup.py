"""How a rank finds its function: by module and name, and by file where the name is not enough.

A rank is a fresh process forked from the forkserver, so the function it runs cannot travel as
an object; it travels as a reference (``FunctionRef``): its module's name, its qualified name,
and the module's source file. The parent checks the reference before any rank starts
(``function_ref``); the rank turns it back into the function (``resolve``).

Rank functions may live in any module with a file, **test files included**. pytest names a
test module one way or another depending on its import mode:

* ``prepend`` (the default) puts the test file's directory (or its package root) on
  ``sys.path`` and imports ``test_x`` (or ``pkg.test_x``) by name. The rank receives the
  parent's ``sys.path``, so the same name imports the same file there.
* ``importlib`` imports the file under a name such as ``tests.sub.test_x`` that is *not*
  importable in another process (nothing on ``sys.path`` leads to it). So when the name does
  not lead to the parent's file, the rank loads that file directly, under the same module
  name, so that objects of that module pickled by the parent (arguments) still unpickle.

Either way, pytest had rewritten the module's ``assert`` statements in the parent, so that a
failing ``assert a == b`` shows both values. A rank that imported the file plainly would lose
that. So for a module pytest rewrote, the parent sends the rewritten code along (marshalled,
tens of kB): pytest's own cached copy (``__pycache__/*-pytest-*.pyc``), or, where pytest
wrote none (``PYTHONDONTWRITEBYTECODE``), the file rewritten once per parent process with
pytest's rewriter. Rewriting in every rank instead would cost 30-100 ms a rank. A test module
the forkserver imported plainly (named in ``rank_preload``) is run again from that code in
the rank, under the same name, so its asserts keep their explanation there too.

What truly cannot work is refused in the parent, with the reason: lambdas and nested
functions (no name a rank could look up), functions of ``__main__`` (ranks do not re-run the
main script or an interactive session), and functions of modules without a file. A
``functools.partial`` travels as its function's reference; its bound arguments go with the
call's (``shape``).
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import marshal
import os
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class FunctionRef:
    """What a rank needs to find its function: module name, qualified name, source file."""

    module: str
    qualname: str
    file: str | None = None  # absolute path of the module's file; None: import by name only
    code: bytes | None = None  # marshalled module code with pytest's rewritten asserts


def function_ref(fn: Callable[..., Any]) -> FunctionRef:
    """Check, in the parent, that a rank will find ``fn``, and return the reference it needs.

    Raises ``TypeError`` naming the reason when a rank could not find it. A
    ``functools.partial`` is looked up as its function; its arguments travel with the
    call's (``shape``).
    """
    if isinstance(fn, functools.partial):
        return function_ref(fn.func)
    if not callable(fn):
        raise TypeError(f"rank function must be callable, got {fn!r}")
    module_name = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module_name or not qualname or "<" in qualname:
        raise TypeError(
            f"rank function {fn!r} is not a module-level function: a rank looks its function "
            "up by name in its module, and lambdas and functions nested in another function "
            "have no such name. Define it at the top level of the test file (or any module); "
            "to bind arguments, pass functools.partial(that_function, ...)"
        )
    if module_name == "__main__":
        main = sys.modules.get("__main__")
        where = "a script" if getattr(main, "__file__", None) else "an interactive session"
        raise TypeError(
            f"rank function {qualname} is defined in __main__ ({where}), which a rank does not "
            "re-run; move it into a module or a test file"
        )
    module = sys.modules.get(module_name)
    if module is None:  # not imported here (its module was removed): the rank imports it
        return FunctionRef(module_name, qualname)
    file = getattr(module, "__file__", None)
    if file is None and getattr(module, "__spec__", None) is None:
        raise TypeError(
            f"rank function {qualname} belongs to module {module_name!r}, which has no file "
            "(made with types.ModuleType or exec?): a rank has nothing to import it from; "
            "define the function in a module or a test file"
        )
    try:
        found = _attribute(module, qualname)
        same = found is fn or bool(found == fn)  # == for bound methods, made anew each access
    except Exception:  # noqa: BLE001 - not found, or an __eq__ that cannot answer
        same = False
    if not same:
        raise TypeError(
            f"rank function {fn!r} is not what its module {module_name!r} holds under the "
            f"name {qualname!r} (redefined, or decorated without functools.wraps?); a rank "
            "would run that object instead. Pass the module-level object itself"
        )
    file = os.path.abspath(file) if file else None
    # "@pytest_ar" is the name pytest's rewriter imports itself under in a module it rewrote.
    code = _rewritten_code(file) if file and "@pytest_ar" in vars(module) else None
    return FunctionRef(module_name, qualname, file, code)


def defined_by(cls: type, name: str) -> type | None:
    """The class of ``cls``'s MRO that defines ``name`` (None: none does)."""
    return next((k for k in cls.__mro__ if name in vars(k)), None)


def resolve(ref: FunctionRef) -> Callable[..., Any]:
    """Inside the rank: the function ``ref`` names, its module imported or loaded as needed."""
    return _attribute(_module(ref), ref.qualname)


def _attribute(obj: Any, qualname: str) -> Any:
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _same_file(module: types.ModuleType | None, file: str | None) -> bool:
    if module is None:
        return False
    if file is None:
        return True  # nothing to compare with: the name is all the parent had
    return _same_path(getattr(module, "__file__", None), file)


def _same_path(a: str | None, b: str) -> bool:
    if a is None:
        return False
    if os.path.abspath(a) == b:  # also for paths that are no files (inside a zip archive)
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _module(ref: FunctionRef) -> types.ModuleType:
    loaded = sys.modules.get(ref.module)  # preloaded in the forkserver, or imported meanwhile
    # ... unless the parent's copy had pytest's rewritten asserts and that one has not.
    if _same_file(loaded, ref.file) and (ref.code is None or "@pytest_ar" in vars(loaded)):
        return loaded  # type: ignore[return-value]
    if ref.code is not None and ref.file:
        return _load_from_file(ref.module, ref.file, marshal.loads(ref.code))
    if ref.file is None:
        try:
            return importlib.import_module(ref.module)
        except ModuleNotFoundError as exc:
            raise ImportError(
                f"rank cannot import the module of its function {ref.module}.{ref.qualname}: {exc}"
            ) from exc
    if _name_leads_to(ref.module, ref.file):
        return importlib.import_module(ref.module)
    return _load_from_file(ref.module, ref.file, None)


def _name_leads_to(name: str, file: str) -> bool:
    """Whether importing ``name`` here would load ``file`` (decided without running it)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    return _same_path(spec.origin if spec is not None else None, file)


_rewritten: dict[tuple[str, int, int], bytes | None] = {}


def _rewritten_code(file: str) -> bytes | None:
    """In the parent: ``file``'s code with pytest's rewritten asserts, marshalled; None if
    it cannot be had (then ranks import the file plainly). Computed once per file version."""
    try:
        stat = os.stat(file)
    except OSError:
        return None
    key = (file, stat.st_mtime_ns, stat.st_size)
    if key not in _rewritten:
        _rewritten[key] = _rewrite(Path(file))
    return _rewritten[key]


def _rewrite(path: Path) -> bytes | None:
    if path.suffix != ".py":
        return None
    try:
        from _pytest.assertion.rewrite import (
            PYC_TAIL,
            _read_pyc,
            get_cache_dir,
            rewrite_asserts,
        )
    except ImportError:  # pytest's internals moved: rank functions still work, plain asserts
        return None
    try:
        code = _read_pyc(path, get_cache_dir(path) / (path.name[:-3] + PYC_TAIL))
        if code is None:  # pytest wrote no cache: rewrite as pytest does, once
            source = path.read_bytes()
            tree = ast.parse(source, filename=str(path))
            rewrite_asserts(tree, source, str(path))
            code = compile(tree, str(path), "exec", dont_inherit=True)
        return marshal.dumps(code)
    except Exception:  # noqa: BLE001 - any trouble here means: ranks import it plainly
        return None


def _load_from_file(name: str, file: str, code: types.CodeType | None) -> types.ModuleType:
    """Execute ``file`` as module ``name`` (pytest's ``code`` for it, if given)."""
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"rank cannot load module {name!r} from {file}")
    module = importlib.util.module_from_spec(spec)
    parent = _ensure_parents(name, file)
    sys.modules[name] = module
    try:
        if code is not None:
            exec(code, module.__dict__)
        else:
            spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    if parent is not None:
        setattr(parent, name.rpartition(".")[2], module)
    return module


def _ensure_parents(name: str, file: str) -> types.ModuleType | None:
    """Make ``a`` and ``a.b`` exist for module ``a.b.c`` (so pickle's import of it works),
    as pytest's importlib mode does: import each if it can be, else an empty stand-in whose
    ``__path__`` is the matching directory above ``file``."""
    parts = name.split(".")
    parent = None
    above = Path(file).parents  # above[0] is the directory of a.b for a.b.c, above[1] of a
    for i in range(1, len(parts)):
        prefix = ".".join(parts[:i])
        module = sys.modules.get(prefix)
        if module is None:
            try:
                module = importlib.import_module(prefix)
            except ImportError:
                module = types.ModuleType(prefix)
                level = len(parts) - 1 - i
                here = above[level] if level < len(above) else None
                module.__path__ = [str(here)] if here and here.name == parts[i - 1] else []  # type: ignore[attr-defined]
                sys.modules[prefix] = module
        if parent is not None and not hasattr(parent, parts[i - 1]):
            setattr(parent, parts[i - 1], module)
        parent = module
    return parent
