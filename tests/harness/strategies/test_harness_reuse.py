"""Reuse (``tutorial_impl/testing/strategies/warm/reuse.py``): a warm rank stays as good as
new between tests.

Each rank function below builds a ``Baseline`` in a forked rank, as a warm world does, then
plays the tests of a warm world itself: ``before_task``, something a test might do, and
``after_task``. What can be reset must be reset (the next task sees a fresh rank's state,
the same draws from every generator); what cannot must be named by ``after_task``, so that
the world is replaced; and a task that touched nothing must cost about a millisecond.
"""

from __future__ import annotations

import functools
import logging
import pickle
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import types
import warnings

import numpy as np
import torch
import torch.distributed as dist

from tutorial_impl.testing.strategies.warm import reuse

# Module-level state a test could leave behind (the "user's module" of the checks).
CACHE: dict[str, int] = {}
SEEN: list[int] = []
TAGS: set[str] = set()
BUFFER = bytearray(4)
TENSOR = torch.zeros(2)
ARRAY = np.zeros(4)
MODEL = torch.nn.Linear(2, 2)
GENERATOR = torch.Generator().manual_seed(0)


class Settings:
    verbose = False

    def describe(self) -> str:
        return "settings"


SETTINGS = Settings()


def draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), torch.rand(1).item()


def flags() -> dict[str, str]:
    """Every global setting ``before_task`` resets, as a test would read it (as text)."""
    hooks = torch.nn.modules.module._global_forward_hooks
    found = {
        "torch": (torch.is_grad_enabled(), torch.get_default_dtype(), torch.get_num_threads()),
        "device": str(torch.get_default_device()),
        "modes": torch._C._len_torch_function_stack(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "anomaly": (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
        "cudnn": (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark),
        "matmul": torch.get_float32_matmul_precision(),
        "print": torch._tensor_str.PRINT_OPTS.precision,
        "hooks": len(hooks),
        "numpy": (np.geterr(), np.get_printoptions()["precision"]),
        "warnings": list(warnings.filters),
        "handlers": signal.getsignal(signal.SIGTERM),
        "timers": [signal.getitimer(t) for t in reuse.TIMERS],
        "mask": signal.pthread_sigmask(signal.SIG_BLOCK, []),
        "logging": (logging.getLogger().handlers[:], logging.root.manager.disable),
        "process": (sys.getrecursionlimit(), socket.getdefaulttimeout()),
    }
    return {key: repr(value) for key, value in found.items()}


def _not_blocked() -> signal.Signals:
    """A signal the rank does not block yet: the session may have inherited a blocked
    SIGWINCH (``perf record`` blocks it for the command it runs)."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    return next(s for s in (signal.SIGWINCH, signal.SIGURG, signal.SIGXCPU) if s not in blocked)


def change_every_setting() -> None:
    """What a careless test leaves set: every global ``before_task`` must reset."""
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    torch.set_grad_enabled(False)
    torch.set_default_dtype(torch.float64)
    torch.set_default_device("meta")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.autograd.set_detect_anomaly(True)
    torch.set_num_threads(2)
    torch.backends.cudnn.deterministic = torch.backends.cudnn.benchmark = True
    torch.set_float32_matmul_precision("medium")
    torch.set_printoptions(precision=1)
    torch.nn.modules.module.register_module_forward_hook(lambda *args: None)
    np.seterr(all="raise")
    np.set_printoptions(precision=2)
    warnings.simplefilter("error")
    signal.signal(signal.SIGTERM, lambda *args: None)
    signal.alarm(100)
    signal.setitimer(signal.ITIMER_PROF, 100)
    signal.pthread_sigmask(signal.SIG_BLOCK, [_not_blocked()])  # SIGUSR2: blocked by records
    logging.getLogger().addHandler(logging.NullHandler())
    logging.disable(logging.CRITICAL)
    sys.setrecursionlimit(5000)
    socket.setdefaulttimeout(3.0)


def warn() -> None:
    warnings.warn("reuse-warning", UserWarning, stacklevel=1)  # always from this one line


def raise_warnings(task: reuse.Baseline) -> None:
    """A warning raised twice from one place in a task, then once in the next task: Python
    shows it once per place (the "default" action); a fresh rank, once per test. The rank
    records what is shown for pytest (``caught``): the test counts it in the results."""
    warn()
    warn()
    assert task.after_task() is None
    task.before_task()
    warn()


def reset_between_tasks(rank: int, world_size: int) -> dict[str, object]:
    task = reuse.Baseline()
    task.before_task()
    first, fresh = draws(), flags()
    change_every_setting()
    changed, left = flags(), task.after_task()
    pending = signal.getitimer(signal.ITIMER_REAL)  # the alarm, cancelled: the rank now idles
    task.before_task()
    again, reset = draws(), flags()
    raise_warnings(task)
    return dict(first=first, again=again, fresh=fresh, changed=changed, reset=reset,
                problem=left, pending=pending)  # fmt: skip


def fresh_draws(rank: int, world_size: int) -> tuple[float, float, float]:
    return draws()


def test_before_task_gives_every_task_a_fresh_ranks_state(run_ranks):
    results = run_ranks(reset_between_tasks, world_size=1, backend=None)
    [warm] = results
    [fresh] = run_ranks(fresh_draws, world_size=1, backend=None)
    # Settings a test may change are not problems: they are reset before the next task ...
    assert warm["problem"] is None
    assert warm["pending"] == (0.0, 0.0)
    assert all(warm["changed"][k] != v for k, v in warm["fresh"].items()), warm["changed"]
    assert warm["reset"] == warm["fresh"]
    # ... which draws what the first task drew, and what a fresh rank draws (torch, numpy:
    # the forkserver's state; ``random`` is reseeded in every forked child).
    assert warm["again"] == warm["first"]
    assert warm["first"][1:] == fresh[1:]
    shown = [w.message for w in results.caught[0].warnings if w.message == "reuse-warning"]
    assert len(shown) == 2  # shown once in each task, as in two fresh ranks


def _thread() -> None:
    threading.Thread(target=time.sleep, args=(5,), name="Leftover", daemon=True).start()


def _enter(context: object) -> object:
    context.__enter__()  # type: ignore[attr-defined]
    return context


class _Renamed:
    """``module``'s last name bound under another: the same objects, in the same order."""

    def __init__(self, module: object) -> None:
        names = vars(module)
        self.module, self.name = module, next(reversed(names))
        setattr(module, "0" + self.name, names.pop(self.name))

    def __exit__(self, *exc: object) -> None:
        names = vars(self.module)
        names[self.name] = names.pop("0" + self.name)


def _wrap(module: object, name: str, imported: bool, torchs: bool = False) -> None:
    """Replace ``module.name`` by a wrapper of it (``__wrapped__``), as an import may do:
    torch's own (``torchs``: the wrapper torch._dynamo's import puts on ``manual_seed``)."""
    if imported:  # a module of a new name: one more module loaded
        probe = f"_reuse_probe{len(sys.modules)}"
        sys.modules[probe] = types.ModuleType(probe)
    original = getattr(module, name)
    if torchs:
        setattr(module, name, torch._disable_dynamo(original))
    else:
        setattr(module, name, functools.wraps(original)(lambda *a, **k: original(*a, **k)))


def _tracer(*args: object) -> None:
    return None


def _call(self: torch.nn.Module, *args: object, **kwargs: object) -> object:
    return self._call_impl(*args, **kwargs)


# What a test does that no reset can undo, and what after_task must name for it. The last
# three stay entered during the cases after them (so, in this order), and are exited after.
LEFT = {
    "cache": (lambda: CACHE.update(k=1), f"{__name__}: CACHE (its contents)"),
    "seen": (lambda: SEEN.append(1), "SEEN (its contents)"),
    "tags": (lambda: TAGS.add("x"), "TAGS (its contents)"),
    "buffer": (lambda: BUFFER.__setitem__(0, 1), "BUFFER (its contents)"),
    "tensor": (lambda: TENSOR.add_(1), "TENSOR (its contents)"),
    "array": (lambda: ARRAY.__setitem__(0, 1.0), "ARRAY (its contents)"),
    "model": (lambda: MODEL.eval(), "MODEL (its contents)"),
    "trained": (lambda: MODEL(torch.ones(1, 2)).sum().backward(), "MODEL (its contents)"),
    "generator": (lambda: torch.rand(1, generator=GENERATOR), "GENERATOR (its contents)"),
    "instance": (lambda: setattr(SETTINGS, "verbose", True), "SETTINGS (its contents)"),
    "class": (lambda: setattr(Settings, "verbose", True), "Settings (its contents)"),
    "function": (lambda: setattr(warn, "calls", 1), "warn (its contents)"),
    "rebound": (lambda: globals().update(SEEN=[]), "SEEN (rebound)"),
    "added": (lambda: globals().update(NEW=1), "NEW (added)"),
    "all_reduce": (
        lambda: setattr(dist, "all_reduce", lambda *a, **k: None),
        "torch.distributed.all_reduce was replaced (monkeypatched)",
    ),
    "wrapped": (lambda: _wrap(torch.nn.functional, "relu", False), "functional.relu was replaced"),
    "torch attr": (lambda: setattr(torch.nn, "extra", 1), "torch.nn.extra was added"),
    "deleted": (lambda: delattr(logging, "BASIC_FORMAT"), "logging.BASIC_FORMAT was deleted"),
    # Every object where it was, one name changed (undone, as the last three, after all).
    "renamed": (lambda: _Renamed(subprocess), "subprocess.0"),
    "stdlib": (lambda: setattr(time, "time", lambda: 0.0), "time.time was replaced"),
    "thread": (_thread, "a thread started by the test is still running: Leftover (daemon)"),
    "sigusr1": (lambda: signal.signal(signal.SIGUSR1, print), "handler of SIGUSR1"),
    "profiler": (lambda: _enter(torch.autograd.profiler.profile()), "profiler was left running"),
    "inference": (lambda: _enter(torch.inference_mode()), "inference mode was left on"),
    "mode": (lambda: _enter(torch.device("meta")), "mode was left entered"),
    # Methods of torch's classes and of a user's (undone after all, with ``time.time``).
    "tensor method": (
        lambda: setattr(torch.Tensor, "equal", lambda *a: True),
        "torch.Tensor.equal was added (monkeypatched)",  # over TensorBase's
    ),
    "module call": (
        lambda: setattr(torch.nn.Module, "__call__", _call),
        "torch.nn.Module.__call__ was replaced (monkeypatched)",
    ),
    "work method": (
        lambda: setattr(dist.Work, "wait", lambda *a: True),
        "torch.distributed.Work.wait was replaced (monkeypatched)",
    ),
    "user method": (
        lambda: setattr(Settings, "describe", lambda self: "patched"),
        "Settings (its contents)",
    ),
    "torch's wrapper, no import": (
        lambda: _wrap(torch.nn.functional, "silu", False, torchs=True),
        "torch.nn.functional.silu was replaced (monkeypatched)",
    ),
    "import wraps": (
        lambda: _wrap(torch.nn.functional, "gelu", True),  # a user's wrapper, not torch's
        "torch.nn.functional.gelu was replaced (monkeypatched)",
    ),
}
HARMLESS = {
    "untouched": lambda: None,
    "short thread": lambda: threading.Thread(target=time.sleep, args=(0.01,)).start(),
    "submodule": lambda: setattr(torch.nn, "lazy", types.ModuleType("torch.nn.lazy")),
    "user submodule": lambda: globals().update(sub=types.ModuleType(f"{__name__}.sub")),
    "wrapped on import": lambda: _wrap(torch, "manual_seed", True, torchs=True),  # as dynamo
    # Hooks reset before the next test (``interpreter.hook_settings``), as ``sys`` and
    # ``threading`` attributes too: not monkeypatches.
    "trace": lambda: (sys.settrace(_tracer), threading.settrace(_tracer)),
    "excepthook": lambda: setattr(sys, "excepthook", _tracer),
    "thread excepthook": lambda: setattr(threading, "excepthook", _tracer),
    "group counter": lambda: setattr(dist.distributed_c10d, "_group_count", -1),
    "a setting": lambda: random.seed(0),  # reset before the next task: no problem
    # Python caches ``__slotnames__`` on a class whose instance is pickled, as a rank's tensor
    # result is: a warm world retired 8 times a run for it (``_forget_slotnames`` first).
    # So does a class of the user's module whose instance a rank returns (a dataclass of
    # results: the lessons' ``BucketCall`` retired a world after each first test).
    "pickled": lambda: pickle.dumps([torch.ones(1), torch.nn.Parameter(torch.ones(1)), SETTINGS]),
}
PICKLED = (torch.Tensor, torch.nn.Parameter, Settings)


def _forget_slotnames() -> None:
    """As in a world that never pickled a tensor yet (this rank sent none back so far)."""
    for cls in PICKLED:
        if "__slotnames__" in vars(cls):
            delattr(cls, "__slotnames__")


def left_behind(rank: int, world_size: int, repeat: int) -> dict[str, object]:
    task = reuse.Baseline()
    cost = []
    for _ in range(repeat):  # an untouched task: the cost of the checks alone (CPU time)
        start = time.thread_time()
        task.before_task()
        task.after_task()
        cost.append(time.thread_time() - start)
    # A task that only changed what torch rebinds itself (OWN): no problem, and that state is
    # the reference from then on; the next task, reset and refreshed as a warm rank does
    # between tasks (no new snapshot), still names what it monkeypatched in that module.
    task = reuse.Baseline()
    task.before_task()
    c10d = dist.distributed_c10d
    c10d._group_count = -2
    chained = [task.after_task()]
    task.reset()
    task.refresh()
    c10d.broadcast = lambda *args, **kwargs: None
    chained.append(task.after_task())
    # So does a task whose import wrapped a function, as torch._dynamo's does: the next task,
    # which imports nothing, finds the wrapper, as a fresh rank after that import would
    # (where the world was retired, "torch.manual_seed was replaced"); one that puts the
    # function back as it was changed it.
    task = reuse.Baseline()
    task.before_task()
    seed = torch.manual_seed
    _wrap(torch, "manual_seed", True, torchs=True)
    chained.append(task.after_task())
    task.reset()
    task.refresh()
    chained.append(task.after_task())
    task.reset()
    task.refresh()
    torch.manual_seed = seed
    chained.append(task.after_task())
    seen, entered, clock = {}, [], time.time
    call, describe = torch.nn.Module.__call__, Settings.describe
    wait, gelu, silu = dist.Work.wait, torch.nn.functional.gelu, torch.nn.functional.silu
    for case, do in {**HARMLESS, **{k: v[0] for k, v in LEFT.items()}}.items():
        if case == "pickled":
            _forget_slotnames()
        task = reuse.Baseline()  # a world that found a problem is replaced: a new baseline
        task.before_task()
        left = do()
        seen[case] = task.after_task()
        if case == "pickled":  # the case did what a result does
            seen["slotnames added"] = all("__slotnames__" in vars(cls) for cls in PICKLED)
        task.reset()
        entered += [left] if case in ("renamed", "profiler", "inference", "mode") else []
    for context in reversed(entered):
        context.__exit__(None, None, None)  # type: ignore[attr-defined]
    time.time = clock
    del torch.Tensor.equal
    torch.nn.Module.__call__, Settings.describe = call, describe
    dist.Work.wait, torch.nn.functional.gelu, torch.nn.functional.silu = wait, gelu, silu
    return dict(seen=seen, cost=sorted(cost)[len(cost) // 2], chained=chained)


def test_after_task_names_what_cannot_be_reset_and_costs_little(run_ranks):
    [found] = run_ranks(left_behind, 50, world_size=1, backend=None)
    for case in HARMLESS:
        assert found["seen"][case] is None, (case, found["seen"][case])
    assert found["seen"]["slotnames added"] is True
    for case, (_, named) in LEFT.items():
        assert named in (found["seen"][case] or ""), (case, found["seen"][case])
    own, patched, wrapped, next_task, unwrapped = found["chained"]
    assert own is None and "distributed_c10d.broadcast was replaced" in (patched or "")
    assert wrapped is None and next_task is None
    assert unwrapped == "torch.manual_seed was replaced (monkeypatched)"
    print(f"before_task + after_task: {found['cost'] * 1e3:.2f} ms of CPU (median)")
    assert found["cost"] < 0.010


# A value other than the current one, for every ``interpreter`` setting that is not a bool
# (a bool is flipped); a setting added without one here fails the test below.
OTHER = {
    "gc thresholds": lambda v: (1, 1, 1),
    "gc debug flags": lambda v: __import__("gc").DEBUG_SAVEALL,
    "gc callbacks": lambda v: [*v, lambda phase, info: None],
    "switch interval": lambda v: 0.5 if v != 0.5 else 0.25,  # binary fractions: read back exact
    "recursion limit": lambda v: v + 500,
    "int max str digits": lambda v: 640,
    "decimal context": lambda v: v.replace("prec=28", "prec=3"),
    "decimal DefaultContext": lambda v: v.replace("ROUND_HALF_EVEN", "ROUND_DOWN"),
    "locale": lambda v: "C",
    "umask": lambda v: 0o077 if v != 0o077 else 0o022,
    "signal mask": lambda v: {*v, _not_blocked()},
    "socket default timeout": lambda v: 3.0,
    "sys trace function": lambda v: _tracer,
    "sys profile function": lambda v: _tracer,
    "threading trace function": lambda v: _tracer,
    "threading profile function": lambda v: _tracer,
    "sys.excepthook": lambda v: _tracer,
    "sys.unraisablehook": lambda v: _tracer,
    "sys.displayhook": lambda v: _tracer,
    "threading.excepthook": lambda v: _tracer,
    "sys async generator hooks": lambda v: (_tracer, _tracer),
    "sys coroutine origin tracking depth": lambda v: 5,
    "sys dlopen flags": lambda v: v ^ __import__("os").RTLD_GLOBAL,
    "logging.disable": lambda v: logging.CRITICAL,
    "torch default dtype": lambda v: torch.float64,
    "torch intra-op threads": lambda v: v + 1,
    "torch float32 matmul precision": lambda v: "medium",
    "torch deterministic algorithms": lambda v: (not v[0], v[1]),
    "torch anomaly detection": lambda v: (True, not v[1]),
    "torch default device": lambda v: types.SimpleNamespace(device="meta"),
    "torch print options": lambda v: {**v, "precision": 1},
    "torch autograd fallback mode": lambda v: "nothing",
    "torch CPU autocast": lambda v: (True, torch.float16),
    "torch preferred linalg library": lambda v: "cusolver",
    "torch.distributed debug level": lambda v: type(v).DETAIL,
    "torch.backends.opt_einsum.strategy": lambda v: "greedy",
    "numpy seterr": lambda v: dict.fromkeys(v, "raise"),
    "numpy print options": lambda v: {**v, "precision": 2},
    **{
        f"torch.backends.{name}fp32_precision": lambda v: "ieee" if v != "ieee" else "tf32"
        for name in ("", "cuda.matmul.", "cudnn.", "mkldnn.")
        for name in (name, f"{name}conv.", f"{name}rnn.", f"{name}matmul.")
    },
}


# Settings whose getter reads back another object than the one given (the context entered).
NOT_AS_GIVEN = {"torch default device"}


def every_setting_reset(rank: int, world_size: int) -> dict[str, list[str]]:
    """Change each setting (one test each), then check after_task and the reset."""
    import logging as log

    stranger = log.getLogger("stranger")
    task, found = reuse.Baseline(), {"unchanged": [], "not reset": [], "problem": [], "no": []}
    for setting, value in task.settings:
        other = OTHER.get(setting.label, (lambda v: not v) if isinstance(value, bool) else None)
        if other is None:
            found["no"].append(setting.label)
            continue
        task.before_task()
        new = other(value)
        try:
            setting.set(new)
        except Exception as exc:  # noqa: BLE001 - named below
            found["unchanged"].append(f"{setting.label}: {exc!r}")
        now = [setting.get(), setting.get()]  # a getter changes nothing (umask's sets it)
        if now[0] == value or (now != [new, new] and setting.label not in NOT_AS_GIVEN):
            found["unchanged"].append(f"{setting.label}: {now}")
        problem = task.after_task()
        task.reset()
        if problem is not None:
            found["problem"].append(f"{setting.label}: {problem}")
        if setting.get() != value:
            found["not reset"].append(setting.label)
    # Loggers, one made after the baseline too: level, handlers, filters, propagate, disabled.
    task.before_task()
    later = log.getLogger("made.later")
    task.refresh()
    for logger in (log.root, stranger, later):
        logger.setLevel(log.DEBUG)
        logger.addHandler(log.NullHandler())
        logger.addFilter(log.Filter("x"))
        logger.propagate, logger.disabled = False, True
        logger.disabled = False
        logger.isEnabledFor(log.DEBUG)  # cached: the reset must clear that cache too
        logger.disabled = True
    problem = task.after_task()
    task.reset()
    found["problem"] += [f"loggers: {problem}"] if problem else []
    for logger in (log.root, stranger, later):
        if logger.isEnabledFor(log.DEBUG):
            found["not reset"].append(f"{logger.name}: DEBUG enabled (a stale cache)")
        state = (logger.handlers, logger.filters, logger.propagate, logger.disabled)
        if logger.level != (log.WARNING if logger is log.root else log.NOTSET):
            found["not reset"].append(f"{logger.name}: level {logger.level}")
        if state != ([], [], True, False) and logger is not log.root:
            found["not reset"].append(f"{logger.name}: {state}")
        if logger is log.root and len(logger.handlers) != len(task.loggers.known[log.root][3]):
            found["not reset"].append("root: handlers")
    return found


def test_every_interpreter_setting_is_reset_and_retires_nothing(run_ranks):
    [found] = run_ranks(every_setting_reset, world_size=1, backend=None)
    assert found == {"unchanged": [], "not reset": [], "problem": [], "no": []}
