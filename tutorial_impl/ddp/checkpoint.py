"""D11. Distributed checkpointing: save a sharded model at one world size, load it at another.

``torch.save(model.state_dict())`` on rank 0 needs the whole model on rank 0. Under FSDP
(lesson D6) no rank has it: each holds a shard of every parameter and of the optimizer's
state. ``torch.distributed.checkpoint`` (DCP) saves the shards as they are:

* ``get_state_dict(model, optimizer)`` gives both state dicts with the *sharded* values
  (``DTensor``s), keyed by parameter name (the optimizer's too, not by position);
* ``dcp.save(state, checkpoint_id=dir)`` writes every rank's pieces in parallel, one file a
  rank, and rank 0 writes ``.metadata``: for each tensor, its whole shape and which chunk
  (offsets, sizes) is where. Nothing is gathered;
* ``dcp.load(state, checkpoint_id=dir)`` fills *the state you hand it, in place*: each rank
  asks for the chunks its own shards cover, whatever cut produced the files. So a checkpoint
  written by 4 ranks loads on 2 (each reads two files' worth), or into an unsharded model
  in a process with no process group at all (``no_dist=True``). ``set_state_dict`` then puts
  the values into the model and the optimizer.

Training resumes exactly: the lesson saves after one step of SGD with momentum (the momentum
buffers are optimizer state, sharded like the parameters), loads at another world size and
takes the second step. Without the buffers, the second step would be a different one.

**Asynchronous save.** ``dcp.async_save`` first *stages* the state: copies it into memory
of its own (CPU memory by default), then returns a future while a background thread writes
the files. From the moment it returns, training may change the parameters: the checkpoint
holds the values of the call. What must not change while the future runs: the writer
thread coordinates the ranks with collectives (it gathers the save plans, for one), so it
gets a process group of its own (``dist.new_group(backend="gloo")``) instead of sharing the
default group with training's collectives, whose order on each rank it could interleave;
and a second ``async_save`` waits for the first future, never two at once.

    python -m tutorial_impl.ddp.checkpoint      # saves on 4 local ranks, loads on 2 and on 1
"""

from __future__ import annotations

import functools
import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh

from tutorial_impl.ddp import fsdp, toy
from tutorial_impl.dist_tuto.process import print_line

PRELOAD = ["torch._dynamo"]  # the first optimizer imports it: see equivalence.py
MOMENTUM = 0.9


def sharded(size: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``toy.mlp(0)`` under FSDP2 over ``size`` ranks (lesson D6), with SGD + momentum."""
    model = fsdp.shard(toy.mlp(0), init_device_mesh("cpu", (size,)))
    return model, torch.optim.SGD(model.parameters(), lr=toy.LR, momentum=MOMENTUM)


def step(model: nn.Module, optimizer, rank: int, size: int, x, y) -> None:
    """One step on this rank's share of the global batch ``(x, y)``."""
    optimizer.zero_grad()
    F.mse_loss(model(toy.shard(x, rank, size)), toy.shard(y, rank, size)).backward()
    optimizer.step()


def whole(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole (a DTensor's ``full_tensor``), by name."""
    return {
        n: getattr(p, "full_tensor", p.detach)().detach().clone()
        for n, p in model.named_parameters()
    }


def momentum(model: nn.Module, optimizer) -> dict[str, torch.Tensor]:
    """A copy of every momentum buffer, gathered whole, by parameter name."""
    names = {p: n for n, p in model.named_parameters()}
    buffers = {names[p]: s["momentum_buffer"] for p, s in optimizer.state.items()}
    return {n: getattr(b, "full_tensor", b.detach)().clone() for n, b in buffers.items()}


def save_after_one_step(rank: int, size: int, x, y, directory: str) -> dict:
    """Train one step on ``size`` ranks and save to ``directory/sync``; then ``async_save``
    to ``directory/async``, take a second step while it writes, and wait for it."""
    model, optimizer = sharded(size)
    step(model, optimizer, rank, size, x, y)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.save(state, checkpoint_id=os.path.join(directory, "sync"))
    held = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
    after_one = whole(model)

    writer_group = dist.new_group(backend="gloo")  # the writer thread's own collectives
    try:
        future = dcp.async_save(
            state, checkpoint_id=os.path.join(directory, "async"), process_group=writer_group
        )
        step(model, optimizer, rank, size, x, y)  # training goes on: the state changes now
        future.result(timeout=60)  # before the next save, and before the group goes
    finally:
        dist.destroy_process_group(writer_group)
    return {"held": held, "after_one": after_one, "after_two": whole(model)}


def load_and_step(rank: int, size: int, x, y, checkpoint: str) -> dict:
    """A fresh sharded model on ``size`` ranks, loaded from ``checkpoint``; one more step."""
    model, optimizer = sharded(size)
    model_state, optim_state = get_state_dict(model, optimizer)  # the shapes to fill
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=checkpoint)  # each rank reads the chunks its shards cover
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    loaded, buffers = whole(model), momentum(model, optimizer)
    held = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
    step(model, optimizer, rank, size, x, y)
    return {"held": held, "loaded": loaded, "momentum": buffers, "after_two": whole(model)}


def load_in_one_process(x, y, checkpoint: str) -> dict:
    """The same checkpoint in a plain model and optimizer, with no process group at all."""
    model = toy.mlp(1)  # another seed: only the checkpoint can make it right
    optimizer = torch.optim.SGD(model.parameters(), lr=toy.LR, momentum=MOMENTUM)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    # torch warns "torch.distributed is disabled ... assuming the intent is to load in a
    # single process" even when no_dist=True says so: here that is the intent.
    dcp.load(state, checkpoint_id=checkpoint, no_dist=True)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    loaded, buffers = whole(model), momentum(model, optimizer)
    step(model, optimizer, 0, 1, x, y)
    return {"loaded": loaded, "momentum": buffers, "after_two": whole(model)}


def chunks(checkpoint: str, key: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """How ``key`` was saved: (offsets, sizes) of each chunk, read from ``.metadata``."""
    metadata = dcp.FileSystemReader(checkpoint).read_metadata()
    found = metadata.state_dict_metadata[key].chunks
    return sorted((tuple(c.offsets), tuple(c.sizes)) for c in found)


def demo_save(rank: int, size: int, *, x, y, directory: str) -> None:
    seen = save_after_one_step(rank, size, x, y, directory)
    print_line(f"saved at world {size}: rank {rank} held {seen['held']}")


def demo_load(rank: int, size: int, *, x, y, directory: str) -> None:
    seen = load_and_step(rank, size, x, y, os.path.join(directory, "sync"))
    print_line(f"loaded at world {size}: rank {rank} holds {seen['held']}")


def main(argv: list[str] | None = None) -> int:
    from tutorial_impl import cli  # the CLI's launcher, not the lesson's

    parser = toy.demo_parser(
        __name__,
        "D11. Save a sharded model and optimizer on 4 ranks, load on 2 and in one process.",
        world_size=None,
    )
    parser.add_argument(
        "--directory",
        help="where to save (default: a temporary directory, removed after; "
        "under torchrun, give one every worker sees)",
    )
    args = parser.parse_args(argv)
    x, y = toy.batch(16)
    with tempfile.TemporaryDirectory() as scratch:
        directory = args.directory or scratch
        for demo, size in ((demo_save, 4), (demo_load, 2)):
            fn = functools.partial(demo, x=x, y=y, directory=directory)  # pickled to the ranks
            status = cli.exit_status(
                lambda f=fn, n=size: cli.launch(f, n, "gloo", args.timeout, PRELOAD)
            )
            if status:
                return status
        saved = os.path.join(directory, "sync")
        print_line(f"model.0.weight as saved, (offsets, sizes): {chunks(saved, 'model.0.weight')}")
        one = load_in_one_process(x, y, saved)
        print_line(f"loaded in one process: 0.bias[:3] {one['loaded']['0.bias'][:3].tolist()}")
    return 0


if __name__ == "__main__":
    toy.run_as_script(main)  # the package's copy of this module: see toy.py
