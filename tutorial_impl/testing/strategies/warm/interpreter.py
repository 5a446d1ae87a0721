"""The interpreter-wide settings a warm rank puts back before each test (for ``reuse``).

A fresh rank starts with the settings its forkserver had; a warm rank keeps whatever the last
test left. Each ``Setting`` here is one such process-wide value with a getter and a setter,
cheap enough to compare after every test (about a microsecond each): ``reuse.Baseline``
reads them all when its world is made and sets back each one that differs. Settings that
cannot be set back (interop threads, a ``sys.addaudithook``) are in ``reuse.NOT_SEEN``.

The labels are what ``docs/harness.md`` lists (``reuse.describe`` writes that list, and a test
checks the page against it); a test changes every setting by its label and checks the reset.

``Loggers`` does the same for every logger's level, handlers, filters, ``propagate`` and
``disabled``: a test's ``logging.getLogger("x").setLevel(DEBUG)`` or a ``dictConfig`` that
disables existing loggers would otherwise carry into the next test.
"""

from __future__ import annotations

import decimal  # imported here, so also in every rank: its contexts have a baseline
import gc
import locale
import logging
import operator
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

# torch.backends flags, set as attributes (those this build lacks are left out). TF32: the
# ``fp32_precision`` ones (roots before leaves, as each is compared after the one before was
# set back); the legacy ``allow_tf32`` flags are views of the same state, which torch refuses
# to read once the two APIs were mixed: read only on a torch without the new ones.
BACKENDS = (
    "cudnn.enabled cudnn.benchmark cudnn.deterministic "
    "cuda.matmul.allow_fp16_reduced_precision_reduction "
    "cuda.matmul.allow_bf16_reduced_precision_reduction mkldnn.enabled mkldnn.deterministic "
    "opt_einsum.enabled opt_einsum.strategy fp32_precision cuda.matmul.fp32_precision "
    "cudnn.fp32_precision cudnn.conv.fp32_precision cudnn.rnn.fp32_precision "
    "mkldnn.fp32_precision mkldnn.matmul.fp32_precision mkldnn.conv.fp32_precision "
    "mkldnn.rnn.fp32_precision"
).split()
LEGACY_TF32 = ("cudnn.allow_tf32", "cuda.matmul.allow_tf32")
# torch.backends.cuda's scaled-dot-product kernels: NAME_enabled() and enable_NAME(bool).
SDP = ("flash_sdp", "mem_efficient_sdp", "math_sdp", "cudnn_sdp")


@dataclass(frozen=True)
class Setting:
    """One process-wide value: ``label`` names it in the docs and in a failed reset."""

    label: str
    get: Callable[[], Any]
    set: Callable[[Any], Any]


def python_settings() -> list[Setting]:
    """The interpreter's own and the standard library's."""
    return [
        Setting("gc enabled", gc.isenabled, lambda on: gc.enable() if on else gc.disable()),
        Setting("gc thresholds", gc.get_threshold, lambda v: gc.set_threshold(*v)),
        Setting("gc debug flags", gc.get_debug, gc.set_debug),
        Setting("gc callbacks", lambda: list(gc.callbacks), _callbacks),
        Setting("switch interval", sys.getswitchinterval, sys.setswitchinterval),
        Setting("recursion limit", sys.getrecursionlimit, sys.setrecursionlimit),
        Setting("int max str digits", sys.get_int_max_str_digits, sys.set_int_max_str_digits),
        Setting(
            "decimal context",
            lambda: repr(decimal.getcontext()),
            lambda text: decimal.setcontext(_context(text)),
        ),
        Setting(
            "decimal DefaultContext", lambda: repr(decimal.DefaultContext), _set_decimal_default
        ),
        Setting("locale", partial(locale.setlocale, locale.LC_ALL), _set_locale),
        Setting("umask", _umask, os.umask),
        Setting("signal mask", _blocked, partial(signal.pthread_sigmask, signal.SIG_SETMASK)),
        Setting("socket default timeout", socket.getdefaulttimeout, socket.setdefaulttimeout),
        Setting("logging.disable", lambda: logging.root.manager.disable, logging.disable),
        *hook_settings(),
    ]


# The hooks Python calls, bound as attributes (``sys.breakpointhook`` is the harness's own,
# set for every task: ``rank.debugging``).
SYS_HOOKS = ("excepthook", "unraisablehook", "displayhook")


def hook_settings() -> list[Setting]:
    """The process-wide hooks of ``sys`` and ``threading``: trace and profile functions (the
    rank function's thread's, and those ``threading`` gives every new thread), the hooks
    called on an uncaught exception, an unraisable one, a displayed value, an async
    generator's first iteration and finalisation; the coroutine origin depth, dlopen flags."""
    return [
        Setting("sys trace function", sys.gettrace, sys.settrace),
        Setting("sys profile function", sys.getprofile, sys.setprofile),
        Setting("threading trace function", threading.gettrace, threading.settrace),
        Setting("threading profile function", threading.getprofile, threading.setprofile),
        *(Setting(f"sys.{name}", *_attribute(sys, name)) for name in SYS_HOOKS),
        Setting("threading.excepthook", *_attribute(threading, "excepthook")),
        Setting(
            "sys async generator hooks",
            lambda: tuple(sys.get_asyncgen_hooks()),
            lambda v: sys.set_asyncgen_hooks(*v),
        ),
        Setting(
            "sys coroutine origin tracking depth",
            sys.get_coroutine_origin_tracking_depth,
            sys.set_coroutine_origin_tracking_depth,
        ),
        Setting("sys dlopen flags", sys.getdlopenflags, sys.setdlopenflags),
    ]


def torch_settings(t: Any) -> list[Setting]:
    """torch's process-wide settings (those this build has), in the order they are reset."""
    return [*_torch_modes(t), *_torch_autograd(t), *_torch_backends(t)]


def _torch_modes(t: Any) -> list[Setting]:
    """Modes and defaults: grad, dtype, threads, precision, determinism, device, printing."""
    options = t._tensor_str.PRINT_OPTS
    det = t.are_deterministic_algorithms_enabled, t.is_deterministic_algorithms_warn_only_enabled
    anomaly = t.is_anomaly_enabled, t.is_anomaly_check_nan_enabled
    return [
        Setting("torch grad mode", t.is_grad_enabled, t.set_grad_enabled),
        Setting("torch forward-mode AD", t._C._is_fwd_grad_enabled, t._C._set_fwd_grad_enabled),
        Setting("torch default dtype", t.get_default_dtype, t.set_default_dtype),
        Setting("torch intra-op threads", t.get_num_threads, t.set_num_threads),
        Setting("torch warn_always", t.is_warn_always_enabled, t.set_warn_always),
        Setting(
            "torch float32 matmul precision",
            t.get_float32_matmul_precision,
            t.set_float32_matmul_precision,
        ),
        Setting(
            "torch deterministic algorithms",
            _both(det),
            lambda v: t.use_deterministic_algorithms(v[0], warn_only=v[1]),
        ),
        Setting("torch anomaly detection", _both(anomaly), lambda v: t.set_anomaly_enabled(*v)),
        Setting(
            "torch default device",
            partial(device_context, t),
            lambda v: t.set_default_device(v and v.device),
        ),
        Setting("torch print options", lambda: dict(vars(options)), vars(options).update),
    ]


def _torch_autograd(t: Any) -> list[Setting]:
    """Autograd's and the dispatcher's switches, autocast, fast paths, the c10d debug level."""
    c = t._C
    return [
        Setting(
            "torch autograd multithreading",
            c._is_multithreading_enabled,
            c._set_multithreading_enabled,
        ),
        Setting("torch view replay", c._is_view_replay_enabled, c._set_view_replay_enabled),
        Setting(
            "torch autograd fallback mode",
            c._get_autograd_fallback_mode,
            c._set_autograd_fallback_mode,
        ),
        Setting(
            "torch sparse invariants checks",
            c._check_sparse_tensor_invariants,
            c._set_check_sparse_tensor_invariants,
        ),
        Setting(
            "torch fill_uninitialized_memory",
            *_attribute(t.utils.deterministic, "fill_uninitialized_memory"),
        ),
        Setting(
            "torch CPU autocast",
            lambda: (t.is_autocast_enabled("cpu"), t.get_autocast_dtype("cpu")),
            lambda v: (t.set_autocast_enabled("cpu", v[0]), t.set_autocast_dtype("cpu", v[1])),
        ),
        Setting("torch autocast cache", t.is_autocast_cache_enabled, t.set_autocast_cache_enabled),
        Setting(
            "torch mha fastpath",
            t.backends.mha.get_fastpath_enabled,
            t.backends.mha.set_fastpath_enabled,
        ),
        Setting(
            "torch.distributed debug level",
            t._C._distributed_c10d.get_debug_level,
            t._C._distributed_c10d.set_debug_level,
        ),
    ]


def _torch_backends(t: Any) -> list[Setting]:
    """``torch.backends``' flags this build has (CUDA's linalg library and SDP kernels)."""
    found = []
    cuda = t.backends.cuda
    if cuda.is_built():  # a CPU build has one linalg library: nothing to set
        library = cuda.preferred_linalg_library
        found.append(Setting("torch preferred linalg library", library, library))
    found += [
        Setting(
            f"torch.backends.cuda {name}",
            getattr(cuda, f"{name}_enabled"),
            getattr(cuda, f"enable_{name}"),
        )
        for name in SDP
        if hasattr(cuda, f"enable_{name}")
    ]
    legacy = () if hasattr(t.backends, "fp32_precision") else LEGACY_TF32
    for flag in (*legacy, *BACKENDS):
        owner, _, name = flag.rpartition(".")
        try:
            obj = operator.attrgetter(owner)(t.backends) if owner else t.backends
        except AttributeError:
            continue
        if hasattr(obj, name):
            found.append(Setting(f"torch.backends.{flag}", *_attribute(obj, name)))
    return found


def numpy_settings(np: Any) -> list[Setting]:
    return [
        Setting("numpy seterr", np.geterr, lambda v: np.seterr(**v)),
        Setting("numpy print options", np.get_printoptions, lambda v: np.set_printoptions(**v)),
    ]


# One logger's state: level, disabled, propagate, and its handlers and filters (by identity).
_STATE = operator.attrgetter("level", "disabled", "propagate", "handlers", "filters")


class Loggers:
    """Every logger's configuration, as it was when first seen, put back before each test.

    A logger first made inside a test (by an import) is taken as it is at the next ``take``:
    as for module state, a logger made and changed by the same test is not seen."""

    def __init__(self) -> None:
        self.known: dict[logging.Logger, tuple[Any, ...]] = {}
        self.loggers: list[logging.Logger] = []  # ``known``'s keys and values, in order:
        self.states: list[tuple[Any, ...]] = []  # compared all at once, in C
        self.count = -1  # loggerDict's size when last taken
        self.take()

    def take(self) -> None:
        """Record the loggers made since the last call (cheap when none was)."""
        made = logging.root.manager.loggerDict
        if len(made) == self.count:
            return
        self.count = len(made)
        for logger in [logging.root, *made.values()]:
            if isinstance(logger, logging.Logger) and logger not in self.known:
                self.known[logger] = _copied(_STATE(logger))
        self.loggers, self.states = list(self.known), list(self.known.values())

    def reset(self) -> None:
        if list(map(_STATE, self.loggers)) == self.states:  # a hundred loggers: ~10 us
            return
        changed = False
        for logger, state in self.known.items():
            if _STATE(logger) != state:
                level, disabled, propagate, handlers, filters = state
                logger.level, logger.disabled, logger.propagate = level, disabled, propagate
                logger.handlers[:], logger.filters[:] = handlers, filters
                changed = True
        if changed:  # levels cached by isEnabledFor
            logging.root.manager._clear_cache()


def _copied(state: tuple[Any, ...]) -> tuple[Any, ...]:
    level, disabled, propagate, handlers, filters = state
    return level, disabled, propagate, list(handlers), list(filters)


def device_context(torch: Any) -> Any:
    """The context ``torch.set_default_device`` entered, or None."""
    return getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None)


def _both(getters: tuple[Callable[[], Any], ...]) -> Callable[[], tuple[Any, ...]]:
    return lambda: tuple(get() for get in getters)


def _attribute(obj: Any, name: str) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    return partial(getattr, obj, name), partial(setattr, obj, name)


def _blocked() -> set[int]:
    return signal.pthread_sigmask(signal.SIG_BLOCK, [])


def _callbacks(value: list[Any]) -> None:
    gc.callbacks[:] = value


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _set_locale(value: str) -> None:
    locale.setlocale(locale.LC_ALL, value)


# decimal's contexts: the calling thread's (the rank function runs in the main thread) and
# DefaultContext, the template of every new thread's first context. A context is compared by
# its repr (4 us; reading its flags as a dict costs 13), which ``_context`` reads back.
def _context(text: str) -> decimal.Context:
    return eval(text, vars(decimal))  # noqa: S307 - a repr decimal wrote, in its namespace


def _set_decimal_default(text: str) -> None:
    made = _context(text)
    for name in "prec rounding Emin Emax capitals clamp flags traps".split():
        setattr(decimal.DefaultContext, name, getattr(made, name))
