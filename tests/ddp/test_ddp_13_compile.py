"""13. ``torch.compile`` with DDP: the eager step, one graph per bucket (``ddp/compile_ddp.py``).

The claims, on 2 ranks: a DDP model compiled with ``torch.compile`` takes the step the same
model takes eagerly; Dynamo's DDPOptimizer hands the backend one graph per bucket, in
forward order, each holding the layers of its bucket: with DDP's default caps (the first
bucket 1 MiB, then 25 MiB) the last layer alone and then the other two, with a 1 MiB cap one
layer a graph (``optimize_ddp = False``, one graph, is the demo's: a compile costs a second).
The expected split
is computed here from the layers' sizes by the rule the lesson states; torch's code is not
consulted. The backend records graphs and compiles nothing, so no C++ compiler runs.
"""

from __future__ import annotations

import pytest
import torch

from tutorial_impl.ddp import compile_ddp

pytestmark = pytest.mark.warm_world

MIB = 2**20
FIRST_BUCKET, DEFAULT_CAP = 1 * MIB, 25 * MIB  # DDP's documented defaults
LAYER_BYTES = (compile_ddp.WIDTH * compile_ddp.WIDTH + compile_ddp.WIDTH) * 4


def expected_graphs(cap_mb: float | None, optimize: bool) -> list[list[str]]:
    """Walk the layers from the last, close a graph once its parameters reach the cap (the
    first one's cap is 1 MiB); return them in forward order."""
    layers = list(compile_ddp.LAYERS)
    if not optimize:
        return [layers]
    cap = DEFAULT_CAP if cap_mb is None else int(cap_mb * MIB)
    graphs: list[list[str]] = [[]]
    filled = 0
    for layer in reversed(layers):
        if graphs[0] and filled >= (FIRST_BUCKET if len(graphs) == 1 else cap):
            graphs.insert(0, [])
            filled = 0
        graphs[0].insert(0, layer)
        filled += LAYER_BYTES
    return graphs


def layers_in(graph_inputs: list[str]) -> list[str]:
    """The layers whose parameters a graph takes as inputs (torch names them
    ``..._modules_a_parameters_weight_``)."""
    named = "\n".join(graph_inputs)
    return [x for x in compile_ddp.LAYERS if f"_modules_{x}_parameters_" in named]


def test_the_reference_split() -> None:
    assert LAYER_BYTES > MIB  # each layer alone fills a 1 MiB bucket
    assert expected_graphs(None, True) == [["a", "b"], ["c"]]
    assert expected_graphs(1.0, True) == [["a"], ["b"], ["c"]]
    assert expected_graphs(None, False) == [["a", "b", "c"]]


def test_torch_compile_with_ddp_equals_eager_and_splits_at_buckets(run_ranks) -> None:
    setups = [s for s in compile_ddp.SETUPS if s[2]]  # DDPOptimizer on: the two splits
    assert [s[1] for s in setups] == [None, 1.0]
    results = run_ranks(compile_ddp.compiled_and_eager, setups, world_size=2)
    start = compile_ddp.Wide().state_dict()
    for rank, seen in enumerate(results):
        eager = seen["eager"]
        assert max((eager[k] - start[k]).abs().max() for k in eager) > 1e-4  # it stepped
        for name, cap_mb, optimize in setups:
            where = f"rank {rank}, {name}"
            graphs = [layers_in(g) for g in seen[name]["graphs"]]
            assert graphs == expected_graphs(cap_mb, optimize), f"{where}: {graphs}"
            for param, value in eager.items():  # measured: bit for bit
                torch.testing.assert_close(seen[name]["params"][param], value, atol=0, rtol=0)
    assert results[0]["eager"].keys() == results[1]["eager"].keys()
    for param in results[0]["eager"]:  # and DDP kept the two ranks equal
        assert torch.equal(results[0]["eager"][param], results[1]["eager"][param])
