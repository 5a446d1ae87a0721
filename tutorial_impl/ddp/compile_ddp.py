"""D13. ``torch.compile`` with DDP: the same step, and the graph split where buckets end.

``torch.compile(ddp_model)`` traces the model's forward into a graph (TorchDynamo) and hands
it to a *backend* that compiles it ("inductor" by default: generated C++ or Triton kernels).
A compiled graph runs backward as one autograd node: every gradient of the graph is written
when that node finishes. Lesson D2's overlap would be lost: DDP launches a bucket's
all-reduce when the bucket's last gradient is written, so all buckets would wait for the
end of backward.

So when the model is a DDP model, Dynamo's **DDPOptimizer** cuts the graph in pieces meant
to follow DDP's buckets: it walks the graph from the output back, fills a piece with the
parameters of the operations it meets until ``bucket_cap_mb`` is reached, and makes each
piece a subgraph compiled on its own. In backward each subgraph is its own node again:
when the last layer's subgraph has finished its backward, its gradients are written and a
bucket's all-reduce can start while the earlier subgraphs still compute ("graph breaks at
bucket boundaries" is torch's reason). The lesson counts them.

The pieces are DDP's buckets only with DDP's default caps. DDPOptimizer caps its *first*
piece at ``dist._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB) whatever ``bucket_cap_mb`` says, while
DDP caps its first bucket at 1 MiB only when ``bucket_cap_mb`` is left at its default. With
``bucket_cap_mb=25`` the three layers here are one DDP bucket but two graphs (the last
layer alone, then the other two): the test measures both.

To count without compiling anything, the lesson's backend only *records* each graph it is
given and returns the graph's own ``forward`` (plain PyTorch ops: no C++ compiler, no
kernels, and no AOTAutograd either, so its backward is still one autograd node per op: it
shows the split, not the lost overlap). The split is DDPOptimizer's, made before any backend
sees a graph, so it is the split inductor would get. ``torch._dynamo.config.optimize_ddp =
False`` turns the splitting off: one graph, whatever the buckets (the demo shows it; the
test, which pays for every compile, checks the two splits).

The model is three ``Linear(512, 512)`` layers, 1 MiB of parameters each (the toy model
of the other lessons, 6 KB, would fit one bucket whatever the cap), defined here as a
module of our own: Dynamo traces a user's ``forward``; an ``nn.Sequential`` straight out of
``torch.nn`` would be run, not traced, after DDP's forward breaks the graph.

    python -m tutorial_impl.ddp.compile_ddp     # 2 local ranks; or torchrun --nproc-per-node=2
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from tutorial_impl.ddp import toy
from tutorial_impl.dist_tuto.process import print_line

PRELOAD = ["torch._dynamo"]
WIDTH, LAYERS = 512, ("a", "b", "c")  # 512 * 512 + 512 floats: 1,050,624 bytes a layer
# (name, bucket_cap_mb, DDPOptimizer on): DDP's default (25 MiB, the first bucket 1 MiB),
# an explicit 25 MiB (one DDP bucket, two graphs), a 1 MiB cap (every layer reaches it),
# and the default with the splitting turned off.
SETUPS = [
    ("default", None, True),
    ("25 MiB", 25.0, True),
    ("1 MiB", 1.0, True),
    ("not split", None, False),
]


class Wide(nn.Module):
    """``a -> ReLU -> b -> ReLU -> c``, each ``Linear(512, 512)``: just over 1 MiB a layer."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.b, self.c = (nn.Linear(WIDTH, WIDTH) for _ in LAYERS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


@dataclass
class GraphLog:
    """A Dynamo backend that compiles nothing: it records the inputs of every graph it is
    handed (torch's names: the parameters' names are in them) and runs the graph as is."""

    graphs: list[list[str]] = field(default_factory=list)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs.append([n.name for n in gm.graph.nodes if n.op == "placeholder"])
        return gm.forward


def compiled_step(model: nn.Module, x, y, cap_mb: float | None, optimize: bool) -> GraphLog:
    """One SGD step of ``model`` in DDP with buckets of ``cap_mb``, compiled; the graphs the
    backend was handed, with DDPOptimizer on (``optimize``) or off."""
    torch._dynamo.reset()  # forget earlier compiles: this model is traced anew
    torch._dynamo.config.optimize_ddp = optimize
    try:
        backend = GraphLog()
        compiled = torch.compile(DDP(model, bucket_cap_mb=cap_mb), backend=backend)
        sgd_step(compiled, model, x, y)
    finally:
        torch._dynamo.config.optimize_ddp = True  # torch's default
        torch._dynamo.reset()
    return backend


def sgd_step(forward: nn.Module, model: nn.Module, x, y) -> None:
    F.mse_loss(forward(x), y).backward()
    toy.plain_sgd_step(model)


def compiled_and_eager(rank: int, size: int, setups: list | None = None) -> dict:
    """One step eager and the same step compiled, on this rank's share of a batch; the
    graphs the backend was handed for three set-ups, and the parameters after each."""
    x = torch.randn(2 * size, WIDTH, generator=torch.Generator().manual_seed(1))
    y = torch.randn(2 * size, WIDTH, generator=torch.Generator().manual_seed(2))
    xs, ys = toy.shard(x, rank, size), toy.shard(y, rank, size)
    eager = Wide()
    sgd_step(DDP(eager), eager, xs, ys)
    seen: dict = {"eager": toy.parameters(eager)}
    for name, cap_mb, optimize in setups or SETUPS:
        model = Wide()
        seen[name] = {
            "graphs": compiled_step(model, xs, ys, cap_mb, optimize).graphs,
            "params": toy.parameters(model),
        }
    return seen


def demo(rank: int, size: int) -> None:
    seen = compiled_and_eager(rank, size)
    for name, cap_mb, optimize in SETUPS:
        graphs = seen[name]["graphs"]
        eager = seen["eager"]
        diff = max((seen[name]["params"][k] - eager[k]).abs().max().item() for k in eager)
        print_line(
            f"rank {rank}, bucket_cap_mb={cap_mb}, optimize_ddp={optimize}: {len(graphs)} "
            f"graph(s); the step differs from eager's by {diff:.3g}"
        )


def main(argv: list[str] | None = None) -> int:
    args = toy.demo_parser(
        __name__, "D13. torch.compile with DDP: DDPOptimizer's graphs, counted under three caps."
    ).parse_args(argv)
    return toy.main(demo, args.world_size, args.timeout, PRELOAD)


if __name__ == "__main__":
    toy.run_as_script(main)  # the package's copy of this module: see toy.py
