"""Rank functions that test ``ring.py`` against ``dist.all_reduce`` (used by tests/test_06_ring.py).

They live in the package, not in the test file, because ranks import their function by name.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from tutorial_impl.dist_tuto.ring import SEGMENT_BYTES, allreduce, ring_allreduce


def case_input(
    rank: int, shape: tuple[int, ...], dtype: torch.dtype, transposed: bool = False
) -> torch.Tensor:
    """A rank's deterministic input for one test case: small integers, or random floats.

    ``transposed`` stores the last two dims swapped, so the tensor is a non-contiguous view.
    """
    store_shape = (*shape[:-2], shape[-1], shape[-2]) if transposed else shape
    numel = math.prod(store_shape)
    if dtype.is_floating_point:
        gen = torch.Generator().manual_seed(1000 + rank)
        t = torch.randn(numel, generator=gen, dtype=torch.float64).to(dtype)
    else:
        t = ((torch.arange(numel) * (rank + 3)) % 19 - 9).to(dtype)
    t = t.reshape(store_shape)
    return t.transpose(-1, -2) if transposed else t


def compare_cases(
    rank: int, size: int, cases: list[tuple], segment_bytes: int = SEGMENT_BYTES
) -> list[dict[str, object]]:
    """Run both rings and ``dist.all_reduce`` on every case, all in one process group.

    A case is ``(shape, dtype, transposed)``. The bandwidth-optimal ring runs three times: into
    a separate ``recv`` (``send`` must stay untouched), in place, and in place without the
    layout check.
    """
    out = []
    for shape, dtype, transposed in cases:
        send = case_input(rank, shape, dtype, transposed)
        before = send.clone()
        tutorial = torch.empty_like(send)  # same strides as send: non-contiguous recv too
        allreduce(send, tutorial)
        ring = ring_allreduce(send, torch.empty_like(send), segment_bytes=segment_bytes)
        in_place = ring_allreduce(send.clone(), segment_bytes=segment_bytes)
        unchecked = ring_allreduce(send.clone(), segment_bytes=segment_bytes, check=False)
        reference = send.clone()
        dist.all_reduce(reference)
        out.append(
            {
                "tutorial": tutorial,
                "ring": ring,
                "in_place": in_place,
                "unchecked": unchecked,
                "all_reduce": reference,
                "send_unchanged": torch.equal(send, before),
            }
        )
    return out


def mismatched(rank: int, size: int, problem: str) -> str:
    """Give rank ``size - 1`` a bad input and return the error each rank gets (or "no error").

    ``problem`` is ``shape`` (one element more), ``dtype`` (float64) or ``recv`` (a recv
    buffer of the wrong size, on that rank only). Both rings are tried, the tutorial's first.
    """
    send = torch.ones(6)
    recv = torch.zeros(6)
    if rank == size - 1:
        if problem == "shape":
            send, recv = torch.ones(7), torch.zeros(7)
        elif problem == "dtype":
            send, recv = send.double(), recv.double()
        elif problem == "recv":
            recv = torch.zeros(5)
    errors = []
    for fn in (allreduce, ring_allreduce):
        try:
            fn(send, recv)
            errors.append("no error")
        except ValueError as exc:
            errors.append(str(exc))
    return "\n---\n".join(errors)


def bytes_sent(rank: int, size: int, numel: int) -> dict[str, int]:
    """Count the payload bytes each ring sends from this rank with ``dist.isend``."""
    counted = {"n": 0}
    real_isend = dist.isend

    def counting_isend(tensor: torch.Tensor, dst: int, *args: object, **kwargs: object):
        counted["n"] += tensor.numel() * tensor.element_size()
        return real_isend(tensor, dst, *args, **kwargs)

    send = torch.ones(numel)
    result = {}
    dist.isend = counting_isend  # both rings send with dist.isend, looked up at call time
    try:
        for name, fn in (("tutorial", allreduce), ("ring", ring_allreduce)):
            counted["n"] = 0
            fn(send, torch.empty_like(send))
            result[name] = counted["n"]
    finally:
        dist.isend = real_isend
    return result
