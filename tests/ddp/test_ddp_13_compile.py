"""D13. ``torch.compile`` with DDP: the eager step, graphs split where buckets end
(``ddp/compile_ddp.py``).

The claims, on 2 ranks: a DDP model compiled with ``torch.compile`` takes the step the same
model takes eagerly; Dynamo's DDPOptimizer hands the backend the graph in pieces, in forward
order, each holding the layers of its piece: walking from the last layer, it closes a piece
once its parameters reach the cap, the first piece's cap always 1 MiB, every later one
``bucket_cap_mb`` (25 MiB by default). With DDP's default caps (its first bucket 1 MiB too)
that is one graph per DDP bucket: the last layer alone, then the other two. With an explicit
``bucket_cap_mb=25`` it is not: DDP makes one bucket of all three layers (measured here with
lesson D2's hook), DDPOptimizer still two graphs. (A 1 MiB cap, one layer a graph, and
``optimize_ddp = False``, one graph, are the demo's: a compile costs about a second.)
The expected split is computed here from the layers' sizes by that rule; torch's code is not
consulted. The backend records graphs and compiles nothing, so no C++ compiler runs.
"""

from __future__ import annotations

import pytest
import torch

from tutorial_impl.ddp import buckets, compile_ddp

pytestmark = pytest.mark.warm_world

MIB = 2**20
# DDP's 25 MiB default is documented; the 1 MiB first bucket is dist._DEFAULT_FIRST_BUCKET_BYTES,
# which DDPOptimizer applies to its first graph whatever bucket_cap_mb says.
FIRST_GRAPH, DEFAULT_CAP = 1 * MIB, 25 * MIB
LAYER_BYTES = (compile_ddp.WIDTH * compile_ddp.WIDTH + compile_ddp.WIDTH) * 4
TESTED = ("default", "25 MiB")  # one graph per bucket, and not


def expected_graphs(cap_mb: float | None, optimize: bool) -> list[list[str]]:
    """Walk the layers from the last, close a graph once its parameters reach the cap (the
    first one's cap is 1 MiB, whatever ``cap_mb``); return them in forward order."""
    layers = list(compile_ddp.LAYERS)
    if not optimize:
        return [layers]
    cap = DEFAULT_CAP if cap_mb is None else int(cap_mb * MIB)
    graphs: list[list[str]] = [[]]
    filled = 0
    for layer in reversed(layers):
        if graphs[0] and filled >= (FIRST_GRAPH if len(graphs) == 1 else cap):
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


def graphs_and_buckets(rank: int, size: int, setups: list) -> dict:
    """In the ranks: the lesson's compiled and eager steps, and, for the same caps, how many
    buckets eager DDP reduces in its second iteration (lesson D2's hook, on layers of the
    same sizes)."""
    seen = compile_ddp.compiled_and_eager(rank, size, setups)
    caps = [cap_mb for _, cap_mb, _ in setups]
    by_cap = buckets.buckets_by_cap(rank, size, caps, 2, buckets.WIDE)
    seen["buckets"] = {cap: len(iterations[1]) for cap, iterations in by_cap.items()}
    return seen


def test_the_reference_split() -> None:
    assert LAYER_BYTES > MIB  # each layer alone fills a 1 MiB graph
    assert expected_graphs(None, True) == [["a", "b"], ["c"]]
    assert expected_graphs(25.0, True) == [["a", "b"], ["c"]]  # the first graph: 1 MiB still
    assert expected_graphs(1.0, True) == [["a"], ["b"], ["c"]]
    assert expected_graphs(None, False) == [["a", "b", "c"]]


def test_torch_compile_with_ddp_equals_eager_and_splits_where_buckets_end(run_ranks) -> None:
    setups = [s for s in compile_ddp.SETUPS if s[0] in TESTED]
    assert [s[1] for s in setups] == [None, 25.0]
    results = run_ranks(graphs_and_buckets, setups, world_size=2)
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
        # One graph per bucket with the default caps; two graphs for one bucket at 25 MiB.
        assert seen["buckets"] == {None: 2, 25.0: 1}, f"rank {rank}: {seen['buckets']}"
    assert results[0]["eager"].keys() == results[1]["eager"].keys()
    for param in results[0]["eager"]:  # and DDP kept the two ranks equal
        assert torch.equal(results[0]["eager"][param], results[1]["eager"][param])
