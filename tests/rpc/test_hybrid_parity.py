"""DDP + RPC gradients, checked against a single process that never heard of either.

The hybrid model splits one computation over processes: the embedding table lives on the
parameter server(s), a replica of the ``Linear`` on each trainer. Whatever the split, the
numbers must be those of the plain model::

    out = Linear(EmbeddingBag(indices, offsets))       # one process, plain autograd

Each trainer takes one step (``hybrid_checks._probe_trainer``) and reports its batch, the
gradients in its dist-autograd context and its weights before and after the step; the
master reports the whole table before and after. Here, in the test process, we replay the
same batches through a plain ``EmbeddingBag`` + ``Linear`` starting from the same weights.

Tolerance: float32 with ``rtol=1e-5, atol=1e-6``. The distributed run adds the same terms in
another order (shards' partial sums, DDP's allreduce), so we expect rounding, not equality.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tutorial_impl.rpc.hybrid import HybridConfig
from tutorial_impl.rpc.hybrid_checks import TEST_DEADLINES, probe_worker
from tutorial_impl.rpc.hybrid_model import shard_bounds, split_bags
from tutorial_impl.testing.supervisor import run_ranks

TOL = {"rtol": 1e-5, "atol": 1e-6}
SEED = 1234
# (trainers, parameter servers): the tutorial's world, then the same data over three
# shards (rows 0-33, 34-66, 67-99), then three trainers over two shards.
VARIANTS = [(2, 1), (2, 3), (3, 2)]


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


_runs: dict[tuple[int, int], dict] = {}


@pytest.fixture
def probe() -> Callable[[int, int], dict]:
    """Run (once per variant and test process) the probing world; return the master's report.

    Every test of a variant reads the same run: an RPC world costs about a second to start.
    """

    def run(trainers: int, servers: int) -> dict:
        if (trainers, servers) not in _runs:
            config = HybridConfig(trainers, servers, seed=SEED, verbose=False, **TEST_DEADLINES)
            results = run_ranks(
                probe_worker, config, world_size=config.world_size, backend=None, timeout=90
            )
            # Every rank ran its role and came back, not just the master.
            names = [r["name"] for r in results]
            assert names == [f"trainer{i}" for i in range(trainers)] + ["master"] + [
                f"ps{j}" for j in range(servers)
            ]
            _runs[trainers, servers] = results[trainers]
        return _runs[trainers, servers]

    return run


def _replay(report: dict) -> dict[str, tuple]:
    """The reference step of every trainer, from the run's initial weights and batches."""
    table = report["initial_table"]
    fc = report["trainers"]["trainer0"]["fc_before"]
    return {
        name: reference_step(table, fc, seen["batch"]) for name, seen in report["trainers"].items()
    }


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"{v[0]}trainers-{v[1]}ps")
def test_one_step_matches_the_single_process_reference(probe, variant):
    # One test per world (not one per claim): under ``pytest -n auto`` tests of a module may
    # land in different processes, and each would start the world again.
    report = probe(*variant)
    trainers = report["trainers"]
    assert len(trainers) == variant[0]
    ref = _replay(report)

    # DDP broadcast trainer 0's fc at construction: every replica starts identical.
    for seen in trainers.values():
        for mine, first in zip(seen["fc_before"], trainers["trainer0"]["fc_before"], strict=True):
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
    lr = HybridConfig().lr
    table = report["initial_table"].clone()
    for name in sorted(ref):  # trainer0, trainer1, ...: the order of the steps
        table -= lr * ref[name][1]
    torch.testing.assert_close(report["table"], table, **TOL)
    assert not torch.equal(report["table"], report["initial_table"])
    fc0 = trainers["trainer0"]["fc_before"]
    for seen in trainers.values():
        for k in range(2):
            torch.testing.assert_close(seen["fc_after"][k], fc0[k] - lr * mean_fc[k], **TOL)


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


@pytest.mark.parametrize("servers", [1, 2, 3, 7])
def test_shard_lookup_adds_up_to_the_whole_table(servers):
    """The sharded lookup, without RPC: each shard's ``EmbeddingBag`` sees only its rows
    (renumbered) and the same bags; the partial sums add up to the unsharded lookup. The
    bags include one with a single row and rows at both ends of the table, so some shards
    see empty bags (which must contribute zeros)."""
    g = torch.Generator().manual_seed(SEED)
    table = torch.randn(100, 16, generator=g)
    indices = torch.tensor([0, 99, 5, 50, 50, 33, 34, 66, 67, 12])
    offsets = torch.tensor([0, 2, 3, 6, 9])  # bags: [0, 99] [5] [50, 50, 33] [34, 66, 67] [12]
    whole = F.embedding_bag(indices, table, offsets, mode="sum")

    bounds = shard_bounds(100, servers)
    sizes = [end - start for start, end in bounds]
    assert bounds[0][0] == 0 and bounds[-1][1] == 100 and max(sizes) - min(sizes) <= 1
    parts = []
    for start, end in bounds:
        local_indices, local_offsets = split_bags(indices, offsets, start, end)
        assert len(local_offsets) == len(offsets)  # every bag kept, maybe empty
        assert ((local_indices >= 0) & (local_indices < end - start)).all()
        parts.append(F.embedding_bag(local_indices, table[start:end], local_offsets, mode="sum"))
    torch.testing.assert_close(torch.stack(parts).sum(0), whole, **TOL)
