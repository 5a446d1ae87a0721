"""Faults and bad input in the hybrid world: clear errors, bounded waits, no leftovers.

RPC never retries a call, and a graceful ``rpc.shutdown`` waits for every worker: a world
that loses a member must notice, say who failed, and still let everyone leave.
"""

from __future__ import annotations

import pytest

from tutorial_impl.rpc import hybrid
from tutorial_impl.rpc.hybrid import HybridConfig
from tutorial_impl.rpc.hybrid_checks import (
    DEATH_EXIT_CODE,
    TEST_DEADLINES,
    bad_index_worker,
    dying_ps_worker,
    unknown_worker_check,
)
from tutorial_impl.testing import proctable

RPC_TIMEOUT = 10.0  # short, yet far above any healthy RPC here, even on a loaded machine


@pytest.mark.rank_timeout(60)
def test_dead_parameter_server_fails_training_fast(run_ranks, tmp_path):
    """The server dies (``os._exit``) on its fifth lookup, mid-training.

    How this is observed honestly: the harness stops everything as soon as a *rank* dies,
    which would hide what the others do. So the dying server is a child process that the
    last rank forks (and only waits for); the master and the trainers are ordinary ranks,
    and the master returns the error it got instead of raising it.
    """
    config = HybridConfig(
        2, 1, epochs=1, batches=10, verbose=False, rpc_timeout=RPC_TIMEOUT, train_timeout=30
    )
    pid_dir = str(tmp_path)
    results = run_ranks(
        dying_ps_worker, config, 5, pid_dir, world_size=config.world_size, backend=None
    )
    trainer0, trainer1, master, ps_host = results
    died_at = float((tmp_path / "death-time").read_text())

    # The server really died of the injected fault, not of something else.
    assert ps_host["child_exit"] == DEATH_EXIT_CODE

    # The master's error names each trainer and the server whose lookup failed...
    error = master["error"]
    assert error is not None and error.startswith("training failed:")
    for name in ("trainer0", "trainer1"):
        assert f"{name} failed:" in error
    assert "embedding lookup on parameter server ps0 failed" in error
    # ... and came within the RPC timeout of the death (a lost connection is noticed
    # at once; a silent one would take the full timeout).
    assert master["error_time"] - died_at < RPC_TIMEOUT

    # The trainers heard that training failed and left without a graceful shutdown
    # (which would wait for the dead server), also within the RPC timeout.
    for trainer in (trainer0, trainer1):
        assert trainer["training_ok"] is False
        assert trainer["end_time"] - died_at < RPC_TIMEOUT

    # Nothing left behind: every rank and the forked server are gone (OS process table).
    assert set(proctable.recorded(pid_dir)) == {"rank0", "rank1", "rank2", "rank3", "ps0-child"}
    assert proctable.wait_until_gone(pid_dir) == {}


def test_indices_outside_the_table_are_refused(run_ranks):
    """Out-of-range rows raise on the trainer before any lookup is sent. With the table split
    over two servers this matters: each shard keeps only its own rows, so index 100 would
    otherwise be dropped silently. Afterwards a normal step still works on both trainers."""
    config = HybridConfig(2, 2, verbose=False, **TEST_DEADLINES)
    results = run_ranks(bad_index_worker, config, world_size=config.world_size, backend=None)
    for name, seen in results[2]["trainers"].items():
        assert seen["errors"]["past_end"] == (
            "IndexError: embedding indices must lie in [0, 100); got [100]"
        ), name
        assert seen["errors"]["negative"] == (
            "IndexError: embedding indices must lie in [0, 100); got [-1]"
        ), name
        assert 0 < seen["loss"] < 20


def test_unknown_worker_name(run_ranks):
    config = HybridConfig(2, 1, verbose=False, **TEST_DEADLINES)
    results = run_ranks(
        unknown_worker_check, config, "ps7", world_size=config.world_size, backend=None
    )
    assert [r["name"] for r in results] == ["trainer0", "trainer1", "master", "ps0"]
    errors = results[2]["errors"]
    # Ours names the worker and lists who is there...
    assert errors["check_worker"] == (
        "ValueError: unknown RPC worker 'ps7'; this world has: master, ps0, trainer0, trainer1"
    )
    # ... RPC's own error is immediate too (no wait for a worker that never comes).
    assert "ps7" in errors["rpc_sync"]
    assert float(errors["rpc_sync_seconds"]) < 1.0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--trainers", "0"], "need at least one trainer, got --trainers 0"),
        (["--parameter-servers", "0"], "need at least one parameter server, got 0"),
        (["--parameter-servers", "101"], "cannot split 100 rows over 101 servers"),
    ],
)
def test_bad_configuration_is_refused_before_any_process_starts(argv, message, capsys):
    assert hybrid.main(argv) == 2
    assert f"error: {message}" in capsys.readouterr().err


def test_world_size_must_fit_the_roles():
    """Under torchrun the world size comes from --nproc_per_node: 2 + 1 + 1 roles need 4."""
    with pytest.raises(ValueError, match="need 4 processes, not 3"):
        hybrid.run_worker(0, 3, HybridConfig(2, 1))
