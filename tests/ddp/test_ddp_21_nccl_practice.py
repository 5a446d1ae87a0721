"""D21. A stuck collective: what ends it on gloo, what the NCCL watchdog reads.

On gloo (here): a bounded ``wait(timeout)`` gives up at its timeout while the collective goes
on, and ends with the right sum once the late rank joins; ``abort()`` returns at once and
ends nothing, the collective in flight ending at the group's own timeout. The NCCL names the
lesson teaches are torch's own: read from the ``ProcessGroupNCCL.hpp`` every torch wheel ships.
On a CUDA machine (``pytest -m dist_gpu``) an NCCL collective returns to its caller before a
late rank has joined: the hang is on the GPU's stream, where only the watchdog sees it.
"""

from __future__ import annotations

import contextlib
import io
import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tutorial_impl.ddp import nccl_practice as lesson

HEADER = Path(torch.__file__).parent / "include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp"


@pytest.mark.world_size(3)
def test_a_bounded_wait_gives_up_and_the_collective_goes_on(run_ranks):
    first, middle, last = run_ranks(lesson.bounded_wait, 0.4, 1.5)
    # Every rank, the late one too, must hold the sum of three ones.
    assert [r["sum"] for r in (first, middle, last)] == [3.0, 3.0, 3.0]
    # Rank 0 gave up at its 0.4 s, with gloo's message, before the late rank came ...
    assert first["raised"] is not None and "timed out" in first["raised"].lower(), first
    assert 0.4 <= first["gave_up"] < 1.5, first
    # ... and its second wait ended only once the late rank had joined, 1.5 s in.
    assert 1.5 <= first["ended"] < 10, first


def abort_then_count_groups(rank: int, size: int) -> dict:
    """The lesson's abort, then how many process groups this rank still has."""
    seen = lesson.abort_in_flight(rank, size, 0.3, 1.5)
    return {**seen, "groups": len(dist.distributed_c10d._world.pg_map)}


def test_abort_on_gloo_ends_nothing_the_groups_timeout_does(run_ranks):
    first, second = run_ranks(abort_then_count_groups)
    for rank in (first, second):
        assert 0.3 <= rank["aborted"] < 1.5, rank  # abort() returned at once, on every rank
        assert rank["groups"] == 1, rank  # the aborted group was destroyed: the world's is left
    assert second["ended"] is None and second["error"] is None  # rank 1 never entered
    # Rank 0's all_reduce went on after the abort: it ended at the group's 1.5 s timeout.
    assert first["aborted"] < 1.5 <= first["ended"] < 10, first
    assert first["error"] is not None and "timed out" in first["error"].lower(), first


def test_the_demo_prints_both_on_rank_0():
    """``python -m tutorial_impl.ddp.nccl_practice`` (its ``main``, as the command runs it, with
    no preload list) prints two lines, rank 0's: the bounded wait (its gloo message, the late
    end, the sum of two ranks) and the abort that ended nothing."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert lesson.main(["--timeout", "60"]) == 0
    waited, aborted = printed.getvalue().splitlines()
    found = re.fullmatch(
        r"wait\(0\.4 s\) gave up after ([\d.]+) s: Operation timed out!; "
        r"the all_reduce ended after ([\d.]+) s, sum 2",
        waited,
    )
    assert found is not None, waited
    assert float(found[1]) < 1.5 <= float(found[2]), waited
    found = re.fullmatch(
        r"gloo: abort\(\) returned after ([\d.]+) s; the all_reduce ended after ([\d.]+) s",
        aborted,
    )
    assert found is not None, aborted
    assert float(found[1]) < 1.5 <= float(found[2]), aborted


def test_the_watchdogs_settings_are_torchs_own():
    """Each variable the lesson names is declared in torch's NCCL header, and the error
    handling modes have the values the lesson gives; what the header says of ``wait`` and
    ``abort`` is what the lesson quotes."""
    if not HEADER.is_file():
        pytest.skip(f"this torch ships no C++ headers ({HEADER})")
    text = HEADER.read_text()
    declared = set(re.findall(r"static std::vector<std::string> (TORCH_NCCL_\w+) = \{", text))
    assert set(lesson.NCCL_ENV) <= declared, set(lesson.NCCL_ENV) - declared
    enum = re.search(r"enum ErrorHandlingMode \{(.*?)\};", text, re.S)
    assert enum is not None
    modes = dict(re.findall(r"(\w+) = (\d+)", enum.group(1)))
    assert {k: int(v) for k, v in modes.items()} == lesson.ERROR_HANDLING
    flat = " ".join(text.split()).replace("// ", "")
    assert "it will block the CPU thread until the NCCL work is completed or timed out" in flat
    assert "abort the ProcessGroup (similar to ncclCommAbort)" in flat
    assert "the default value (3 - SkipCleanUp)" in flat


def returns_before_the_late_rank(rank: int, size: int, late: float = 1.0) -> dict:
    """On NCCL: the last rank joins ``late`` s after rank 0 starts its all_reduce (a note sent
    first, as in ``bounded_wait``); rank 0's call returns at once (queued on the stream), and
    synchronizing then waits for the late rank."""
    tensor = torch.ones(1, device=lesson.rank_device())
    note = torch.zeros(1, device=lesson.rank_device())
    start = time.monotonic()  # the late rank joins ``late`` s after this at the earliest
    if rank == size - 1:
        dist.recv(note, src=0)
        torch.cuda.synchronize()  # the note has arrived: rank 0 is starting
        time.sleep(late)
    elif rank == 0:
        dist.send(note, dst=size - 1)
    called = time.monotonic()
    dist.all_reduce(tensor)
    returned = time.monotonic() - called
    torch.cuda.synchronize()
    return {"returned": returned, "synced": time.monotonic() - start, "sum": tensor.item()}


@pytest.mark.dist_gpu(2)
@pytest.mark.dist_backend("nccl")
@pytest.mark.world_size(2)
def test_on_nccl_a_collective_returns_before_a_late_rank_joins(run_ranks):
    first, second = run_ranks(returns_before_the_late_rank, 1.0)
    assert first["sum"] == second["sum"] == 2.0
    assert first["returned"] < 0.5, first  # the call queued the collective and returned
    assert first["synced"] >= 0.9, first  # the stream waited for the late rank
