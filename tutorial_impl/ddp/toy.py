"""The model and the data every lesson of this course uses, kept tiny on purpose.

A lesson about communication should spend its time communicating. Three ``Linear`` layers
with ReLUs between them have six parameters of clearly different sizes (enough to fill
several DDP buckets, to shard unevenly, to split into two pipeline stages), and a step costs
microseconds. The data is a regression problem (``y = x @ w_true + noise``) so the loss is a
plain ``MSELoss`` and no dropout or batch norm can make two runs differ.

Everything here is deterministic in its seed, so every rank, and the test that checks them
in its own process, can rebuild *the same* model and *the same* global batch independently:
no communication is needed to agree on the starting point (except where a lesson shows what
DDP does when ranks do *not* agree, in ``equivalence.py``).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import torch
import torch.nn as nn

from tutorial_impl.dist_tuto.process import run_main

# (in, hidden, hidden, out): the parameters are 256 + 32, 1024 + 32, 128 + 4 floats.
SIZES = (8, 32, 32, 4)
LR = 0.1


def mlp(seed: int = 0, sizes: tuple[int, ...] = SIZES) -> nn.Sequential:
    """``Linear, ReLU, Linear, ReLU, Linear`` with weights drawn from ``seed``."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(zip(sizes, sizes[1:], strict=False)):
        if i:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(fan_in, fan_out))
    return nn.Sequential(*layers)


def batch(rows: int, seed: int = 1, sizes: tuple[int, ...] = SIZES) -> tuple[torch.Tensor, ...]:
    """``rows`` samples ``(x, y)`` of a noisy linear map, from their own generator.

    A private ``torch.Generator`` leaves the global one alone, so drawing data never shifts
    the weights a later ``mlp(seed)`` draws.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, sizes[0], generator=g)
    w_true = torch.randn(sizes[0], sizes[-1], generator=g)
    y = x @ w_true + 0.1 * torch.randn(rows, sizes[-1], generator=g)
    return x, y


def shard(tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous share of a global batch (the rows split evenly)."""
    if len(tensor) % size:
        raise ValueError(f"a batch of {len(tensor)} rows does not split evenly over {size} ranks")
    return tensor.chunk(size)[rank]


def plain_sgd_step(model: nn.Module, lr: float = LR) -> None:
    """``p -= lr * p.grad`` for every parameter: ``torch.optim.SGD`` without momentum, written
    out. The tests' one-process references step with it: independent of ``torch.optim``, and
    cheap (the first ``torch.optim`` optimizer a process builds imports ``torch._dynamo``,
    about a second of CPU)."""
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad


def parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of every parameter, by name: what a rank returns to be compared."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def demo_parser(
    module: str, description: str, world_size: int | None = 2
) -> argparse.ArgumentParser:
    """A lesson demo's command line: its name, what it shows, --world-size, --timeout."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=description)
    if world_size is not None:
        parser.add_argument("--world-size", type=int, default=world_size, help="number of ranks")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds for the run")
    return parser


def main(
    demo: Callable[[int, int], object],
    world_size: int,
    timeout: float,
    preload: list[str] | None = None,
) -> int:
    """The lessons' demos' main: run a demo on local gloo ranks; the exit status (the CLI's
    launcher, not the lesson's: a learner's own script would use ``torch.multiprocessing``
    or torchrun)."""
    from tutorial_impl import cli

    return cli.exit_status(lambda: cli.launch(demo, world_size, "gloo", timeout, preload or ()))


def run_as_script(main: Callable[[], int | None]) -> NoReturn:
    """A lesson's ``if __name__ == "__main__":``, in one line: run its demo's ``main``.

    Run as ``python -m tutorial_impl.ddp.<lesson>`` (or as a file), the lesson is the module
    ``__main__``, and the ranks the demo starts (forked from a server started before it)
    cannot look ``__main__.demo`` up by name. The same file imported under its package's
    name can be looked up, so this runs that copy's ``main`` (``run_main``: its exit status,
    and a torchrun worker's careful exit)."""
    run_main(package_copy(main))


def package_copy(function: Callable) -> Callable:
    """``function`` as defined by its module imported under the package's name (itself when
    it is not ``__main__``'s)."""
    if function.__module__ != "__main__":
        return function
    spec = function.__globals__.get("__spec__")  # None when run as a file, not with -m
    if spec is not None:
        name = spec.name
    else:
        name = f"{__package__}.{Path(function.__globals__['__file__']).stem}"
    return getattr(importlib.import_module(name), function.__qualname__)
