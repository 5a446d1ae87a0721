"""Faults on purpose (``faults.plan``, ``faults``, ``faults.group``) and the flight recorder's
records read as one line (``recorder``, ``desync``).

Read in order: the plan is checked, field by field, and travels through the environment;
the injector counts and fires deterministically (in this process, no ranks); the one-line
explanation of hand-built records; then real ranks, each run folding several claims: every
path a collective comes from reaches the faulty group (direct, DDP's buckets, a functional
collective, DTensor), a delay is survived, ``Close`` breaks the group on every rank, and the
records of a real two-rank desync explain it; a raise at the third all_reduce, and one inside
a DDP bucket, are the verdict's first line; a SIGKILL at the second is seen by the peer at
once. Each rank function builds its own group (``backend=None``).
"""

from __future__ import annotations

import re
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tutorial_impl.testing import RankExited, RankFailed
from tutorial_impl.testing.diagnose import desync, recorder
from tutorial_impl.testing.diagnose.recorder import Record
from tutorial_impl.testing.faults import group as faulty_group
from tutorial_impl.testing.faults import inject as faults
from tutorial_impl.testing.faults import plan as fault_plan
from tutorial_impl.testing.faults.plan import Close, Delay, Exit, Fault, Hang, Kill, Point, Raise

GROUP_TIMEOUT = timedelta(seconds=30)  # far above what any run here needs

# --- the plan: checked, encoded, decoded ---------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"ranks": set(), "action": Kill()}, "ranks are integers"),
        ({"ranks": {-1}, "action": Kill()}, "ranks are integers"),
        ({"ranks": "1", "action": Kill()}, "a rank or a collection"),
        ({"ranks": {1}, "action": "kill"}, "Fault(action): one of Kill"),
        ({"ranks": {1}, "action": Kill(), "at": 0}, "Fault(at)"),
        ({"ranks": {1}, "action": Kill(), "at": True}, "Fault(at)"),
        ({"ranks": {1}, "action": Kill(), "op": "allreduce"}, "Fault(op): one of all_gather"),
        ({"ranks": {1}, "action": Kill(), "step": ""}, "Fault(step): a non-empty str"),
        ({"ranks": {1}, "action": Kill(), "step": "s", "op": "barrier"}, "takes no op"),
    ],
)
def test_a_bad_fault_is_refused_naming_the_field(kwargs, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        Fault(**kwargs)


def test_bad_actions_and_ranks_outside_the_world_are_refused():
    for make, words in [
        (lambda: Exit(256), "Exit(code)"),
        (lambda: Delay(0), "Delay(seconds)"),
        (lambda: Delay(float("inf")), "Delay(seconds)"),
        (lambda: Raise(3), "Raise(message)"),  # type: ignore[arg-type]
    ]:
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            make()
    plan = (Fault(0, Kill()), Fault({1, 2}, Hang(), at=3))
    with pytest.raises(ValueError, match=r"fault 1 \(hang on rank\(s\) 1, 2 at collective #3\) "):
        fault_plan.check_plan(plan, world_size=2)
    assert fault_plan.check_plan(plan, world_size=3) == plan


def test_a_plan_travels_through_the_environment_and_bad_text_is_refused():
    plan = (
        Fault({1}, Raise("boom"), at=3, op="all_reduce", group="default_pg"),
        Fault({0, 2}, Delay(0.5), step="after_backward", at=2),
        Fault(1, Exit(7)),
        Fault(3, Close(), op="barrier"),
    )
    assert fault_plan.decode(fault_plan.encode(plan)) == plan
    for text, words in [
        ("nope", "not JSON"),
        ('{"ranks": [1]}', "a JSON list of faults"),
        ('[{"ranks": [1], "action": "explode"}]', "fault 0: unknown action 'explode'"),
        ('[{"ranks": [1], "action": "kill", "seconds": 1}]', r"unknown field\(s\) \['seconds'\]"),
        ('[{"ranks": 1, "action": "kill"}]', "ranks are a JSON list"),
        ('[{"ranks": [1], "action": "delay"}]', "fault 0: .*seconds"),
        ('[{"ranks": [1], "action": "kill", "at": 0}]', r"fault 0: Fault\(at\)"),
    ]:
        with pytest.raises(ValueError, match=words):
            fault_plan.decode(text)


# --- the injector: counted, deterministic, once ----------------------------------------------


def test_faults_count_only_their_points_and_fire_once(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(faults, "delay", slept.append)
    injector = faults.Injector()
    injector.arm(
        (
            Fault(1, Delay(0.25), at=2, op="broadcast"),
            Fault(1, Delay(0.5), at=2, group="mysub"),
            Fault(0, Delay(9.0)),  # another rank's: never counted here
            Fault(1, Delay(1.0), step="after_backward", at=2),
        ),
        rank=1,
        world_size=2,
    )
    points = [
        Point("all_reduce", 1, "0", "default_pg"),
        Point("broadcast", 2, "0", "default_pg"),
        Point("all_reduce", 1, "1", "mysub"),
        Point("broadcast", 3, "0", "default_pg"),  # the 2nd broadcast: fires
        Point("broadcast", 2, "1", "mysub"),  # the 2nd on mysub: fires
        Point("broadcast", 4, "0", "default_pg"),  # the 3rd broadcast: nothing, once only
    ]
    for point in points:
        injector.reached(point)
    injector.step("after_backward")
    injector.step("after_backward")
    injector.step("after_backward")
    assert slept == [0.25, 0.5, 1.0]
    assert [str(p) for _, p in injector.fired] == [
        "broadcast #3",
        "broadcast #2 on group 1 (mysub)",
        "fault_point('after_backward') #2",
    ]
    assert len(injector.history) == 9


def test_raise_names_rank_and_point_and_kill_exit_hang_close_act(monkeypatch):
    injector = faults.Injector()
    injector.arm((Fault(1, Raise("boom"), at=2),), rank=1)
    injector.reached(Point("all_reduce", 1, "0", "default_pg"))
    with pytest.raises(faults.InjectedFault, match=r"rank 1 at all_reduce #2: boom$"):
        injector.reached(Point("all_reduce", 2, "0", "default_pg"))
    acted: list[object] = []
    monkeypatch.setattr(faults, "kill_self", lambda: acted.append("kill"))
    monkeypatch.setattr(faults, "exit_now", lambda code: acted.append(("exit", code)))
    monkeypatch.setattr(faults, "close_sockets", lambda socks: acted.append(("close", socks)))
    injector.sockets.append((99, "socket:[1]"))
    for action in (Kill(), Exit(3), Close()):
        injector.arm((Fault(0, action),), rank=0)
        injector.reached(Point("barrier", 1))
    assert acted == ["kill", ("exit", 3), ("close", [(99, "socket:[1]")])]
    # A hang sleeps until its call is over (the next arming releases it), then raises: a
    # torchrun worker, which outlives the call, must not keep a thread inside the group.
    injector.arm((Fault(0, Hang()),), rank=0)
    caught: list[BaseException] = []

    def hung() -> None:
        try:
            injector.reached(Point("barrier", 1))
        except faults.InjectedFault as exc:
            caught.append(exc)

    thread = threading.Thread(target=hung)
    thread.start()
    thread.join(0.2)
    assert thread.is_alive() and not caught  # hanging
    injector.arm((), rank=0)
    thread.join(5)
    assert not thread.is_alive()
    assert "hung until its call was over" in str(caught[0])


# --- one line from every rank's records (hand-built) -----------------------------------------


def rec(rank, seq, op="all_reduce", sizes=((4,),), dtypes=("Float",), done=True, **kw):
    group, desc = kw.get("group", ("0", "default_pg"))
    frames = kw.get("frames", ())
    return Record(rank, group, desc, seq, op, False, sizes, dtypes, sizes, dtypes, "scheduled",
                  done, frames)  # fmt: skip


def test_the_explanation_names_the_rank_behind_and_where_the_others_wait():
    calls = [("/x/site-packages/torch/distributed/distributed_c10d.py", 3245, "all_reduce")]
    user = [*calls, ("/tests/test_x.py", 12, "train")]
    records = {
        0: [rec(0, 16), rec(0, 17, done=False, frames=user)],
        1: [rec(1, 16)],
        2: [rec(2, 16), rec(2, 17, done=False)],
    }
    assert desync.explain(records) == (
        "ranks 0, 2 wait in all_reduce #17 at test_x.py:12; rank 1 never reached #17 "
        "(its last: all_reduce #16)"
    )
    assert desync.explain(records, world_size=4).endswith(
        "; rank 3 left no record (a killed rank dumps nothing)"
    )


def test_the_explanation_names_different_collectives_and_different_inputs():
    different = {r: [rec(r, 5), rec(r, 6, done=False)] for r in (0, 2, 3)}
    different[1] = [rec(1, 5), rec(1, 6, op="broadcast", done=False)]
    assert desync.explain(different) == (
        "ranks 0, 2, 3 wait in all_reduce #6; rank 1 waits in broadcast #6: "
        "the ranks are in different collectives"
    )
    sizes = {0: [rec(0, 1, done=False)], 1: [rec(1, 1, sizes=((5,),), dtypes=("Half",))]}
    assert desync.explain(sizes) == (
        "ranks 0, 1 are in all_reduce #1 with different inputs: rank 0 [4] Float, rank 1 [5] Half"
    )


def test_the_explanation_of_agreement_a_shared_hang_subgroups_and_a_short_memory():
    agree = {r: [rec(r, 1), rec(r, 2, op="broadcast")] for r in (0, 1)}
    assert desync.explain(agree) is None
    stuck = {r: [rec(r, 1), rec(r, 2, done=False)] for r in (0, 1)}
    assert desync.explain(stuck) == (
        "ranks 0, 1 wait in all_reduce #2: every rank reached it (the hang is inside the "
        "collective)"
    )
    sub = ("1", "mysub")
    parted = {r: [rec(r, 1), rec(r, 1, group=sub, done=r == 1)] for r in (0, 1)}
    parted[1].pop()  # rank 1 never reached the subgroup's first collective
    # Who else is in group 1? The records cannot say: only where rank 0 waits.
    assert desync.explain(parted) == "rank 0 waits in all_reduce #1 on group 1 (mysub)"
    assert desync.explain(parted, members={"1": [0, 1]}) == (
        "rank 0 waits in all_reduce #1 on group 1 (mysub); rank 1 never reached #1"
    )
    # Rank 0's recorder kept only #3 on: #1 and #2 are not compared (rank 1's #1 differs).
    short = {0: [rec(0, 3)], 1: [rec(1, 1, op="broadcast"), rec(1, 2), rec(1, 3)]}
    assert desync.explain(short) is None


# --- real ranks ------------------------------------------------------------------------------


def join(rank: int, world_size: int, plan: fault_plan.Plan) -> None:
    recorder.enable()  # on by default in torch 2.13; here before the rank's first group
    faulty_group.init_process_group(rank, world_size, plan, timeout=GROUP_TIMEOUT)


def ddp_steps(steps: int) -> tuple[int, int]:
    """A tiny DDP model, one step to settle its buckets, then ``steps`` counted: how many
    all_reduces the faulty group saw in those, and how many buckets DDP made."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0001)
    ddp(torch.randn(3, 8)).sum().backward()  # DDP rebuilds its buckets after the first
    before = len(faults.INJECTOR.history)
    for _ in range(steps):
        ddp(torch.randn(3, 8)).sum().backward()
    seen = list(faults.INJECTOR.history)[before:]
    buckets = ddp._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(",")
    return sum(p.op == "all_reduce" for p in seen), len(buckets)


def settled_records(rank: int) -> list[Record]:
    """The recorder's records once every one is marked done: gloo's worker thread marks a
    work done (retired) a moment after the caller has its result (10 s at the most)."""
    stop = time.monotonic() + 10.0
    records = recorder.dump(rank, stacks=False)  # with stacks, a first dump imports inductor
    while not all(r.completed for r in records) and time.monotonic() < stop:
        time.sleep(0.01)
        records = recorder.dump(rank, stacks=False)
    return records


def every_path(rank: int, world_size: int) -> dict[str, object]:
    """Direct, functional, DDP and DTensor collectives, a delay on rank 1 inside the
    functional all_reduce (#3), then ``Close`` on rank 1 at a step."""
    import torch.distributed._functional_collectives as fc
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    join(rank, world_size, (Fault(1, Delay(0.3), at=3), Fault(1, Close(), step="cut")))
    dist.all_reduce(torch.ones(2))
    dist.broadcast(torch.ones(2), 0)
    started = time.monotonic()
    fc.wait_tensor(fc.all_reduce(torch.ones(2), "sum", dist.group.WORLD))
    waited = time.monotonic() - started
    ddp_all_reduces, buckets = ddp_steps(steps=2)
    mesh = init_device_mesh("cpu", (world_size,))
    whole = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)]).redistribute(mesh, [Replicate()])
    records = settled_records(rank)
    ops = [p.op for p in faults.INJECTOR.history]
    faults.fault_point("cut")
    try:
        dist.all_reduce(torch.ones(2))
        cut = "no error"
    except RuntimeError as exc:
        cut = str(exc)
    return {
        "waited": waited,
        "fired": [str(p) for _, p in faults.INJECTOR.fired],
        "ddp": (ddp_all_reduces, buckets),
        "dtensor": (whole.to_local().tolist(), ops[-1]),
        "records": records,
        "seqs": [p.seq for p in faults.INJECTOR.history if p.op not in fault_plan.P2P][
            : len(records)
        ],
        "cut": cut,
    }


def test_every_path_reaches_the_faulty_group(run_ranks):
    results = run_ranks(every_path, backend=None, timeout=30)
    for out in results:
        assert out["ddp"][0] == 2 * out["ddp"][1] >= 4  # every bucket's all_reduce, each step
        assert out["dtensor"] == ([0.0, 1.0, 2.0, 3.0], "all_gather_into_tensor_coalesced")
        assert "Connection closed by peer" in out["cut"] or "reset by peer" in out["cut"]
        records = out["records"]
        assert [r.op for r in records[:3]] == ["all_reduce", "broadcast", "all_reduce"]
        assert [r.seq for r in records] == out["seqs"]  # our numbers are the recorder's
        assert all(r.completed and r.group_desc == "default_pg" for r in records)
    assert results[1]["fired"] == ["all_reduce #3", "fault_point('cut') #1"]
    assert results[0]["fired"] == [] and results[0]["waited"] >= 0.25  # delayed, survived
    assert desync.explain({r: out["records"] for r, out in enumerate(results)}) is None


def behind_at_the_third(rank: int, world_size: int) -> list[Record]:
    """Rank 1 raises at all_reduce #3 and catches it; rank 0 waits in #3 (asynchronously)
    and dumps its records there; then rank 1 joins #3 late, so the run ends well."""
    join(rank, world_size, (Fault(1, Raise("late"), at=3),))
    store = dist.distributed_c10d._get_default_store()
    for _ in range(2):
        dist.all_reduce(torch.ones(2))
    if rank == 0:
        work = dist.all_reduce(torch.ones(2), async_op=True)
        records = recorder.dump(rank)
        store.set("dumped", "1")
        work.wait()
        return records
    with pytest.raises(faults.InjectedFault):
        dist.all_reduce(torch.ones(2))
    records = recorder.dump(rank)
    store.wait(["dumped"])
    dist.all_reduce(torch.ones(2))
    return records


def test_the_records_of_a_real_run_say_which_rank_is_behind(run_ranks):
    records = run_ranks(behind_at_the_third, backend=None, timeout=30)
    line = desync.explain(dict(enumerate(records)))
    assert re.fullmatch(
        r"rank 0 waits in all_reduce #3 at test_harness_faults.py:\d+; "
        r"rank 1 never reached #3 \(its last: all_reduce #2\)",
        line or "",
    ), line


def raise_at(rank: int, world_size: int, where: str) -> None:
    """Rank 1 raises at the third all_reduce: of a plain loop, or of DDP's buckets."""
    join(rank, world_size, (Fault(1, Raise("boom"), at=3, op="all_reduce"),))
    if where == "loop":
        for _ in range(5):
            dist.all_reduce(torch.ones(2))
    else:
        ddp_steps(steps=2)


@pytest.mark.parametrize("where", ["loop", "ddp"])
def test_a_raised_fault_is_the_first_line_of_the_verdict(run_ranks, where):
    with pytest.raises(RankFailed) as caught:
        run_ranks(raise_at, where, backend=None, timeout=30)
    error = caught.value
    assert error.rank == 1
    seq = re.fullmatch(
        r"rank 1 raised tutorial_impl\.testing\.faults\.InjectedFault: injected fault on "
        r"rank 1 at all_reduce #(\d+): boom",
        error.headline,
    )[1]
    # The loop's third all_reduce is its group's #3; DDP's come after DDP's own broadcasts.
    assert int(seq) == 3 if where == "loop" else int(seq) > 3
    if where == "ddp":  # raised in a bucket's all_reduce, through DDP's C++ reducer
        assert "backward()" in error.traceback and "ddp_steps" in error.traceback


def killed_at_the_second(rank: int, world_size: int) -> tuple[str, float]:
    join(rank, world_size, (Fault(1, Kill(), at=2),))
    dist.all_reduce(torch.ones(2))
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(2))
    except RuntimeError as exc:
        return str(exc), time.monotonic() - started
    return "no error", time.monotonic() - started


def test_a_killed_rank_is_seen_by_its_peer_at_once(run_ranks):
    results = run_ranks(killed_at_the_second, backend=None, may_exit={1}, timeout=30)
    message, seconds = results[0]
    assert "Connection closed by peer" in message or "reset by peer" in message
    assert seconds < 5.0  # at once: not at the group's timeout (30 s) nor the deadline
    assert isinstance(results[1], RankExited) and results[1].exitcode == -9


def test_run_ranks_refuses_a_bad_faults_option_before_any_rank_starts():
    """``faults=`` is checked in ``call.build``: a word, a bare action, a rank the world does
    not have are each refused by name; one Fault alone is a plan of one."""
    from tutorial_impl.testing import call

    for plan, words in [
        ("kill", "faults must be a Fault or a collection"),
        ([Kill()], "fault 0 of the plan is not a Fault"),
        ([Fault(5, Kill())], r"names rank\(s\) \[5\], not ranks of a world of 2"),
    ]:
        with pytest.raises(ValueError, match=words):
            call.build(join, ((),), faults=plan)
    assert call.build(join, ((),), faults=Fault(1, Kill())).faults == (Fault(1, Kill()),)
    # Under torchrun rank 0 reports for the job: a kill there would leave no one to report
    # it, so it is refused by name before anything runs; elsewhere it runs, and an exit on
    # rank 0 ends only its function (conformance case c27e).
    from tutorial_impl.testing.strategies.torchrun.worker import reporter_killed

    for plan in (Fault(0, Kill()), [Fault(1, Raise()), Fault({0, 1}, Kill())]):
        refusal = reporter_killed(call.build(join, ((),), faults=plan))
        assert refusal and "a kill on rank 0" in refusal, plan
    for plan in (Fault(1, Kill()), Fault(0, Hang()), Fault(0, Raise()), Fault(0, Exit(3))):
        assert reporter_killed(call.build(join, ((),), faults=plan)) is None, plan


def test_the_parent_closes_the_fault_file_it_reads(tmp_path):
    """``read_fired``/``read_unfired`` close the rank's fault file themselves: left to the
    GC, its ResourceWarning fails every test in which a fault fired under ``-W error``."""
    path = tmp_path / "rank1.fault"
    report = faults.fired(1, Fault(1, Delay(0.1)), Point("all_reduce", 1, "0", "default_pg"))
    faults._append(str(path), report)
    import gc
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert faults.read_fired(path) == [report]
        assert faults.read_unfired(path) == []
        gc.collect()
    assert [w for w in seen if issubclass(w.category, ResourceWarning)] == []
    assert faults.read_fired(tmp_path / "none") == []


def test_the_guides_module_names_import_as_it_says():
    """docs/faults.md names ``faulty_group.X`` and ``fault_plan.X``: its own import line
    gives both, and every attribute it names of them exists."""
    from pathlib import Path

    guide = (Path(__file__).parents[3] / "docs" / "faults.md").read_text()
    line = next(x for x in guide.splitlines() if "as faulty_group" in x and "import" in x)
    names: dict[str, object] = {}
    exec(line, names)  # noqa: S102 - the guide's own line
    assert names["faulty_group"] is faulty_group and names["fault_plan"] is fault_plan
    named = set(re.findall(r"\b(faulty_group|fault_plan)\.([A-Za-z_]\w*)", guide))
    assert len(named) >= 5
    missing = [f"{m}.{a}" for m, a in sorted(named) if not hasattr(names[m], a)]
    assert missing == []


def test_after_its_close_a_groups_collectives_fail_at_once(monkeypatch):
    """After this rank's ``Close`` the faulty groups made before it fail each collective at
    once, before gloo (handed to gloo, rank 1's next collective once waited out the group's
    timeout); a group made after it is untouched."""
    from types import SimpleNamespace

    monkeypatch.setattr(faults, "close_sockets", lambda sockets: 0)
    injector = faults.Injector()
    monkeypatch.setattr(faults, "INJECTOR", injector)
    injector.arm((Fault(1, Close(), step="cut"),), rank=1, world_size=2)
    called: list[str] = []
    plain = SimpleNamespace(allreduce=lambda *a: called.append("gloo") or "work")
    old = SimpleNamespace(_born=injector.closes, _names=("0", "default_pg"), _plain=plain)
    old._reached = lambda op, p2p: None
    intercept = faulty_group._intercept("allreduce", "all_reduce")
    assert intercept(old) == "work" and called == ["gloo"]
    injector.step("cut")  # the Close fires
    with pytest.raises(dist.DistBackendError, match="^Connection closed by peer: .* group 0"):
        intercept(old)
    assert called == ["gloo"]  # never handed to gloo
    new = SimpleNamespace(_born=injector.closes, _names=("1", "x"), _plain=plain)
    new._reached = old._reached
    assert intercept(new) == "work" and called == ["gloo", "gloo"]
