"""The DDP + RPC tutorial's program as written (``tutorial_impl/rpc/hybrid_tutorial.py``).

``run_worker`` is the tutorial's function for one of its four processes; here the harness
starts the four (where the tutorial's ``mp.spawn`` would), with ``file://`` rendezvous for
the trainers' process group and for RPC instead of the tutorial's fixed ports. One epoch of
the tutorial's ten batches runs on both trainers, every process must end cleanly
(``rpc.shutdown`` waits for all), and the output must be the tutorial's.

The program prints nothing of what it computed, so the test watches it, without changing a
line of it (``watched_worker``): on each trainer, torch's global forward pre-hook sees every
batch the ``HybridModel`` is called with, and the model itself (its DDP ``Linear`` before the
first step and after the last); on the parameter server, a wrapper of
``EmbeddingBag.forward`` sees every lookup and the table itself. What the program computed,
checked against what the tutorial says it does:

1. each trainer trained on 10 batches of its own, shaped as ``get_next_batch`` makes them;
2. the parameter server looked up exactly those batches, and training changed exactly the
   table rows they used (distributed autograd and the ``DistributedOptimizer`` reached it);
3. the two trainers end with the same ``Linear``, bit for bit, moved from where it started,
   though their batches differ: DDP averaged their gradients.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook

from tutorial_impl.rpc import hybrid_tutorial

# The tutorial's program as written meets torch 2.13's deprecations (the ranks' warnings reach
# this test's report, labelled with the rank): a gloo backend used as a ProcessGroup (RPC's
# own) and TorchScript under DistributedOptimizer, filtered here, narrowly. One stays in the
# summary whatever a filter says, as in a plain test: torch warns "`TorchScript` support for
# functional optimizers is deprecated" under a ``simplefilter("always")`` of its own.
pytestmark = [
    pytest.mark.filterwarnings(
        "ignore:You are using a Backend .*ProcessGroupGloo.* as a ProcessGroup"
    ),
    pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning"),
]

EPOCHS = 1
BATCHES = 10  # the tutorial's get_next_batch yields 10 batches per epoch


def fc_vector(model: hybrid_tutorial.HybridModel) -> torch.Tensor:
    """The trainer's ``Linear`` (inside DDP) as one vector: weight, then bias."""
    return torch.cat([p.detach().flatten() for p in model.fc.module.parameters()]).clone()


def watched_trainer(rank: int, world_size: int) -> dict[str, Any]:
    """A trainer, watched through torch's global forward pre-hook (every module's call)."""
    seen: dict[str, Any] = {"batches": []}

    def before_forward(module: nn.Module, args: tuple) -> None:
        if isinstance(module, hybrid_tutorial.HybridModel):
            if "model" not in seen:  # the first call: no step has been taken yet
                seen["model"], seen["fc_start"] = module, fc_vector(module)
            indices, offsets = args
            seen["batches"].append((indices.tolist(), offsets.tolist()))

    handle = register_module_forward_pre_hook(before_forward)
    try:
        hybrid_tutorial.run_worker(rank, world_size, EPOCHS)
    finally:
        handle.remove()
    return {
        "batches": seen["batches"],
        "fc_start": seen["fc_start"],
        "fc_end": fc_vector(seen["model"]),
    }


def watched_server(rank: int, world_size: int) -> dict[str, Any]:
    """The parameter server, its lookups seen by wrapping ``EmbeddingBag.forward`` here.

    ``RemoteModule`` runs a lookup as ``module.forward(...)``, which skips module hooks, so
    the wrapper goes on the class, in this process only, for the length of the run. The
    first lookup comes before any step (a step needs a lookup first): the initial table.
    """
    lookups: list[tuple[nn.EmbeddingBag, torch.Tensor, list[int]]] = []
    forward = nn.EmbeddingBag.forward

    def watched(self, input, offsets=None, per_sample_weights=None):  # noqa: A002 - torch's
        lookups.append((self, self.weight.detach().clone(), input.tolist()))
        return forward(self, input, offsets, per_sample_weights)

    nn.EmbeddingBag.forward = watched
    try:
        hybrid_tutorial.run_worker(rank, world_size, EPOCHS)
    finally:
        nn.EmbeddingBag.forward = forward
    table, initial, _ = lookups[0]
    return {
        "tables": len({id(t) for t, _, _ in lookups}),
        "lookups": [indices for _, _, indices in lookups],
        "initial": initial,
        "final": table.weight.detach().clone(),
    }


def watched_worker(rank: int, world_size: int) -> dict[str, Any] | None:
    """``hybrid_tutorial.run_worker(rank, world_size, 1)``, trainers and server watched."""
    if rank in (0, 1):
        return watched_trainer(rank, world_size)
    if rank == 3:
        return watched_server(rank, world_size)
    hybrid_tutorial.run_worker(rank, world_size, EPOCHS)  # the master
    return None


def test_the_tutorials_program_trains_and_shuts_down(run_ranks, tmp_path):
    env = {
        "DDP_INIT_METHOD": f"file://{tmp_path / 'ddp'}",
        "RPC_INIT_METHOD": f"file://{tmp_path / 'rpc'}",
    }
    # World size 4, as the tutorial's mp.spawn: trainers 0 and 1, master 2, server 3.
    results = run_ranks(watched_worker, world_size=4, backend=None, env=env, timeout=60)
    trainers, master, server = results[:2], results[2], results[3]
    assert master is None  # every process returned: rpc.shutdown completed
    for rank in (0, 1):  # the tutorial's line, once per epoch, from each trainer
        assert "Training done for epoch 0" in results.outputs[rank].splitlines()
    for other in (2, 3):  # master and parameter server print nothing of their own
        assert "Training done" not in results.outputs[other]

    # 1. Ten batches per trainer, as get_next_batch makes them: 20 to 50 rows of the 100,
    # in bags of 1 to 10 (offsets start at 0 and step by 1 to 10).
    for trainer in trainers:
        assert len(trainer["batches"]) == EPOCHS * BATCHES
        for indices, offsets in trainer["batches"]:
            assert 20 <= len(indices) <= 50 and all(0 <= i < 100 for i in indices)
            bags = [b - a for a, b in zip(offsets, [*offsets[1:], len(indices)], strict=True)]
            assert offsets[0] == 0 and all(1 <= size <= 10 for size in bags)
    assert trainers[0]["batches"] != trainers[1]["batches"]  # each trainer has its own data

    # 2. One table on the server, looked up once per batch of either trainer, nothing else;
    # only the rows a batch used were stepped (an epoch uses nearly all 100) ...
    assert server["tables"] == 1
    sent = [indices for trainer in trainers for indices, _ in trainer["batches"]]
    assert sorted(server["lookups"]) == sorted(sent)
    used = {i for indices in sent for i in indices}
    changed = (server["final"] != server["initial"]).any(dim=1).nonzero().flatten().tolist()
    assert set(changed) <= used
    # ... and nearly all of them, not all: the server steps each trainer's update as it comes,
    # the two at once, without a lock (for SGD, DistributedOptimizer runs TorchScript's
    # functional optimizer there, torch's _ScriptLocalOptimizer, which takes none; the eager
    # _LocalOptimizer does). Each step adds its dense gradient to the whole table, zeros for
    # the rows its trainer did not use, so a step that overlaps the other's can write a row
    # back as it read it. A row only one batch used can end as it began (seen: 1 row of ~95).
    assert len(changed) >= 0.9 * len(used)

    # 3. One Linear on two trainers: the same at the start, stepped, the same at the end.
    assert torch.equal(trainers[0]["fc_start"], trainers[1]["fc_start"])
    assert not torch.equal(trainers[0]["fc_end"], trainers[0]["fc_start"])
    assert torch.equal(trainers[0]["fc_end"], trainers[1]["fc_end"])
