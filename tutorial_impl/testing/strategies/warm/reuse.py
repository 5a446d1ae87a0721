"""What a warm rank does between tests to stay as good as new (see ``warm``).

A test must pass warm if and only if it passes fresh, for everything the harness can see. A
fresh rank is forked from the forkserver, so a warm rank's state when its world is made
(``Baseline()``) is the reference. Around each test's rank function, ``before_task`` resets
what can be reset and snapshots what can only be compared; ``after_task`` answers None or
the first problem found, and then the world is replaced.

**Reset before each task**, to the state at ``Baseline``: every setting of ``interpreter``
(the garbage collector, switch interval, recursion limit, ``decimal``, locale, umask, trace
and profile functions, the hooks of ``sys`` and ``threading``, torch's process-wide flags, ...)
and every logger's configuration (``interpreter.Loggers``); the
generators of ``random``, numpy's legacy global ``RandomState`` (reseeded from entropy if numpy
was imported later, as a fresh import is), torch's CPU generator, CUDA's if initialised at
``Baseline``; global ``nn.Module`` hooks; the ``warnings`` filters, ``defaultaction`` and
once-registry (every module's registry of warnings shown is invalidated, so a warning shows
again); the handler of every signal Python can restore, ``alarm`` / ``setitimer`` timers
(cancelled after the task too, or one could kill the idle rank). (The harness sets the
environment, the working directory and ``sys.path`` for each task.)

**Detected after each task**, against ``before_task``'s snapshot:

* threads the task started (Python's, daemon or not) still alive 50 ms after it;
* globals of the user's modules (files outside the standard library, ``site-packages`` /
  ``dist-packages`` and the harness): rebound, added (but a submodule imported), removed, or
  changed one level inside (``fingerprint``: a container's items, a tensor's version and
  ``.grad``, an ``nn.Module``'s parameters, buffers and the modes of all its submodules, an
  array's bytes, a generator's state, an object's ``__dict__``);
* attributes replaced, added or deleted in the ``WATCHED`` modules and ``CLASSES``
  (monkeypatching; a user's own classes are globals of the user's modules, above), but a
  submodule imported meanwhile, a wrapper of the old value in a task that imported modules
  (torch._dynamo's import wraps ``torch.manual_seed``: the wrapper is the reference from
  then on, as in a fresh rank after that import), what torch rebinds itself (``OWN``) and
  the hooks reset instead (``RESET_ATTRS``);
* a changed handler Python cannot restore: one set in C, or of a signal faulthandler handles
  in C (``C_HANDLED``; SIGUSR1 is the deadline's stack dump);
* a torch function or dispatch mode left entered, inference mode or a profiler left on, CUDA
  initialised by the task (its generators' fresh state is lost).

What it cannot see: ``docs/harness.md`` (its lists checked against these by a test).
"""

from __future__ import annotations

import _signal  # getsignal without signal's enum conversion: 64 calls each task
import copy
import operator
import random
import signal
import sys
import sysconfig
import threading
import time
import types
import warnings
from os import path, sep
from typing import Any

from tutorial_impl.testing.strategies.warm import fingerprint, interpreter

WATCHED = (  # the modules whose attributes tests commonly monkeypatch
    "torch torch.cuda torch.distributed torch.distributed.distributed_c10d torch.distributed.rpc "
    "torch.nn torch.nn.functional torch.nn.parallel torch.autograd torch.optim builtins os sys "
    "time random warnings threading socket signal subprocess logging"
).split()
# Rebound by torch itself (group and RPC counters; torch.Storage follows the default dtype,
# which is reset), Python's registry of warnings shown and its cache on a pickled class (a
# rank's tensor result sets ``torch.Tensor.__slotnames__``), the harness's ``breakpointhook``.
OWN = {"_group_count", "_init_counter", "rendezvous_iterator", "Storage", "__warningregistry__"}
OWN |= {"__slotnames__", "breakpointhook"}  # breakpointhook: set for every task (debugging)
# The classes whose methods tests commonly monkeypatch (a user's own: ``_globals``); torch's
# classes made in C (``torch._C.TensorBase``, ``torch.Generator``) refuse any attribute set.
CLASSES = (
    "torch.Tensor torch.nn.Module torch.nn.Parameter torch.optim.Optimizer "
    "torch.autograd.Function torch.nn.parallel.DistributedDataParallel "
    "torch.distributed.ProcessGroup torch.distributed.Work torch.utils.data.DataLoader"
).split()
# Attributes of the watched modules that are reset instead (``interpreter.hook_settings``;
# ``threading.settrace`` and ``setprofile`` keep theirs in the module).
RESET_ATTRS = {f"sys.{n}" for n in interpreter.SYS_HOOKS}
RESET_ATTRS |= {f"threading.{n}" for n in ("excepthook", "_trace_hook", "_profile_hook")}
GRACE = 0.05  # seconds the threads a task started have to finish
TIMERS = (signal.ITIMER_REAL, signal.ITIMER_VIRTUAL, signal.ITIMER_PROF)
# Signals faulthandler handles in C (SIGUSR1: the deadline's stack dumps, see ``rank``).
C_HANDLED = {getattr(signal, n) for n in "SIGUSR1 SIGSEGV SIGFPE SIGABRT SIGBUS SIGILL".split()}
_NOT_USER = (  # the standard library, installed packages, the harness
    *{path.join(sysconfig.get_paths()[k], "") for k in "stdlib platstdlib purelib platlib".split()},
    path.join(path.dirname(path.dirname(path.dirname(path.abspath(__file__)))), ""),  # testing/
)
_GONE = object()
_is = operator.is_


# Which loaded modules are the user's (``_is_user``), by name: filled once in the forkserver
# (``classify_loaded``, from ``forkserver.ready``), so that a warm rank, forked from it, does
# not classify the two thousand modules torch loads again (6 ms of CPU a rank).
CLASSIFIED: dict[str, tuple[Any, bool]] = {}


def classify_loaded() -> None:
    for name, module in list(sys.modules.items()):
        CLASSIFIED[name] = module, _is_user(module)


class Baseline:
    """Taken once in a warm rank after its world is made (process group joined)."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.settings = [(s, s.get()) for s in _settings(torch)]
        self.values = [value for _, value in self.settings]
        self.loggers = interpreter.Loggers()
        self.rng = random.getstate(), torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.device, self.modes = interpreter.device_context(torch), _modes(torch)
        hooks = vars(torch.nn.modules.module).items()  # global nn.Module hooks
        self.hooks = [(k, v, copy.copy(v)) for k, v in hooks if k.startswith("_global_")]
        np = sys.modules.get("numpy")
        self.numpy = _legacy_state(np) if np else None
        self.warnings = warnings.filters, list(warnings.filters), warnings.defaultaction
        self.once = warnings.onceregistry, dict(warnings.onceregistry)
        handlers = [(int(s), _signal.getsignal(s)) for s in signal.valid_signals()]
        # Split once: those the reset restores, and those set in C it can only compare.
        self.handlers = [(s, h) for s, h in handlers if s not in C_HANDLED and h is not None]
        self.fixed = [(s, h) for s, h in handlers if s in C_HANDLED or h is None]
        self.problem: str | None = None  # a reset or snapshot that failed: after_task's answer
        self.loaded, self.user = {}, []  # type: ignore  # _user_modules
        self.threads, self.imported, self.attrs, self.globals = set(), 0, [], []  # type: ignore

    def before_task(self) -> None:
        """Reset what can be reset, snapshot what can only be compared (never raises). (A
        warm rank calls ``reset`` after ``after_task``, which puts the loggers back.)"""
        self.loggers.reset()
        self.reset()
        self.snapshot()

    def reset(self) -> None:
        """Give back what a fresh rank has (never raises). A warm rank calls it right after
        a task's check (``check_then_reset``): between tasks, off the next test's path."""
        # The generators last: a setting put back must not draw from them (nor its import).
        for step in (self._reset_settings, self._reset_python, self._reset_rng):
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - reported by after_task
                self.problem = self.problem or f"the reset {step.__name__} failed: {exc!r}"

    def snapshot(self) -> None:
        """What after_task compares with (never raises)."""
        try:
            self.attrs = [(n, owner, dict(vars(owner))) for n, owner in _watched()]
            self.globals = [(n, m, *_snapshot(m)) for n, m in self._user_modules()]
        except Exception as exc:  # noqa: BLE001
            self.problem = self.problem or f"the snapshot before the test failed: {exc!r}"
        self.refresh()

    def refresh(self) -> None:
        """Right before the function: the threads, and the modules imported (loggers made)
        since the snapshot (the test module, on its first test), whose state is then the
        reference."""
        try:
            self.loggers.take()
            self.threads = set(threading.enumerate())
            self.imported = len(sys.modules)
            have = {name for name, *_ in self.attrs}
            self.attrs += [(n, o, dict(vars(o))) for n, o in _watched() if n not in have]
            known = {name for name, *_ in self.globals}
            new = [(n, m) for n, m in self._user_modules() if n not in known]
            self.globals += [(n, m, *_snapshot(m)) for n, m in new]
        except Exception as exc:  # noqa: BLE001
            self.problem = self.problem or f"the snapshot before the test failed: {exc!r}"

    def check_then_reset(self) -> str | None:
        """``after_task``'s answer; when None (as good as new: the snapshot still holds),
        everything is reset for the next task first, while the world's barrier is under way
        (``loop.WorldCheck``), so that the next test does not wait for it."""
        problem = self.after_task()
        if problem is None:
            self.reset()
        return problem

    def after_task(self) -> str | None:
        """None if the world is as good as new, else the first problem found (never raises).
        Loggers are put back first: a module's ``LOG = logging.getLogger(...)`` is one of its
        globals, and a reset setting must not retire the world."""
        checks = (_cancel_timers, self.loggers.reset, lambda: self.problem, self._threads)
        checks += (self._globals,)
        for check in (*checks, self._attrs, self._signals, self._torch):
            try:
                problem = check()
            except Exception as exc:  # noqa: BLE001 - a bug in a check replaces the world
                problem = f"the check {check.__name__} failed: {exc!r}"
            if problem:
                return problem
        return None

    def _reset_rng(self) -> None:
        torch, np = self.torch, sys.modules.get("numpy")
        random.setstate(self.rng[0])
        torch.set_rng_state(self.rng[1])
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        if np is not None:  # first imported after the world was made: seeded as a fresh import
            np.random.set_state(self.numpy) if self.numpy is not None else np.random.seed()

    def _reset_settings(self) -> None:
        try:  # the common case, nothing changed: one comparison of every value at once
            if [setting.get() for setting, _ in self.settings] == self.values:
                self._reset_hooks()
                return
        except Exception:  # noqa: BLE001 - a getter that raises: each on its own, below
            pass
        problems = []
        for setting, value in self.settings:
            try:
                if setting.get() != value:
                    setting.set(value)
            except Exception as exc:  # noqa: BLE001 - the others are still reset
                problems.append(f"{setting.label}: {exc!r}")
        if problems:
            raise RuntimeError("; ".join(problems))
        self._reset_hooks()

    def _reset_hooks(self) -> None:
        for name, value, items in self.hooks:
            setattr(self.torch.nn.modules.module, name, value)
            if isinstance(value, dict) and not _same_dict(value, items):
                value.clear()
                value.update(items)

    def _reset_python(self) -> None:
        (filters, items, action), (once, seen) = self.warnings, self.once
        warnings.filters, warnings.defaultaction, warnings.onceregistry = filters, action, once
        warnings.resetwarnings()  # also invalidates every module's registry of warnings shown
        filters[:] = items
        once.clear()
        once.update(seen)
        _cancel_timers()
        for sig, handler in self.handlers:
            if handler != _signal.getsignal(sig):
                signal.signal(sig, handler)

    def _threads(self) -> str | None:
        new = [t for t in threading.enumerate() if t not in self.threads and t.is_alive()]
        end = time.monotonic() + GRACE
        for thread in new:
            thread.join(max(0.0, end - time.monotonic()))
        alive = ", ".join(f"{t.name}{' (daemon)' if t.daemon else ''}" for t in new if t.is_alive())
        return f"a thread started by the test is still running: {alive}" if alive else None

    def _globals(self) -> str | None:
        for name, module, names, deep in self.globals:
            now = vars(module)  # read only: no copy
            changed = [] if _same_dict(now, names) else _changed(now, names)
            for key, (value, (seen, refs)) in deep.items():
                same = now.get(key) is value  # as in _snapshot: by the module's own name
                state = fingerprint.state_of(value, module.__name__) if same else (seen, refs)
                if state is None or state[0] != seen or not _same_refs(state[1], refs):
                    changed.append(f"{key} (its contents)")
            if changed:
                return f"the test changed module globals of {name}: {', '.join(changed)}"
        return None

    def _attrs(self) -> str | None:
        """The first attribute of a watched module or class a test added, replaced or deleted,
        or None. What an import explains (``_by_import``) is the reference from then on, as
        in a fresh rank after the same import."""
        imported = len(sys.modules) > self.imported
        for i, (name, owner, before) in enumerate(self.attrs):
            now = vars(owner)
            try:  # the same objects (or equal ones) bound to the same names: one C loop
                if now == before:
                    continue
            except Exception:  # noqa: BLE001 - an == that raises: compared one by one below
                pass
            for key in sorted(now.keys() | before.keys()):
                old, new = before.get(key, _GONE), now.get(key, _GONE)
                if old is new or key in OWN or f"{name}.{key}" in RESET_ATTRS:
                    continue
                if not _by_import(old, new, imported):
                    how = "added" if old is _GONE else "deleted" if new is _GONE else "replaced"
                    return f"{name}.{key} was {how} (monkeypatched)"
            self.attrs[i] = (name, owner, dict(now))
        return None

    def _signals(self) -> str | None:
        for sig, handler in self.fixed:
            if _signal.getsignal(sig) is not handler:
                name = next((s.name for s in signal.Signals if s.value == sig), sig)
                return f"the handler of {name} was changed: Python cannot restore it"
        return None

    def _torch(self) -> str | None:
        torch, (function, dispatch) = self.torch, _modes(self.torch)
        if self.device is None and interpreter.device_context(torch) is not None:
            function -= 1  # set_default_device's mode, reset before the next task
        if (function, dispatch) != self.modes:
            return "a torch function or dispatch mode was left entered (a `with` never exited)"
        if torch.is_inference_mode_enabled():
            return "inference mode was left on"
        if torch.autograd._profiler_enabled():
            return "a torch profiler was left running"
        if self.cuda is None and torch.cuda.is_initialized():
            return "CUDA was initialised by the test (its generators' fresh state is lost)"
        return None

    def _user_modules(self) -> list[tuple[str, Any]]:
        """The user's modules (``_is_user``) loaded, found again only when ``sys.modules``
        changed since."""
        if _same_refs(sys.modules.values(), self.loaded.values()):
            return self.user  # the same module objects (one renamed is compared as is)
        self.loaded, self.user = dict(sys.modules), []
        for name, module in self.loaded.items():
            known = CLASSIFIED.get(name)
            if known is None or known[0] is not module:
                known = CLASSIFIED[name] = module, _is_user(module)
            if known[1]:
                self.user.append((name, module))
        return self.user


def _watched() -> list[tuple[str, Any]]:
    """The ``WATCHED`` modules and the ``CLASSES`` loaded now, by name."""
    found = [(name, module) for name in WATCHED if (module := sys.modules.get(name))]
    split = [(name, *name.rpartition(".")[::2]) for name in CLASSES]
    classes = [(name, getattr(sys.modules.get(m), attr, 0)) for name, m, attr in split]
    return found + [(name, cls) for name, cls in classes if isinstance(cls, type)]


def _legacy_state(np: Any) -> tuple[Any, ...]:
    """numpy's global state, its key a list: ``set_state`` reads it item by item (5 us, 90
    from an array)."""
    name, key, *rest = np.random.get_state()
    return (name, key.tolist(), *rest)


def _settings(torch: Any) -> list[interpreter.Setting]:
    """Every process-wide setting ``reset`` puts back (``interpreter``)."""
    np = sys.modules.get("numpy")
    numpy = interpreter.numpy_settings(np) if np is not None else []
    return [*interpreter.python_settings(), *interpreter.torch_settings(torch), *numpy]


def _modes(torch: Any) -> tuple[int, int]:
    return torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack()


def _cancel_timers() -> None:
    for timer in TIMERS:
        signal.setitimer(timer, 0)


def _is_user(module: Any) -> bool:
    """Whether ``module`` is the user's own: a file outside Python, packages and harness."""
    file = getattr(module, "__file__", None)
    if not isinstance(file, str) or not path.isabs(file) or file.startswith(_NOT_USER):
        return False
    return not {"site-packages", "dist-packages"} & set(file.split(sep))


def _by_import(old: Any, new: Any, imported: bool) -> bool:
    """Whether an import explains a changed attribute: a submodule bound, or torch's own
    wrapper of the old value (its code in torch's files) in a task that imported modules."""
    if old is _GONE:
        return isinstance(new, types.ModuleType)
    if not imported or getattr(new, "__wrapped__", None) is not old:
        return False
    code = getattr(new, "__code__", None)
    torch = path.join(path.dirname(sys.modules["torch"].__file__), "")  # a Baseline's
    return code is not None and code.co_filename.startswith(torch)


def _same_dict(a: dict[Any, Any], b: dict[Any, Any]) -> bool:
    """The same keys, in order, bound to the same objects (C loops, ~20 ns an item)."""
    return _same_refs(a, b) and _same_refs(a.values(), b.values())


def _same_refs(a: Any, b: Any) -> bool:
    return len(a) == len(b) and all(map(_is, a, b))


def _changed(now: dict[str, Any], before: dict[str, Any]) -> list[str]:
    """Globals added (but a submodule imported, Python's registry of warnings), removed, rebound."""
    added = (k for k in now if k not in before and k != "__warningregistry__")
    changed = [f"{k} (added)" for k in added if not isinstance(now[k], types.ModuleType)]
    changed += [f"{k} (removed)" for k in before if k not in now]
    return changed + [f"{k} (rebound)" for k in now if k in before and now[k] is not before[k]]


def _snapshot(module: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """A module's globals, and one level inside each (``fingerprint``) but Python's dunders."""
    names, deep = dict(vars(module)), {}
    for key, value in names.items():
        if (
            not key.startswith("__")
            and (state := fingerprint.state_of(value, module.__name__)) is not None
        ):
            deep[key] = value, state
    return names, deep
