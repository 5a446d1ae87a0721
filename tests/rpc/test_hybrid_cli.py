"""``python -m tutorial_impl hybrid``: the tutorial's demo on local ranks, under torchrun, on GPUs.

What the tutorial claims: four processes (trainers 0 and 1, master 2, parameter server 3),
started by ``mp.spawn`` or ``torchrun``, print each trainer's loss per epoch and then
"Training complete"; with CUDA, each trainer's ``Linear`` runs on its own GPU.

What this module proves: the same ``run_worker`` runs in all three settings, each process's
role following from its RANK alone. Read the local run first, then ``--help``, then
torchrun, then the GPU runs (skipped without GPUs).

What torchrun does for this job, ``torchrun --standalone --nproc_per_node=4 -m
tutorial_impl hybrid``: its agent hosts the rendezvous store itself, on a port the kernel
picks (``--standalone``: one node, nothing to agree on with other agents); starts 4
workers, each ``python -u -m tutorial_impl hybrid ...`` with ``RANK`` 0 to 3,
``WORLD_SIZE=4`` and ``MASTER_ADDR``/``MASTER_PORT`` naming that store; watches them; and
exits 0 only if every worker did. Our CLI sees it runs under an agent and runs just its own
rank (``cli.launch``): trainers 0 and 1, master 2, parameter server 3, the tutorial's
layout, meeting at the agent's store. Here the command goes to torchrun's own ``main`` in a
harness rank, and its agent forks each worker from itself, which then calls what the
command would run (``tutorial_impl.__main__.main``): four fresh interpreters would import
torch, RPC and the optimizers, about 2.6 s of CPU each. Fresh workers under torchrun are
lesson 7's (``tests/dist_tuto/test_07_torchrun.py``); how the suite runs the job, and
checks that no worker outlives it: ``tests/torchrun_in_process.py``.
"""

from __future__ import annotations

import os
import re

import pytest

from tests.torchrun_in_process import Entry, assert_forks_of, torchrun_with_forked_workers
from tutorial_impl import __main__ as entry
from tutorial_impl.rpc import hybrid
from tutorial_impl.rpc.hybrid import HybridConfig, run_worker
from tutorial_impl.rpc.hybrid_world import master_rank

LOSS_LINE = re.compile(r"^Trainer (\d+) - Epoch (\d+) - Loss: (\d+\.\d+)$", re.MULTILINE)


def _check_output(out: str, trainers: int, epochs: int) -> None:
    """One loss line per trainer and epoch, each a plausible cross-entropy, then the end."""
    seen = {(int(t), int(e)): float(loss) for t, e, loss in LOSS_LINE.findall(out)}
    assert sorted(seen) == [(t, e) for t in range(trainers) for e in range(epochs)], out
    # Random labels over 8 classes: near ln 8 = 2.08 at the start, never 0 or huge.
    assert all(0.5 < loss < 6.0 for loss in seen.values()), seen
    assert out.count("Training complete") == 1, out


def test_cli_runs_the_tutorial_on_local_ranks(capsys):
    argv = ["--epochs", "2", "--batches", "3", "--seed", "3", "--rpc-timeout", "15"]
    assert hybrid.main([*argv, "--timeout", "30"]) == 0
    out = capsys.readouterr().out
    _check_output(out, trainers=2, epochs=2)
    assert "4 processes" in out


def test_cli_help_names_every_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        hybrid.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--trainers", "--parameter-servers", "--epochs", "--batches", "--seed"):
        assert option in out
    assert "--device {cpu,cuda}" in out


# ``torchrun`` and its arguments, after ``python -m torch.distributed.run``: the demo as a
# learner types it (the README's command, one epoch of two batches), with what the suite
# adds: ``--monitor-interval=0.1`` (notice the end sooner) and ``--start-method=fork`` (see
# the module's docstring).
TORCHRUN = ["--standalone", "--nproc_per_node=4", "--monitor-interval=0.1", "--start-method=fork"]
TORCHRUN += ["-m", "tutorial_impl", "hybrid", "--epochs", "1", "--batches", "2"]
TORCHRUN += ["--rpc-timeout", "30", "--timeout", "120"]


def run_cli(*argv: str) -> int:
    """What ``python -m tutorial_impl ARGV`` runs, called: its exit status is the return
    value, which the agent reads back."""
    return entry.main(list(argv))


CLI = Entry(("-u", "-m", "tutorial_impl"), run_cli)  # a forked worker's stand-in for the command


def torchrun_job(rank: int, world_size: int, pids: str):
    """The command, run by torchrun's agent in this rank (``OMP_NUM_THREADS=1``, as torchrun
    sets it for more than one worker, inherited by every worker)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    return torchrun_with_forked_workers(TORCHRUN, CLI, pids)


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.warm_world(False)  # the agent installs signal handlers and rewrites os.environ
def test_same_code_under_torchrun(run_ranks, tmp_path):
    """Ranks 0, 1 train, 2 is the master, 3 the server, exactly the tutorial's layout, each
    a worker of one torchrun agent; every worker's main said 0, and none outlived its agent.
    This is the suite's one-node torchrun job (``test_07_torchrun`` runs the two-agent form,
    with fresh interpreters and how they end)."""
    (pids := tmp_path / "pids").mkdir()
    results = run_ranks(torchrun_job, str(pids), world_size=1, backend=None, timeout=150)
    job = results[0]
    assert job.returned == {0: 0, 1: 0, 2: 0, 3: 0}  # every worker's main said 0
    assert job.left == {}, "workers outlived their torchrun agent"
    assert_forks_of(pids, job.agent, [f"attempt0_rank{r}" for r in range(4)])  # one attempt
    _check_output(results.outputs[0], trainers=2, epochs=1)


def _gpu_run(run_ranks, trainers: int) -> None:
    config = HybridConfig(
        trainers, 1, epochs=1, batches=2, device="cuda", verbose=False, rpc_timeout=15.0
    )
    results = run_ranks(run_worker, config, world_size=config.world_size, backend=None)
    master = results[master_rank(config)]
    # Each trainer's fc on its own GPU; the table stayed on the servers' CPU (it was
    # fetched back as a CPU tensor and still differs from its initial value: it trained).
    assert [master["trainers"][f"trainer{i}"]["device"] for i in range(trainers)] == [
        f"cuda:{i}" for i in range(trainers)
    ]
    assert master["table"].device.type == "cpu"
    assert not master["table"].equal(master["initial_table"])


@pytest.mark.dist_gpu(1)
def test_one_trainer_on_a_gpu(run_ranks):
    _gpu_run(run_ranks, trainers=1)


@pytest.mark.dist_gpu(2)
def test_each_trainer_on_its_own_gpu(run_ranks):
    _gpu_run(run_ranks, trainers=2)
