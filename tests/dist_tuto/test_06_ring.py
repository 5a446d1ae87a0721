"""4.5 Ring-allreduce (``tutorial_impl/dist_tuto/ring.py``): the tutorial's ring and an optimal one.

The tutorial claims its hand-written ``allreduce(send, recv)`` computes what
``dist.all_reduce`` computes, by passing the partial sum around a ring of ranks. This module
proves it, and the same for the bandwidth-optimal ring (reduce-scatter, then all-gather, in
1 MiB segments), on every rank, for every shape and dtype we could think of, against two
references: gloo's own all_reduce run in the same ranks, and the sum of every rank's input
computed here in the parent (which rebuilds each rank's input from its seed). Integers must
match exactly; floats up to rounding, since a ring adds in a different order from gloo.

Read in this order:

1. ``case_input`` and the references: what every rank brings, and the closed-form answer.
2. ``compare_cases`` + ``test_both_rings_equal_all_reduce``: correctness at worlds 1-4
   (many cases in one process group per world size, so the module stays cheap).
3. ``bytes_sent`` + ``test_bytes_sent_per_rank_match_the_theory``: why the optimal ring is
   optimal, counted byte by byte: (N-1)K against 2(N-1)/N K from each rank.
4. ``mismatched`` + its test: one rank with a different shape: an error on every rank, not a
   crash.
5. The demo, ``python -m tutorial_impl ring``.
6. ``schedule`` + ``test_recorded_trace_is_the_rings_schedule``: the trace the pictures are
   drawn from (``dist_tuto/ring_trace.py``), recorded from the real rings, is step for step the
   schedule each algorithm prescribes, written here in closed form.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from tutorial_impl.dist_tuto import ring, ring_trace
from tutorial_impl.dist_tuto.ring import SEGMENT_BYTES, allreduce, ring_allreduce

# One warm world serves this lesson's multi-rank tests
# (tutorial_impl/testing/strategies/warm/pool.py):
# each test still runs in a world that is as good as new, checked before reuse.
pytestmark = pytest.mark.warm_world

DTYPES = [torch.float32, torch.float64, torch.int64, torch.int32]

# --- 1. What each rank brings, and the answer ---------------------------------------------


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
    inputs = [case_input(r, shape, dtype, transposed) for r in range(world_size)]
    return torch.stack([t.double() for t in inputs]).sum(0)


def assert_same(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and got.shape == want.shape
    if dtype.is_floating_point:
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(got, want.to(dtype))


# --- 2. Both rings equal dist.all_reduce --------------------------------------------------


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


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_both_rings_equal_all_reduce(run_ranks, world_size):
    cases = cases_for(world_size)
    # 64-byte segments: the 250-element case crosses many segments and exercises the
    # pipelining, which real tensors only reach at megabytes.
    results = run_ranks(compare_cases, cases, 64, world_size=world_size)
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


# --- 3. Bytes on the wire ---------------------------------------------------------------


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


@pytest.mark.world_size(4)
def test_bytes_sent_per_rank_match_the_theory(run_ranks):
    """The tutorial ring sends (N-1)*K bytes from each rank, the optimal one 2(N-1)/N*K."""
    numel = 4 * 1000  # divisible by N: chunks are equal and the counts exact
    k = numel * 4  # float32 bytes
    for counts in run_ranks(bytes_sent, numel):
        assert counts["tutorial"] == 3 * k
        assert counts["ring"] == 2 * 3 * k // 4


# --- 4. Mismatched inputs: an error on every rank, not a crash of one ------------------


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


@pytest.mark.world_size(3)
@pytest.mark.parametrize("problem", ["shape", "dtype", "recv"])
def test_mismatched_inputs_raise_on_every_rank(run_ranks, problem):
    """The last rank brings a different shape or dtype (or a recv of the wrong size): without
    the check gloo would abort a rank sent more bytes than it expects ("Received data size
    doesn't match expected size"), its peers would see "Connection reset by peer", and a
    rank sent fewer would return a partial sum silently. Instead every rank, including the
    ones whose own tensors are fine, raises a ValueError that says which rank has what."""
    errors = run_ranks(mismatched, problem, timeout=30)
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


# --- 5. The demo -------------------------------------------------------------------------


def test_demo_prints_the_tutorial_line(run_ranks):
    results = run_ranks(ring.run)
    # rank inputs are [0..4] and [10..14]: the sum is [10, 12, 14, 16, 18] everywhere
    for rank, (values, out) in enumerate(zip(results, results.outputs, strict=True)):
        assert values["tutorial"] == values["ring"] == values["all_reduce"]
        assert values["all_reduce"] == [10.0, 12.0, 14.0, 16.0, 18.0]
        assert f"Rank  {rank}  has data  tensor(10.)" in out.splitlines()


# --- 6. The ring step by step, recorded ---------------------------------------------------


def schedule(ring_name: str, rank: int, n: int) -> list[tuple]:
    """What rank ``rank`` of ``n`` must send, receive and hold at each step, in closed form.

    A step is ``(send_to, sent, recv_from, received, holds)``, each message or buffer a tuple
    of ``(chunk, ranks whose data it sums)``. Indices are modulo ``n``; ``ranks(a, b)`` is the
    ranks ``a, a-1, ..., b`` going left round the ring.
    """

    def ranks(first: int, last: int) -> frozenset[int]:
        return frozenset((first - j) % n for j in range((first - last) % n + 1))

    left, right, everyone = (rank - 1) % n, (rank + 1) % n, frozenset(range(n))
    steps = []
    if ring_name == "tutorial":
        # Whole tensors travel: at step s rank r passes on rank r-s's input and receives
        # rank r-s-1's, adding it to everything it holds.
        for s in range(n - 1):
            sent = tuple((c, frozenset({(rank - s) % n})) for c in range(n))
            received = tuple((c, frozenset({(rank - s - 1) % n})) for c in range(n))
            holds = tuple((c, ranks(rank, rank - s - 1)) for c in range(n))
            steps.append((right, sent, left, received, holds))
        return steps
    holds = {c: frozenset({rank}) for c in range(n)}
    # Reduce-scatter: at step s rank r sends chunk r-s (holding ranks r..r-s) and receives
    # chunk r-s-1 (ranks r-1..r-s-1), adding its own: after N-1 steps chunk r+1 is complete.
    for s in range(n - 1):
        c = (rank - s - 1) % n
        holds[c] = ranks(rank, rank - s - 1)
        sent = (((rank - s) % n, ranks(rank, rank - s)),)
        received = ((c, ranks(rank - 1, rank - s - 1)),)
        steps.append((right, sent, left, received, tuple(holds.items())))
    # All-gather: at step s rank r passes on the complete chunk r+1-s and stores chunk r-s.
    for s in range(n - 1):
        holds[(rank - s) % n] = everyone
        sent = (((rank + 1 - s) % n, everyone),)
        received = (((rank - s) % n, everyone),)
        steps.append((right, sent, left, received, tuple(holds.items())))
    return steps


def test_the_trace_encoding_reads_back_chunk_and_ranks():
    """Every element says which chunk it is and whose inputs it sums, even after adding."""
    three = ring_trace.encode(0, 2) + ring_trace.encode(1, 2) + ring_trace.encode(3, 2)
    assert ring_trace.decode_value(three) == (2, frozenset({0, 1, 3}))
    assert ring_trace.decode(ring_trace.ring_input(1, 3)) == tuple(
        (c, frozenset({1})) for c in range(3)
    )
    with pytest.raises(ValueError, match="not a sum of encoded chunks"):
        ring_trace.decode_value(3 << 8 | 0b11)  # two ranks, 3 is not 2 x a chunk number


@pytest.mark.world_size(4)
def test_recorded_trace_is_the_rings_schedule(run_ranks):
    """Both rings, recorded while they really run on 4 ranks, follow their schedules exactly:
    the tutorial's passes whole tensors and adds everything everywhere; the optimal one
    passes one chunk a step, and after the reduce-scatter rank r alone holds chunk r+1
    complete, which the all-gather then hands round."""
    traces = run_ranks(ring_trace.trace_rings)
    for rank, trace in enumerate(traces):
        for name in ("tutorial", "optimal"):
            got = [(s.send_to, s.sent, s.recv_from, s.received, s.holds) for s in trace[name]]
            assert got == schedule(name, rank, 4), (name, rank)
        # after reduce-scatter (step N-2) the optimal ring's rank r owns chunk r+1, complete
        complete = [c for c, who in trace["optimal"][2].holds if len(who) == 4]
        assert complete == [(rank + 1) % 4]
