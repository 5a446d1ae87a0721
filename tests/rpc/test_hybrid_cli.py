"""``python -m tutorial_impl hybrid``: the tutorial's demo on local ranks, under torchrun, on GPUs.

What the tutorial claims: four processes (trainers 0 and 1, master 2, parameter server 3),
started by ``mp.spawn`` or ``torchrun``, print each trainer's loss per epoch and then
"Training complete"; with CUDA, each trainer's ``Linear`` runs on its own GPU.

What this module proves: the same ``run_worker`` runs in all three settings. Our launcher
starts the roles through the harness (a race-free port for rank 0's store), torchrun
starts them itself (the agent's store; its own ``main`` in a harness rank, the workers forked
by its agent), and each process's role follows from its RANK. Read
the local run first, then ``--help``, then torchrun, then the GPU runs (skipped without GPUs).
"""

from __future__ import annotations

import multiprocessing
import os
import re
import sys
from unittest import mock

import pytest
from torch.distributed import run as torchrun
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from tutorial_impl import __main__ as cli
from tutorial_impl.rpc import hybrid
from tutorial_impl.rpc.hybrid import HybridConfig, run_worker
from tutorial_impl.rpc.hybrid_world import master_rank
from tutorial_impl.testing import proctable

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
# learner types it (the README's command, one epoch of two batches), and ``--start-method
# fork``, which only says how the agent starts a worker given as a function (see below).
TORCHRUN = ["--standalone", "--nproc_per_node=4", "--monitor-interval=0.1", "--start-method=fork"]
TORCHRUN += ["-m", "tutorial_impl", "hybrid", "--epochs", "1", "--batches", "2"]
TORCHRUN += ["--rpc-timeout", "30", "--timeout", "120"]


def worker(pids: str, *argv: str) -> int:
    """One worker of the job, a copy of the agent: its pid written down (the leak check),
    then what ``python -m tutorial_impl ARGV`` runs, called, so that its exit status is the
    worker's return value (the agent reads it back)."""
    proctable.record_self(pids, f"worker{os.environ['RANK']}")
    return cli.main(list(argv))


def agent(rank: int, world_size: int, pids: str) -> dict:
    """torchrun, in this rank: ``torch.distributed.run.main(TORCHRUN)``, its rendezvous, its
    store (``--standalone``: on a port the kernel picks), the workers' ranks and variables,
    their monitoring and stop, all torchrun's own, as in ``test_09_elastic.py``. One change:
    torchrun hands ``elastic_launch`` the command each worker would run in a fresh
    interpreter (``python -u -m tutorial_impl ARGS``); here it gets ``worker``, which the
    agent starts by fork. Four fresh interpreters import torch, RPC and the optimizers
    (about 2.6 s of CPU each); a fork of this rank costs milliseconds."""
    # The harness starts its ranks as daemonic processes, and multiprocessing gives a
    # daemonic process no children; lifted in this rank alone.
    multiprocessing.current_process().daemon = False
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the workers, as torchrun sets it
    returned = {}

    def launch(config: LaunchConfig, entrypoint: str):
        assert entrypoint == sys.executable and config.start_method == "fork", entrypoint

        def run_workers(*cmd: str) -> None:
            assert cmd[:3] == ("-u", "-m", "tutorial_impl"), cmd
            returned.update(elastic_launch(config, worker)(pids, *cmd[3:]))

        return run_workers

    with mock.patch.object(torchrun, "elastic_launch", launch):
        torchrun.main(TORCHRUN)
    # The job is over: none of its workers may outlive it (asked here, before this rank
    # ends: the harness kills whatever its rank leaves behind).
    return {"returned": returned, "left": proctable.wait_until_gone(pids, timeout=10.0)}


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.warm_world(False)  # the agent installs signal handlers and rewrites os.environ
def test_same_code_under_torchrun(run_ranks, tmp_path):
    """``torchrun --standalone --nproc_per_node=4 -m tutorial_impl hybrid``: ranks 0, 1
    train, 2 is the master, 3 the server, exactly the tutorial's layout. This is the suite's
    one-node torchrun job (``test_07_torchrun`` runs the two-agent form, with fresh
    interpreters and how they end), and no worker may outlive its agent."""
    (pids := tmp_path / "pids").mkdir()
    results = run_ranks(agent, str(pids), world_size=1, backend=None, timeout=150)
    assert results[0]["returned"] == {0: 0, 1: 0, 2: 0, 3: 0}  # every worker's main said 0
    assert sorted(proctable.recorded(pids)) == [f"worker{r}" for r in range(4)]
    assert results[0]["left"] == {}, "workers outlived their torchrun agent"
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
