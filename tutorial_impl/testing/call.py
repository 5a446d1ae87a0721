"""One ``run_ranks`` call, checked once into a typed value, and what each rank is given.

Markers, options and ``run_ranks`` keyword arguments all end up here: ``build`` checks every
field (a ``ValueError`` or ``TypeError`` naming the field and what is accepted) and returns
a frozen ``Call``. Every way of starting ranks takes a ``Call``; a strategy that cannot honour
a field the call sets (``Call.sets``) refuses it by name (``protocol.refusal``), it never
drops it. ``rank_spec`` turns a call into what one rank receives (``RankSpec``).

Nothing here imports torch at import time (the pytest plugin imports this module).
"""

from __future__ import annotations

import contextlib
import inspect
import multiprocessing
import os
import pickle
import shutil
import sys
import tempfile
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, TextIO

from tutorial_impl.testing import backends
from tutorial_impl.testing.faults import plan
from tutorial_impl.testing.rank import coverage as _coverage
from tutorial_impl.testing.rank import shape as _shape
from tutorial_impl.testing.rank import torchenv
from tutorial_impl.testing.rank.caught import Filters
from tutorial_impl.testing.rank.debugging import check_rank
from tutorial_impl.testing.rank.lookup import FunctionRef, function_ref
from tutorial_impl.testing.rank.spec import RankFiles, RankSpec
from tutorial_impl.testing.rendezvous import INIT_METHODS
from tutorial_impl.testing.settings.config import (
    DEFAULT_BACKEND,
    DEFAULT_DEADLINE,
    DEFAULT_INIT_METHOD,
    DEFAULT_WORLD_SIZE,
)
from tutorial_impl.testing.settings.matrix import check_world_size
from tutorial_impl.testing.settings.timing import SECONDS, usable_seconds

SAME = object()  # Source.keyword_default: the keyword's default is the field's


@dataclass(frozen=True)
class Source:
    """Where a ``Call`` field's value comes from, by the names a user writes (a field no user
    names says what the harness puts there instead). The ``Call``'s fields and these are the
    one list of options: ``DEFAULTS``, the run_ranks keywords, derive from it, and a test holds
    the markers, command-line options and ini values of the plugin to it."""

    keyword: str | None = None  # run_ranks(fn, ..., keyword=value)
    marker: str | None = None  # @pytest.mark.<marker>(...), read and checked by ``config``
    option: str | None = None  # on the command line
    ini: str | None = None  # in the ini file
    keyword_default: Any = SAME  # the keyword's default where it is not the field's
    harness: str = ""  # what the harness puts in a field no user names


def _field(default: Any = MISSING, *, factory: Any = MISSING, **source: Any) -> Any:
    """A ``Call`` field, its default and its ``Source``."""
    return field(default=default, default_factory=factory, metadata={"source": Source(**source)})


@dataclass(frozen=True)
class Call:
    """One run, checked: the function, where it runs, and for how long."""

    function: FunctionRef = _field(harness="run_ranks's fn, found by name in the rank (lookup)")
    # pickle of (a partial's args, args, keywords): unpickled in each rank
    payload: bytes = _field(keyword="fn_kwargs", keyword_default=None, harness="with the args")
    rank_params: int = _field(harness="how many of (rank, world_size) fn takes first (shape)")
    world_size: int = _field(DEFAULT_WORLD_SIZE, keyword="world_size", marker="world_size")
    backend: str | None = _field(DEFAULT_BACKEND, keyword="backend", marker="dist_backend")
    init_method: str = _field(DEFAULT_INIT_METHOD, keyword="init_method", option="--init-method")
    # seconds for the whole run
    deadline: float = _field(
        DEFAULT_DEADLINE,
        keyword="timeout",
        marker="rank_timeout",
        option="--rank-timeout",
        ini="rank_timeout",
    )
    # the check_collectives marker and option add TORCH_DISTRIBUTED_DEBUG (``torchenv``)
    env: dict[str, str] = _field(
        factory=dict,
        keyword="env",
        keyword_default=None,
        marker="check_collectives",
        option="--check-collectives",
    )
    may_exit: frozenset[int] = _field(frozenset(), keyword="may_exit", keyword_default=())
    debug_rank: int | None = _field(None, keyword="debug_rank", option="--rank-pdb")
    log_dir: Path | None = _field(None, keyword="log_dir")  # the caller's, for the ranks' files
    stream: TextIO | None = _field(None, keyword="stream")
    stream_prefix: bool = _field(True, keyword="stream_prefix")
    coverage: dict[str, Any] | None = _field(None, harness="the parent's coverage, if measured")
    faults: plan.Plan = _field((), keyword="faults")  # docs/faults.md
    # Where the harness keeps the ranks' files when the caller gave no ``log_dir``;
    # neither: a temporary directory (``work_dir``).
    home: Path | None = _field(None, harness="the fixture's ranks/<test>-<n>")
    announce: Callable[[str], None] | None = _field(
        None, harness="where a debugged rank's 'attach to port N' goes: pytest's terminal"
    )
    warning_filters: Filters | None = _field(
        None, harness="the test's warning filters at the call (caught); None: the rank's own"
    )

    def sets(self, name: str) -> bool:
        """Whether field ``name`` is away from its default: something a strategy that
        cannot honour the field must refuse (``protocol.refusal``)."""
        found = _FIELDS[name]
        default = found.default_factory() if found.default is MISSING else found.default  # type: ignore[misc]
        return bool(getattr(self, name) != default)

    @property
    def debug_env(self) -> dict[str, str]:
        return check_rank(self.debug_rank, self.world_size)


_FIELDS = {f.name: f for f in fields(Call)}
SOURCES: dict[str, Source] = {name: f.metadata["source"] for name, f in _FIELDS.items()}
# The options of run_ranks, beside the function and its positional arguments, and their
# defaults (run_ranks's own signature says the same, for help() and editors: a test checks).
DEFAULTS: dict[str, Any] = {
    source.keyword: _FIELDS[name].default
    if source.keyword_default is SAME
    else source.keyword_default
    for name, source in SOURCES.items()
    if source.keyword is not None
}
OPTIONS = tuple(DEFAULTS)


def build(fn: Callable[..., Any], args: tuple[Any, ...] = (), **options: Any) -> Call:
    """Check a call's every field (``options``: run_ranks's keyword options, the others at
    their ``DEFAULTS``) and pickle what the ranks need."""
    unknown = unknown_options(options)
    if unknown:
        raise TypeError(f"unknown option(s) {unknown}; the options are {', '.join(OPTIONS)}")
    o = {**DEFAULTS, **options}
    world_size, backend, timeout = o["world_size"], o["backend"], o["timeout"]
    check_world_size(world_size)  # a positive int, at most what the host can start
    if o["init_method"] not in INIT_METHODS:
        raise ValueError(
            f"unknown init method {o['init_method']!r}; expected one of {INIT_METHODS}"
        )
    if not usable_seconds(timeout):
        raise ValueError(f"timeout must be {SECONDS}, got {timeout!r}")
    backends.check(backend)
    refusal = backends.mpi_refusal(backend, world_size)
    if refusal:
        raise ValueError(refusal)
    env = check_env(o["env"])
    check_rank(o["debug_rank"], world_size)
    _check_gpus(backend, world_size, env)
    _check_stream(o["stream"])
    _check_callable(fn)
    ref = function_ref(fn)
    shape = _shape.decide(fn, args, _check_kwargs(o["fn_kwargs"]))
    return Call(
        function=ref,
        payload=_payload(ref, shape, args),
        rank_params=shape.rank_params,
        world_size=world_size,
        backend=backend,
        init_method=o["init_method"],
        deadline=float(timeout),
        env=env,
        may_exit=_check_ranks(o["may_exit"], world_size),
        debug_rank=o["debug_rank"],
        log_dir=Path(o["log_dir"]) if o["log_dir"] is not None else None,
        stream=o["stream"],
        stream_prefix=bool(o["stream_prefix"]),
        coverage=_coverage.parent_settings(),
        faults=check_faults(o["faults"], world_size),
    )


def check_faults(faults: Any, world_size: int) -> plan.Plan:
    """``faults=`` as a plan: one ``Fault`` or a collection of them, each striking ranks of
    this world; else a ValueError naming the fault and what is wrong."""
    if isinstance(faults, plan.Fault):
        faults = (faults,)
    if isinstance(faults, (str, bytes, dict)) or not isinstance(faults, Collection):
        raise ValueError(f"faults must be a Fault or a collection of Faults, got {faults!r}")
    return plan.check_plan(tuple(faults), world_size)


def _check_kwargs(fn_kwargs: Any) -> dict[str, Any]:
    if fn_kwargs is not None and not isinstance(fn_kwargs, dict):
        raise TypeError(f"fn_kwargs must be a dict of keyword arguments, got {fn_kwargs!r}")
    return dict(fn_kwargs or {})


def _payload(ref: FunctionRef, shape: _shape.Shape, args: tuple[Any, ...]) -> bytes:
    """What each rank unpickles (``shape.arguments``)."""
    try:
        return pickle.dumps((shape.head, tuple(args), shape.kwargs))
    except Exception as exc:
        raise TypeError(f"arguments for {ref.qualname} cannot be sent to the ranks: {exc}") from exc


@contextlib.contextmanager
def work_dir(call: Call) -> Iterator[Path]:
    """The run's directory (logs, stacks, file:// rendezvous): the caller's ``log_dir``, else
    the harness's ``home`` for it, else a temporary one removed afterwards."""
    given = call.log_dir or call.home
    work = given or Path(tempfile.mkdtemp(prefix="ranks-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        yield work
    finally:
        if given is None:
            shutil.rmtree(work, ignore_errors=True)


def unknown_options(options: Collection[str]) -> list[str]:
    """The keyword arguments of a run_ranks call that are no option of it."""
    return sorted(set(options) - set(OPTIONS))


def check_env(env: Any) -> dict[str, str]:
    """``env=`` as a dict: a mapping of str to str (None: nothing), else a TypeError."""
    if env is None:
        return {}
    if not isinstance(env, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise TypeError(f"env must be a mapping of str to str, got {env!r}")
    return dict(env)


def _check_stream(stream: Any) -> None:
    """``stream=``: None, or a text stream the ranks' lines are written and flushed to."""
    if stream is None:
        return
    if isinstance(stream, (str, bytes, os.PathLike)) or not all(
        callable(getattr(stream, method, None)) for method in ("write", "flush")
    ):
        raise TypeError(
            f"stream must be a text stream with write() and flush() (sys.stdout, a file "
            f"opened for writing) or None, got {stream!r}"
        )


# What a rank function must not be: calling one only makes an object, and its work never
# runs (the rank would have nothing it could send back). Each: the test, what it is, the fix.
NOT_A_RANK_FUNCTION = (
    (inspect.iscoroutinefunction, "an async def function", "returns asyncio.run(...) of it"),
    (inspect.isasyncgenfunction, "an async generator function", "drives it in asyncio.run"),
    (inspect.isgeneratorfunction, "a generator function", "returns list(...) of it"),
)


def _check_callable(fn: Any) -> None:
    """The rank function (``fn``, a partial of one included): a plain function."""
    for test, kind, fix in NOT_A_RANK_FUNCTION:
        if test(fn):
            name = getattr(getattr(fn, "func", fn), "__qualname__", None) or repr(fn)
            raise TypeError(
                f"fn (the rank function {name}) is {kind}: calling it in a rank would only "
                f"make an object, and its body would never run; give a plain function that "
                f"{fix}"
            )


def _check_ranks(may_exit: Collection[int], world_size: int) -> frozenset[int]:
    """``may_exit`` as a set, or a ValueError naming what is not a rank of this world."""
    if isinstance(may_exit, (str, bytes)) or not isinstance(may_exit, Collection):
        raise ValueError(f"may_exit must be a collection of ranks, got {may_exit!r}")
    bad = [r for r in may_exit if type(r) is not int or not 0 <= r < world_size]
    if bad:
        raise ValueError(f"may_exit names {bad!r}, not ranks of a world of {world_size}")
    return frozenset(may_exit)


def _check_gpus(backend: str | None, world_size: int, env: dict[str, str] | None) -> None:
    """Refuse, in the parent, more NCCL ranks than GPUs (ranks check again: see rank.py)."""
    if not backends.uses_nccl(backend) or "CUDA_VISIBLE_DEVICES" in (env or {}):
        return  # the ranks see other GPUs than we do: they will judge for themselves
    import torch

    shortage = backends.gpu_shortage(backend, world_size, torch.cuda.device_count())
    if shortage:
        raise ValueError(shortage)


def rank_spec(
    call: Call,
    rank: int,
    work: Path,
    rank_env: dict[str, str],
    extra_env: dict[str, str] | None = None,
    harness_env: dict[str, str] | None = None,
) -> RankSpec:
    """What rank ``rank`` runs for ``call``, its files in ``work``. Its environment, last
    word first: ``extra_env`` (the debugger's), the caller's ``env``, ``rank_env`` (the
    rendezvous the user's code sees), the parent's own; ``harness_env``: the harness's own
    group's (``rendezvous.harness_view``)."""
    return RankSpec(
        rank=rank,
        world_size=call.world_size,
        function=call.function,
        payload=call.payload,
        rank_params=call.rank_params,
        env={**rank_env, **call.env, **(extra_env or {})},
        files=RankFiles(work, rank),
        backend=call.backend,
        init_method=call.init_method,
        tmp_dir=str(work),
        timeout=call.deadline,
        parent_env=dict(torchenv.environ_bytes()),
        parent_path=list(sys.path),
        parent_cwd=os.getcwd(),
        coverage=call.coverage,
        owner_pid=os.getpid(),
        harness_env=dict(harness_env or {}),
        faults=call.faults,
        warning_filters=call.warning_filters,
        start_method=multiprocessing.get_start_method(allow_none=True),
    )
