"""DDP + RPC computes what one process would: the hybrid tutorial's gradients, checked.

What the tutorial claims: a trainer's ``HybridModel`` looks its bags up in an ``EmbeddingBag``
on the parameter server (RPC) and feeds them to a ``Linear`` that DDP replicates. In the
backward pass DDP averages the ``Linear``'s gradients over the trainers, and distributed
autograd sends each trainer's embedding gradient to the server; a ``DistributedOptimizer``,
given RRefs of every parameter, updates both. It cannot be given ``model.parameters()``,
because the remote module has no parameters of its own.

What this module proves: splitting the model over processes changes none of the numbers. Each
trainer takes one step and reports what it saw; here, in the test process, the same batches go
through a plain ``EmbeddingBag`` + ``Linear`` (one process, no RPC, no DDP) from the same
weights, and everything must agree::

    out = Linear(EmbeddingBag(indices, offsets))       # the reference: plain autograd

Read in this order: the reference and the rank functions (a trainer that steps once and
reports); why the optimizer is given RRefs (what ``parameters()`` really raises); one step
against the reference, in three worlds; twin trainers, which separate what DDP averages from
what it does not; and sharding, which changes nothing. (The split table's lookup without RPC
is in ``test_hybrid_model.py``.)

Tolerance: float32 with ``rtol=1e-5, atol=1e-6``. The distributed run adds the same terms in
another order (shards' partial sums, DDP's allreduce), so we expect rounding, not equality.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch import nn

from tutorial_impl.rpc.hybrid import HybridConfig, _setup_trainer, run_worker
from tutorial_impl.rpc.hybrid_data import DATASETS, get_next_batch, trainer_generator
from tutorial_impl.rpc.hybrid_world import master_rank

TOL = {"rtol": 1e-5, "atol": 1e-6}
SEED = 1234
# Every deadline of these worlds stays below the harness's: a stuck world then fails with
# our error naming what it waited for, before the harness has to kill it.
DEADLINES = {"rpc_timeout": 15.0, "train_timeout": 30.0}


def reference_step(
    table: torch.Tensor,
    fc: list[torch.Tensor],
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
) -> tuple[float, torch.Tensor, list[torch.Tensor]]:
    """Loss, table gradient and [weight, bias] gradients of one batch, on one process."""
    indices, offsets, target = batch
    emb = nn.EmbeddingBag(*table.shape, mode="sum", _weight=table.clone())
    linear = nn.Linear(table.shape[1], fc[0].shape[0])
    with torch.no_grad():
        linear.weight.copy_(fc[0])
        linear.bias.copy_(fc[1])
    loss = criterion(linear(emb(indices, offsets)), target)
    loss.backward()
    return loss.item(), emb.weight.grad, [linear.weight.grad, linear.bias.grad]


# --- Rank functions: trainers that take one step and report what they saw ------------------


def fc_state(model: Any) -> list[torch.Tensor]:
    return [p.detach().cpu().clone() for p in model.fc.module.parameters()]  # weight, bias


def one_step(model: Any, opt: Any, criterion: Any, batch: tuple, rank: int, trainers: int) -> dict:
    """The tutorial's step, taken apart: forward, backward, then the optimizer steps one
    trainer at a time. The barriers fix the order the reference replays: every trainer has
    read the table and done its backward before the first one steps, and trainer i's SGD
    update of the table lands before trainer i+1's."""
    indices, offsets, target = batch
    fc_before = fc_state(model)
    with dist_autograd.context() as context_id:
        loss = criterion(model(indices, offsets), target.to(model.device))
        dist_autograd.backward(context_id, [loss])
        # The gradients of this context: the fc's here (DDP has averaged them), the table's
        # on the servers (dist autograd sent each server the gradient of its lookup).
        grads = dist_autograd.get_gradients(context_id)
        fc_grads = [grads[p].cpu().clone() for p in model.fc.module.parameters()]
        emb_grad = model.remote_emb_module.gradient(context_id)
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
        "fc_after": fc_state(model),
    }


def refusals(model: Any) -> dict[str, str | None]:
    """What ``parameters()`` raises on one of the table's shards and on the whole model."""
    calls = {
        "RemoteModule.parameters()": model.remote_emb_module.shards[0].parameters,
        "model.parameters()": model.parameters,
    }
    seen: dict[str, str | None] = {}
    for name, call in calls.items():
        try:
            list(call())
            seen[name] = None
        except ValueError as exc:
            seen[name] = str(exc)
    return seen


def probe_trainer(remote_emb_module: Any, rank: int, config: HybridConfig) -> dict:
    """The tutorial's trainer setup, then one step on its first batch; returns what it saw."""
    model, opt, criterion = _setup_trainer(remote_emb_module, rank, config)
    batch = next(
        DATASETS[config.data](trainer_generator(config.seed, rank), 1, config.num_embeddings)
    )
    report = one_step(model, opt, criterion, batch, rank, config.trainers)
    owners = sorted(o.owner().name for o in opt.remote_optimizers)
    return {**report, "refused": refusals(model), "optimizer_parts": owners}


def probe_world(rank: int, world_size: int, config: HybridConfig) -> dict:
    return run_worker(rank, world_size, config, probe_trainer)


_runs: dict[tuple[int, int], dict] = {}


@pytest.fixture
def probe(run_ranks, once_per_session) -> Callable[[int, int], dict]:
    """Run (once per world and test session) the probing world; return the master's report.

    Every test of a world reads the same run: an RPC world costs about a second of CPU, and
    under ``pytest -n auto`` this module's tests land on several workers, which would each
    start it again (``once_per_session``, ``tests/conftest.py``).
    """

    def start(trainers: int, servers: int) -> dict:
        config = HybridConfig(trainers, servers, seed=SEED, verbose=False, **DEADLINES)
        results = run_ranks(
            probe_world, config, world_size=config.world_size, backend=None, timeout=90
        )
        # Every rank ran the role of the tutorial's layout and came back.
        assert [r["name"] for r in results] == [f"trainer{i}" for i in range(trainers)] + [
            "master"
        ] + [f"ps{j}" for j in range(servers)]
        return results[master_rank(config)]

    def run(trainers: int, servers: int) -> dict:
        if (trainers, servers) not in _runs:
            _runs[trainers, servers] = once_per_session.run(
                f"hybrid-probe-{trainers}t-{servers}ps", lambda: start(trainers, servers), 120
            )
        return _runs[trainers, servers]

    return run


# --- The tests ------------------------------------------------------------------------------


def test_the_optimizer_gets_rrefs_because_a_remote_module_has_no_parameters(probe):
    """The tutorial says ``model.parameters()`` would call the remote module's
    ``parameters()``, which is not supported. What really raises on torch 2.13: the remote
    module's own ``parameters()``, and for the whole model the walk over its submodules."""
    for name, seen in probe(2, 1)["trainers"].items():
        assert seen["refused"] == {
            "RemoteModule.parameters()": "Method ``parameters`` not supported for "
            "RemoteModule. Please use ``remote_parameters`` instead.",
            "model.parameters()": "Method ``named_modules`` not supported for RemoteModule",
        }
        # So the trainer gives the optimizer RRefs: remote_parameters() for the table, local
        # RRefs for its fc. The optimizer then has a part where each parameter lives: on the
        # server, and on this trainer (one step against the reference shows both update).
        assert seen["optimizer_parts"] == ["ps0", name]


@pytest.mark.parametrize("world", [(2, 1), (2, 3), (3, 2)], ids=lambda w: f"{w[0]}t-{w[1]}ps")
def test_one_step_matches_the_single_process_reference(probe, world):
    """The tutorial's world, the same data over three shards (rows 0-33, 34-66, 67-99), and
    three trainers over two shards. One test per world (not one per claim): under ``pytest
    -n auto`` tests may land in different processes, and each would start the world again."""
    report = probe(*world)
    trainers = report["trainers"]
    assert len(trainers) == world[0]
    table0, fc0 = report["initial_table"], trainers["trainer0"]["fc_before"]
    ref = {name: reference_step(table0, fc0, seen["batch"]) for name, seen in trainers.items()}

    # Each trainer drew its own fc (seed + rank); DDP broadcast trainer 0's at construction,
    # so every replica starts identical: without the broadcast they would differ here.
    for seen in trainers.values():
        for mine, first in zip(seen["fc_before"], fc0, strict=True):
            assert torch.equal(mine, first)

    # (a) The fc gradient in each trainer's dist-autograd context is DDP's average of the
    # trainers' gradients, the same on every trainer.
    mean_fc = [torch.stack([r[2][k] for r in ref.values()]).mean(0) for k in range(2)]
    for seen in trainers.values():
        for got, want in zip(seen["fc_grads"], mean_fc, strict=True):
            torch.testing.assert_close(got, want, **TOL)

    # (b) The table's gradient is *not* averaged: each context holds that trainer's own
    # gradient (only the rows its bags touched are non-zero).
    for name, seen in trainers.items():
        loss, emb_grad, _ = ref[name]
        assert seen["loss"] == pytest.approx(loss, rel=1e-5)
        torch.testing.assert_close(seen["emb_grad"], emb_grad, **TOL)
        assert emb_grad.abs().sum() > 0  # a zero gradient would make (b) and (c) vacuous

    # (c) The trainers stepped one after another (trainer 0 first): the server's table got
    # each trainer's SGD update in turn, and every fc replica the averaged update.
    lr = 0.05  # the tutorial's DistributedOptimizer(optim.SGD, ..., lr=0.05), written out
    table = table0.clone()
    for name in sorted(ref):  # trainer0, trainer1, ...: the order of the steps
        table -= lr * ref[name][1]
    torch.testing.assert_close(report["table"], table, **TOL)
    assert not torch.equal(report["table"], table0)
    for seen in trainers.values():
        for k in range(2):
            torch.testing.assert_close(seen["fc_after"][k], fc0[k] - lr * mean_fc[k], **TOL)


# Twins: the same bags, opposite labels (after PyTorch's DDP-under-dist-autograd test).


def signed_loss(output: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
    """A loss linear in the output: flipping every label's sign flips every gradient, exactly."""
    return (output.sum(dim=1) * sign).mean()


def twin_trainer(remote_emb_module: Any, rank: int, config: HybridConfig) -> dict:
    """Trainers 2k and 2k+1 get the same bags with opposite labels (+1 / -1)."""
    model, opt, _ = _setup_trainer(remote_emb_module, rank, config)
    g = trainer_generator(config.seed, rank // 2)
    indices, offsets, _ = next(get_next_batch(g, 1, config.num_embeddings))
    sign = torch.full((len(offsets),), 1.0 if rank % 2 == 0 else -1.0)
    return one_step(model, opt, signed_loss, (indices, offsets, sign), rank, config.trainers)


def twin_world(rank: int, world_size: int, config: HybridConfig) -> dict:
    return run_worker(rank, world_size, config, twin_trainer)


def test_twin_examples_cancel_in_ddp_but_not_in_the_table(run_ranks):
    """Two trainers, same bags, opposite labels, a loss linear in the output: their fc
    gradients are exact negatives, so DDP's average is exactly zero; the embedding
    gradients, never averaged, are not."""
    config = HybridConfig(2, 1, seed=7, verbose=False, **DEADLINES)
    results = run_ranks(twin_world, config, world_size=config.world_size, backend=None)
    report = results[master_rank(config)]
    t0, t1 = report["trainers"]["trainer0"], report["trainers"]["trainer1"]
    assert torch.equal(t0["batch"][0], t1["batch"][0])  # same bags...
    assert torch.equal(t0["batch"][2], -t1["batch"][2])  # ...opposite labels

    # Alone, each trainer's bias gradient would be +1 or -1 for every class (the loss is
    # sign * sum of the outputs). DDP's average is zero on both: the replicas do not move.
    for seen in (t0, t1):
        for grad in seen["fc_grads"]:
            assert torch.count_nonzero(grad) == 0
        for before, after in zip(seen["fc_before"], seen["fc_after"], strict=True):
            assert torch.equal(before, after)

    # The table's gradient is not averaged. Closed form for this loss: row r gets
    # sign / bags * (occurrences of r in the batch) * (sum of the fc's rows).
    weight = t0["fc_before"][0]
    for seen, sign in ((t0, 1.0), (t1, -1.0)):
        indices, offsets, _ = seen["batch"]
        counts = torch.bincount(indices, minlength=config.num_embeddings).float()
        expected = sign / len(offsets) * counts[:, None] * weight.sum(0)[None, :]
        torch.testing.assert_close(seen["emb_grad"], expected, **TOL)
        assert seen["emb_grad"].abs().sum() > 0
    assert torch.equal(t0["emb_grad"], -t1["emb_grad"])  # the same sums, opposite signs
    # Both steps applied: the table moved by +g and back by -g (to rounding).
    torch.testing.assert_close(report["table"], report["initial_table"], rtol=0, atol=1e-6)


def test_sharding_does_not_change_the_gradients(probe):
    """Same seed, same data, one server or three: the same losses and gradients. (The table
    is drawn whole by the master and then split, so both runs start from the same one.)"""
    one, three = probe(2, 1), probe(2, 3)
    assert torch.equal(one["initial_table"], three["initial_table"])
    for name in ("trainer0", "trainer1"):
        a, b = one["trainers"][name], three["trainers"][name]
        for x, y in zip(a["batch"], b["batch"], strict=True):
            assert torch.equal(x, y)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        torch.testing.assert_close(a["emb_grad"], b["emb_grad"], **TOL)
        for x, y in zip(a["fc_grads"], b["fc_grads"], strict=True):
            torch.testing.assert_close(x, y, **TOL)
    torch.testing.assert_close(one["table"], three["table"], **TOL)
