"""What DDP averages and what it does not, and that the hybrid model learns.

In the hybrid model two mechanisms move gradients. DDP *averages* the dense layer's
gradients over the trainers (an allreduce inside the backward pass), while distributed
autograd sends each trainer's *own* embedding gradient to the parameter server. The twin
experiment (after PyTorch's own DDP-under-dist-autograd test) separates the two: two
trainers see the same bags with opposite labels and a loss linear in the output, so their
dense gradients are exact negatives. DDP's average is then exactly zero, while the
embedding gradients, never averaged, are not.
"""

from __future__ import annotations

import torch

from tutorial_impl.rpc.hybrid import HybridConfig, run_worker
from tutorial_impl.rpc.hybrid_checks import TEST_DEADLINES, twin_worker

SEED = 7


def test_twin_examples_cancel_in_ddp_but_not_in_the_table(run_ranks):
    config = HybridConfig(2, 1, seed=SEED, verbose=False, **TEST_DEADLINES)
    results = run_ranks(twin_worker, config, world_size=config.world_size, backend=None)
    assert [r["name"] for r in results] == ["trainer0", "trainer1", "master", "ps0"]
    report = results[2]
    t0, t1 = report["trainers"]["trainer0"], report["trainers"]["trainer1"]

    # Same bags, opposite labels.
    assert torch.equal(t0["batch"][0], t1["batch"][0])
    assert torch.equal(t0["batch"][2], -t1["batch"][2])

    # Alone, each trainer's bias gradient would be mean(sign) * 1 = +1 or -1 for every
    # class (the loss is sign * sum of the outputs). DDP's average makes every fc gradient
    # exactly zero on both trainers, so the replicas do not move at all.
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
        torch.testing.assert_close(seen["emb_grad"], expected, rtol=1e-5, atol=1e-6)
        assert seen["emb_grad"].abs().sum() > 0
    # Exact negatives of each other, bit for bit: the same sums with the opposite sign.
    assert torch.equal(t0["emb_grad"], -t1["emb_grad"])
    # Both steps applied: the table moved by +g and back by -g (to rounding).
    torch.testing.assert_close(report["table"], report["initial_table"], rtol=0, atol=1e-6)


def test_training_lowers_the_loss(run_ranks):
    """Labels a linear model can learn (a bag of class c holds rows of block c only), two
    trainers, the table over two servers: four epochs must cut every trainer's loss."""
    config = HybridConfig(
        2, 2, epochs=4, batches=5, data="learnable", seed=SEED, verbose=False, **TEST_DEADLINES
    )
    results = run_ranks(run_worker, config, world_size=config.world_size, backend=None)
    assert [r["name"] for r in results] == ["trainer0", "trainer1", "master", "ps0", "ps1"]
    assert all(r["training_ok"] for r in results if r["name"] != "master")
    report = results[2]
    for name, seen in report["trainers"].items():
        losses = seen["losses"]
        assert len(losses) == config.epochs
        # Chance level is ln 8 = 2.08; a learning run ends far below its first epoch.
        assert losses[-1] < 0.7 * losses[0], f"{name} did not learn: {losses}"
    assert not torch.equal(report["table"], report["initial_table"])
