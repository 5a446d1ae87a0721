"""What a warm rank resets, detects and cannot see: the lists ``docs/harness.md`` shows (a test's
helper, not the harness's: ``test_harness_warm_interpreter`` checks the page against it).

``describe`` writes them, from the settings ``interpreter`` defines and the lists below, which
``reuse`` and ``strategies.warm.loop`` implement (``tests/harness/strategies/test_harness_reuse.py``
proves each
reset and detection, ``test_harness_warm_interpreter.py`` checks the page against
``describe``). A change to what a warm rank does changes these lists, and the page with them.
"""

from __future__ import annotations

import textwrap
from typing import Any

from tutorial_impl.testing.strategies.warm import interpreter, reuse

# Reset before each test besides ``interpreter``'s settings (``reuse.Baseline.reset``).
RESET = (
    "the generators of `random`, numpy's global `RandomState` and torch's CPU generator "
    "(CUDA's if initialised when the world was made)",
    "global `nn.Module` hooks",
    "the `warnings` filters, default action and once-registry",
    "every signal handler Python can restore",
    "pending `alarm`/`setitimer` timers",
    "every logger's level, handlers, filters, `propagate` and `disabled`",
    "the process groups torch made for a `DeviceMesh` the test built (destroyed, once every "
    "rank has returned)",
)
# Set for each test from the parent's, at its call (``rank.take_task``).
PER_TASK = ("the environment", "the working directory", "`sys.path`")
# Found after a test and retiring its world (``strategies.warm.loop.WorldCheck``,
# ``reuse.after_task``).
DETECTED = (
    "a process group (but a `DeviceMesh`'s), RPC agent or child process left behind",
    "a replaced default group",
    "a point-to-point operation never completed (an `isend`, `irecv`, or a `P2POp` of "
    "`batch_isend_irecv`, seen at torch's `ProcessGroup`, however it was called)",
    "a barrier of the whole world, once the parent has every rank's report (never a "
    "collective a rank still in the test could match), that does not complete within 2 s (an "
    "un-waited async collective)",
    "a thread the test started still running, daemon or not",
    "the user's module globals changed (rebound, added, removed, or changed one level inside "
    "a dict, list, set, tensor, array, object or class, but the `__slotnames__` Python caches "
    "on a class whose instance is pickled, as a result is; a module-level `nn.Module`'s "
    "parameters, buffers and the train/eval mode of every submodule)",
    "attributes added, replaced or deleted (a monkeypatched `dist.all_reduce`, "
    "`torch.Tensor.equal`) in the modules {modules} and the classes {classes}, but torch's own "
    "wrapper put on by an import (torch._dynamo's on `torch.manual_seed`)",
    "a signal handler set in C",
    "a torch mode left entered, inference mode or a profiler left on",
    "CUDA initialised by the test",
)
NOT_SEEN = (
    "C/C++ state (gloo's, torch's caches such as DTensor's sharding-propagation cache, allocators)",
    "third-party modules, torch modules and classes outside the watched lists (`torch.compile`'s "
    "configuration and caches among them)",
    "anything nested deeper than one level (a dict in a module-level dict, a model held in a "
    "dict or an object, an optimizer's state, an `lru_cache`)",
    "objects with `__slots__` only",
    "a module first imported inside a test and changed by that same test (a logger first "
    "made and changed by it)",
    "files, sockets, the store",
    "`sys.meta_path`, `sys.path_hooks`, audit hooks, `sys.monitoring` tools, resource limits, "
    "`gc.freeze`",
    "interop threads",
    "seeds queued for CUDA's first use",
)


def describe(torch: Any) -> str:
    """The three lists as ``docs/harness.md`` shows them (Markdown, wrapped at 100)."""
    settings = interpreter.python_settings() + interpreter.torch_settings(torch)
    try:
        import numpy as np

        settings += interpreter.numpy_settings(np)
    except ImportError:  # then numpy's settings are not a rank's either
        pass
    labels = [s.label for s in settings if not s.label.startswith("torch.backends.")]
    labels.append("`torch.backends` flags (" + ", ".join(interpreter.BACKENDS) + ")")
    labels.append("the SDPA kernels of `torch.backends.cuda` (" + ", ".join(interpreter.SDP) + ")")
    items = [
        "**resets** before every test, to what a fresh rank has: "
        + ", ".join(labels)
        + "; "
        + "; ".join(RESET)
        + "; and sets for each test "
        + ", ".join(PER_TASK)
        + " as the parent has them",
        "**detects**, and replaces the world after the test: "
        + "; ".join(DETECTED).format(
            modules=", ".join(f"`{m}`" for m in reuse.WATCHED),
            classes=", ".join(f"`{c}`" for c in reuse.CLASSES),
        ),
        "**cannot see**: " + "; ".join(NOT_SEEN),
    ]
    wrap = textwrap.TextWrapper(
        width=100, initial_indent="- ", subsequent_indent="  ", break_on_hyphens=False
    )
    return "".join(wrap.fill(item) + ";\n" for item in items[:-1]) + wrap.fill(items[-1]) + ".\n"
