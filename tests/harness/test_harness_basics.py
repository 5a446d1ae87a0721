"""The harness on its happy path: every rank runs, joins its group, and reports back.

Each test starts real rank processes and checks what *every* rank returned, so a rank that
silently did nothing (or a group that silently had fewer members) cannot pass.
"""

from __future__ import annotations

import sys

import pytest

from tutorial_impl.testing import RankResults, run_ranks
from tutorial_impl.testing import selftest_ranks as sr

pytest_plugins = ["pytester"]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_every_rank_returns_its_all_reduce(run_ranks, world_size):
    """Rank r contributes r + 1, so after all_reduce every rank must hold 1 + 2 + ... + n."""
    results = run_ranks(sr.all_reduce_rank, world_size=world_size)
    expected = world_size * (world_size + 1) / 2  # closed form, not computed by the ranks
    assert results == [expected] * world_size


@pytest.mark.world_size(4)
def test_each_rank_sees_its_place_in_the_world(run_ranks):
    """The world_size marker sets the group size; every rank joined it with gloo, 1 thread."""
    results = run_ranks(sr.report_env)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]  # dist.get_rank() inside each rank
    assert [r["env_rank"] for r in results] == ["0", "1", "2", "3"]  # RANK, as torchrun sets
    assert {r["world_size"] for r in results} == {4}
    assert {r["backend"] for r in results} == {"gloo"}
    assert {r["threads"] for r in results} == {1}  # no oversubscription on a small machine
    assert len({r["pid"] for r in results}) == 4  # four distinct processes, not one
    # torch's objects, inherited from the forkserver, are frozen out of the rank's garbage
    # collections (a full collection would otherwise copy ~100 MB of shared pages per rank)
    assert min(r["frozen_objects"] for r in results) > 100_000


@pytest.mark.parametrize("init_method", ["env", "tcp", "file"])
def test_every_init_method_rendezvouses(run_ranks, init_method):
    """env:// and tcp:// meet on the parent's port-0 TCPStore; file:// on a fresh file."""
    results = run_ranks(sr.all_reduce_value, 10, init_method=init_method, world_size=3)
    assert results == [10 + 11 + 12] * 3


def test_arguments_and_output_reach_every_rank():
    """Positional args, keyword args (fn_kwargs) and extra env arrive in every rank intact;
    what a rank prints comes back in ``results.outputs``, in rank order."""
    payload = {"nested": [1, 2.5, "three"]}
    results = run_ranks(sr.echo, payload, 7, world_size=2, backend="gloo", fn_kwargs={"flag": True})
    assert isinstance(results, RankResults)
    assert results == [(r, 2, (payload, 7), {"flag": True}) for r in range(2)]
    assert results.outputs == ["rank 0 got 2 args\n", "rank 1 got 2 args\n"]


def test_ranks_see_the_environment_of_the_call(run_ranks, monkeypatch):
    """A variable the test sets now (after the forkserver started with an older copy of
    the environment) reaches the ranks, and ``env=`` adds more for this call only."""
    monkeypatch.setenv("HARNESS_PROBE", "set by the test")
    assert run_ranks(sr.getenv, "HARNESS_PROBE") == ["set by the test"] * 2
    assert run_ranks(sr.getenv, "EXTRA", env={"EXTRA": "per call"}) == ["per call"] * 2
    monkeypatch.delenv("HARNESS_PROBE")
    assert run_ranks(sr.getenv, "HARNESS_PROBE") == [None, None]  # and removals too


@pytest.mark.parametrize("how", ["env", "tcp"])
def test_backend_none_leaves_the_group_to_the_function(run_ranks, how):
    """backend=None: no group exists when the function starts; it can join one itself
    through the rendezvous environment (the parent's store, as under torchrun)."""
    results = run_ranks(sr.init_itself, how, backend=None, world_size=3)
    for rank, r in enumerate(results):
        assert r["had_group"] is False  # the harness did not initialise anything
        assert (r["rank"], r["world_size"], r["sum"]) == (rank, 3, 6.0)
        assert r["agent_store"] == "True"


INIT_METHOD_SPY = """
import pytest
from tutorial_impl.testing import plugin, selftest_ranks as sr

seen = []
real = plugin.run_ranks

def spy(fn, *args, **options):
    seen.append(options["init_method"])
    return real(fn, *args, **options)

def test_uses_the_option(run_ranks, monkeypatch):
    monkeypatch.setattr(plugin, "run_ranks", spy)
    assert run_ranks(sr.all_reduce_rank) == [3.0, 3.0]
    assert seen == [{expected!r}]
"""


@pytest.mark.parametrize("option", [None, "tcp", "file"])
def test_init_method_option_reaches_the_fixture(pytester, option):
    """``--init-method`` changes how every test's ranks rendezvous (default env)."""
    pytester.makeconftest('pytest_plugins = ["tutorial_impl.testing.plugin"]')
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
    assert run_ranks(sr.all_reduce_rank) == [3.0, 3.0]
    assert not marker.exists()
