"""Strict faults, and no fault state crossing a test (in this process: no ranks).

A planned fault a rank never reached fails the test, naming the fault and what the rank did
instead (``faults.Injector.unfired``, ``verdict`` raising ``FaultNotFired``), unless the fault
says ``optional=True``; the results say which faults fired, where and when
(``RankResults.fired``). Arming again starts every count afresh (a warm world's test, a
torchrun job's call), the records of a group made anew are numbered from its making
(``records.this_test``), and the default group is read first (``desync``). The same claims
made by a stranger, forked, warm and under torchrun: the conformance suite's ``c28`` cases.
"""

from __future__ import annotations

import pytest

from tutorial_impl.testing import RankFailed, RankSkipped
from tutorial_impl.testing.diagnose import desync, records
from tutorial_impl.testing.diagnose.recorder import Record
from tutorial_impl.testing.faults import group as faulty_group
from tutorial_impl.testing.faults import inject as faults
from tutorial_impl.testing.faults.inject import FaultNotFired, Point
from tutorial_impl.testing.faults.plan import ENV, Delay, Fault, Raise, decode, encode
from tutorial_impl.testing.rank import outcome as _o
from tutorial_impl.testing.verdict import decision as verdict

DEFAULT = ("0", "default_pg")


def test_an_unfired_fault_says_what_its_rank_did_instead(monkeypatch):
    monkeypatch.setattr(faults, "delay", lambda seconds: None)
    injector = faults.Injector()
    plan = (
        Fault(1, Delay(30), at=5, op="all_reduce"),
        Fault(1, Delay(1), step="step", at=3),
        Fault(1, Delay(1), at=9, optional=True),  # optional: never a failure
        Fault(0, Delay(1), at=9),  # another rank's
        Fault(1, Delay(1), op="broadcast"),  # fires
    )
    injector.arm(plan, rank=1, world_size=2)
    for seq in range(1, 5):
        injector.reached(Point("all_reduce", seq, *DEFAULT))
    injector.reached(Point("broadcast", 5, *DEFAULT))
    injector.step("step")
    injector.step("other")
    missed = injector.unfired()
    assert [str(u) for u in missed] == [
        "delay on rank(s) 1 at all_reduce #5 did not fire on rank 1: it made 4 all_reduce(s) "
        "that matched; its collectives: all_reduce 4, broadcast 1; its steps: 'other' 1, "
        "'step' 1",
        "delay on rank(s) 1 at fault_point('step') #3 did not fire on rank 1: it named "
        "fault_point('step') 1 time(s); its collectives: all_reduce 4, broadcast 1; its "
        "steps: 'other' 1, 'step' 1",
    ]
    (report,) = injector.reports
    assert (report.fault, report.op, report.seq, report.group, report.point) == (
        "delay on rank(s) 1 at broadcast #1",
        "broadcast",
        5,
        "0",
        "broadcast #5",
    )
    assert report.counted == "1st broadcast"  # the plan's count, where the number differs
    assert str(report) == "injected delay at broadcast #5, the 1st broadcast"
    assert report.where == f"test_harness_fault_strict.py:{LINE_OF_BROADCAST}"
    assert report.elapsed >= 0 and report.time > 0
    # A rank that reached no faulty collective is told why that may be.
    injector.arm((Fault(1, Delay(1)),), rank=1)
    assert "a group made on plain gloo is not counted" in str(injector.unfired()[0])


LINE_OF_BROADCAST = next(  # the line of ``injector.reached(Point("broadcast", 5, ...))``
    n
    for n, line in enumerate(open(__file__), 1)
    if 'Point("broadcast", 5,' in line  # noqa: SIM115
)


def test_arming_again_counts_every_point_afresh(monkeypatch):
    """A warm world's next test (or a torchrun job's next call) arms again: its steps,
    counts, collectives and fired faults start from nothing, as in a fresh rank."""
    monkeypatch.setattr(faults, "delay", lambda seconds: None)
    injector = faults.Injector()
    injector.arm((Fault(0, Raise("first"), step="step", at=3),), rank=0)
    for _ in range(2):
        injector.step("step")
    with pytest.raises(faults.InjectedFault):
        injector.step("step")
    injector.step("step")
    injector.reached(Point("all_reduce", 1, *DEFAULT))
    injector.arm((Fault(0, Delay(1), step="step", at=2),), rank=0)
    assert (injector.fired, injector.reports, injector.ops, injector.steps) == ([], [], {}, {})
    injector.step("step")
    injector.step("step")
    assert [str(p) for _, p in injector.fired] == ["fault_point('step') #2"]
    assert [r.point for r in injector.reports] == ["fault_point('step') #2"]
    assert injector.unfired() == []


def test_optional_travels_with_the_plan_and_a_bad_one_is_refused():
    plan = (Fault(1, Delay(2), at=3, op="all_gather_single", optional=True), Fault(0, Raise()))
    assert decode(encode(plan)) == plan
    assert plan[0].op == "all_gather_into_tensor"  # torch 2.13's newer name, an alias
    assert str(plan[0]).endswith(" (optional)") and "optional" not in str(plan[1])
    with pytest.raises(ValueError, match=r"Fault\(optional\): True or False"):
        Fault(1, Delay(2), optional="yes")


def _finished(outcomes, unfired=None, fired=None) -> verdict.Finished:
    reports = {r: _o.Report(o, 100 + r, float(r)) for r, o in enumerate(outcomes)}
    return verdict.Finished(
        world_size=len(outcomes),
        reports=reports,
        order=sorted(reports),
        outputs={},
        deadline=5.0,
        unfired=unfired or {},
        fired=fired or {},
    )


def test_the_verdict_fails_a_rank_that_returned_with_a_fault_unfired():
    missed = faults.Unfired(1, "kill on rank(s) 1 at all_reduce #2", "all_reduce", None, 1,
                            {"all_reduce": 1}, {})  # fmt: skip
    with pytest.raises(FaultNotFired) as failure:
        verdict.decide(_finished([_o.Returned(1), _o.Returned(2)], {1: [missed]}))
    assert str(failure.value).startswith(
        "planned fault(s) did not fire (Fault(..., optional=True) if that may be so): kill on "
        "rank(s) 1 at all_reduce #2 did not fire on rank 1: it made 1 all_reduce(s)"
    )
    assert not isinstance(failure.value, RankFailed)  # pytest.raises(RankFailed) misses it
    # Beside another rank's failure it is still the verdict, that failure its cause...
    raised = _o.Raised("ValueError", "boom", "tb")
    with pytest.raises(FaultNotFired) as failure:
        verdict.decide(_finished([raised, _o.Returned(2)], {1: [missed]}))
    assert isinstance(failure.value.__cause__, RankFailed)
    # ... but only a rank that returned did all it would have done.
    with pytest.raises(RankFailed):
        verdict.decide(_finished([_o.Returned(1), raised], {1: [missed]}))
    # A skip is no run of the test: it stays the verdict.
    with pytest.raises(RankSkipped):
        verdict.decide(_finished([_o.Returned(1), _o.Skipped("no data")], {0: [missed]}))
    fired = faults.Fired(1, "delay", "all_reduce #1")
    results = verdict.decide(_finished([_o.Returned(1), _o.Returned(2)], fired={1: [fired]}))
    assert results == [1, 2] and results.fired == {0: (), 1: (fired,)}


def _rec(seq: int, created: int, group=DEFAULT, done=True) -> Record:
    return Record(0, *group, seq, "all_reduce", False, ((1,),), ("Float",), ((1,),),
                  ("Float",), "scheduled", done, (), created_ns=created)  # fmt: skip


def test_the_records_of_a_group_made_anew_count_from_its_making():
    """Under torchrun or warm, a test's records are numbered as a fresh world's: from the
    test's start, and, where the group was made anew meanwhile (its numbers start again),
    from its making: after a test that hung in its first collective, the next says #1."""
    old = [_rec(1, 10), _rec(2, 11), _rec(3, 12, done=False)]
    continued = records.this_test([*old, _rec(4, 30), _rec(5, 31)], since_ns=20)
    assert [r.seq for r in continued] == [1, 2]
    anew = records.this_test([*old, _rec(1, 30), _rec(2, 31, done=False)], since_ns=20)
    assert [r.seq for r in anew] == [1, 2]
    line = desync.explain({0: anew, 1: [_rec(1, 30)]})
    assert line == (
        "rank 0 waits in all_reduce #2; rank 1 never reached #2 (its last: all_reduce #1)"
    )


def test_the_default_group_is_read_before_any_other():
    """Where the default group and a subgroup both part, the default group's parting is
    named (the subgroup's follows from it), whatever the groups' names."""
    default, sub = ("2", "default_pg"), ("1", "mysub")
    behind = [_rec(1, 1, sub, done=False), _rec(1, 1, default, done=False)]
    ahead = [_rec(1, 1, sub), _rec(1, 1, default)]
    ahead += [_rec(2, 2, sub, done=False), _rec(2, 2, default, done=False)]
    assert desync.explain({0: behind, 1: ahead}) == (
        "rank 1 waits in all_reduce #2; rank 0 never reached #2 (its last: all_reduce #1)"
    )


def test_what_fired_and_what_never_did_reach_the_parent(tmp_path, monkeypatch):
    """A forked or warm rank writes both to its fault file (``RankSpec.fault_path``): each
    fired fault before its action, the unfired ones once its function has returned."""
    monkeypatch.setattr(faults, "delay", lambda seconds: None)
    injector = faults.Injector()
    monkeypatch.setattr(faults, "INJECTOR", injector)
    path = tmp_path / "rank1.fault"
    plan = (Fault(1, Delay(1), op="broadcast"), Fault(1, Delay(1), at=3))
    injector.arm(plan, rank=1, report_to=str(path))
    injector.reached(Point("broadcast", 1, *DEFAULT))
    assert faults.report_unfired() == injector.unfired() != []
    with open(path, "a") as out:
        out.write('["Fired", {"rank": 1, "act')  # a line cut short by the kill it announced
    assert faults.read_fired(path) == injector.reports != []
    assert faults.read_unfired(path) == injector.unfired()
    assert faults.read_fired(tmp_path / "none") == faults.read_unfired(tmp_path / "none") == []


def test_the_documented_helper_keeps_the_plan_a_harness_rank_armed(monkeypatch):
    """``faulty_group.init_process_group(rank, world_size)`` in a rank the harness armed keeps
    that plan (a harness rank has no ``TUTORIAL_IMPL_FAULTS``); a process never armed reads
    the variable, as ``fault_launch``'s worker."""
    import torch.distributed as dist

    joined: list[tuple[str, str]] = []
    monkeypatch.setattr(
        dist, "init_process_group", lambda b, **kw: joined.append((b, kw["init_method"]))
    )
    injector = faults.Injector()
    monkeypatch.setattr(faults, "INJECTOR", injector)
    monkeypatch.setattr(faults, "arm", injector.arm)  # the module's, bound to its INJECTOR
    monkeypatch.delenv(ENV, raising=False)
    harness_plan = (Fault(1, Delay(1), at=2),)
    injector.arm(harness_plan, rank=1)
    injector.reached(Point("all_reduce", 1, *DEFAULT))
    faulty_group.init_process_group(1, 2)
    assert (injector.plan, injector.counts) == (harness_plan, [1])
    assert joined == [("faulty", "env://")]  # what ``run_ranks(..., backend=None)`` gives
    injector.arm((), rank=1)
    monkeypatch.setenv(ENV, encode(harness_plan))
    faulty_group.init_process_group(1, 2)
    assert injector.plan == harness_plan
    given = (Fault(0, Raise()),)
    faulty_group.init_process_group(1, 2, given)
    assert injector.plan == given
    # The rank's code armed the harness's plan away: the parent still hears of its fault.
    (lost,) = injector.unfired(harness_plan)
    assert lost.fault.endswith(faults.ARMED_AWAY) and lost.counted == 0
    assert injector.unfired(given) == []  # the plan the rank has: nothing lost
