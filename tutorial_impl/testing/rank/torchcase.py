"""Inside a rank: one test of a torch ``MultiProcessTestCase`` class, as torch's harness runs it.

torch's spawned rank calls ``cls._run(rank, test_name, file_name, pipe, **kwargs)``: a fresh
instance with ``self.rank`` and ``self.file_name`` set, then ``self.run_test(test_name,
pipe)``, which runs the test method, turns a ``unittest.SkipTest`` into exit code 86
(``TEST_SKIPS["generic"]``), catches any other exception (its text to the parent, exit code
10) and, if the class asks (``destroy_pg_upon_exit``), destroys the default group. The
parent then reads the exit codes (``_check_return_codes``).

Here the class's own ``_run`` runs unchanged (``FSDPTest``'s, which makes its group, and any
subclass's), with ``run_test`` replaced on the class, in this rank only (a throwaway forked
process), by ``run_test`` below: torch's steps, except that an exception of the test body
leaves the rank function, for the harness's capture to report with its traceback (the
raising rank named first, not the peer that saw "Connection closed"). What torch's rank would
have turned into a process exit code is the rank function's return value instead
(``torch_rank``): 0, a ``sys.exit`` code, 86 for a skip, 1 for an exception outside the test
body or one that is no ``Exception`` (``multiprocessing``'s exit code for an uncaught one).
The parent applies torch's own rules to those codes (``torchcase``).

Left out, as diagnostics only: torch's event-listener thread (the parent asks it for a stack
at its timeout; the harness dumps every rank's stack itself) and its fatal-signal stack
printer (the harness's own ``faulthandler`` reports a fatal signal's stack).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import traceback
from typing import Any

from tutorial_impl.testing.rank.lookup import FunctionRef, resolve

UNCAUGHT = 1  # what multiprocessing's child exits with when an exception leaves its target


class _Body:
    """The exception of the test body in this rank, if it raised one: it leaves the rank
    function as it is; any other exception is what torch's process would have exited 1 for."""

    error: BaseException | None = None


def torch_rank(
    rank: int,
    world_size: int,
    case: FunctionRef,
    test_name: str,
    file_name: str,
    kwargs: dict[str, Any],
) -> int:
    """Run ``test_name`` of the class ``case`` names as torch's rank ``rank`` would; return
    the exit code torch's process would have ended with (an error of the body is raised)."""
    cls = resolve(case)
    cls.run_test = run_test  # this rank only: torch's run_test, the body's error raised
    pipe, parent_pipe = multiprocessing.Pipe()  # what torch's _run hands run_test
    try:
        cls._run(rank, test_name, file_name, parent_pipe, **kwargs)
    except SystemExit as exc:
        return exit_code(exc.code)
    except BaseException as exc:
        if exc is _Body.error:
            raise
        traceback.print_exc()  # as multiprocessing prints it
        return UNCAUGHT
    finally:
        pipe.close()
    return 0


def exit_code(code: Any) -> int:
    """The process exit code ``sys.exit(code)`` gives a ``multiprocessing`` child."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF  # as the kernel keeps it
    print(code, file=sys.stderr)
    return 1


def run_test(self: Any, test_name: str, parent_pipe: Any) -> None:
    """torch's ``MultiProcessTestCase.run_test``, but the body's exception is raised, not
    sent to the parent as text with exit code 10."""
    import unittest  # here, not at the top: the plugin imports this module

    import torch.distributed as c10d
    from torch.testing._internal import common_utils
    from torch.testing._internal.common_distributed import TEST_SKIPS

    os.environ["TORCH_SHOW_CPP_STACKTRACES"] = "1"
    common_utils.set_rng_seed()
    try:
        getattr(self, test_name)()
    except unittest.SkipTest as skip:
        print(f"rank {self.rank} skipping {test_name}: {skip}", file=sys.stderr)
        sys.exit(TEST_SKIPS["generic"].exit_code)
    except Exception as error:
        _Body.error = error
        raise
    finally:
        parent_pipe.close()
    if self.destroy_pg_upon_exit:
        with contextlib.suppress(AssertionError, ValueError):  # torch's: destroyed already
            c10d.destroy_process_group()


def continuous_rank(rank: int, world_size: int, case: FunctionRef, test_name: str) -> None:
    """One test of a torch ``MultiProcContinuousTest`` class, in a rank of a world that stays
    for the class's tests (``torchcase_continuous``), as torch's worker runs it
    (``_run_test_given_id``): a fresh instance with ``self.rank`` and ``self.world_size``,
    the same seed on every rank, the test method; the class itself is left as it is (a warm
    world would take a changed class for state carried into the next test).

    The verdict is torch's worker's: a ``sys.exit`` with a ``TEST_SKIPS`` code skips the test
    with that entry's message; any other exception fails it, ``unittest.SkipTest`` and any
    other ``sys.exit`` included (torch's worker sends them to the parent as errors)."""
    import unittest  # here, not at the top: the plugin imports this module

    import torch.distributed as dist
    from torch.testing._internal import common_utils
    from torch.testing._internal.common_distributed import TEST_SKIPS

    cls = resolve(case)
    os.environ["LOCAL_RANK"] = str(rank)  # torch's _init_pg sets it (the harness resets it)
    self = cls(test_name)
    self.rank, self.world_size = rank, world_size
    self.pg = dist.distributed_c10d._get_default_group()  # torch's _init_pg: ``cls.pg``
    common_utils.set_rng_seed()
    try:
        getattr(self, test_name)()
    except SystemExit as exc:
        skip = next((s for s in TEST_SKIPS.values() if s.exit_code == exc.code), None)
        if skip is None:
            raise WorkerExit(
                f"sys.exit({exc.code!r}) in the test, which torch's harness fails"
            ) from None
        raise unittest.SkipTest(skip.message) from None
    except unittest.SkipTest as exc:
        raise WorkerSkipTest(
            f"{exc} (a SkipTest raised in a rank fails the test, as under torch's harness)"
        ) from exc


class WorkerExit(RuntimeError):
    """A ``sys.exit`` in a continuous test's rank with no ``TEST_SKIPS`` code: torch's worker
    reports it to the parent as an error."""


class WorkerSkipTest(RuntimeError):
    """A ``unittest.SkipTest`` raised in a continuous test's rank: torch's worker reports it
    to the parent as an error (only a ``TEST_SKIPS`` exit code skips there)."""
