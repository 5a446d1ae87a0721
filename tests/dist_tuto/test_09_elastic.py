"""Elastic recovery: a job that loses a worker and ends as if it never had
(``tutorial_impl/dist_tuto/elastic.py``).

The claim: a DDP job under ``torchrun --max-restarts 1`` whose rank 1 is killed inside step
3's all_reduce is restarted by its agent, resumes from its last complete checkpoint (the
one of step 2, saved with ``torch.distributed.checkpoint``), and ends with exactly the
parameters of a run that was never interrupted: bit for bit, not merely close. Nothing else
would do: the resumed run replays no step and skips none, and its optimizer carries on with
the momentum it had, so every float it computes is the float the uninterrupted run computed.

How the worker dies: no ``os._exit`` in the lesson's code. The job runs the lesson's module
behind the harness's launcher (``tutorial_impl/testing/fault_launch.py``), which makes its
group on the ``"faulty"`` backend (gloo, with every collective counted) and arms the plan
"SIGKILL rank 1 at its 3rd all_reduce" in the first attempt only. That the 3rd all_reduce
*is* step 3's comes from the uninterrupted run itself, which counts every collective of
every step (DDP's one gradient bucket is the only all_reduce a step makes: DCP's save
gathers, scatters and broadcasts, but never all-reduces).

The cost: torchrun's agent and each worker of each attempt is a fresh Python that imports
torch, DDP and DCP (about 2 s of CPU each, five processes in all); the uninterrupted
reference runs in the harness's forked ranks instead, torch already imported.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tutorial_impl.dist_tuto import elastic
from tutorial_impl.testing import fault_launch, faults, faulty_group, proctable
from tutorial_impl.testing.fault_plan import ENV, Fault, Kill, encode

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[2]
STEPS, KILLED_IN = 5, 3
PLAN = (Fault(ranks={1}, action=Kill(), at=KILLED_IN, op="all_reduce"),)
DEADLINE = 180.0  # seconds for the whole job, restart included; the machine is shared
MARK = "TUTORIAL_ELASTIC_JOB"  # in the agent's environment, inherited by every worker
LINE = re.compile(r"^Rank (\d) attempt (\d): (.*)$", re.MULTILINE)
FIRED = re.compile(r"injected fault on rank (\d) at (all_reduce #\d+): Kill\(\)")


def uninterrupted(rank: int, world_size: int, ckpt_dir: str) -> tuple[dict, list[list[str]]]:
    """The lesson's ``train``, never interrupted, on the same backend (nothing armed); and
    each step's collectives, as the faulty group counted them (cut at each checkpoint)."""
    faulty_group.init_process_group(rank, world_size, plan=())  # env:// from run_ranks
    start, ends, save = len(faults.INJECTOR.history), [], dcp.save

    def save_and_mark(*args, **kwargs):
        save(*args, **kwargs)
        ends.append(len(faults.INJECTOR.history))

    try:
        with mock.patch.object(dcp, "save", save_and_mark):
            params = elastic.train(rank, world_size, STEPS, ckpt_dir)
    finally:
        dist.destroy_process_group()
    history = [str(point) for point in faults.INJECTOR.history]
    return params, [history[a:b] for a, b in zip([start, *ends], ends, strict=False)]


def run_job(tmp_path: Path) -> str:
    """The faulted job, as a learner would type it (behind the fault launcher); its output.

    torchrun starts each worker in a session of its own, so only the environment reaches
    them all: a mark every process of the job inherits. Whatever happens (a failure, the
    deadline), the ``finally`` kills every process carrying it; after a clean exit, none
    may be left. Output goes to a file, which cannot fill up and block like a pipe.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["--max-restarts=1", "--monitor-interval=0.1", f"--log-dir={tmp_path / 'logs'}"]
    cmd += ["-m", "tutorial_impl.testing.fault_launch", "-m", "tutorial_impl.dist_tuto.elastic"]
    cmd += ["--backend", "faulty", "--steps", str(STEPS)]
    cmd += ["--ckpt-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "final.pt")]
    job = uuid.uuid4().hex
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", MARK: job}
    env[ENV] = encode(PLAN)
    log = tmp_path / "torchrun.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        code = proc.wait(timeout=DEADLINE)
        left = proctable.wait_until_unmarked(MARK, job, timeout=10.0) if code == 0 else []
    finally:
        proctable.kill_marked(MARK, job)
        proc.wait(5)
    output = log.read_text(errors="replace")
    assert code == 0, f"the job failed (a restart should have saved it):\n{output}"
    assert not left, f"processes outlived their torchrun agent: {left}"
    return output


def said(output: str, rank: int, attempt: int) -> list[str]:
    """What the lesson's worker of ``rank`` printed in ``attempt``, in order."""
    return [text for r, a, text in LINE.findall(output) if (int(r), int(a)) == (rank, attempt)]


@pytest.mark.slow
def test_a_job_killed_in_step_3_resumes_and_ends_as_if_never_interrupted(run_ranks, tmp_path):
    # The reference first: the same training, never interrupted, in forked ranks.
    (expected, _), (replica, steps) = run_ranks(
        uninterrupted, str(tmp_path / "reference"), backend=None
    )
    assert all(torch.equal(replica[name], p) for name, p in expected.items())  # DDP's replicas
    # In rank 1 (the rank the plan kills), each step made exactly one all_reduce (DDP's one
    # bucket; DCP's save makes none): the plan's 3rd all_reduce is step 3's, numbered #N
    # among all the collectives of the group.
    all_reduces = [[p for p in step if p.startswith("all_reduce #")] for step in steps]
    assert [len(found) for found in all_reduces] == [1] * STEPS, steps
    killed_at = all_reduces[KILLED_IN - 1][0]

    output = run_job(tmp_path)

    # Attempt 0: rank 1 was killed at that very all_reduce, once, and nowhere else.
    assert FIRED.findall(output) == [("1", killed_at)], output
    for rank in (0, 1):
        # Both workers started fresh (no checkpoint yet), saved steps 1 and 2, and neither
        # got to save step 3.
        first = said(output, rank, 0)
        assert first[1:] == ["starting after step 0", "step 1 saved", "step 2 saved"], output
        # Attempt 1: the agent started both again, through the launcher (not armed now),
        # and each resumed after the newest complete checkpoint, step 2, to train 3, 4, 5.
        second = said(output, rank, 1)
        assert second[1:] == ["starting after step 2"] + [
            f"step {s} saved" for s in range(KILLED_IN, STEPS + 1)
        ], output
        # Both attempts met at the same store (torchrun's agent keeps it): the per-attempt
        # prefix of ``attempt_store`` is what kept attempt 1 from attempt 0's stale keys.
        assert first[0] == second[0] and first[0].startswith("store "), (first, second)
    assert output.count(fault_launch.NOT_ARMED.format(attempt=1)) == 2, output
    assert output.count("starting after step") == 4  # two attempts of two workers, no third
    ckpts = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if (p / ".metadata").exists())
    assert ckpts == [elastic.CHECKPOINT.format(s) for s in range(1, STEPS + 1)]

    # The bar: rank 0's final parameters, bit for bit those of the uninterrupted run.
    final = torch.load(tmp_path / "final.pt")
    assert sorted(final) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(final[name], tensor), f"{name} differs from the uninterrupted run"
    # And the equality says something: the five steps moved every parameter.
    with torch.random.fork_rng():  # make_model seeds the global generator: not ours to move
        start = dict(elastic.make_model().named_parameters())
    assert all(not torch.equal(start[name], tensor) for name, tensor in expected.items())


def test_the_launcher_runs_a_module_under_torchrun_only(monkeypatch):
    """``fault_launch`` needs ``-m MODULE``, and the rank torchrun gives its worker: a plan
    is armed for a rank, and a process no agent started has none."""
    with pytest.raises(SystemExit, match="usage: python -m tutorial_impl.testing.fault_launch"):
        fault_launch.main(["tutorial_impl.dist_tuto.elastic"])
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit, match="RANK and WORLD_SIZE are not set"):
        fault_launch.main(["-m", "tutorial_impl.dist_tuto.elastic", "--steps", "1"])
