"""The harness on its happy path: every rank runs, joins its group, and reports back.

Each test starts real rank processes and checks what *every* rank returned, so a rank that
silently did nothing (or a group that silently had fewer members) cannot pass. The rank
functions are defined here, above the tests that run them: ranks find them in this file.
"""

from __future__ import annotations

import functools
import gc
import multiprocessing.process
import os
import sys
from datetime import timedelta
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from tutorial_impl.testing import RankResults, call, run_ranks
from tutorial_impl.testing.rank import shape
from tutorial_impl.testing.rendezvous import init_method_url

pytest_plugins = ["pytester"]


def all_reduce_rank(rank: int, world_size: int) -> float:
    """The smallest useful group: every rank contributes rank + 1; returns the sum."""
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_every_rank_returns_its_all_reduce(run_ranks, world_size):
    """Rank r contributes r + 1, so after all_reduce every rank must hold 1 + 2 + ... + n."""
    results = run_ranks(all_reduce_rank, world_size=world_size)
    expected = world_size * (world_size + 1) / 2  # closed form, not computed by the ranks
    assert results == [expected] * world_size


def report_env(rank: int, world_size: int) -> dict[str, object]:
    """What the rank sees of its world: group state, env vars, threads."""
    return {
        "rank": dist.get_rank() if dist.is_initialized() else None,
        "world_size": dist.get_world_size() if dist.is_initialized() else None,
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "env_rank": os.environ.get("RANK"),
        "threads": torch.get_num_threads(),
        "pid": os.getpid(),
        "frozen_objects": gc.get_freeze_count(),
        "collector_on": gc.isenabled(),
    }


def my_pid(rank: int, world_size: int) -> int:
    return os.getpid()


def test_a_calls_ranks_are_off_the_callers_books_when_it_returns(run_ranks):
    """The ranks are this process's multiprocessing children while they run; once run_ranks
    has returned, none is left among them (killed, not waited for): a process that calls it
    again (a torchrun worker, a rank with a nested run_ranks) must not find an earlier call's
    ranks as its own."""
    pids = set(run_ranks(my_pid))
    children = {p.pid for p in multiprocessing.process._children}  # what active_children polls
    assert not pids & children


@pytest.mark.world_size(4)
def test_each_rank_sees_its_place_in_the_world(run_ranks):
    """The world_size marker sets the group size; every rank joined it with gloo, 1 thread."""
    results = run_ranks(report_env)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]  # dist.get_rank() inside each rank
    assert [r["env_rank"] for r in results] == ["0", "1", "2", "3"]  # RANK, as torchrun sets
    assert {r["world_size"] for r in results} == {4}
    assert {r["backend"] for r in results} == {"gloo"}
    assert {r["threads"] for r in results} == {1}  # no oversubscription on a small machine
    assert len({r["pid"] for r in results}) == 4  # four distinct processes, not one
    # torch's objects, inherited from the forkserver, are frozen out of the rank's garbage
    # collections (a full collection would otherwise copy ~100 MB of shared pages per rank)
    assert min(r["frozen_objects"] for r in results) > 100_000
    # The server imported them with its collector off (no passes meanwhile); a rank starts
    # with it on, as any process does: garbage a test makes in cycles is still collected.
    assert {r["collector_on"] for r in results} == {True}


def all_reduce_value(rank: int, world_size: int, base: int) -> int:
    """Every rank contributes ``base + rank``; the sum tells the parent which group ran."""
    t = torch.tensor([base + rank], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t.item())


@pytest.mark.parametrize("init_method", ["env", "tcp", "file"])
def test_every_init_method_rendezvouses(run_ranks, init_method):
    """env:// and tcp:// meet on the parent's port-0 TCPStore; file:// on a fresh file."""
    results = run_ranks(all_reduce_value, 10, init_method=init_method, world_size=3)
    assert results == [10 + 11 + 12] * 3


def echo(rank: int, world_size: int, *args: object, **kwargs: object) -> tuple:
    """Return what the rank received, to prove arguments travel to every rank intact."""
    print(f"rank {rank} got {len(args)} args")
    return rank, world_size, args, kwargs


def test_arguments_and_output_reach_every_rank():
    """Positional args, keyword args (fn_kwargs) and extra env arrive in every rank intact;
    what a rank prints comes back in ``results.outputs``, in rank order."""
    payload = {"nested": [1, 2.5, "three"]}
    results = run_ranks(echo, payload, 7, world_size=2, backend="gloo", fn_kwargs={"flag": True})
    assert isinstance(results, RankResults)
    assert results == [(r, 2, (payload, 7), {"flag": True}) for r in range(2)]
    assert results.outputs == ["rank 0 got 2 args\n", "rank 1 got 2 args\n"]


def only_rank(rank: int) -> int:
    return rank


def rank_then_keyword(rank: int, scale: int) -> int:
    return rank * scale


def keyword_only(rank: int, *, scale: int) -> int:
    return rank * scale


def defaulted(rank: int, world_size: int = 2) -> int:
    return world_size


def no_parameters() -> None:
    pass


def bound_first(model: str, rank: int, world_size: int, *, scale: int = 1) -> None:
    pass


@mock.patch("os.getcwd")
def patched(rank: int, world_size: int, getcwd: mock.Mock) -> None:
    pass  # the decorator supplies getcwd: the call is not refused, as before


@pytest.mark.parametrize(
    ("fn", "args", "fn_kwargs", "received"),
    [
        (only_rank, (), {}, ((1,), {})),
        (all_reduce_rank, (), {}, ((1, 4), {})),
        (echo, (7, "x"), {"flag": True}, ((1, 4, 7, "x"), {"flag": True})),
        (keyword_only, (), {"scale": 3}, ((1,), {"scale": 3})),
        (rank_then_keyword, (), {"scale": 3}, ((1,), {"scale": 3})),
        (defaulted, (), {}, ((1, 4), {})),  # as before: a defaulted second one gets the size
        (no_parameters, (), {}, ((), {})),
        (patched, (), {}, ((1, 4), {})),
        (functools.partial(bound_first, "m", scale=2), (), {}, (("m", 1, 4), {"scale": 2})),
        (
            functools.partial(bound_first, "m", scale=2),
            (),
            {"scale": 5},
            (("m", 1, 4), {"scale": 5}),
        ),
        (functools.partial(functools.partial(echo, 1), 2), (3,), {}, ((1, 2, 1, 4, 3), {})),
    ],
    ids=lambda v: getattr(v, "__name__", None) if callable(v) else None,
)
def test_the_signature_decides_what_each_rank_passes(fn, args, fn_kwargs, received):
    """In the parent (no rank started): the call checked into its shape, and what rank 1 of
    a world of 4 then passes its function (``shape.arguments``, the rank side's one step)."""
    built = call.build(fn, args, fn_kwargs=fn_kwargs, world_size=4)
    assert built.function.qualname == getattr(fn, "func", fn).__qualname__  # a partial's own
    assert shape.arguments(built.payload, built.rank_params, 1, 4) == received


def getenv(rank: int, world_size: int, name: str) -> str | None:
    return os.environ.get(name)


def test_ranks_see_the_environment_of_the_call(run_ranks, monkeypatch):
    """A variable the test sets now (after the forkserver started with an older copy of
    the environment) reaches the ranks, and ``env=`` adds more for this call only."""
    monkeypatch.setenv("HARNESS_PROBE", "set by the test")
    assert run_ranks(getenv, "HARNESS_PROBE") == ["set by the test"] * 2
    assert run_ranks(getenv, "EXTRA", env={"EXTRA": "per call"}) == ["per call"] * 2
    monkeypatch.delenv("HARNESS_PROBE")
    assert run_ranks(getenv, "HARNESS_PROBE") == [None, None]  # and removals too


def where_am_i(rank: int, world_size: int) -> tuple[str, str]:
    return os.getcwd(), sys.path[0]


def test_ranks_start_in_the_directory_and_import_path_of_the_call(run_ranks, monkeypatch, tmp_path):
    """Like the environment, the working directory and sys.path are the caller's at the
    call, not the forkserver's (which date from its start)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "on-the-path"))
    assert run_ranks(where_am_i) == [(str(tmp_path), str(tmp_path / "on-the-path"))] * 2


def init_itself(rank: int, world_size: int, how: str) -> dict[str, object]:
    """``backend=None``: no group yet; join one through the rendezvous env, as under torchrun."""
    had_group = dist.is_initialized()
    dist.init_process_group(
        "gloo",
        init_method=init_method_url(how),
        rank=int(os.environ["RANK"]),  # tcp:// wants them spelled out; the harness set both
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timedelta(seconds=30),
    )
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return {
        "had_group": had_group,
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "sum": t.item(),
        "agent_store": os.environ.get("TORCHELASTIC_USE_AGENT_STORE"),
    }


@pytest.mark.parametrize("how", ["env", "tcp"])
def test_backend_none_leaves_the_group_to_the_function(run_ranks, how):
    """backend=None: no group exists when the function starts; it can join one itself
    through the rendezvous environment, as in plain torch: rank 0 hosts MASTER_PORT (no
    TORCHELASTIC_USE_AGENT_STORE tells torch otherwise)."""
    results = run_ranks(init_itself, how, backend=None, world_size=3)
    for rank, r in enumerate(results):
        assert r["had_group"] is False  # the harness did not initialise anything
        assert (r["rank"], r["world_size"], r["sum"]) == (rank, 3, 6.0)
        assert r["agent_store"] is None


INIT_METHOD_SPY = """
import torch
import torch.distributed as dist
from tutorial_impl.testing.strategies import protocol

seen = []
real = protocol.run

def spy(strategy, call):
    seen.append(call.init_method)
    return real(strategy, call)

def rank_sum(rank, world_size):
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return t.item()

def test_uses_the_option(run_ranks, monkeypatch):
    monkeypatch.setattr(protocol, "run", spy)
    assert run_ranks(rank_sum) == [3.0, 3.0]
    assert seen == [{expected!r}]
"""


@pytest.mark.parametrize("option", [None, "tcp", "file"])
def test_init_method_option_reaches_the_fixture(pytester, option):
    """``--init-method`` changes how every test's ranks rendezvous (default env)."""
    pytester.makepyfile(INIT_METHOD_SPY.format(expected=option or "env"))
    args = ["-p", "no:cacheprovider"] + ([f"--init-method={option}"] if option else [])
    pytester.runpytest(*args).assert_outcomes(passed=1)


MAIN_SCRIPT = """
from pathlib import Path
Path({marker!r}).write_text("the main script ran in a rank")
raise SystemExit("a rank re-ran the main script")
"""


def test_ranks_do_not_re_run_the_main_script(run_ranks, tmp_path, monkeypatch):
    """multiprocessing normally re-runs the parent's main script in every child, so that
    a script calling run_ranks at module level (no ``if __name__ == "__main__":``) would
    call it again inside each rank, and every rank would die. Here the parent's __main__
    is made to look like such a script (one that leaves a mark and exits): the ranks must
    neither run it nor die."""
    import types

    marker = tmp_path / "main-script-ran"
    script = tmp_path / "script.py"
    script.write_text(MAIN_SCRIPT.format(marker=str(marker)))
    fake_main = types.ModuleType("__main__")
    fake_main.__file__ = str(script)  # what `python script.py` gives its __main__
    fake_main.__spec__ = None
    monkeypatch.setitem(sys.modules, "__main__", fake_main)
    assert run_ranks(all_reduce_rank) == [3.0, 3.0]
    assert not marker.exists()
