"""D16. Tensor parallelism for a transformer block (``ddp/tp_transformer.py``).

The claims, on 2 ranks: with the lesson's plan each rank holds half the heads of ``wq``,
``wk``, ``wv`` (rows, ``Shard(0)``) and of ``wo`` (columns, ``Shard(1)``), half the MLP as in
D10, half the vocabulary of the embedding and of the output layer, and whole norms
(``Replicate()``); the logits stay sharded over the vocabulary (``Shard(-1)``) into
``loss_parallel``; the loss, the logits and the parameters after one SGD step are one
process's. The collectives, counted from the plan: forward, one reduce-scatter where each
row-wise layer ends (embedding, ``wo``, ``w2``: 3) and one all-gather where each
column-wise layer needs the whole sequence (attention, MLP, output: 3); backward the
mirror image (3 and 3); the loss, all-reduces on the vocabulary shards only; the step, one
all-reduce per norm parameter (6), whose gradients backward left ``Partial``. The reference
is the unsplit block in this process.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

from tutorial_impl.ddp import toy
from tutorial_impl.ddp import tp_transformer as lesson

pytestmark = pytest.mark.warm_world

WORLD = 2
ATOL = 1e-5  # float32, sums in another order; one step moves the parameters ~1e-3 or more
ROW_WISE = ("embed", "attention.wo", "feed_forward.w2")  # end with a reduce-scatter
COLUMN_WISE_INPUTS = ("attention", "feed_forward", "output")  # start with an all-gather
NORMS = ("attention_norm", "ffn_norm", "norm")


def one_process(tokens: torch.Tensor, labels: torch.Tensor) -> dict:
    model = lesson.Block()
    logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))
    loss.backward()
    toy.plain_sgd_step(model)
    return {"logits": logits.detach(), "loss": loss.detach(), "params": toy.parameters(model)}


def test_a_transformer_block_split_over_heads_sequence_and_vocabulary(run_ranks) -> None:
    tokens, labels = lesson.data()
    reference = one_process(tokens, labels)
    start = toy.parameters(lesson.Block())
    assert max((reference["params"][k] - start[k]).abs().max() for k in start) > 100 * ATOL
    results = run_ranks(lesson.tensor_parallel_block, tokens, labels, world_size=WORLD)
    for rank, seen in enumerate(results):
        where = f"rank {rank}"
        placements = seen["placements"]
        for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1"):
            assert placements[f"{name}.weight"] == (Shard(0),), f"{where}: {name}"
        for name in ("attention.wo", "feed_forward.w2"):
            assert placements[f"{name}.weight"] == (Shard(1),), f"{where}: {name}"
        assert placements["embed.weight"] == placements["output.weight"] == (Shard(0),)
        for norm in NORMS:
            assert placements[f"{norm}.weight"] == (Replicate(),), f"{where}: {norm}"
            assert seen["grad_placements"][f"{norm}.weight"] == (Partial(),), f"{where}: {norm}"
        assert seen["logits"][0] == (Shard(2),), where  # the vocabulary dimension
        # The collectives, from the plan (the counts are per rank).
        assert seen["forward"] == {
            "reduce_scatter_tensor": len(ROW_WISE),
            "all_gather_into_tensor": len(COLUMN_WISE_INPUTS),
        }, where
        assert seen["backward"] == seen["forward"], where  # the mirror image
        assert set(seen["loss_comms"]) == {"all_reduce"}, where  # no gather of the logits
        assert seen["step"] == {"all_reduce": 2 * len(NORMS)}, where  # weight and bias
        torch.testing.assert_close(seen["logits"][1], reference["logits"], atol=ATOL, rtol=0)
        torch.testing.assert_close(seen["loss"], reference["loss"], atol=ATOL, rtol=0)
        for name, value in reference["params"].items():
            torch.testing.assert_close(seen["params"][name], value, atol=ATOL, rtol=0, msg=name)
