"""4.5 Ring-allreduce (``tutorial_impl/ring.py``): the tutorial's ring and the optimal one.

Both must compute exactly what ``dist.all_reduce`` computes, on every rank, for every shape
and dtype we can think of. We check them against two references: gloo's own all_reduce, run
in the same ranks, and the sum of every rank's input computed here in the parent (which
rebuilds each rank's input from its seed). Integer data must match exactly; floats up to
rounding, since the rings add in a different order from gloo.

Many cases run inside one process group per world size, so the module stays cheap.
"""

from __future__ import annotations

import pytest
import torch

from tutorial_impl.dist_tuto import ring, ring_checks

DTYPES = [torch.float32, torch.float64, torch.int64, torch.int32]


def cases_for(world_size: int) -> list[tuple]:
    """(shape, dtype, transposed): empty, one element, fewer elements than ranks, numel not
    divisible by the world size, many segments, 2-D, and non-contiguous (transposed)."""
    shapes = [(0,), (1,), (max(world_size - 1, 1),), (7,), (250,), (3, 5)]
    cases = [(shape, dtype, False) for shape in shapes for dtype in DTYPES]
    cases += [((3, 5), dtype, True) for dtype in DTYPES]
    cases += [((2, 4, 3), torch.float32, True), ((0, 4), torch.int64, False)]
    return cases


def expected_sum(world_size: int, shape, dtype, transposed) -> torch.Tensor:
    """The closed-form answer: every rank's input, rebuilt here, summed in float64."""
    inputs = [ring_checks.case_input(r, shape, dtype, transposed) for r in range(world_size)]
    return torch.stack([t.double() for t in inputs]).sum(0)


def assert_same(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and got.shape == want.shape
    if dtype.is_floating_point:
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(got, want.to(dtype))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_both_rings_equal_all_reduce(run_ranks, world_size):
    cases = cases_for(world_size)
    # 64-byte segments: the 250-element case crosses many segments and exercises the
    # pipelining, which real tensors only reach at megabytes.
    results = run_ranks(ring_checks.compare_cases, cases, 64, world_size=world_size)
    assert len(results) == world_size
    for i, (shape, dtype, transposed) in enumerate(cases):
        want = expected_sum(world_size, shape, dtype, transposed)
        for rank in range(world_size):
            got = results[rank][i]
            # gloo's all_reduce agrees with the closed form: the reference is sound.
            assert_same(got["all_reduce"], want, dtype)
            for name in ("tutorial", "ring", "in_place", "unchecked"):
                assert_same(got[name], want, dtype)
            # allreduce(send, recv) must leave send alone.
            assert got["send_unchanged"], (rank, shape, dtype)


@pytest.mark.world_size(4)
def test_bytes_sent_per_rank_match_the_theory(run_ranks):
    """The tutorial ring sends (N-1)*K bytes from each rank, the optimal one 2(N-1)/N*K."""
    numel = 4 * 1000  # divisible by N: chunks are equal and the counts exact
    k = numel * 4  # float32 bytes
    for counts in run_ranks(ring_checks.bytes_sent, numel):
        assert counts["tutorial"] == 3 * k
        assert counts["ring"] == 2 * 3 * k // 4


@pytest.mark.world_size(3)
@pytest.mark.parametrize("problem", ["shape", "dtype", "recv"])
def test_mismatched_inputs_raise_on_every_rank(run_ranks, problem):
    """The last rank brings a different shape or dtype (or a recv of the wrong size): a ring
    would wait forever for bytes that never come. Instead every rank, including the ones
    whose own tensors are fine, raises a ValueError that says which rank has what."""
    errors = run_ranks(ring_checks.mismatched, problem, timeout=30)
    for text in errors:
        assert "no error" not in text
        assert text.count("ring allreduce needs the same shape and dtype on every rank") == 2
    if problem == "shape":
        assert "rank 0: shape (6,), dtype torch.float32" in errors[0]
        assert "rank 2: shape (7,), dtype torch.float32" in errors[0]
    elif problem == "dtype":
        assert "rank 2: shape (6,), dtype torch.float64" in errors[1]
    else:
        assert "rank 2: recv (shape (5,), dtype torch.float32) does not match send" in errors[0]


def test_demo_prints_the_tutorial_line(run_ranks):
    results = run_ranks(ring.run)
    # rank inputs are [0..4] and [10..14]: the sum is [10, 12, 14, 16, 18] everywhere
    for rank, (values, out) in enumerate(zip(results, results.outputs, strict=True)):
        assert values["tutorial"] == values["ring"] == values["all_reduce"]
        assert values["all_reduce"] == [10.0, 12.0, 14.0, 16.0, 18.0]
        assert f"Rank  {rank}  has data  tensor(10.)" in out.splitlines()
