"""T8. Failure (``tutorial_impl/dist_tuto/failure.py``): what the other ranks see, and when.

The tutorial's programs assume every rank lives and calls the same collectives with the
same tensors. Here each assumption is broken on purpose, on gloo, and what torch 2.13 does
is measured. Every failure here ends, at once or at a timeout; none waits forever:

1. ``peers_of_a_killed_rank``: rank 1 of three is killed (SIGKILL) as it calls its second
   all_reduce. The two others, already inside theirs, raise ``RuntimeError: [...pair.cc]
   Read error ...: Connection reset by peer`` (or ``Connection closed by peer ...``: see
   ``PEER_GONE``) at once (asserted: under ``AT_ONCE``, 5 s, room for a loaded machine):
   the kernel closes a dead process's sockets, and gloo notices, long before the group's
   timeout (60 s here).
2. ``caller_of_a_killed_worker``: the same in an RPC world. The caller's ``rpc_sync`` raises
   ``RuntimeError: eof (this error originated at tensorpipe/transport/shm/...)`` at once,
   not at the RPC timeout (20 s here); every later call to that worker too.
3. ``sizes_that_disagree``: a receive into a buffer larger than the message returns
   silently, the buffer's tail untouched: a partial result no one reports. A message larger
   than the buffer aborts the receiving process (SIGABRT: gloo's "Received data size
   doesn't match expected size. Is there a distributed collective mismatch in your
   code?"), and the sender's next call raises "Connection reset by peer".
4. ``waits_without_a_partner``: a collective nobody answers ends at the group's
   ``timeout`` (30 minutes by default on gloo; 1.5 s here): one extra all_reduce raises
   "Timed out waiting 1500ms for recv operation to complete", a ring of blocking sends
   (each rank sends before it receives) "... for send operation to complete" (or, on a rank
   a moment behind, the connection its peer dropped as it timed out). Then the
   tools that say why: ``dist.monitored_barrier`` names the rank that did not arrive;
   ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` catches different sizes at the call, on every rank;
   the flight recorder's dumps, read by torch's analyzer
   (``python -m torch.distributed.flight_recorder.fr_trace DIR``) and by this project's
   ``desync.explain``, name the collective and the rank missing from it.

Rank functions make their own groups (``run_ranks(..., backend=None)``); a rank meant to
die is named in ``may_exit``, so the harness lets the others finish and report.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch.distributed.flight_recorder import fr_trace

from tutorial_impl.dist_tuto import failure
from tutorial_impl.dist_tuto.failure import what_it_raises
from tutorial_impl.rpc.workers import init_worker
from tutorial_impl.testing import RankExited, run_ranks
from tutorial_impl.testing.diagnose import desync, recorder
from tutorial_impl.testing.faults import group as faulty_group
from tutorial_impl.testing.faults.plan import Fault, Kill

GROUP_TIMEOUT = timedelta(seconds=60)  # far above what any run here needs
RPC_TIMEOUT = 20.0  # the course's default (tutorial_impl/rpc/workers.py)
AT_ONCE = 5.0  # seconds: "at once" with room for a busy machine, far below either timeout
TIMEOUT = timedelta(seconds=1.5)  # the group of part 4: its waits end here
WAIT = timedelta(seconds=20)  # a rank that waits for another's signal gives up after this
FR_LOGGER = "Flight Recorder"  # the logger torch's analyzer writes its findings to
# What gloo raises when a peer dropped the connection: its process died (the kernel closed its
# sockets), or its own wait timed out.
# In two wordings: "reset" when data sent to the dead process was still unread (its kernel
# answers with a reset), "closed" when not (an orderly end of stream): a matter of timing.
PEER_GONE = (
    r"RuntimeError: \[\S+/pair\.cc:\d+\] "
    r"(Read error \S+: Connection reset by peer|Connection closed by peer \S+)\. "
    r"This is typically caused by a remote worker"
)
# What gloo raises when a wait of TIMEOUT (1.5 s) ends with no partner: for a recv or a send.
TIMED_OUT = (
    r"RuntimeError: \[\S+unbound_buffer\.cc:\d+\] Timed out waiting 1500ms for {} operation "
    r"to complete"
)

# --- 1. A rank killed inside an all_reduce -----------------------------------------------


def peers_of_a_killed_rank(rank: int, world_size: int) -> tuple[str, float]:
    """Rank 1 is SIGKILLed as it calls its second all_reduce (a fault the ``faulty`` gloo
    group fires, deterministically); the others are inside theirs and say what they saw."""
    plan = (Fault(ranks={1}, action=Kill(), at=2, op="all_reduce"),)
    faulty_group.init_process_group(rank, world_size, plan, timeout=GROUP_TIMEOUT)
    dist.all_reduce(torch.ones(2))  # every rank is alive for the first
    return what_it_raises(dist.all_reduce, torch.ones(2))


def test_a_killed_rank_is_an_error_at_once_on_every_other_rank(run_ranks):
    results = run_ranks(peers_of_a_killed_rank, world_size=3, backend=None, may_exit={1})
    assert isinstance(results[1], RankExited) and results[1].exitcode == -signal.SIGKILL
    for rank in (0, 2):
        error, seconds = results[rank]
        # Every survivor raises, naming the lost connection, not the collective or the rank.
        assert re.match(PEER_GONE, error), error
        # ... and at once: not at the group's 60 s timeout.
        assert seconds < AT_ONCE


# --- 2. A worker killed inside an RPC ----------------------------------------------------


def die_now() -> None:
    """Runs on the callee: its process dies mid-call, as a machine that fails would."""
    os.kill(os.getpid(), signal.SIGKILL)


def caller_of_a_killed_worker(rank: int, world_size: int) -> dict:
    init_worker(rank, world_size, rpc_timeout=RPC_TIMEOUT)
    if rank == 1:
        time.sleep(RPC_TIMEOUT)  # serve calls until one of them kills this process
        return {}
    report = {
        "dying": what_it_raises(rpc.rpc_sync, "worker1", die_now),
        "after": what_it_raises(rpc.rpc_sync, "worker1", os.getpid),
    }
    rpc.shutdown(graceful=False)  # a graceful shutdown waits for every worker: not the dead
    return report


# torch's own RPC transports, shared memory included (this suite's ranks otherwise run RPC
# over TCP only: tests/rpc_over_tcp.py): the words below are what a learner's run prints.
TORCH_TRANSPORTS = {"TUTORIAL_SUITE_TORCH_RPC_TRANSPORTS": "1"}


def test_a_killed_rpc_worker_is_an_error_at_once_for_its_caller(run_ranks):
    results = run_ranks(
        caller_of_a_killed_worker, backend=None, may_exit={1}, timeout=40, env=TORCH_TRANSPORTS
    )
    assert isinstance(results[1], RankExited) and results[1].exitcode == -signal.SIGKILL
    for call in ("dying", "after"):
        error, seconds = results[0][call]
        # TensorPipe's words: the connection ended (shm: both workers on one machine).
        assert re.fullmatch(r"RuntimeError: eof \(this error originated at tensorpipe/.*\)", error)
        assert seconds < AT_ONCE  # at once, not at the 20 s RPC timeout


# --- 3. Sizes that disagree ----------------------------------------------------------------


def sizes_that_disagree(rank: int, world_size: int) -> tuple[str, float] | None:
    """Rank 1 receives twice into 6 floats; rank 0 sends 5 floats, then 7."""
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT)
    if rank == 0:
        dist.send(torch.arange(1.0, 6.0), dst=1)  # [1, ..., 5]: fewer than rank 1 expects

        def send_too_much_then_go_on() -> None:
            dist.send(torch.arange(1.0, 8.0), dst=1)  # 7 floats into rank 1's 6
            dist.all_reduce(torch.ones(1))

        return what_it_raises(send_too_much_then_go_on)
    buffer = torch.zeros(6)
    dist.recv(buffer, src=0)
    print(f"rank 1 received {buffer.tolist()}", flush=True)  # no error: let us look
    dist.recv(buffer, src=0)  # gloo aborts this process here
    return None


def test_sizes_that_disagree_pass_silently_or_abort_the_receiver(run_ranks):
    results = run_ranks(sizes_that_disagree, backend=None, may_exit={1})
    # Five floats into six: the receive returned, and only the last element tells.
    assert "rank 1 received [1.0, 2.0, 3.0, 4.0, 5.0, 0.0]" in results.outputs[1]
    # Seven into six (28 bytes sent, 24 expected): gloo's check fails in its I/O thread, an
    # exception nothing catches there, so the C++ runtime aborts the whole process.
    assert isinstance(results[1], RankExited) and results[1].exitcode == -signal.SIGABRT
    assert re.search(
        r"terminate called after throwing an instance of 'gloo::EnforceNotMet'\n.*"
        r"op\.preamble\.length <= op\.nbytes\. 28 vs 24\. Received data size doesn't match "
        r"expected size\. Is there a distributed collective mismatch in your code\?",
        results.outputs[1],
    )
    error, seconds = results[0]  # the sender learns of it from the lost connection, at once
    assert re.match(PEER_GONE, error) and seconds < AT_ONCE


# --- 4. A collective nobody answers, and the tools that say why ------------------------------


def one_all_reduce_too_many(rank: int, trace_dir: str) -> dict:
    """Both ranks call all_reduce #1 and broadcast #2; rank 0 alone calls all_reduce #3.
    Each rank writes its flight recorder's dump while rank 0 waits (``async_op=True`` lets
    rank 0 take its own, as a watchdog thread would), then rank 0 waits for the answer."""
    store = dist.distributed_c10d._get_default_store()
    dist.all_reduce(torch.ones(2))
    dist.broadcast(torch.ones(2), src=0)
    if rank == 1:
        torch_dump = failure.write_fr_dump(trace_dir, rank)
        store.wait(["timed out"], WAIT)  # alive, so rank 0 waits for an answer, not a corpse
        return {"group_table": sorted(torch_dump["pg_config"])}
    started = time.monotonic()
    work = dist.all_reduce(torch.ones(6), async_op=True)
    torch_dump = failure.write_fr_dump(trace_dir, rank)
    error, _ = what_it_raises(work.wait)
    seconds = time.monotonic() - started
    store.set("timed out", "1")
    return {
        "error": error,
        "seconds": seconds,
        "group_table": sorted(torch_dump["pg_config"]),
        "finished_after": reads_finished(rank, within=2.0),
    }


def reads_finished(rank: int, within: float) -> bool:
    """Whether this rank's newest record (all_reduce #3, timed out) reads finished within
    ``within`` seconds: gloo's worker thread marks it a moment after ``wait`` raised."""
    deadline = time.monotonic() + within
    while not recorder.dump(rank, stacks=False)[-1].completed:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def send_then_recv(rank: int, world_size: int, group: dist.ProcessGroup) -> None:
    """A ring written with blocking calls: every rank sends first. A gloo send returns only
    once its receiver has called recv (lesson T2), so no rank ever gets to its recv."""
    dist.send(torch.ones(2), dst=(rank + 1) % world_size, group=group)
    dist.recv(torch.zeros(2), src=(rank - 1) % world_size, group=group)


def checked_by_detail(rank: int) -> tuple[str, float]:
    """A group made under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` checks every collective's op and
    shapes across the ranks before running it; here rank 0 brings 6 floats, rank 1 seven."""
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"  # as a user sets it, read by torch:
    dist.set_debug_level_from_env()
    checked = dist.new_group()
    del os.environ["TORCH_DISTRIBUTED_DEBUG"]  # only this group is checked
    dist.set_debug_level_from_env()
    return what_it_raises(dist.all_reduce, torch.ones(6 + rank), group=checked)


def waits_without_a_partner(rank: int, world_size: int, trace_dir: str) -> dict:
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=TIMEOUT)
    store = dist.distributed_c10d._get_default_store()
    ring, watched = dist.new_group(timeout=TIMEOUT), dist.new_group()
    report = one_all_reduce_too_many(rank, trace_dir)
    report["ring"] = what_it_raises(send_then_recv, rank, world_size, ring)
    if rank == 0:  # rank 1 is busy elsewhere (here: waiting for a key), never at the barrier
        barrier = what_it_raises(dist.monitored_barrier, watched, timedelta(seconds=0.5))
        report["barrier"] = barrier
        store.set("barrier over", "1")
    else:
        store.wait(["barrier over"], WAIT)
    report["detail"] = checked_by_detail(rank)
    return report


@pytest.fixture(scope="module")
def waits(once_per_session) -> tuple[list[dict], str]:
    """One two-rank run for the tests below (once per session, even under xdist)."""
    trace_dir = once_per_session.directory("failure-traces")
    results = once_per_session.run(
        "test_08_failure.waits",
        lambda: list(run_ranks(waits_without_a_partner, str(trace_dir), backend=None)),
        timeout=60,
    )
    return results, str(trace_dir)


def test_a_collective_nobody_answers_ends_at_the_group_timeout(waits):
    (rank0, rank1), _ = waits
    # The extra all_reduce: rank 0 alone, rank 1 alive but elsewhere. It ends at the
    # group's 1.5 s timeout (30 minutes unless init_process_group says otherwise).
    assert re.fullmatch(TIMED_OUT.format("recv"), rank0["error"]), rank0["error"]
    assert 1.5 <= rank0["seconds"] < 1.5 + AT_ONCE
    # The ring of blocking sends: every rank waits in its send until the group's timeout.
    # The first rank whose timer fires drops its connections, so a rank whose own timer was
    # a moment behind may read that instead: the same moment, in other words.
    errors = [report["ring"][0] for report in (rank0, rank1)]
    seconds = [report["ring"][1] for report in (rank0, rank1)]
    timed_out = [re.fullmatch(TIMED_OUT.format("send"), error) is not None for error in errors]
    assert any(timed_out)
    assert all(t or re.match(PEER_GONE, e) for t, e in zip(timed_out, errors, strict=True))
    assert 1.5 <= max(seconds) < 1.5 + AT_ONCE


def test_torchs_tools_name_the_rank_and_the_collective(waits, caplog):
    (rank0, rank1), trace_dir = waits
    # monitored_barrier: rank 0 waits for each other rank in turn and names the first one
    # missing, after the barrier's own timeout (0.5 s).
    error, seconds = rank0["barrier"]
    assert error.startswith(
        "RuntimeError: [Rank 0]: Rank 1 failed to pass monitoredBarrier in 500 ms\n"
    )
    assert 0.5 <= seconds < 0.5 + AT_ONCE
    # DETAIL: both ranks raise at the call, before any data moves, naming both fingerprints;
    # the same 6-against-7 that aborted a receiver in part 3.
    for rank, report in enumerate((rank0, rank1)):
        error, seconds = report["detail"]
        assert error.startswith("RuntimeError: Detected mismatch between collectives on ranks.")
        assert re.search(rf"OpType=ALLREDUCE, TensorShape=\[{6 + rank}\]", error)
        assert re.search(rf"Tensor shapes: {6 + rank}vs {7 - rank}$", error), error
        assert seconds < AT_ONCE
    # The flight recorder. torch's own gloo dump leaves the table of groups unnamed, which
    # the analyzer cannot read; write_fr_dump filled it in from each rank's groups.
    assert rank0["group_table"] == rank1["group_table"] == [""]
    # ``python -m torch.distributed.flight_recorder.fr_trace DIR`` runs ``fr_trace.main()``:
    # we call it here, with DIR, and read what it logs (on stderr, through its logger).
    caplog.set_level(logging.INFO, logger=FR_LOGGER)
    fr_trace.main([trace_dir])
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name == FR_LOGGER)
    # It logs the first collective not every rank joined, and who is missing.
    assert re.search(
        r"Not all ranks joining collective, sequence number: 3\n.*\n"
        r"group info: 0:default_pg\ncollective: gloo:all_reduce\nmissing ranks: \{1\}\n"
        r"input sizes: \[\[6\]\]",
        logged,
    ), logged
    # This project's explain, on the same two files, in one line.
    records = {r: recorder.load(open(f"{trace_dir}/rank_{r}", "rb").read(), r) for r in (0, 1)}
    assert desync.explain(records) == (
        "rank 0 waits in all_reduce #3; rank 1 never reached #3 (its last: broadcast #2)"
    )
    # So dump while it waits: once it has timed out, gloo's record of #3 reads finished, like
    # any collective that went well, and neither tool could tell.
    assert rank0["finished_after"] is True
