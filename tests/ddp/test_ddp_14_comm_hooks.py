"""D14. Communication hooks: the bytes each sends, and how far it lands (``ddp/comm_hooks.py``).

The claims, on 2 ranks, every hook from the same parameters and batches: the float32
all-reduce (DDP's default) sends the whole bucket, 4 bytes a parameter, and is the exact
average; fp16 and bf16 compression send half, one all-reduce of 2 bytes a parameter, and
land within 2^-10 (fp16) and 2^-7 (bf16) of the exact average in norm, tensor by tensor
(bf16 does not meet fp16's bound: the tolerance tells them apart); rank-1 PowerSGD sends
``(n + m)`` numbers for each matrix worth compressing and the rest whole (832 bytes instead
of 5,904 for the toy model), leaves the uncompressed tensors exact, and each compressed one
an orthogonal projection of the exact average: ``|M|² = |PPᵀM|² + |M - PPᵀM|²``, with an
error well above fp16's and below 100%. DDP refuses torch's own bf16 hook unless torch was
built with CUDA and NCCL (or XPU and XCCL), as in this CPU-only build.

The expected bytes are computed here from the parameters' shapes and the rule PowerSGD
states (compress an n x m matrix when ``(n + m) r * min_compression_rate < n m``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tutorial_impl.ddp import comm_hooks, toy

pytestmark = pytest.mark.warm_world

WORLD, ROWS = 2, 16
FP16_TOLERANCE, BF16_TOLERANCE = 2**-10, 2**-7  # in norm: a few roundings of 11 and 8 bits


def relative_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return ((got - exact).norm() / exact.norm()).item()


def powersgd_plan(model, rank: int = 1, rate: float = 2.0) -> tuple[int, int, int]:
    """(numbers sent whole, numbers in the Ps, numbers in the Qs) for rank-``rank`` PowerSGD."""
    whole = ps = qs = 0
    for p in model.parameters():
        n, m = p.shape[0], p.numel() // p.shape[0]  # a bias is an n x 1 matrix
        r = min(n, m, rank)
        if (n + m) * r * rate < n * m:
            ps, qs = ps + n * r, qs + m * r
        else:
            whole += n * m
    return whole, ps, qs


def builds_bf16_hook() -> bool:
    """Whether this torch build has what DDP's check asks of torch's bf16 hook."""
    cuda = torch.version.cuda is not None and dist.is_nccl_available()
    xpu = dist.is_xccl_available() and torch.xpu.is_available()
    return (cuda and torch.cuda.nccl.version() >= (2, 10)) or xpu


def test_fp16s_range_as_the_lesson_states_it() -> None:
    """The lesson's numbers for fp16's range: 2^-25 (~3e-8) and below round to 0, anything
    above it to at least 2^-24 (~6e-8); 65504 is the largest, 65520 and up are infinity.
    bf16 keeps both ends (float32's exponent)."""
    tiny, smallest = 2.0**-25, 2.0**-24
    values = torch.tensor([tiny, tiny * 1.001, smallest, 65504.0, 65519.0, 65520.0])
    assert values.half().tolist() == [0.0, smallest, smallest, 65504.0, 65504.0, float("inf")]
    assert (values.bfloat16() > 0).all() and values.bfloat16().isfinite().all()


def test_the_reference_plan_on_the_lessons_model() -> None:
    # 0.weight 32x8, 2.weight 32x32, 4.weight 4x32 compress; the three biases go whole.
    assert powersgd_plan(toy.mlp(0)) == (32 + 32 + 4, 32 + 32 + 4, 8 + 32 + 32)


def test_compression_hooks_send_less_within_a_stated_tolerance(run_ranks) -> None:
    x, y = toy.batch(ROWS)
    model = toy.mlp(0)
    numel = sum(p.numel() for p in model.parameters())
    whole, ps, qs = powersgd_plan(model)
    results = run_ranks(comm_hooks.compare, x, y, world_size=WORLD)
    for rank, seen in enumerate(results):
        exact = seen["float32"]["grads"]
        S = comm_hooks.Sent
        assert seen["float32"]["sent"] == [S(torch.float32, numel, 4 * numel)], rank
        assert seen["fp16"]["sent"] == [S(torch.float16, numel, 2 * numel)], rank
        assert seen["bf16"]["sent"] == [S(torch.bfloat16, numel, 2 * numel)], rank
        assert seen["powerSGD"]["sent"] == [S(torch.float32, n, 4 * n) for n in (whole, ps, qs)]
        assert 4 * (whole + ps + qs) == 832 and 4 * numel == 5904

        for name, p in model.named_parameters():
            where = f"rank {rank}, {name}"
            fp16 = relative_error(seen["fp16"]["grads"][name], exact[name])
            bf16 = relative_error(seen["bf16"]["grads"][name], exact[name])
            assert 0 < fp16 <= FP16_TOLERANCE, f"{where}: fp16 {fp16:.3g}"
            assert 0 < bf16 <= BF16_TOLERANCE, f"{where}: bf16 {bf16:.3g}"
            got, want = seen["powerSGD"]["grads"][name], exact[name]
            if p.ndim == 1:  # sent whole: exact
                torch.testing.assert_close(got, want, atol=1e-7, rtol=0)
                continue
            error = relative_error(got, want)
            assert FP16_TOLERANCE * 10 < error < 1, f"{where}: PowerSGD {error:.3g}"
            # An orthogonal projection: the kept part and the lost part are at right angles.
            pythagoras = got.norm() ** 2 + (want - got).norm() ** 2
            torch.testing.assert_close(pythagoras, want.norm() ** 2, rtol=1e-4, atol=0)
        assert (
            max(relative_error(seen["bf16"]["grads"][n], exact[n]) for n in exact) > FP16_TOLERANCE
        )  # the fp16 bound would catch bf16's rounding
        if builds_bf16_hook():
            assert seen["torch_bf16"] == "accepted", seen["torch_bf16"]
        else:
            assert "BF16" in seen["torch_bf16"] and "NCCL" in seen["torch_bf16"], seen["torch_bf16"]
