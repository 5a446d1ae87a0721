"""Elastic recovery: a DDP job that survives a worker's death under ``torchrun --max-restarts``.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 \\
        -m tutorial_impl.dist_tuto.elastic --steps 5 --ckpt-dir ckpt --out final.pt

When a worker dies, torchrun's agent stops the other workers of the job and, while restarts
are left, starts all of them again: new processes, with ``TORCHELASTIC_RESTART_COUNT`` one
higher and nothing of the old ones' memory. What the new workers know is what is on disk.
So a job written for torchrun follows the recipe of torchrun's documentation: on start, load
the newest checkpoint if there is one; then train, checkpointing as it goes. This one saves
a ``torch.distributed.checkpoint`` (DCP) checkpoint after every step, holding all it needs
to go on exactly where it stopped: the model, the optimizer's state (SGD's momentum
buffers) and the step. A restarted job then ends with the very parameters, bit for bit, of
a job that was never interrupted (``tests/dist_tuto/test_09_elastic.py`` proves it, with
rank 1 killed inside step 3's all_reduce). One more thing a restart needs on torch 2.13:
keys of its own in the store the attempts share (``attempt_store``).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.nn.parallel import DistributedDataParallel as DDP

from tutorial_impl.dist_tuto.process import print_line, run_main

MODEL_SEED, DATA_SEED = 0, 1
ROWS = 16  # the global batch of every step, split evenly over the ranks
LR, MOMENTUM = 0.05, 0.9
CHECKPOINT = "step_{:05d}"  # one directory per step: an old one is never half overwritten
COMPLETE = ".metadata"  # DCP writes it last: see ``newest_checkpoint``


def make_model() -> nn.Module:
    """Two small ``Linear`` layers, drawn from a fixed seed: the same start on every rank."""
    torch.manual_seed(MODEL_SEED)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))


def step_batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of step ``step``'s global batch.

    The batch is a function of the step alone, drawn from a generator seeded with it: the
    data order must not depend on the attempt. A generator seeded once at start and drawn
    from step after step would hand a restarted job step 1's batch again at step 3, and its
    parameters would part from the uninterrupted run's for good.
    """
    g = torch.Generator().manual_seed(DATA_SEED * 1_000_003 + step)
    x = torch.randn(ROWS, 8, generator=g)
    y = x[:, :4] * 2.0 - x[:, 4:] + 0.1 * torch.randn(ROWS, 4, generator=g)
    return x.chunk(world_size)[rank], y.chunk(world_size)[rank]


class AppState(Stateful):
    """What a checkpoint holds, in the shape DCP's tutorial gives it: DCP calls
    ``state_dict`` when it saves and ``load_state_dict`` when it loads.

    ``get_state_dict`` names the parameters as the plain model does (without DDP's
    ``module.`` prefix) and the optimizer's state by those names, not by position;
    ``set_state_dict`` puts them back, creating the momentum buffers a fresh optimizer
    does not have yet. The step travels as a tensor so that DCP loads it in place."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.step = torch.zeros((), dtype=torch.int64)

    def state_dict(self) -> dict:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state, "step": self.step}

    def load_state_dict(self, state_dict: dict) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
        )
        self.step.copy_(state_dict["step"])


def newest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The checkpoint of the latest step that is complete, or None.

    A checkpoint is trusted only when complete: a worker killed while saving leaves a
    directory with some ranks' files and not others', and loading it would fail, or load
    a state no step ever had. DCP writes ``.metadata`` last, on rank 0 (written aside, then
    renamed into place), once every rank has reported its files written: its presence
    means the whole checkpoint is there. An incomplete one is skipped and will be written
    again when the job gets to that step.
    """
    complete = [p for p in ckpt_dir.glob("step_*") if (p / COMPLETE).exists()]
    return max(complete, default=None)  # zero-padded names: the newest sorts last


def attempt() -> int:
    """Which attempt of the job this is: 0, then one more each time torchrun restarts it."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def train(rank: int, world_size: int, steps: int, ckpt_dir: str | Path) -> dict[str, torch.Tensor]:
    """Train ``steps`` steps of DDP, resuming from the newest checkpoint in ``ckpt_dir``,
    saving one after every step; returns the final parameters (every rank holds them)."""
    ckpt_dir = Path(ckpt_dir)
    model = DDP(make_model())  # its start broadcasts rank 0's parameters to the others
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    state = AppState(model, optimizer)
    # Whether to resume is the directory's call, not the attempt number's: attempt 1 of a
    # job killed before its first save starts fresh, and attempt 0 of a job resubmitted by
    # hand should resume. The count is for the log (and the reader of it).
    newest = newest_checkpoint(ckpt_dir)
    if newest is not None:
        dcp.load({"app": state}, checkpoint_id=newest)  # every rank reads, in place
    start = int(state.step)
    print_line(f"Rank {rank} attempt {attempt()}: starting after step {start}")
    for step in range(start + 1, steps + 1):
        x, y = step_batch(step, rank, world_size)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()  # DDP all-reduces the gradients in here
        optimizer.step()
        state.step.fill_(step)
        dcp.save({"app": state}, checkpoint_id=ckpt_dir / CHECKPOINT.format(step))
        print_line(f"Rank {rank} attempt {attempt()}: step {step} saved")
    return {name: p.detach().clone() for name, p in model.module.named_parameters()}


def attempt_store(rank: int, world_size: int) -> dist.Store:
    """The store torchrun names in MASTER_ADDR:MASTER_PORT, seen through a prefix of this
    attempt's own.

    Why not plain ``init_process_group(backend)``: torchrun's agent hosts the workers'
    store (``TORCHELASTIC_USE_AGENT_STORE=True``) and, in torch 2.13, keeps the same one for
    every attempt. The new workers' gloo then finds the dead workers' addresses under the
    very keys it waits for, connects to them, and fails ("Connection refused") or stalls:
    the restart is lost (seen here without the prefix, in each of three runs). A prefix per
    attempt gives every attempt keys no earlier one wrote. The count is the agent's own, so
    this holds for one node (one agent); on several nodes a healthy agent restarts its
    workers without counting, and ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (a new store per
    attempt, hosted by rank 0) is the way there.
    """
    on_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=rank == 0 and not on_agent,  # without the agent's store, rank 0 hosts one
    )
    print_line(f"Rank {rank} attempt {attempt()}: store {store.host}:{store.port}")
    return dist.PrefixStore(f"attempt_{attempt()}/", store)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="torchrun ... -m tutorial_impl.dist_tuto.elastic",
        description="DDP training that checkpoints every step and resumes after a restart.",
    )
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--ckpt-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, help="rank 0 writes the final parameters here")
    args = parser.parse_args(argv)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        args.backend, store=attempt_store(rank, world_size), rank=rank, world_size=world_size
    )
    try:
        params = train(rank, world_size, args.steps, args.ckpt_dir)
        if rank == 0 and args.out is not None:
            torch.save(params, args.out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    run_main(main)
