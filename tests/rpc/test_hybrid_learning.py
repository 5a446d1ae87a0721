"""The hybrid model learns: training through RPC and DDP lowers the loss.

What the tutorial claims: the trainers' loop (a dist-autograd context, forward, loss,
distributed backward, ``DistributedOptimizer.step``) trains both halves of the model, the
table on the parameter servers and the DDP-replicated ``Linear`` on the trainers.

What this module proves: on data a linear model *can* learn, every trainer's loss falls well
below where it started. (The tutorial's own batches have random labels, which nothing can
learn: ``test_hybrid_cli.py`` runs those and checks only that the loss stays plausible.) The
gradients of a single step are checked exactly in ``test_hybrid_parity.py``; this is the
whole loop, run as the tutorial runs it, over several epochs.
"""

from __future__ import annotations

import torch

from tutorial_impl.rpc.hybrid import HybridConfig, run_worker
from tutorial_impl.rpc.hybrid_world import master_rank


def test_training_lowers_the_loss(run_ranks):
    """Labels a linear model can learn (a bag of class c holds rows of block c only), two
    trainers, the table over two servers: four epochs must cut every trainer's loss."""
    config = HybridConfig(
        2,
        2,
        epochs=4,
        batches=5,
        data="learnable",
        seed=7,
        verbose=False,
        rpc_timeout=15.0,
        train_timeout=30.0,
    )
    results = run_ranks(run_worker, config, world_size=config.world_size, backend=None)
    # Every process played its role of the layout: trainers, master, servers.
    assert [r["name"] for r in results] == ["trainer0", "trainer1", "master", "ps0", "ps1"]
    # The master told everyone that training succeeded, so they all left gracefully.
    assert all(r["training_ok"] for r in results if r["name"] != "master")

    report = results[master_rank(config)]
    for name, seen in report["trainers"].items():
        losses = seen["losses"]
        assert len(losses) == config.epochs
        # Chance level is ln 8 = 2.08; a learning run ends far below its first epoch.
        assert losses[-1] < 0.7 * losses[0], f"{name} did not learn: {losses}"
    # The table on the servers was trained too, not only the trainers' Linear.
    assert not torch.equal(report["table"], report["initial_table"])
