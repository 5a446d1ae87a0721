"""A rank's outcome, typed, and the exceptions built from it in one place.

1. Every way a rank can end is a small dataclass (``outcome``); ``errors.error_for`` turns
   each failure into its exception, whose first line is the cause.
2. The exceptions keep structured fields and survive pickling.
3. A hang's headline says where each rank's own code was (``diagnose.stacks.where``), and when the
   ranks sit in different collectives it says so; when they wait in a call that forms a
   group, it says which, and why the group did not form.
4. Through real ranks: a result the parent cannot unpickle is a ``RankFailed`` naming the
   rank, not a raw error from the harness's internals.
"""

from __future__ import annotations

import pickle

import pytest

from tutorial_impl.testing import proctable, run_ranks, words
from tutorial_impl.testing.diagnose import stacks
from tutorial_impl.testing.diagnose.stacks import Place
from tutorial_impl.testing.rank import outcome
from tutorial_impl.testing.verdict import errors
from tutorial_impl.testing.verdict.errors import RankCrashed, RankFailed, RankSkipped, RankXFailed

# --- 1. outcomes and the exceptions built from them ------------------------------------------


def _raised() -> outcome.Raised:
    try:
        raise ValueError("boom on one\nsecond line")
    except ValueError as exc:
        result = outcome.from_exception(exc)
    assert isinstance(result, outcome.Raised)
    return result


def test_each_failure_becomes_its_exception_with_the_cause_first():
    outputs = {0: "zero\n", 1: "one\n"}
    failed = errors.error_for(1, _raised(), "", outputs, {0: "stack of 0"})
    assert isinstance(failed, RankFailed)
    assert failed.headline == "rank 1 raised ValueError: boom on one"
    assert (failed.rank, failed.exc_type) == (1, "ValueError")
    assert failed.exc_message == "boom on one\nsecond line"
    assert "Traceback (most recent call last)" in failed.traceback

    killed = errors.error_for(0, outcome.died(-9), "", outputs)
    assert isinstance(killed, RankCrashed) and killed.exitcode == -9
    assert killed.headline == "rank 0 was killed by signal SIGKILL before returning a result"
    exited = errors.error_for(0, outcome.died(3), "", outputs)
    assert exited.headline.startswith("rank 0 exited with code 3")

    assert isinstance(errors.error_for(1, outcome.Skipped("no GPU"), "", {}), RankSkipped)
    assert isinstance(errors.error_for(1, outcome.XFailed("bug 12"), "", {}), RankXFailed)
    with pytest.raises(TypeError, match="not a failure"):
        errors.error_for(0, outcome.Returned(3), "", {})


def test_pytest_skip_and_xfail_in_a_rank_are_told_apart_by_name():
    for call, kind in ((pytest.skip, outcome.Skipped), (pytest.xfail, outcome.XFailed)):
        try:
            call("why")
        except BaseException as exc:  # noqa: BLE001 - skip/xfail are BaseExceptions
            assert outcome.from_exception(exc) == kind("why")


def test_the_whole_text_outside_pytest_and_sections_inside():
    """``str(error)`` is the whole report for a script or the CLI; under pytest the plugin
    sets ``in_message = False`` and the stacks and outputs become report sections."""
    error = errors.error_for(1, _raised(), "", {0: "zero\n"}, {0: "stack of 0"})
    assert "[rank 0] zero" in str(error) and "stack of 0" in str(error)
    error.in_message = False
    assert "[rank 0] zero" not in str(error) and "stack of 0" not in str(error)


def test_a_long_output_keeps_its_last_lines_and_counts_the_cut_ones():
    """A rank that printed 250 lines shows its LAST 200 (``OUTPUT_TAIL_LINES``): the lines
    just before a failure are the ones that explain it. One header line says exactly how
    many earlier lines were cut; an output that fits is shown whole, with no header."""
    assert errors.OUTPUT_TAIL_LINES == 200
    printed = "".join(f"line {n}\n" for n in range(1, 251))
    error = errors.error_for(1, _raised(), "", {1: printed})
    shown = str(error).partition("----- output of the ranks (stdout and stderr) -----\n")[2]
    assert shown.splitlines() == ["[rank 1] ... (50 earlier lines cut)"] + [
        f"[rank 1] line {n}" for n in range(51, 251)
    ]
    assert errors.prefixed(0, "a\nb\n", limit=2) == "[rank 0] a\n[rank 0] b"
    assert errors.prefixed(0, "a\nb\nc\n", limit=2) == (
        "[rank 0] ... (1 earlier lines cut)\n[rank 0] b\n[rank 0] c"
    )


# --- 2. structured fields that survive pickling ---------------------------------------------


def test_every_exception_survives_pickling_with_its_fields():
    built = [
        errors.error_for(1, _raised(), "", {1: "out"}, {0: "stack"}),
        errors.error_for(0, outcome.died(-9), "fatal", {}),
        errors.error_for(2, outcome.Skipped("s"), "", {}),
        errors.error_for(2, outcome.XFailed("x"), "", {}),
        errors.timeout_error(
            [0, 1], 5.0, {0: "a", 1: "b"}, {}, {0: Place("t.py", 3, "f", "all_reduce")}
        ),
    ]
    for error in built:
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error)
        assert str(copy) == str(error)
        assert vars(copy) == vars(error)


# --- 3. the hang headline -----------------------------------------------------------------

DUMP = """Thread 0x00007f (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait

Current thread 0x00007e (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2 in {op}
  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 8 in wrapper
  File "/home/me/project/test_sum.py", line {line} in {fn}
  File "/venv/lib/python3.11/site-packages/tutorial_impl/testing/rank/main.py", line 9 in rank_main
"""


def test_where_reads_the_innermost_user_line_and_the_call_it_sits_in():
    """Library frames (torch, the harness, decorators' ``wrapper``) are looked through."""
    dump = DUMP.format(op="all_reduce", line=12, fn="step")
    assert stacks.where(dump) == Place("test_sum.py", 12, "step", "all_reduce")
    assert str(stacks.where(dump)) == "in all_reduce at test_sum.py:12"
    own = 'Current thread 0x1 (most recent call first):\n  File "/p/t.py", line 5 in spin\n'
    own += '  File "/x/tutorial_impl/testing/rank/main.py", line 9 in rank_main\n'
    assert str(stacks.where(own)) == "at t.py:5 in spin"
    assert stacks.where("") is None


WARM_DUMP = """Thread 0x2 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/p/helper.py", line 7 in watch
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x1 (most recent call first):
  File "/p/test_x.py", line 34 in sleeping
  File "/x/tutorial_impl/testing/rank/outcome.py", line 9 in capture
  File "/x/tutorial_impl/testing/strategies/warm/loop.py", line 160 in warm_rank_main
  File "/x/multiprocessing/process.py", line 108 in run
"""


def test_a_warm_ranks_dump_is_read_from_its_own_thread():
    """A warm rank's stack ends in ``warm_rank_main``: its place is its own thread's, the
    same as a fresh rank's, never another thread's frames read with it ("in _bootstrap");
    frames below the entry are cut as a fresh rank's are."""
    assert str(stacks.where(WARM_DUMP)) == "at test_x.py:34 in sleeping"
    assert "multiprocessing" not in stacks.trim(WARM_DUMP)
    assert "in warm_rank_main" in stacks.trim(WARM_DUMP)


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text")


def test_an_exception_whose_str_raises_is_reported_by_its_type():
    try:
        raise Unprintable()
    except Unprintable as exc:
        got = outcome.from_exception(exc)
    assert isinstance(got, outcome.Raised)
    assert got.summary.endswith("Unprintable: <str() failed>")
    assert outcome.safe_str(Unprintable()) == outcome.UNPRINTABLE == "<str() failed>"
    assert outcome.safe_str(ValueError("fine")) == "fine"
    said = outcome.unpicklable("result of rank 0", Unprintable())
    assert said.message == "result of rank 0: <str() failed>"


def test_a_warning_made_an_error_is_located_at_the_users_frame():
    """The innermost frame of the user's code, not the library's ``warnings.warn`` (here
    a stand-in for ``typing_extensions``, a file of site-packages): the user's ``step``, or
    this test where it calls the library itself."""
    import warnings

    lib = "/v/lib/python3.11/site-packages/typing_extensions.py"
    scope: dict[str, object] = {"warnings": warnings}
    library = "\n" * 9 + "def deprecated_call():\n    warnings.warn('old', DeprecationWarning)\n"
    exec(compile(library, lib, "exec"), scope)  # noqa: S102 - a library's frame, by its path
    user = "\n" * 11 + "def step():\n    deprecated_call()\n"
    exec(compile(user, "/p/test_x.py", "exec"), scope)  # noqa: S102 - the user's frame
    here = "test_harness_outcomes.py:"
    for call, where in ((scope["step"], "test_x.py:13"), (scope["deprecated_call"], here)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            try:
                call()  # type: ignore[operator]
            except DeprecationWarning as exc:
                got = outcome._warned_at(exc)
        assert got == where or (where == here and got.startswith(here)), got
    assert outcome._warned_at(ValueError("not a warning")) is None


def test_a_hang_in_different_collectives_says_so():
    where = {0: Place("t.py", 3, "f", "all_reduce"), 1: Place("t.py", 5, "f", "broadcast")}
    line = words.hang([0, 1], 5, where)
    assert line.startswith("rank(s) 0, 1 still running after the harness deadline of 5 s: ")
    assert "rank 0 in all_reduce at t.py:3, rank 1 in broadcast at t.py:5" in line
    assert "the ranks are in different collectives (" + words.CHECK_COLLECTIVES in line
    same = words.hang([0, 1], 5, {0: where[0], 1: Place("t.py", 3, "f", "all_reduce")})
    assert "different collectives" not in same
    # A rank sitting in something that is no collective (a debugger's trace_dispatch) is
    # not in "a different collective": only torch.distributed's calls count.
    debugging = {0: where[0], 1: Place("t.py", 5, "f", "trace_dispatch")}
    assert "different collectives" not in words.hang([0, 1], 5, debugging)
    three = {**where, 2: Place("t.py", 9, "spin")}  # ranks 0 and 1 still differ
    assert "different collectives" in words.hang([0, 1, 2], 5, three)
    # Ranks that had already ended are named, so a rank that returned early is seen.
    ended = words.hang([0], 5, {0: where[0]}, {1: "returned"})
    assert ended.endswith("rank 0 in all_reduce at t.py:3; rank 1 had returned")


def test_a_hang_the_records_explain_names_only_the_ranks_outside_a_collective():
    """With the records' line (``desync``), the stacks add where the ranks were that neither
    wait in a collective (the records said those) nor sit in one: here rank 1 only."""
    where = {
        0: Place("t.py", 3, "f", "all_reduce"),  # in a collective: the records speak for it
        1: Place("t.py", 5, "f", "compute"),  # outside any: only its stack says where
        2: Place("t.py", 7, "f", "compute"),  # waiting, by its records
    }
    said = "rank 0 waits in all_reduce #2 at t.py:3; rank 2 never reached #2"
    line = words.hang([0, 1, 2], 5, where, explained=said, waiting=frozenset({2}))
    assert line == (
        "rank(s) 0, 1, 2 still running after the harness deadline of 5 s: "
        f"{said}; rank 1 in compute at t.py:5"
    )


# torchmetrics' setup_ddp (a library frame) in torch's env:// rendezvous, as faulthandler shows it
FORMING = """Current thread 0x00007e (most recent call first):
  File "{v}/torch/distributed/rendezvous.py", line 190 in _create_c10d_store
  File "{v}/torch/distributed/rendezvous.py", line 280 in _env_rendezvous_handler
  File "{v}/torch/distributed/distributed_c10d.py", line 1892 in init_process_group
  File "{v}/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "{v}/unittests/conftest.py", line 70 in setup_ddp
  File "/home/me/project/test_ddp.py", line 7 in test_fn
  File "{v}/tutorial_impl/testing/rank/main.py", line 9 in rank_main
""".format(v="/venv/lib/python3.11/site-packages")


def test_a_group_that_cannot_form_says_why():
    """A hang in a call that forms a group names the call and its init method, and why:
    the ranks that never joined it, or, when all wait in it, that they never meet."""
    place = stacks.where(FORMING)
    assert place == Place("test_ddp.py", 7, "test_fn", "setup_ddp", "init_process_group(env://)")
    assert stacks.where(DUMP.format(op="all_reduce", line=3, fn="f")).joining is None
    stuck = {0: place, 1: place}
    line = words.hang([0, 1], 5, stuck)
    assert line.endswith(
        "rank 1 in setup_ddp at test_ddp.py:7: the group did not form in "
        "init_process_group(env://): " + words.NEVER_MET
    )
    assert "TORCHELASTIC_USE_AGENT_STORE=True" in words.NEVER_MET
    elsewhere = {0: place, 1: Place("t.py", 5, "f", "all_reduce")}
    absent = words.hang([0, 1], 5, elsewhere, {2: "returned"})
    assert absent.endswith("init_process_group(env://): rank(s) 1, 2 never joined")
    assert words.unformed_group([0], {0: Place("t.py", 5, "f", "barrier")}, {1: "returned"}) == ""


# --- 4. a result the parent cannot unpickle ---------------------------------------------------


def _refuse() -> None:
    raise TypeError("this object cannot be rebuilt here")


class Boomerang:
    """Pickles in the rank; unpickling it (in the parent) raises."""

    def __reduce__(self):
        return (_refuse, ())


def return_boomerang_on_rank_1(rank, world_size, pid_dir):
    proctable.record_self(pid_dir, f"rank{rank}")
    return Boomerang() if rank == 1 else rank


def xfail_on_rank_0(rank, world_size, pid_dir):
    proctable.record_self(pid_dir, f"rank{rank}")
    if rank == 0:
        pytest.xfail("known bug on rank 0")
    return rank


def test_a_result_the_parent_cannot_unpickle_names_the_rank(tmp_path):
    with pytest.raises(RankFailed) as info:
        run_ranks(return_boomerang_on_rank_1, str(tmp_path), world_size=2, timeout=30)
    assert info.value.rank == 1
    assert info.value.headline == (
        "rank 1 raised TypeError: its result could not be unpickled in the parent: "
        "this object cannot be rebuilt here"
    )
    assert set(proctable.recorded(tmp_path)) == {"rank0", "rank1"}
    assert proctable.wait_until_gone(tmp_path) == {}  # both ranks gone, none left behind


def test_xfail_in_a_rank_is_a_rank_xfailed_and_leaves_no_process(tmp_path):
    """(The plugin turns ``RankXFailed`` into an xfail: see test_harness_report.)"""
    with pytest.raises(RankXFailed) as info:
        run_ranks(xfail_on_rank_0, str(tmp_path), world_size=2, timeout=30)
    assert (info.value.rank, info.value.reason) == (0, "known bug on rank 0")
    assert proctable.wait_until_gone(tmp_path) == {}


def test_a_failed_tests_rank_output_reaches_junit_through_the_items_stdout():
    """junit's ``system-out`` is written from the teardown report, whose sections are the
    item's captured ones: ``rewrite`` adds each rank's output there (``Captured stdout``),
    each line naming its rank; an empty output adds nothing, a passed report nothing."""
    from types import SimpleNamespace

    from tutorial_impl.testing.verdict import report

    outputs = {0: "zero\n", 1: "", 2: "two\nlast"}
    failed = errors.error_for(0, _raised(), "", outputs)
    added: list[tuple[str, str, str]] = []
    item = SimpleNamespace(add_report_section=lambda *section: added.append(section))
    rep = SimpleNamespace(failed=True, when="call", longrepr=None, sections=[])
    report.rewrite(rep, failed, item)
    assert added == [
        ("call", "stdout (rank 0)", "[rank 0] zero\n"),
        ("call", "stdout (rank 2)", "[rank 2] two\n[rank 2] last\n"),
    ]
    assert [title for title, _ in rep.sections] == ["output of rank 0", "output of rank 2"]
    added.clear()
    report.rewrite(SimpleNamespace(failed=False, when="call", sections=[]), failed, item)
    report.rewrite(rep, ValueError("not a rank's"), item)
    assert added == []
