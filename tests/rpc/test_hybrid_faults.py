"""Faults and bad input in the hybrid world: clear errors, bounded waits, nothing left behind.

What the RPC reference says: RPC never retries a call, and a graceful ``rpc.shutdown`` waits
for every worker. So a world that loses a member must notice, say who failed, and still let
everyone leave; and input that cannot work must be refused with a message that says why.

What this module proves, in reading order: a parameter server that dies mid-training fails the
run with an error naming each trainer that failed and the server, within the RPC timeout, and
leaves no process behind; rows outside the table and a worker name the world does not have
are refused at once, and the world still trains afterwards; a configuration that cannot run
is refused before any process starts.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn

from tutorial_impl.rpc import hybrid
from tutorial_impl.rpc.hybrid import HybridConfig, _setup_trainer, run_worker, train_step
from tutorial_impl.rpc.hybrid_data import get_next_batch, trainer_generator
from tutorial_impl.rpc.hybrid_world import check_worker, master_rank, ps_rank
from tutorial_impl.testing import RankExited, proctable

RPC_TIMEOUT = 10.0  # short, yet far above any healthy RPC here, even on a loaded machine
DEADLINES = {"rpc_timeout": 15.0, "train_timeout": 30.0}  # below the harness's 60 s

# --- A parameter server that dies on its fifth lookup ---------------------------------------

DEATH_EXIT_CODE = 17


class DyingEmbeddingBag(nn.EmbeddingBag):
    """An ``EmbeddingBag`` whose process dies (``os._exit``) on its ``die_on``-th lookup."""

    def __init__(self, *args: Any, die_on: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.die_on = die_on
        self.lookups = 0

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.lookups += 1
        if self.lookups == self.die_on:
            print(f"dying at {time.time()!r}", flush=True)
            os._exit(DEATH_EXIT_CODE)  # no reply, no goodbye: like a machine that fails
        return super().forward(*args, **kwargs)


def world_with_a_dying_server(rank: int, world_size: int, config: HybridConfig, pids: str) -> dict:
    """The tutorial's world, its server a ``DyingEmbeddingBag``; each rank says when it left."""
    proctable.record_self(pids, f"rank{rank}")
    try:
        report = run_worker(rank, world_size, config, module_cls=DyingEmbeddingBag, die_on=5)
    except RuntimeError as exc:  # the master: training failed, and it says how
        report = {"error": str(exc)}
    return {**report, "end_time": time.time()}


def test_a_dead_parameter_server_fails_training_with_a_clear_error(run_ranks, tmp_path):
    config = HybridConfig(2, 1, epochs=1, verbose=False, rpc_timeout=RPC_TIMEOUT, train_timeout=30)
    ps, master = ps_rank(config, 0), master_rank(config)
    results = run_ranks(
        world_with_a_dying_server,
        config,
        str(tmp_path),
        world_size=config.world_size,
        backend=None,
        may_exit={ps},  # its death is the lesson: the harness lets the others run on
    )
    # The server died of the injected fault, and said when.
    assert isinstance(results[ps], RankExited) and results[ps].exitcode == DEATH_EXIT_CODE
    died_at = float(re.search(r"dying at (\S+)", results.outputs[ps]).group(1))
    # The master's error names each trainer and the server whose lookup failed.
    error = results[master]["error"]
    assert error.startswith("training failed:\ntrainer0 failed:") and "\ntrainer1 failed:" in error
    assert "embedding lookup on parameter server ps0 failed" in error
    # The trainers heard it, so they left without a graceful shutdown (which would wait for
    # the dead server). Each heard it as the lost connection (EOF), at once, not as its RPC
    # timing out: a silent server would have taken the whole timeout. (The wall clock is not
    # the proof: at load 5 the ranks' ends came 10.1 s after the death, the EOF at once.)
    assert [results[i]["training_ok"] for i in range(config.trainers)] == [False, False]
    first, second = error.split("\ntrainer1 failed:")
    assert "EOF: end of file" in first and "EOF: end of file" in second, error
    assert "ran for more than" not in error  # torch's words for an RPC past its timeout
    for rank in (0, 1, master):
        assert results[rank]["end_time"] > died_at  # everyone was still there to hear it
    assert proctable.wait_until_gone(tmp_path) == {}  # asked of the kernel, not the harness


# --- Bad input: rows outside the table, a worker that is not there ---------------------------


def bad_input_trainer(remote_emb_module: Any, rank: int, config: HybridConfig) -> dict:
    """Look up rows outside the table and call a worker the world does not have; then prove
    the world still works with a real training step."""
    model, opt, criterion = _setup_trainer(remote_emb_module, rank, config)
    n = config.num_embeddings
    attempts = {
        "past_end": lambda: model(torch.tensor([3, n]), torch.tensor([0])),
        "negative": lambda: model(torch.tensor([-1, 3]), torch.tensor([0])),
        "check_worker": lambda: check_worker("ps7"),
        "rpc_sync": lambda: rpc.rpc_sync("ps7", os.getpid),
    }
    errors: dict[str, str | None] = {}
    for name, attempt in attempts.items():
        start = time.monotonic()
        try:
            with dist_autograd.context():
                attempt()
            errors[name] = None
        except (IndexError, ValueError, RuntimeError) as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
        errors[name + "_seconds"] = f"{time.monotonic() - start:.3f}"
    batch = next(get_next_batch(trainer_generator(config.seed, rank), 1, n))
    return {"errors": errors, "loss": train_step(model, opt, criterion, batch).item()}


def bad_input_world(rank: int, world_size: int, config: HybridConfig) -> dict:
    return run_worker(rank, world_size, config, bad_input_trainer)


def test_bad_input_is_refused_at_once_and_the_world_still_trains(run_ranks):
    """Both trainers try, with the table split over two servers. One world for both lessons:
    an RPC world costs seconds to start."""
    config = HybridConfig(2, 2, verbose=False, **DEADLINES)
    results = run_ranks(bad_input_world, config, world_size=config.world_size, backend=None)
    for name, seen in results[master_rank(config)]["trainers"].items():
        errors = seen["errors"]
        # Out-of-range rows raise on the trainer before any lookup is sent. With the table
        # split by rows this matters: each shard keeps only its own rows, so index 100
        # would otherwise be dropped silently.
        assert errors["past_end"] == "IndexError: embedding indices must lie in [0, 100); got [100]"
        assert errors["negative"] == "IndexError: embedding indices must lie in [0, 100); got [-1]"
        # A worker name the world does not have: ours names it and lists who is there...
        assert errors["check_worker"] == (
            "ValueError: unknown RPC worker 'ps7'; this world has: master, ps0, ps1, trainer0, "
            "trainer1"
        )
        # ... RPC's own error is immediate too (no wait for a worker that never comes).
        assert errors["rpc_sync"].startswith("RuntimeError: ") and "ps7" in errors["rpc_sync"]
        assert float(errors["rpc_sync_seconds"]) < 1.0, name
        # Afterwards a normal step still works on both trainers.
        assert 0 < seen["loss"] < 20, name


# --- Configurations that cannot run ---------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--trainers", "0"], "--trainers must be at least 1, got 0"),
        (["--parameter-servers", "0"], "--parameter-servers must be at least 1, got 0"),
        (["--parameter-servers", "101"], "cannot split 100 rows over --parameter-servers 101"),
        (["--rpc-timeout", "0"], "--rpc-timeout and --timeout must be positive"),
    ],
)
def test_bad_configuration_is_refused_before_any_process_starts(argv, message, capsys):
    assert hybrid.main(argv) == 2
    assert f"error: {message}" in capsys.readouterr().err


def test_world_size_must_fit_the_roles():
    """Under torchrun the world size comes from --nproc_per_node: 2 + 1 + 1 roles need 4."""
    with pytest.raises(ValueError, match="need 4 processes, not 3"):
        hybrid.run_worker(0, 3, HybridConfig(2, 1))
