"""T9. Elastic recovery: a job that loses a worker and ends as if it never had
(``tutorial_impl/dist_tuto/elastic.py``).

The idea. When a worker of a ``torchrun --max-restarts 1`` job dies, torchrun's agent stops
the others and starts all of them again: a new *attempt* (``TORCHELASTIC_RESTART_COUNT`` one
higher), with the same command. The new workers are new processes: nothing of the old ones'
memory survives, so what a restart resumes from is what the old workers left on disk. The
lesson's ``train`` saves a ``torch.distributed.checkpoint`` after every step (the model, the
optimizer's momentum, the step) and, when it starts, loads the newest *complete* one.

The claim: such a job, stopped after step 2 and started again, trains steps 3, 4 and 5 and
ends with exactly the parameters of a run that was never interrupted: bit for bit, not
merely close. Nothing else would do: the resumed run replays no step and skips none, and its
optimizer carries on with the momentum it had, so every float it computes is the float the
uninterrupted run computed.

Read in this order:

1. ``test_a_stopped_job_resumes_from_its_checkpoint_bit_for_bit``: the idea in plain torch.
   Two ranks train one step and stop; a new model and optimizer (all ``train`` builds
   anew, so only the files carry over) resume and train steps 2 and 3; an uninterrupted
   run trains 3 steps. Both ranks must now hold the same parameters as that run.
2. ``test_a_job_killed_in_step_3_resumes_and_ends_as_if_never_interrupted``: the real thing,
   a learner's command line, rank 1 killed inside step 3's all_reduce, torchrun restarting
   both workers as new processes:

    TUTORIAL_IMPL_FAULTS=<the plan> torchrun --standalone --nproc-per-node 2 --max-restarts 1 \\
        -m tutorial_impl.testing.fault_launch -m tutorial_impl.dist_tuto.elastic \\
        --backend faulty --steps 5 --ckpt-dir CKPT --out FINAL

3. At the bottom, the machinery of that job (you need not read it to follow the lesson).

How the worker dies: no ``os._exit`` in the lesson's code. The launcher
(``tutorial_impl/testing/fault_launch.py``) registers the ``"faulty"`` backend (gloo, with
every collective counted) and arms the plan "SIGKILL rank 1 at its 3rd all_reduce" in the
first attempt only. That the 3rd all_reduce *is* step 3's comes from the uninterrupted run
itself, which counts every collective of every step (DDP's one gradient bucket is the only
all_reduce a step makes: DCP's save gathers, scatters and broadcasts, but never all-reduces).

Where this test's job differs from your command, said plainly: the workers. Your
``torchrun`` starts each worker as a fresh interpreter, ``python -u -m
tutorial_impl.testing.fault_launch -m tutorial_impl.dist_tuto.elastic ...``. Here the same
command line goes to torchrun's own ``main`` in a rank the harness forked, and its agent
*forks* each worker from itself (``--start-method=fork``), which then calls the launcher's
function form, ``fault_launch.call_main``, with the same arguments. The agent's rendezvous,
store, variables, monitoring, stop and restart are torchrun's own. A fork skips the
imports: a fresh worker imports torch, DDP (``torch._dynamo``) and DCP, about 2.2 s of CPU,
four times over. It inherits the agent's signal handlers, which ``call_main`` puts back as a
fresh interpreter has them. And nothing the lesson claims depends on it: a restarted worker,
forked or fresh, is a new process that knows only the files (the test checks the new pids).
How the suite runs such a job, and checks that no worker outlives it:
``tests/torchrun_in_process.py``. Fresh workers under torchrun, and how they end: lesson T7.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tests.torchrun_in_process import Entry, assert_forks_of, torchrun_with_forked_workers
from tutorial_impl.dist_tuto import elastic
from tutorial_impl.testing import fault_launch, proctable
from tutorial_impl.testing.faults import group as faulty_group
from tutorial_impl.testing.faults import inject as faults
from tutorial_impl.testing.faults.plan import ENV, Fault, Kill, encode

# A fresh world: the agent installs signal handlers (from the main thread only) and
# rewrites the environment; none of that may reach another test.
pytestmark = [pytest.mark.timeout(240), pytest.mark.warm_world(False)]

STEPS, KILLED_IN = 5, 3
PLAN = (Fault(ranks={1}, action=Kill(), at=KILLED_IN, op="all_reduce"),)
DEADLINE = 150.0  # seconds for the agent's rank, the whole job and its restart included
LINE = re.compile(r"^Rank (\d) attempt (\d): (.*)$", re.MULTILINE)
FIRED = re.compile(r"injected fault on rank (\d) at (all_reduce #\d+): Kill\(\)")


# ---- The idea: a restart knows only the files, and that is enough ----------------------


def stopped_and_resumed(rank: int, world_size: int, tmp: str) -> tuple[dict, dict]:
    """In each rank, plain torch (the harness made the gloo group): a job that stops after
    step 1, the same job started again on its checkpoints, and a job never interrupted.
    (Three steps, not the five of the job below: the idea needs no more, and CPU is dear.)"""
    elastic.train(rank, world_size, 1, f"{tmp}/job")  # attempt 0: saves step 1, stops
    # Attempt 1: ``train`` builds a new DDP model and a new optimizer (no momentum yet): all
    # it can resume from is the newest complete checkpoint in the directory.
    resumed = elastic.train(rank, world_size, 3, f"{tmp}/job")
    return resumed, elastic.train(rank, world_size, 3, f"{tmp}/never")


def test_a_stopped_job_resumes_from_its_checkpoint_bit_for_bit(run_ranks, tmp_path):
    results = run_ranks(stopped_and_resumed, str(tmp_path))
    for rank, (resumed, never) in enumerate(results):
        # Both ranks must now hold the uninterrupted run's parameters, bit for bit.
        assert sorted(resumed) == sorted(never)
        for name, tensor in never.items():
            assert torch.equal(resumed[name], tensor), f"rank {rank}: {name} differs"
        # And the restart did resume: it started after step 1 and saved only 2 and 3.
        lines = [text for r, _, text in LINE.findall(results.outputs[rank]) if int(r) == rank]
        assert lines[:2] == ["starting after step 0", "step 1 saved"], lines
        assert lines[2:5] == ["starting after step 1", "step 2 saved", "step 3 saved"], lines
    # The equality says something: the three steps moved every parameter.
    with torch.random.fork_rng():  # make_model seeds the global generator: not ours to move
        start = dict(elastic.make_model().named_parameters())
    assert all(not torch.equal(start[n], t) for n, t in results[0][1].items())


# ---- The real thing: torchrun restarts a job whose worker was killed -------------------


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

    # The faulted job, its agent in one rank of the harness's, ended by its deadline. No GPU
    # for it: on a CUDA machine DCP's file writer takes a CUDA stream, which a forked worker
    # cannot ("Cannot re-initialize CUDA in forked subprocess"; torch 2.11, an H200). The
    # lesson is a CPU one; a fresh worker, as your torchrun starts, has no such limit.
    (pids := tmp_path / "pids").mkdir()
    no_gpu = {"CUDA_VISIBLE_DEVICES": ""}
    [job] = run_ranks(
        faulted_job, str(tmp_path), world_size=1, backend=None, timeout=DEADLINE, env=no_gpu
    )
    assert job.returned == {0: 0, 1: 0}  # the last attempt's workers, both through main
    assert job.left == {}, "workers outlived their torchrun agent"

    # What torchrun did: two attempts of two workers, no third. Each attempt's workers are
    # new processes (so they know only the files), here forks of the agent (see above).
    attempts = [f"attempt{a}_rank{r}" for a in (0, 1) for r in (0, 1)]
    assert_forks_of(pids, job.agent, attempts)
    processes = proctable.recorded(pids)  # name -> (pid, kernel start time)
    assert all(processes[f"attempt0_rank{r}"] != processes[f"attempt1_rank{r}"] for r in (0, 1))

    # Attempt 0: rank 1 was killed at that very all_reduce, once, and nowhere else.
    assert FIRED.findall(said(tmp_path, 1, 0, "stderr")) == [("1", killed_at)]
    assert not FIRED.findall(said(tmp_path, 0, 0, "stderr"))
    for rank in (0, 1):
        # Both workers started fresh (no checkpoint yet), saved steps 1 and 2, and neither
        # got to save step 3.
        first = lesson_lines(tmp_path, rank, 0)
        assert first[1:] == ["starting after step 0", "step 1 saved", "step 2 saved"], first
        # Attempt 1: the agent started both again, through the launcher (not armed now),
        # and each resumed after the newest complete checkpoint, step 2, to train 3, 4, 5.
        second = lesson_lines(tmp_path, rank, 1)
        assert second[1:] == ["starting after step 2"] + [
            f"step {s} saved" for s in range(KILLED_IN, STEPS + 1)
        ], second
        assert fault_launch.NOT_ARMED.format(attempt=1) in said(tmp_path, rank, 1, "stderr")
        assert not FIRED.findall(said(tmp_path, rank, 1, "stderr"))
        # Both attempts met at the same store (torchrun's agent keeps it): the per-attempt
        # prefix of ``attempt_store`` is what kept attempt 1 from attempt 0's stale keys.
        assert first[0] == second[0] and first[0].startswith("store "), (first, second)
    ckpt = tmp_path / "ckpt"
    ckpts = sorted(p.name for p in ckpt.iterdir() if (p / elastic.COMPLETE).exists())
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


def test_the_launcher_runs_a_module_under_torchrun_only(monkeypatch, capsys):
    """``fault_launch`` needs ``-m MODULE``, and the rank torchrun gives its worker: a plan
    is armed for a rank, and a process no agent started has none. Given both, it runs
    MODULE as ``python -m MODULE ARGS`` would (what torchrun's fresh workers do; the job
    above calls ``call_main`` instead): here ``calendar``, as a restarted worker (not armed)."""
    with pytest.raises(SystemExit, match="usage: python -m tutorial_impl.testing.fault_launch"):
        fault_launch.main(["tutorial_impl.dist_tuto.elastic"])
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit, match="RANK and WORLD_SIZE are not set"):
        fault_launch.main(["-m", "tutorial_impl.dist_tuto.elastic", "--steps", "1"])
    with pytest.raises(SystemExit, match="RANK and WORLD_SIZE are not set"):
        fault_launch.call_main("tutorial_impl.dist_tuto.elastic", "--steps", "1")
    env = {"RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_RESTART_COUNT": "1"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    registered = []
    monkeypatch.setattr(faulty_group, "register", lambda: registered.append(True))
    monkeypatch.setattr(sys, "argv", sys.argv)  # the launcher sets it, as -m does
    fault_launch.main(["-m", "calendar", "2024", "2"])
    out, err = capsys.readouterr()
    assert "February 2024" in out and "29" in out.split()  # a leap year's February
    assert sys.argv[1:] == ["2024", "2"] and registered == [True]
    assert err.strip() == fault_launch.NOT_ARMED.format(attempt=1)


# ---- Machinery: the faulted job's command, launcher, reference and logs -----------------
# The lesson above needs none of this to be read; it is how the suite kills a worker at a
# chosen collective and runs torchrun's agent cheaply.


def command(tmp: str) -> list[str]:
    """The learner's command line, after ``torchrun`` (``python -m torch.distributed.run``),
    with what the suite adds: ``--monitor-interval=0.1`` (notice the death sooner),
    ``--start-method=fork`` (see the module's docstring), and ``--redirects=3`` (each
    worker's stdout and stderr to files of their own, one directory per attempt)."""
    flags = ["--standalone", "--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=0.1"]
    flags += ["--start-method=fork", "--redirects=3", f"--log-dir={tmp}/logs"]
    flags += ["-m", "tutorial_impl.testing.fault_launch", "-m", "tutorial_impl.dist_tuto.elastic"]
    flags += ["--backend=faulty", f"--steps={STEPS}"]
    return flags + [f"--ckpt-dir={tmp}/ckpt", f"--out={tmp}/final.pt"]


# What a forked worker runs in place of ``python -u -m tutorial_impl.testing.fault_launch -m
# MODULE ARGS``: ``fault_launch.call_main(MODULE, *ARGS)``.
LAUNCHER = Entry(("-u", "-m", fault_launch.__name__, "-m"), fault_launch.call_main)


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


def faulted_job(rank: int, world_size: int, tmp: str):
    """The command, with the plan in its environment (every worker inherits it), run by
    torchrun's agent in this rank."""
    os.environ.update({ENV: encode(PLAN), "OMP_NUM_THREADS": "1"})
    return torchrun_with_forked_workers(command(tmp), LAUNCHER, f"{tmp}/pids")


def said(tmp: Path, rank: int, attempt: int, stream: str = "stdout") -> str:
    """What worker ``rank`` of ``attempt`` wrote: the agent redirects each to its files."""
    (path,) = tmp.glob(f"logs/*/attempt_{attempt}/{rank}/{stream}.log")
    return path.read_text()


def lesson_lines(tmp: Path, rank: int, attempt: int) -> list[str]:
    """The lesson's own lines of worker ``rank`` in ``attempt``, in order."""
    found = LINE.findall(said(tmp, rank, attempt))
    assert {(int(r), int(a)) for r, a, _ in found} <= {(rank, attempt)}, found
    return [text for _, _, text in found]
