"""Rank functions the hybrid tests run: a probing trainer, injected faults, bad input.

They live in the package (ranks import their function by name; test files are not
importable) and reuse the tutorial's pieces from ``hybrid`` unchanged: the same roles, the
same ``HybridModel`` and ``_setup_trainer``, the same master. Only the trainer's loop body is
replaced, by one that takes a single step in a fixed order and reports what it saw.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
from torch import nn

from tutorial_impl.rpc.hybrid import _setup_trainer, run_worker
from tutorial_impl.rpc.hybrid_model import (
    DATASETS,
    ShardedEmbeddingBag,
    get_next_batch,
    trainer_generator,
)
from tutorial_impl.rpc.hybrid_world import (
    HybridConfig,
    check_worker,
    init_worker,
    role_of,
    shutdown_worker,
)
from tutorial_impl.testing import proctable

# The worlds the tests start keep every deadline of their own (an RPC, a whole training
# run, the wait for the master's word) below the harness's 60 s: a stuck world then fails
# with our error naming what it waited for, before the harness has to kill it.
TEST_DEADLINES = {"rpc_timeout": 15.0, "train_timeout": 30.0}


def _fc_state(model: Any) -> list[torch.Tensor]:
    return [p.detach().cpu().clone() for p in model.fc.module.parameters()]  # weight, bias


def _one_step(
    model: Any, opt: Any, criterion: Any, batch: tuple[torch.Tensor, ...], rank: int, trainers: int
) -> dict[str, Any]:
    """Forward, backward, then the optimizer steps one trainer at a time, and a report.

    The barriers fix the order the reference replays: every trainer has done its forward
    (read the table) and backward before the first one steps, and trainer i's SGD update of
    the table lands before trainer i+1's.
    """
    indices, offsets, target = batch
    remote_emb_module: ShardedEmbeddingBag = model.remote_emb_module
    fc_before = _fc_state(model)
    with dist_autograd.context() as context_id:
        output = model(indices, offsets)
        loss = criterion(output, target.to(model.device))
        dist_autograd.backward(context_id, [loss])
        # The gradients of this context: the fc's here (DDP has averaged them), the table's
        # on the servers (dist autograd sent each server the gradient of its lookup).
        grads = dist_autograd.get_gradients(context_id)
        fc_grads = [grads[p].cpu().clone() for p in model.fc.module.parameters()]
        emb_grad = remote_emb_module.gradient(context_id)
        dist.barrier()
        for turn in range(trainers):
            if turn == rank:
                opt.step(context_id)
            dist.barrier()
    return {
        "batch": batch,
        "loss": loss.item(),
        "fc_before": fc_before,
        "fc_grads": fc_grads,
        "emb_grad": emb_grad,
        "fc_after": _fc_state(model),
    }


def _probe_trainer(
    remote_emb_module: ShardedEmbeddingBag, rank: int, config: HybridConfig
) -> dict[str, Any]:
    """One step on the trainer's first batch of ``config.data``; returns what it saw."""
    model, opt, criterion = _setup_trainer(remote_emb_module, rank, config)
    batches = DATASETS[config.data]
    batch = next(batches(trainer_generator(config.seed, rank), 1, config.num_embeddings))
    return _one_step(model, opt, criterion, batch, rank, config.trainers)


def signed_loss(output: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
    """A loss linear in the output (as in PyTorch's DDP-under-dist-autograd test).

    Flipping the sign of every label flips the sign of every gradient, exactly.
    """
    return (output.sum(dim=1) * sign).mean()


def _twin_trainer(
    remote_emb_module: ShardedEmbeddingBag, rank: int, config: HybridConfig
) -> dict[str, Any]:
    """Trainers 2k and 2k+1 get the same bags with opposite labels (+1 / -1)."""
    model, opt, _ = _setup_trainer(remote_emb_module, rank, config)
    g = trainer_generator(config.seed, rank // 2)
    indices, offsets, _ = next(get_next_batch(g, 1, config.num_embeddings))
    sign = torch.full((len(offsets),), 1.0 if rank % 2 == 0 else -1.0)
    return _one_step(model, opt, signed_loss, (indices, offsets, sign), rank, config.trainers)


def _bad_index_trainer(
    remote_emb_module: ShardedEmbeddingBag, rank: int, config: HybridConfig
) -> dict[str, Any]:
    """Look up rows outside the table, then prove the world still works with a good step."""
    model, opt, criterion = _setup_trainer(remote_emb_module, rank, config)
    errors = {}
    n = config.num_embeddings
    for name, bad in (("past_end", [3, n]), ("negative", [-1, 3])):
        try:
            with dist_autograd.context():
                model(torch.tensor(bad), torch.tensor([0]))
            errors[name] = None
        except (IndexError, ValueError) as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
    batch = next(get_next_batch(trainer_generator(config.seed, rank), 1, n))
    report = _one_step(model, opt, criterion, batch, rank, config.trainers)
    return {"errors": errors, "loss": report["loss"]}


def probe_worker(rank: int, world_size: int, config: HybridConfig) -> dict[str, Any]:
    return run_worker(rank, world_size, config, _probe_trainer)


def twin_worker(rank: int, world_size: int, config: HybridConfig) -> dict[str, Any]:
    return run_worker(rank, world_size, config, _twin_trainer)


def bad_index_worker(rank: int, world_size: int, config: HybridConfig) -> dict[str, Any]:
    return run_worker(rank, world_size, config, _bad_index_trainer)


def unknown_worker_check(
    rank: int, world_size: int, config: HybridConfig, name: str
) -> dict[str, Any]:
    """The master asks for a worker that is not in the world: our check, then RPC's own."""
    me = init_worker(rank, config)
    errors: dict[str, str | None] = {}
    try:
        if me == "master":
            for how, call in (
                ("check_worker", lambda: check_worker(name)),
                ("rpc_sync", lambda: torch.distributed.rpc.rpc_sync(name, os.getpid)),
            ):
                start = time.monotonic()
                try:
                    call()
                    errors[how] = None
                except (ValueError, RuntimeError) as exc:
                    errors[how] = f"{type(exc).__name__}: {exc}"
                errors[how + "_seconds"] = f"{time.monotonic() - start:.3f}"
    finally:
        shutdown_worker(config)
    return {"name": me, "errors": errors}


# --- A parameter server that dies mid-training -------------------------------------------

DEATH_EXIT_CODE = 17


class DyingEmbeddingBag(nn.EmbeddingBag):
    """An ``EmbeddingBag`` whose process dies (``os._exit``) on its ``die_after``-th lookup."""

    def __init__(self, *args: Any, die_after: int, death_note: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.die_after = die_after
        self.death_note = death_note  # a file that receives the time of death
        self.lookups = 0

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.lookups += 1
        if self.lookups >= self.die_after:
            with open(self.death_note, "w") as f:
                f.write(repr(time.time()))
            os._exit(DEATH_EXIT_CODE)  # no reply, no goodbye: like a machine that fails
        return super().forward(*args, **kwargs)


def _serve_until_death(rank: int, world_size: int, config: HybridConfig, pid_dir: str) -> None:
    """The body of the forked parameter server (never returns)."""
    code = 1
    try:
        proctable.record_self(pid_dir, "ps0-child")
        run_worker(rank, world_size, config)  # serves lookups until the fatal one
        code = 0
    except BaseException:  # noqa: BLE001 - report whatever it was, then leave
        traceback.print_exc()
    finally:
        os._exit(code)


def dying_ps_worker(
    rank: int, world_size: int, config: HybridConfig, die_after: int, pid_dir: str
) -> dict[str, Any]:
    """The hybrid world with a parameter server that dies after ``die_after`` lookups.

    The harness fails fast: a *rank* that dies ends the whole run with ``RankCrashed``
    before anyone else can report. So the dying server is not a rank but a child the last
    rank forks before any thread or RPC exists; that rank only waits for it. The master and
    the trainers are ordinary ranks, and each reports how it ended and how long it took.
    """
    proctable.record_self(pid_dir, f"rank{rank}")
    if role_of(rank, config)[0] == "ps":
        pid = os.fork()
        if pid == 0:
            _serve_until_death(rank, world_size, config, pid_dir)
        deadline = time.monotonic() + config.train_timeout + 2 * config.rpc_timeout
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return {"name": "ps host", "child_exit": os.waitstatus_to_exitcode(status)}
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return {"name": "ps host", "child_exit": None}
    death_note = os.path.join(pid_dir, "death-time")
    try:
        report = run_worker(
            rank,
            world_size,
            config,
            module_cls=DyingEmbeddingBag,
            die_after=die_after,
            death_note=death_note,
        )
        report["error"] = None
    except RuntimeError as exc:
        report = {"name": "master", "error": str(exc), "error_time": time.time()}
    report["end_time"] = time.time()  # after rpc.shutdown and destroy_process_group
    return report
