"""Faults on purpose (``faults``, ``faulty_group``).

Read in order: the plan is checked, field by field, and travels through the environment;
the injector counts and fires deterministically (in this process, no ranks); then real
ranks, each run folding several claims: every path a collective comes from reaches the
faulty group (direct, DDP's buckets, a functional collective, DTensor), a delay is
survived, ``Close`` breaks the group on every rank; a raise at the third all_reduce, and
one inside a DDP bucket, are the verdict's first line; a SIGKILL at the second is seen by
the peer at once. Each rank function builds its own group (``backend=None``).
"""

from __future__ import annotations

import re
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tutorial_impl.testing import RankExited, RankFailed, faults, faulty_group
from tutorial_impl.testing.faults import Close, Delay, Exit, Fault, Hang, Kill, Point, Raise

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
        faults.check_plan(plan, world_size=2)
    assert faults.check_plan(plan, world_size=3) == plan


def test_a_plan_travels_through_the_environment_and_bad_text_is_refused():
    plan = (
        Fault({1}, Raise("boom"), at=3, op="all_reduce", group="default_pg"),
        Fault({0, 2}, Delay(0.5), step="after_backward", at=2),
        Fault(1, Exit(7)),
        Fault(3, Close(), op="barrier"),
    )
    assert faults.decode(faults.encode(plan)) == plan
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
            faults.decode(text)


# --- the injector: counted, deterministic, once ----------------------------------------------


def test_faults_count_only_their_points_and_fire_once(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
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
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: acted.append(("kill", sig)))
    monkeypatch.setattr(faults.os, "_exit", lambda code: acted.append(("exit", code)))
    monkeypatch.setattr(faults, "hang", lambda: acted.append("hang"))
    monkeypatch.setattr(faults, "close_sockets", lambda socks: acted.append(("close", socks)))
    injector.sockets.append((99, "socket:[1]"))
    for action in (Kill(), Exit(3), Hang(), Close()):
        injector.arm((Fault(0, action),), rank=0)
        injector.reached(Point("barrier", 1))
    assert acted == [("kill", 9), ("exit", 3), "hang", ("close", [(99, "socket:[1]")])]


# --- real ranks ------------------------------------------------------------------------------


def join(rank: int, world_size: int, plan: faults.Plan) -> None:
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
        "cut": cut,
    }


def test_every_path_reaches_the_faulty_group(run_ranks):
    results = run_ranks(every_path, backend=None, timeout=30)
    for out in results:
        assert out["ddp"][0] == 2 * out["ddp"][1] >= 4  # every bucket's all_reduce, each step
        assert out["dtensor"] == ([0.0, 1.0, 2.0, 3.0], "all_gather_into_tensor_coalesced")
        assert "Connection closed by peer" in out["cut"] or "reset by peer" in out["cut"]
    assert results[1]["fired"] == ["all_reduce #3", "fault_point('cut') #1"]
    assert results[0]["fired"] == [] and results[0]["waited"] >= 0.25  # delayed, survived


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
    # The loop's third all_reduce is its group's #3; DDP's comes after its own broadcasts.
    assert re.fullmatch(
        r"rank 1 raised tutorial_impl\.testing\.faults\.InjectedFault: injected fault on "
        r"rank 1 at all_reduce #(\d+): boom",
        error.headline,
    )[1] == ("3" if where == "loop" else "8")
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
