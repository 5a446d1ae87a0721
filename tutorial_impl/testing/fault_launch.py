"""Run a module as a torchrun worker, with the fault plan of the environment armed.

    TUTORIAL_IMPL_FAULTS='[...]' torchrun --max-restarts 1 ... \\
        -m tutorial_impl.testing.fault_launch -m MODULE --backend faulty ARGS...

torchrun starts each worker as a fresh interpreter running the command it was given, so a
plan cannot be armed by a parent before the worker's group exists, as the harness does for
its own ranks. This launcher stands in front of the worker's module instead: it registers
the ``"faulty"`` backend (``inject.group``: the module's ``init_process_group("faulty")``
then makes a gloo group that counts its collectives), arms the plan in
``TUTORIAL_IMPL_FAULTS`` for this worker's ``RANK``, then runs MODULE as ``__main__`` with
ARGS as its command line, as ``python -m MODULE ARGS`` would. The module itself imports
nothing of the harness: its backend's name is the only difference it sees.

Only the first attempt is armed (``TORCHELASTIC_RESTART_COUNT`` unset or ``0``). torchrun
restarts every worker of a failed job with the same command and environment; a plan armed
again would strike the same collective of every attempt, and no job could ever recover. A
fault here stands for a one-time event (a machine lost, a process killed), so it fires
once per job. A later attempt says so on stderr (``NOT_ARMED``), which is how a test sees
that a restarted worker went through this launcher.
"""

from __future__ import annotations

import importlib
import os
import runpy
import signal
import sys

from tutorial_impl.testing.faults import group, inject

USAGE = "usage: python -m tutorial_impl.testing.fault_launch -m MODULE [ARGS...]"
NOT_ARMED = "[faults] attempt {attempt}: the plan fires in the first attempt only; not armed"


def attempt() -> int:
    """Which attempt of the job this worker belongs to: 0, then one more per restart."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


def prepare() -> None:
    """What the launcher does before the module runs: the ``"faulty"`` backend registered,
    the plan armed for this worker's ``RANK`` in the first attempt only."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise SystemExit(f"{USAGE}\nRANK and WORLD_SIZE are not set: run it under torchrun")
    group.register()
    if attempt() == 0:
        inject.arm_from_env(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    else:
        print(NOT_ARMED.format(attempt=attempt()), file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or argv[0] != "-m":
        raise SystemExit(USAGE)
    module, args = argv[1], argv[2:]
    prepare()
    sys.argv = [module, *args]  # runpy puts the module's file name first, as -m does
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def call_main(module: str, *args: str) -> object:
    """The launcher as a function: ``elastic_launch(config, call_main)(MODULE, *ARGS)``.

    ``torch.distributed.run.main`` (torchrun) ends in ``elastic_launch`` with a command for
    entrypoint; given a function instead, its agent runs each worker as that function in a
    process it starts with ``config.start_method`` (``"fork"``: a copy of the agent, its
    imports included). Same steps as ``main``, then ``MODULE.main(ARGS)``: the function
    ``python -m MODULE ARGS`` ends in, called rather than run as ``__main__``, so that its
    return value, not an exit, ends the worker (the agent reads it back).

    A forked worker starts with the signal handlers of its agent, which torch's agent set to
    raise ``SignalException`` on SIGTERM, SIGINT, SIGHUP and SIGQUIT. A Python handler runs
    only when the worker's interpreter gets control: a worker stuck in C++ (a collective whose
    peer is gone) would let the agent's SIGTERM wait out its 30 s before SIGKILL. So they are
    put back first as a fresh interpreter, torchrun's own worker, has them.
    """
    for name in ("SIGTERM", "SIGHUP", "SIGQUIT"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    prepare()
    return importlib.import_module(module).main(list(args))


if __name__ == "__main__":
    main()
