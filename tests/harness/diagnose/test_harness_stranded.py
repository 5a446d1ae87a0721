"""A hang that cannot resolve (``stranded``), and the user's words in a hang's line
(``userops``, a caught injected fault in ``verdict``).

Read in order: ``find`` on hand-built records and standings, one claim per rule (a verdict
only where every condition holds; each condition taken away gives none); the names gloo
records for each of torch's calls, measured against ``userops``' table in one real run; the
verdict's text; then real forked runs: four ranks, one returns early, the other three get
their verdict at once; and a run where a rank returns beside peers that are only slow, or
wait in a group it is not in, which passes. The same file run forked, warm and under torchrun
is the conformance suite's (``c04``: cases b to d).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tutorial_impl.testing import RankTimeout
from tutorial_impl.testing.diagnose.recorder import Record
from tutorial_impl.testing.diagnose.stranded import Checked, Standing, find
from tutorial_impl.testing.diagnose.userops import IMPLEMENTED_BY, can_be, user_op
from tutorial_impl.testing.faults.inject import Fired
from tutorial_impl.testing.rank import outcome as _o
from tutorial_impl.testing.verdict.decision import Finished, decide

DEADLINE = 60.0
HOUR_MS = 3_600_000  # a group timeout far beyond the deadline
USER = ("/project/test_x.py", 12, "train")
TORCH = "/v/site-packages/torch/distributed/distributed_c10d.py"
IN_ALL_REDUCE = ((TORCH, 1, "all_reduce"), USER)
WORLD = {"0": (0, 1, 2, 3)}


def rec(rank: int, seq: int, op: str = "all_reduce", group: str = "0", **kw) -> Record:
    fields = dict(
        rank=rank,
        group=group,
        group_desc="default_pg" if group == "0" else "sub",
        seq=seq,
        op=op,
        p2p=False,
        input_sizes=((4,),),
        input_dtypes=("Float",),
        output_sizes=((4,),),
        output_dtypes=("Float",),
        state="scheduled",
        completed=True,
        timeout_ms=HOUR_MS,
    )
    return Record(**{**fields, **kw})


def upto(rank: int, last: int, waiting: bool = False, **kw) -> list[Record]:
    """``rank``'s all_reduces #1..#last, the last one unfinished if ``waiting``."""
    recs = [rec(rank, n, **kw) for n in range(1, last + 1)]
    if waiting:
        recs[-1] = dataclasses.replace(recs[-1], completed=False)
    return recs


def world_of_four() -> tuple[dict[int, list[Record]], dict[int, Standing]]:
    """Rank 1 returned after all_reduce #3; ranks 0, 2, 3 wait in #4."""
    records = {r: upto(r, 4, waiting=True) for r in (0, 2, 3)}
    records[1] = upto(1, 3)
    standings = {r: Standing(r, dict(WORLD), IN_ALL_REDUCE) for r in (0, 2, 3)}
    standings[1] = Standing(1, dict(WORLD))
    return records, standings


def test_the_returned_rank_and_the_collective_are_named():
    records, standings = world_of_four()
    found = find(records, standings, [1], [0, 2, 3], DEADLINE)
    assert found is not None
    assert found.line(True, DEADLINE).startswith(
        "rank 1 returned after all_reduce #3; ranks 0, 2, 3 wait in all_reduce #4 at "
        "test_x.py:12, which rank 1 never entered: a hang that cannot resolve (ended when "
        "seen, not at the harness deadline of 60 s)"
    )
    assert "seen at the harness deadline of 60 s" in found.line(False, DEADLINE)
    # a rank that returned before any collective of the group
    records[1] = []
    found = find(records, standings, [1], [0, 2, 3], DEADLINE)
    assert found is not None and found.left == {1: None}
    assert found.line(True, DEADLINE).startswith("rank 1 returned before any collective; ")


PEERS = (0, 2, 3)


def _peers_standing(groups: dict[str, tuple[int, ...]], frames=IN_ALL_REDUCE) -> dict:
    return {r: Standing(r, dict(groups), frames) for r in PEERS}


def _peers_records(**kw) -> dict[int, list[Record]]:
    return {r: upto(r, 4, **kw) for r in PEERS}


# Each takes one condition of ``find`` away from ``world_of_four``: (records, standings,
# returned ranks) replaced where given.
NO_VERDICT = {
    "none-returned": ({}, {}, []),  # a peer only slow: no rank has returned
    "entered": ({1: upto(1, 4)}, {}, [1]),  # the returned rank entered #4
    "finished": (_peers_records(), {}, [1]),  # the peers' newest collective finished
    # the peers' thread is not in a call that can be it (computing beside async work)
    "not-blocked": ({}, _peers_standing(WORLD, (USER,)), [1]),
    "another-call": ({}, _peers_standing(WORLD, ((TORCH, 1, "barrier"), USER)), [1]),
    # the group's own timeout comes first: the rank function may catch its error
    "short-group-timeout": (_peers_records(waiting=True, timeout_ms=1500), {}, [1]),
    "no-timeout-recorded": (_peers_records(waiting=True, timeout_ms=0), {}, [1]),
    # the returned rank is not a member of the group they wait in
    "not-a-member": ({}, _peers_standing({"0": PEERS}), [1]),
    # a group of that name in another world: other members, or another numbering
    "other-members": ({}, {1: Standing(1, {"0": (0, 1)})}, [1]),
    "other-numbering": ({}, {1: Standing(0, dict(WORLD))}, [1]),
    "peers-numbered-otherwise": (
        {},
        {r: Standing(r + 1, dict(WORLD), IN_ALL_REDUCE) for r in PEERS},
        [1],
    ),
    "no-group": ({}, {r: Standing(None, {}) for r in PEERS}, [1]),
}


@pytest.mark.parametrize("name", sorted(NO_VERDICT))
def test_no_verdict_unless_every_condition_holds(name):
    records, standings = world_of_four()
    changed_records, changed_standings, returned = NO_VERDICT[name]
    records.update(changed_records)
    standings.update(changed_standings)
    running = [r for r in range(4) if r not in returned]
    assert find(records, standings, returned, running, DEADLINE) is None
    standings.pop(1)  # and without the returned rank's own word, never
    assert find(records, standings, [1], PEERS, DEADLINE) is None


def test_a_group_timeout_of_the_deadline_itself_is_no_shorter():
    records, standings = world_of_four()
    records.update(_peers_records(waiting=True, timeout_ms=int(DEADLINE * 1000)))
    assert find(records, standings, [1], PEERS, DEADLINE) is not None


def test_a_subgroup_is_told_apart_from_the_default_one():
    records, standings = world_of_four()
    sub = {"0": WORLD["0"], "1": (0, 1)}
    records[0] = upto(0, 4) + upto(0, 2, waiting=True, group="1")
    records[1] = upto(1, 3) + upto(1, 1, group="1")
    standings = {0: Standing(0, sub, IN_ALL_REDUCE), 1: Standing(1, sub)}
    found = find(records, standings, [1], [0], DEADLINE)
    assert found is not None
    assert found.line(True, DEADLINE).startswith(
        "rank 1 returned after all_reduce #1 on group 1 (sub); rank 0 waits in all_reduce #2 on "
        "group 1 (sub) at test_x.py:12"
    )
    records[1] = upto(1, 3) + upto(1, 2, group="1")  # it entered the subgroup's #2
    assert find(records, standings, [1], [0], DEADLINE) is None


FUNCOL = "/v/site-packages/torch/distributed/_functional_collectives.py"
DTENSOR = "/v/site-packages/torch/distributed/tensor/_api.py"
IN_REDISTRIBUTE = (
    ("/v/site-packages/torch/_ops.py", 1, "__call__"),
    (FUNCOL, 142, "wait_tensor"),
    (FUNCOL, 1122, "wait"),
    (DTENSOR, 731, "redistribute"),
    USER,
)


def test_a_functional_collectives_wait_is_seen_when_its_only_unfinished_one_is_stranded():
    """DTensor's ``redistribute`` waits in ``_functional_collectives.wait_tensor``, under a
    call named for no collective: stranded when the rank's only unfinished collective is
    one the returned rank never entered; never when another is unfinished too (the work
    it waits for may be an older one), nor in a wait of another module's."""
    records, standings = world_of_four()
    standings.update(_peers_standing(WORLD, IN_REDISTRIBUTE))
    found = find(records, standings, [1], PEERS, DEADLINE)
    assert found is not None and sorted(found.waiting) == list(PEERS)
    assert found.line(True, DEADLINE).startswith(
        "rank 1 returned after all_reduce #3; ranks 0, 2, 3 wait in all_reduce #4 at test_x.py:12"
    )
    two_open = {
        r: upto(r, 3) + [rec(r, 4, completed=False), rec(r, 5, completed=False)] for r in PEERS
    }
    assert find({**records, **two_open}, standings, [1], PEERS, DEADLINE) is None
    elsewhere = tuple((p.replace("_functional", "_other"), n, f) for p, n, f in IN_REDISTRIBUTE)
    standings.update(_peers_standing(WORLD, elsewhere))
    assert find(records, standings, [1], PEERS, DEADLINE) is None


def stranded_just_before_the_deadline(rank: int, world_size: int) -> float:
    total = torch.ones(1)
    dist.all_reduce(total)
    if rank == 0:
        dist.all_reduce(total)  # rank 1 returned after #1: rank 0 waits in #2 for good
    return total.item()


def test_a_stranding_no_look_saw_before_the_deadline_is_named_at_it(run_ranks, monkeypatch):
    """A stranding that starts in the last ``POLL`` s before the deadline meets no look:
    the records taken at the deadline name it all the same ("seen at the harness deadline"),
    never a plain timeout. Here no look comes at all (``POLL`` an hour)."""
    from tutorial_impl.testing.strategies import supervise

    monkeypatch.setattr(supervise, "POLL", 3600.0)
    with pytest.raises(RankTimeout) as error:
        run_ranks(stranded_just_before_the_deadline, timeout=2)
    assert error.value.headline.startswith(
        "rank 1 returned after all_reduce #1; rank 0 waits in all_reduce #2 at "
        "test_harness_stranded.py:"
    )
    assert error.value.headline.endswith(
        "a hang that cannot resolve (seen at the harness deadline of 2 s)"
    )


# --- under torch's collective checker (--check-collectives) ------------------------------------
# The checker's records carry no group name ("") and the collective a peer waits to enter is not
# recorded at all: it waits in the checker's barrier. What each rank says of its checked groups
# (how many collectives it issued on each) decides.


def checked_world(issued_by_1: int = 3, **peer) -> tuple[dict, dict]:
    """Rank 1 returned after issuing ``issued_by_1`` collectives; ranks 0, 2, 3 issued 3, all
    finished, and wait in an all_reduce call (the 4th), in the checker's barrier."""
    records = {r: upto(r, 3, group="") for r in PEERS}
    records[1] = upto(1, issued_by_1, group="")
    checked = {"0": Checked(3, HOUR_MS)}
    standings = {
        r: Standing(r, dict(WORLD), peer.get("frames", IN_ALL_REDUCE), peer.get("checked", checked))
        for r in PEERS
    }
    standings[1] = Standing(1, dict(WORLD), (), {"0": Checked(issued_by_1, HOUR_MS)})
    return records, standings


def test_a_peer_in_the_checkers_barrier_is_stranded_by_a_rank_that_never_made_the_call():
    records, standings = checked_world()
    found = find(records, standings, [1], PEERS, DEADLINE)
    assert found is not None and sorted(found.waiting) == list(PEERS)
    assert found.line(True, DEADLINE).startswith(
        "rank 1 returned after all_reduce #3; ranks 0, 2, 3 wait in all_reduce #4 at "
        "test_x.py:12, which rank 1 never entered: a hang that cannot resolve"
    )
    records[1] = []  # before any collective of this call (torchrun: an earlier test's are gone)
    found = find(records, standings, [1], PEERS, DEADLINE)
    assert found is not None and found.left == {1: None}


def test_under_the_checker_a_group_timeout_of_the_deadline_itself_is_no_shorter():
    records, standings = checked_world(checked={"0": Checked(3, int(DEADLINE * 1000))})
    assert find(records, standings, [1], PEERS, DEADLINE) is not None


def test_under_the_checker_a_group_of_another_name_is_named():
    """One group, not the default one (a world the test made itself): its name is said."""
    records, standings = checked_world()
    standings = {
        r: dataclasses.replace(s, groups={"3": WORLD["0"]}, checked={"3": s.checked["0"]})
        for r, s in standings.items()
    }
    found = find(records, standings, [1], PEERS, DEADLINE)
    assert found is not None
    assert found.line(True, DEADLINE).startswith(
        "rank 1 returned after all_reduce #3 on group 3; ranks 0, 2, 3 wait in all_reduce #4 on "
        "group 3 at test_x.py:12"
    )


def test_in_two_checked_groups_the_call_is_named_without_a_number():
    """The stack does not say which group the call is on: stranded only if the returned rank
    is behind in every one, and the call named without a number."""
    groups = {"0": WORLD["0"], "1": (0, 1)}
    both = {"0": Checked(3, HOUR_MS), "1": Checked(2, HOUR_MS)}
    records, standings = checked_world()
    standings = {0: Standing(0, groups, IN_ALL_REDUCE, both), 1: Standing(1, groups, (), both)}
    found = find(records, standings, [1], [0], DEADLINE)
    assert found is not None
    assert found.line(True, DEADLINE).startswith(
        "rank 1 returned after all_reduce; rank 0 waits in all_reduce at test_x.py:12, which "
    )
    ahead = {"0": Checked(3, HOUR_MS), "1": Checked(3, HOUR_MS)}  # it entered one of them
    standings[1] = Standing(1, groups, (), ahead)
    assert find(records, standings, [1], [0], DEADLINE) is None


# Each takes one condition away from ``checked_world``: (its arguments, standings replaced).
NOT_STRANDED_UNDER_THE_CHECKER = {
    "entered": ({"issued_by_1": 4}, {}),  # rank 1 made the call: the checker lets rank 0 by
    "not-in-a-call": ({"frames": (USER,)}, {}),  # computing, not waiting
    "in-another-call": ({"frames": ((TORCH, 1, "monitored_barrier"), USER)}, {}),
    "short-group-timeout": ({"checked": {"0": Checked(3, 1500)}}, {}),
    "a-group-not-checked": ({"checked": {}}, {}),
    "rank-1-unchecked": ({}, {1: Standing(1, dict(WORLD))}),
    "not-a-member": (
        {},
        {r: Standing(r, {"0": PEERS}, IN_ALL_REDUCE, {"0": Checked(3, HOUR_MS)}) for r in PEERS},
    ),
    "other-members": ({}, {1: Standing(1, {"0": (0, 1)}, (), {"0": Checked(3, HOUR_MS)})}),
}


@pytest.mark.parametrize("name", sorted(NOT_STRANDED_UNDER_THE_CHECKER))
def test_no_verdict_under_the_checker_unless_every_condition_holds(name):
    kwargs, changed = NOT_STRANDED_UNDER_THE_CHECKER[name]
    records, standings = checked_world(**kwargs)
    standings.update(changed)
    assert find(records, standings, [1], PEERS, DEADLINE) is None


def test_a_functional_collectives_wait_under_the_checker_is_seen_by_the_counts():
    """DTensor's collectives skip the checker's barrier: the peer's newest record is
    unfinished, under no group name. With one (checked) group, the counts decide: stranded
    when the returned rank issued fewer of the group's collectives; not when it issued as many
    (it entered the one waited in), nor when the peer is in two groups (whose is it?)."""
    records, standings = checked_world()
    records.update({r: upto(r, 4, waiting=True, group="") for r in PEERS})
    four = {"0": Checked(4, HOUR_MS)}
    standings.update(_peers_standing_checked(IN_REDISTRIBUTE, four))
    found = find(records, standings, [1], PEERS, DEADLINE)
    assert found is not None
    assert found.line(True, DEADLINE).startswith(
        "rank 1 returned after all_reduce #3; ranks 0, 2, 3 wait in all_reduce #4 at test_x.py:12"
    )
    standings[1] = Standing(1, dict(WORLD), (), four)  # it entered #4 too
    assert find(records, standings, [1], PEERS, DEADLINE) is None
    standings[1] = Standing(1, dict(WORLD), (), {"0": Checked(3, HOUR_MS)})
    two = {"0": WORLD["0"], "1": WORLD["0"]}
    both = {"0": Checked(4, HOUR_MS), "1": Checked(4, HOUR_MS)}
    standings.update({r: Standing(r, two, IN_REDISTRIBUTE, both) for r in PEERS})
    standings[1] = Standing(1, two, (), {"0": Checked(3, HOUR_MS), "1": Checked(3, HOUR_MS)})
    assert find(records, standings, [1], PEERS, DEADLINE) is None


def _peers_standing_checked(frames, checked) -> dict:
    return {r: Standing(r, dict(WORLD), frames, checked) for r in PEERS}


def test_a_peer_inside_a_collective_under_the_checker_is_left_to_its_deadline():
    """An unfinished collective of the peer's own (it passed the checker's barrier: rank 1 may
    have entered it, async) gives no verdict, whatever the counts say."""
    records, standings = checked_world()
    records.update({r: upto(r, 3, waiting=True, group="") for r in PEERS})
    assert find(records, standings, [1], PEERS, DEADLINE) is None


def test_the_users_call_names_the_collective():
    records, standings = world_of_four()
    standings.update(_peers_standing(WORLD, ((TORCH, 1, "reduce_scatter_tensor"), USER)))
    found = find(records, standings, [1], [0, 2, 3], DEADLINE)
    assert found is not None
    assert "ranks 0, 2, 3 wait in reduce_scatter_tensor #4 at" in found.line(True, DEADLINE)
    assert user_op("reduce_scatter_tensor", "all_reduce") == "reduce_scatter_tensor"
    assert user_op("all_reduce", "all_reduce") == ""  # the recorder's word stands
    assert user_op("broadcast", "all_reduce") == ""  # not an implementation of it
    assert not can_be(None, "all_reduce") and not can_be("barrier", "all_reduce")


# --- gloo's names, measured ---------------------------------------------------------------

ONE, TWO = torch.ones(1), torch.ones(2)  # world 2
CALLS = {
    "all_reduce": lambda r: dist.all_reduce(torch.ones(2)),
    "reduce_scatter_tensor": lambda r: dist.reduce_scatter_tensor(torch.zeros(1), TWO),
    "reduce_scatter": lambda r: dist.reduce_scatter(torch.zeros(1), [ONE, ONE]),
    "all_gather_into_tensor": lambda r: dist.all_gather_into_tensor(torch.zeros(2), ONE),
    "all_gather_object": lambda r: dist.all_gather_object([None, None], r),
    "broadcast_object_list": lambda r: dist.broadcast_object_list([1]),
    "gather_object": lambda r: dist.gather_object(r, [None, None] if r == 0 else None),
    "scatter_object_list": lambda r: dist.scatter_object_list([None], [1, 2] if r == 0 else None),
    "all_to_all_single": lambda r: dist.all_to_all_single(torch.zeros(2), TWO),
    "all_reduce_coalesced": lambda r: dist.all_reduce_coalesced([torch.ones(1), torch.ones(2)]),
    "barrier": lambda r: dist.barrier(),
    "broadcast": lambda r: dist.broadcast(torch.ones(1), 0),
}


def recorded_ops(rank: int, world_size: int) -> dict[str, list[str]]:
    """Each call of ``CALLS`` and the ops torch's recorder wrote for it."""
    from tutorial_impl.testing.diagnose import recorder

    out = {}
    for name, call in CALLS.items():
        before = len(recorder.dump(rank, stacks=False))
        call(rank)
        out[name] = [r.op for r in recorder.dump(rank, stacks=False)[before:]]
    return out


def test_userops_table_is_what_gloo_records(run_ranks):
    """Every call whose recorded ops differ from its name is in the table, with those ops,
    and every call recorded under its own name is not."""
    seen = run_ranks(recorded_ops)[0]
    for name, ops in seen.items():
        assert ops, name
        differ = frozenset(ops) - {name}
        assert IMPLEMENTED_BY.get(name, frozenset()) == differ, (name, ops)


# --- the verdict's words --------------------------------------------------------------------


def finished(outcomes: dict[int, _o.Outcome], **kw) -> Finished:
    reports = {r: _o.Report(o, 100 + r, 1.0) for r, o in outcomes.items()}
    return Finished(len(outcomes), reports, sorted(reports), {}, DEADLINE, **kw)


def test_a_caught_raise_is_named_and_an_uncaught_one_not_twice():
    records, standings = world_of_four()
    stranded = find(records, standings, [1], [0, 2, 3], DEADLINE)
    caught = [Fired(1, "raise", "all_reduce #4")]
    run = finished(
        {0: _o.Stopped(None), 1: _o.Returned("caught")} | {r: _o.Stopped(None) for r in (2, 3)},
        stranded=stranded,
        fired={1: caught},
    )
    with pytest.raises(RankTimeout) as error:
        decide(run)
    assert error.value.headline.endswith(
        "(ended when seen, not at the harness deadline of 60 s) (rank 1: injected raise at "
        "all_reduce #4)"
    )
    assert error.value.pending == [0, 2, 3] and error.value.timeout is None
    # at the deadline: the same line, said so, and the deadline's advice
    run.reports = {r: _o.Report(_o.TimedOut(None), 0, 1.0) for r in (0, 2, 3)} | {1: run.reports[1]}
    with pytest.raises(RankTimeout) as error:
        decide(run)
    assert "seen at the harness deadline of 60 s" in error.value.headline
    assert error.value.timeout == DEADLINE
    # a raise the rank reported: its exception's text says it, the fault is not named again
    message = "injected fault on rank 1 at all_reduce #4: boom"
    raised = _o.Raised("tutorial_impl.testing.faults.InjectedFault", message, "tb")
    run = finished({0: _o.Stopped(None), 1: raised}, fired={1: caught})
    with pytest.raises(Exception) as error:
        decide(run)
    assert error.value.headline == f"rank 1 raised {raised.exc_type}: {message}"


# --- real ranks -----------------------------------------------------------------------------


def three_wait_for_rank_1(rank: int, world_size: int, clock: str) -> float:
    total = torch.ones(1)
    for _ in range(3):
        dist.all_reduce(total)
    if rank == 1:
        Path(clock).write_text(str(time.time()))  # when it returns
    else:
        dist.all_reduce(total)  # ranks 0, 2, 3 wait here
    return total.item()


def test_three_peers_of_a_returned_rank_end_at_once(run_ranks, tmp_path):
    clock = tmp_path / "returned"
    with pytest.raises(RankTimeout) as error:
        run_ranks(three_wait_for_rank_1, str(clock), world_size=4, timeout=30)
    seconds = time.time() - float(clock.read_text())
    assert error.value.headline.startswith(
        "rank 1 returned after all_reduce #3; ranks 0, 2, 3 wait in all_reduce #4 at "
        "test_harness_stranded.py:"
    )
    assert error.value.pending == [0, 2, 3]
    assert seconds < 2.0, seconds  # the bar: from rank 1's return to the verdict


@pytest.mark.check_collectives
def test_under_the_checker_a_peer_of_a_returned_rank_ends_at_once(run_ranks, tmp_path):
    """torch's checker makes rank 0 wait in a barrier before its 4th all_reduce, which no
    record shows: the counts of issued collectives name it, long before the deadline."""
    clock = tmp_path / "returned"
    with pytest.raises(RankTimeout) as error:
        run_ranks(three_wait_for_rank_1, str(clock), world_size=2, timeout=30)
    assert error.value.headline.startswith(
        "rank 1 returned after all_reduce #3; rank 0 waits in all_reduce #4 at "
        "test_harness_stranded.py:"
    )
    assert "(ended when seen, not at the harness deadline of 30 s)" in error.value.headline


def returns_beside_slow_peers(rank: int, world_size: int) -> int:
    """Rank 1 returns at once; ranks 0 and 2 meet in a subgroup rank 1 is not in, rank 2
    late; rank 3 is late to the whole world's all_reduce, which rank 1 had entered."""
    total = torch.ones(1)
    work = dist.all_reduce(total, async_op=True)  # every rank entered it
    pair = dist.new_group([0, 2])
    if rank == 1:
        return 1
    if rank in (0, 2):
        time.sleep(1.0 if rank == 2 else 0.0)  # three looks at least (``stranded.POLL``)
        dist.all_reduce(torch.ones(1), group=pair)
    if rank == 3:
        time.sleep(1.0)
    work.wait()
    return int(total.item())


def test_a_returned_rank_beside_slow_peers_passes(run_ranks):
    assert run_ranks(returns_beside_slow_peers, world_size=4, timeout=30) == [4, 1, 4, 4]


def test_the_parent_looks_only_while_a_rank_has_returned_and_at_its_pace(monkeypatch):
    """``supervise``'s looks: none before a rank returns (a passing test pays nothing), the
    first ``POLL`` s after, then one every ``POLL`` s."""
    from types import SimpleNamespace

    from tutorial_impl.testing.diagnose.stranded import POLL
    from tutorial_impl.testing.strategies import supervise

    now = [100.0]
    asked: list[float] = []
    monkeypatch.setattr(supervise, "time", SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(
        supervise.records, "ask_all", lambda procs: (asked.append(now[0]), ({}, {}))[1]
    )
    watch = supervise._Watch([], None, False, frozenset(), timeout=DEADLINE)
    watch.pending = {0: None}
    assert not watch.stranded() and not asked  # no rank has returned
    watch.reports[1] = _o.Report(_o.Returned(1), 101, 1.0)
    watch.order.append(1)
    for step in (0.0, POLL / 2, POLL / 2, POLL / 2, POLL / 2, POLL):
        now[0] += step
        assert not watch.stranded()  # no records: nothing is stranded
    assert asked == pytest.approx([100.0 + POLL, 100.0 + 2 * POLL, 100.0 + 3 * POLL])


def test_a_torchrun_worker_looks_at_the_returned_ranks_answers(monkeypatch):
    """``strategies.torchrun.stranded.Look`` of rank 0, over a job's store faked in memory:
    stranded by
    rank 1's answer only once rank 1 has returned behind rank 0's collective, looked at
    every ``POLL`` s."""
    from types import SimpleNamespace

    from tutorial_impl.testing.diagnose.stranded import POLL
    from tutorial_impl.testing.strategies.torchrun import stranded as torchrun_stranded

    records, standings = world_of_four()
    now = [0.0]
    store: dict[str, object] = {}
    channel = SimpleNamespace(has=lambda key: key in store, get=lambda key: store[key])
    job = SimpleNamespace(channel=channel, launch=SimpleNamespace(rank=0, world_size=4))
    monkeypatch.setattr(torchrun_stranded, "time", SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(torchrun_stranded.records, "own", lambda rank, since: records[0])
    monkeypatch.setattr(torchrun_stranded, "standing", lambda thread, stop: standings[0])
    look = torchrun_stranded.Look(job, "call/1", 0, 1, DEADLINE, "rank_function")

    def answer(outcome: _o.Outcome, recs: list[Record]) -> SimpleNamespace:
        report = _o.Report(outcome, 1, 1.0)
        return SimpleNamespace(report=report, records=recs, standing=standings[1])

    store["call/1/1"] = answer(_o.Returned(1), records[1])
    now[0] = POLL / 2
    assert not look.stranded()  # not looked at yet: a passing test's ranks end before
    del store["call/1/1"]
    store["call/1/2"] = answer(_o.Stopped(None), records[2])  # not returned: no matter
    now[0] = POLL
    assert not look.stranded()  # no rank has returned
    store["call/1/1"] = answer(_o.Returned(1), upto(1, 4))  # it entered #4
    now[0] = 2 * POLL
    assert not look.stranded()
    store["call/1/1"] = answer(_o.Returned(1), records[1])  # after #3 only
    now[0] = 2.5 * POLL
    assert not look.stranded()  # not yet looked at again
    now[0] = 3 * POLL
    assert look.stranded()
    # and the verdict from every rank's answer, the same on every rank
    answers = {r: answer(_o.Stopped(None), records[r]) for r in (0, 2, 3)}
    answers[1] = store["call/1/1"]
    for r in (0, 2, 3):
        answers[r].standing = standings[r]
    found = torchrun_stranded.of_answers(answers, DEADLINE)
    assert found is not None and sorted(found.waiting) == [0, 2, 3] and list(found.left) == [1]


def test_a_hang_at_the_deadline_names_the_users_call():
    """``desync.placed``: a waiting rank's unfinished record named by its stack's call where
    torch implements that call with the recorded op; never where it does not."""
    from tutorial_impl.testing.diagnose import desync
    from tutorial_impl.testing.diagnose.stacks import Place

    records = {0: upto(0, 1, waiting=True), 1: []}
    where = {0: Place("test_x.py", 9, "f", "reduce_scatter_tensor")}
    assert desync.explain(desync.placed(records, where), 2) == (
        "rank 0 waits in reduce_scatter_tensor #1 at test_x.py:9; rank 1 never reached #1"
    )
    where = {0: Place("test_x.py", 9, "f", "broadcast")}  # no implementation of all_reduce
    assert desync.explain(desync.placed(records, where), 2) == (
        "rank 0 waits in all_reduce #1 at test_x.py:9; rank 1 never reached #1"
    )
