"""Combining Distributed DataParallel with Distributed RPC Framework: the tutorial's program.

    python -m tutorial_impl.rpc.hybrid_tutorial [--epochs N]

This is the tutorial's code as it shows it, in one file, top to bottom: ``mp.spawn`` starts
four processes; ranks 0 and 1 are trainers, rank 2 the master, rank 3 the parameter server.
The trainers build their own process group (gloo, world size 2) for DDP *before* RPC; then
all four join RPC. The master puts an ``EmbeddingBag`` on the parameter server with a
``RemoteModule`` and starts ``_run_trainer`` on each trainer with ``rpc_async``. Each trainer
trains a ``HybridModel``: the remote table, then a local ``Linear`` under DDP, with
distributed autograd and a ``DistributedOptimizer`` over both.

The modules beside this one (``hybrid_world``, ``hybrid_data``, ``hybrid_model``, ``hybrid``)
generalise this program for the tests and the benchmark: any number of trainers and parameter
servers, a table split over servers, seeds, a clean shutdown protocol. Read this file first.

The smallest changes, each marked ``# changed:`` where it is made:

* **Ports.** The tutorial hard-codes ``tcp://localhost:29500`` (DDP) and ``:29501`` (RPC); two
  runs at once, or anything else on those ports, collide. ``DDP_INIT_METHOD`` and
  ``RPC_INIT_METHOD`` override them (the tests use ``file://`` rendezvous: no ports at all).
* **Devices.** The tutorial puts the ``Linear`` on ``cuda:rank``; without two GPUs it stays
  on the CPU and DDP gets no ``device_ids``. Indices and offsets stay on the CPU either way,
  as the tutorial's own code keeps them: the table lives on the parameter server's CPU, and a
  CUDA tensor sent to it would need a device map (a version of this tutorial that moves the
  indices to ``cuda:rank`` before the remote lookup fails there).
* **Length.** ``--epochs`` (the tutorial's 100 by default).

RPC itself is stable but not actively developed (pytorch/tutorials issue 3118, which asks
only that the RPC tutorials be checked to still run, "since there are not active
developments on these"): for new work the field has moved to DTensor, FSDP2 and
``torch.distributed.pipelining`` (see "RPC today" in docs/course.md).
"""

from __future__ import annotations

import argparse
import os
import random

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.optim as optim
from torch.distributed.nn import RemoteModule
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef, TensorPipeRpcBackendOptions
from torch.nn.parallel import DistributedDataParallel as DDP

NUM_EMBEDDINGS = 100
EMBEDDING_DIM = 16
EPOCHS = 100  # the tutorial's; --epochs changes it


class HybridModel(torch.nn.Module):
    r"""
    The model consists of a sparse part and a dense part.
    1) The dense part is an nn.Linear module that is replicated across all trainers using
       DistributedDataParallel.
    2) The sparse part is a Remote Module that holds an nn.EmbeddingBag on the parameter
       server. This remote model can get a Remote Reference to the embedding table on the
       parameter server.
    """

    def __init__(self, remote_emb_module, device):
        super().__init__()
        self.remote_emb_module = remote_emb_module
        if device.type == "cuda":
            self.fc = DDP(torch.nn.Linear(16, 8).cuda(device), device_ids=[device])
        else:  # changed: no GPU for this trainer, DDP on the CPU
            self.fc = DDP(torch.nn.Linear(16, 8))
        self.device = device

    def forward(self, indices, offsets):
        emb_lookup = self.remote_emb_module.forward(indices, offsets)
        return self.fc(emb_lookup.to(self.device))


def _run_trainer(remote_emb_module, rank, epochs=EPOCHS):
    r"""
    Each trainer runs a forward pass which involves an embedding lookup on the
    parameter server and running nn.Linear locally. During the backward pass,
    DDP is responsible for aggregating the gradients for the dense part
    (nn.Linear) and distributed autograd ensures gradients updates are
    propagated to the parameter server.
    """
    # changed: cuda:rank only where there are GPUs for both trainers
    two_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    device = torch.device("cuda", rank) if two_gpus else torch.device("cpu")

    # Setup the model.
    model = HybridModel(remote_emb_module, device)

    # Retrieve all model parameters as rrefs for DistributedOptimizer.

    # Retrieve parameters for embedding table.
    model_parameter_rrefs = model.remote_emb_module.remote_parameters()

    # model.fc.parameters() only includes local parameters.
    # NOTE: Cannot call model.parameters() here,
    # because this will call remote_emb_module.parameters(),
    # which supports remote_parameters() but not parameters().
    for param in model.fc.parameters():
        model_parameter_rrefs.append(RRef(param))

    # Setup distributed optimizer
    opt = DistributedOptimizer(
        optim.SGD,
        model_parameter_rrefs,
        lr=0.05,
    )

    criterion = torch.nn.CrossEntropyLoss()

    def get_next_batch(rank):
        for _ in range(10):
            num_indices = random.randint(20, 50)
            indices = torch.LongTensor(num_indices).random_(0, NUM_EMBEDDINGS)

            # Generate offsets.
            offsets = []
            start = 0
            batch_size = 0
            while start < num_indices:
                offsets.append(start)
                start += random.randint(1, 10)
                batch_size += 1

            offsets_tensor = torch.LongTensor(offsets)
            target = torch.LongTensor(batch_size).random_(8).to(device)
            yield indices, offsets_tensor, target

    # Train for 100 epochs
    for epoch in range(epochs):
        # create distributed autograd context
        for indices, offsets, target in get_next_batch(rank):
            with dist_autograd.context() as context_id:
                output = model(indices, offsets)
                loss = criterion(output, target)

                # Run distributed backward pass
                dist_autograd.backward(context_id, [loss])

                # Tun distributed optimizer
                opt.step(context_id)

                # Not necessary to zero grads as each iteration creates a different
                # distributed autograd context which hosts different grads
        print(f"Training done for epoch {epoch}", flush=True)


def run_worker(rank, world_size, epochs=EPOCHS):
    r"""
    A wrapper function that initializes RPC, calls the function, and shuts down
    RPC.
    """

    # We need to use different port numbers in TCP init_method for init_rpc and
    # init_process_group to avoid port conflicts.
    rpc_backend_options = TensorPipeRpcBackendOptions()
    # changed: the tutorial's port unless RPC_INIT_METHOD says otherwise
    rpc_backend_options.init_method = os.environ.get("RPC_INIT_METHOD", "tcp://localhost:29501")

    # Rank 2 is master, 3 is ps and 0 and 1 are trainers.
    if rank == 2:
        rpc.init_rpc(
            "master",
            rank=rank,
            world_size=world_size,
            rpc_backend_options=rpc_backend_options,
        )

        remote_emb_module = RemoteModule(
            # "ps" with no "/<device>" is ps's CPU: torch/distributed/remote_device.py parses
            # a lone worker name as "<name>/cpu", and RemoteModule takes its device from that.
            "ps",
            torch.nn.EmbeddingBag,
            args=(NUM_EMBEDDINGS, EMBEDDING_DIM),
            kwargs={"mode": "sum"},
        )

        # Run the training loop on trainers.
        futs = []
        for trainer_rank in [0, 1]:
            trainer_name = f"trainer{trainer_rank}"
            fut = rpc.rpc_async(
                trainer_name, _run_trainer, args=(remote_emb_module, trainer_rank, epochs)
            )
            futs.append(fut)

        # Wait for all training to finish.
        for fut in futs:
            fut.wait()
    elif rank <= 1:
        # Initialize process group for Distributed DataParallel on trainers.
        dist.init_process_group(
            backend="gloo",
            rank=rank,
            world_size=2,
            # changed: the tutorial's port unless DDP_INIT_METHOD says otherwise
            init_method=os.environ.get("DDP_INIT_METHOD", "tcp://localhost:29500"),
        )

        # Initialize RPC.
        trainer_name = f"trainer{rank}"
        rpc.init_rpc(
            trainer_name,
            rank=rank,
            world_size=world_size,
            rpc_backend_options=rpc_backend_options,
        )

        # Trainer just waits for RPCs from master.
    else:
        rpc.init_rpc(
            "ps",
            rank=rank,
            world_size=world_size,
            rpc_backend_options=rpc_backend_options,
        )
        # parameter server do nothing
        pass

    # block until all rpcs finish
    rpc.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=EPOCHS, help="epochs of 10 batches")
    epochs = parser.parse_args().epochs
    if epochs < 1:
        parser.error(f"--epochs must be at least 1, got {epochs}")
    # 2 trainers, 1 parameter server, 1 master.
    world_size = 4
    mp.spawn(run_worker, args=(world_size, epochs), nprocs=world_size, join=True)
