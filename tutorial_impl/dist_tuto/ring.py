"""4.5 Custom ring-allreduce: the tutorial's version and a bandwidth-optimal one.

Every rank talks only to its two neighbours, ``left = rank - 1`` and ``right = rank + 1``
(modulo the world size), so no link carries more than its share.

* ``allreduce(send, recv)`` is the tutorial's code: each rank passes *whole* tensors around
  the ring, N-1 times, adding what arrives. Every rank sends (N-1)*K bytes for K bytes of data.
* ``ring_allreduce(send, recv)`` is the algorithm of Baidu's DeepSpeech and of gloo itself:
  cut the tensor into N chunks, run a *reduce-scatter* (N-1 steps; afterwards rank r owns the
  full sum of chunk r+1) and then an *all-gather* (N-1 steps that pass the finished chunks
  on). Every rank sends 2(N-1)/N * K bytes: for large N, about 2K whatever N is, which is
  the least any allreduce can do.

Both first check that every rank brought a tensor of the same shape and dtype: in a ring whose
ranks disagree about the message sizes, gloo aborts a rank that receives more bytes than its
buffer holds (SIGABRT: "Received data size doesn't match expected size") and its peers then
see "Connection reset by peer", while a rank that receives fewer returns silently with a
partly summed tensor (both measured in tests/dist_tuto/test_08_failure.py). The check turns
both into a ``ValueError`` on every rank. It is one tiny exchange, but it synchronises all
ranks, which costs a few milliseconds on a busy machine;
``check=False`` skips it for callers that know their layouts agree (torch's own collectives
check nothing unless ``TORCH_DISTRIBUTED_DEBUG=DETAIL``).
"""

from __future__ import annotations

import argparse
import zlib

import torch
import torch.distributed as dist

from tutorial_impl.dist_tuto.process import print_line, run_main

# gloo moves its own allreduce in segments of at most 1 MiB; we do the same, so the sum of one
# segment overlaps with the transfer of the next instead of waiting for a whole chunk.
SEGMENT_BYTES = 1 << 20
_TAG_STRIDE = 1 << 16  # tags per ring step: room for 64 Ki segments in one chunk


def require_gloo() -> None:
    """The rings are CPU exercises on gloo's point-to-point messages.

    On NCCL a send and a receive between the same two ranks share one CUDA stream, so two
    ranks that both send before they receive (as a ring of two does) can wait on each other
    until the process group's timeout. Refusing is better than a hang. On GPUs use NCCL's own
    all_reduce: it is not always a ring, NCCL picks ring, tree, NVLS or CollNet by message
    size and topology (``NCCL_ALGO`` overrides; NCCL's environment-variable documentation).
    """
    if dist.get_backend() != "gloo":
        raise ValueError(
            f"the ring allreduces run on the gloo backend (CPU tensors), not {dist.get_backend()}"
        )


def describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}"


def check_same_layout(send: torch.Tensor, recv: torch.Tensor | None = None) -> None:
    """Raise ``ValueError`` on *every* rank unless all ranks hold the same shape and dtype.

    Each rank reduces ``[s, -s, problem]`` with MAX, where ``s`` is a checksum of its shape and
    dtype and ``problem`` says whether its own ``recv`` does not fit: max(s) == -max(-s) means
    max(s) == min(s), so every rank has the same signature. One tiny all_reduce, done by gloo
    in C++, was the cheapest exchange we measured (an all_gather, or messages to every peer,
    cost 2 to 4 times as much on a busy machine). Only when something is wrong do the ranks
    exchange their descriptions (``all_gather_object``) for a message that says who has what.
    """
    local_problem = ""
    if recv is not None and (recv.shape != send.shape or recv.dtype != send.dtype):
        local_problem = f"recv ({describe(recv)}) does not match send ({describe(send)})"
    signature = zlib.crc32(describe(send).encode())
    probe = torch.tensor([signature, -signature, int(bool(local_problem))])
    dist.all_reduce(probe, op=dist.ReduceOp.MAX)
    if probe[0] == -probe[1] and probe[2] == 0:
        return
    reports: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, local_problem or describe(send))
    lines = "\n".join(f"  rank {r}: {text}" for r, text in enumerate(reports))
    raise ValueError(
        "ring allreduce needs the same shape and dtype on every rank (and recv like send); "
        f"got:\n{lines}"
    )


def allreduce(send: torch.Tensor, recv: torch.Tensor, *, check: bool = True) -> None:
    """The tutorial's ring: store the sum of every rank's ``send`` in ``recv``.

    Faithful to the tutorial, with one change: the buffers are made contiguous, because gloo
    refuses to send a non-contiguous tensor (``clone`` keeps a transposed layout).
    """
    require_gloo()
    if check:
        check_same_layout(send, recv)
    rank = dist.get_rank()
    size = dist.get_world_size()
    send_buff = send.clone(memory_format=torch.contiguous_format)
    recv_buff = send.clone(memory_format=torch.contiguous_format)
    accum = send.clone(memory_format=torch.contiguous_format)

    left = ((rank - 1) + size) % size
    right = (rank + 1) % size

    for i in range(size - 1):
        # The two buffers take turns: one is on its way right while the other fills from left.
        if i % 2 == 0:
            send_req = dist.isend(send_buff, right)
            dist.recv(recv_buff, left)
            accum[:] += recv_buff[:]
        else:
            send_req = dist.isend(recv_buff, right)
            dist.recv(send_buff, left)
            accum[:] += send_buff[:]
        send_req.wait()
    recv[:] = accum[:]


def _segments(t: torch.Tensor, segment_numel: int) -> tuple[torch.Tensor, ...]:
    return t.split(segment_numel) if t.numel() else ()


def ring_allreduce(
    send: torch.Tensor,
    recv: torch.Tensor | None = None,
    segment_bytes: int = SEGMENT_BYTES,
    *,
    check: bool = True,
) -> torch.Tensor:
    """Bandwidth-optimal ring allreduce (sum): reduce-scatter, then all-gather.

    Stores the sum in ``recv`` and returns it; without ``recv`` (or with ``recv is send``)
    works in place, like ``dist.all_reduce``. Any shape, numel 0 or smaller than the world
    size, integer or floating dtypes, non-contiguous tensors.
    """
    recv = send if recv is None else recv
    require_gloo()
    if check:
        check_same_layout(send, recv)
    rank, size = dist.get_rank(), dist.get_world_size()
    # Work in recv's own memory when we can (no extra copy of the result), else in a scratch
    # buffer that is copied back at the end.
    work = (
        recv.view(-1)
        if recv.is_contiguous()
        else torch.empty(recv.numel(), dtype=recv.dtype, device=recv.device)
    )
    if work.data_ptr() != send.data_ptr() or not send.is_contiguous():
        work.copy_(send.reshape(-1))
    if size > 1 and work.numel():
        _ring(work, rank, size, max(1, segment_bytes // work.element_size()))
    if not recv.is_contiguous():
        recv.copy_(work.view(recv.shape))
    return recv


def _ring(work: torch.Tensor, rank: int, size: int, seg: int) -> None:
    # N chunks whose sizes differ by at most one element (some are empty when numel < N),
    # each cut into segments of at most SEGMENT_BYTES.
    chunks = [_segments(c, seg) for c in torch.tensor_split(work, size)]
    if max(len(c) for c in chunks) >= _TAG_STRIDE:
        raise ValueError(f"tensor too large for one ring call: {work.numel()} elements")
    left, right = (rank - 1) % size, (rank + 1) % size
    # Step s of the reduce-scatter uses tags s*STRIDE + k, step s of the all-gather
    # (size+s)*STRIDE + k: every message has its own tag, so nothing can match the wrong one.
    rs_tag, ag_tag = 0, size * _TAG_STRIDE

    # Two scratch buffers, used in turn: the receives of step s+1 are posted while step s
    # is still adding, so data keeps flowing. Unlike gloo, which keeps two segments in
    # flight, we post a whole step's receives at once: each Python call costs microseconds,
    # and waiting on a busy machine costs milliseconds, so fewer round trips win.
    biggest = work.numel() // size + 1
    scratch = _scratch(2 * biggest, work.dtype, work.device).split(biggest)

    def post_rs_recvs(step: int) -> tuple[list, tuple[torch.Tensor, ...]]:
        numel = sum(p.numel() for p in chunks[(rank - step - 1) % size])
        tmp = _segments(scratch[step % 2][:numel], seg)
        tag = rs_tag + step * _TAG_STRIDE
        return [dist.irecv(t, left, tag=tag + k) for k, t in enumerate(tmp)], tmp

    # Reduce-scatter. At step s rank r sends chunk r-s and adds the chunk r-s-1 it receives;
    # after N-1 steps chunk r+1 holds the sum over all ranks. Each segment is sent on as soon
    # as it has been added to, which pipelines the steps the way gloo does.
    sends = [dist.isend(p, right, tag=rs_tag + k) for k, p in enumerate(chunks[rank])]
    pending = post_rs_recvs(0)
    for step in range(size - 1):
        recvs, tmp = pending
        if step + 1 < size - 1:
            pending = post_rs_recvs(step + 1)
        forward_tag = rs_tag + (step + 1) * _TAG_STRIDE
        for k, piece in enumerate(chunks[(rank - step - 1) % size]):
            recvs[k].wait()
            piece.add_(tmp[k])
            if step < size - 2:
                sends.append(dist.isend(piece, right, tag=forward_tag + k))
    # The all-gather receives into chunks we sent above: those sends must be finished first.
    _wait(sends)

    # All-gather. Rank r now owns chunk r+1; pass finished chunks on, receiving straight into
    # place: nothing is added, so no scratch memory is needed.
    sends = [dist.isend(p, right, tag=ag_tag + k) for k, p in enumerate(chunks[(rank + 1) % size])]
    recvs = [
        [dist.irecv(p, left, tag=ag_tag + s * _TAG_STRIDE + k) for k, p in enumerate(chunks[c])]
        for s, c in ((s, (rank - s) % size) for s in range(size - 1))
    ]
    for step in range(size - 1):
        into = chunks[(rank - step) % size]
        for k, req in enumerate(recvs[step]):
            req.wait()
            if step < size - 2:  # forward what just arrived, segment by segment
                tag = ag_tag + (step + 1) * _TAG_STRIDE + k
                sends.append(dist.isend(into[k], right, tag=tag))
    _wait(sends)


_scratch_cache: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _scratch(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Scratch memory kept from call to call, growing when needed.

    A fresh multi-megabyte buffer comes straight from the kernel (mmap) and every page of it
    faults on first touch, which costs a noticeable share of a ring's time; reusing one does not.
    (One buffer per dtype and device: two rings must not run at once in one process.)
    """
    key = (dtype, device)
    if key not in _scratch_cache or _scratch_cache[key].numel() < numel:
        _scratch_cache[key] = torch.empty(numel, dtype=dtype, device=device)
    return _scratch_cache[key][:numel]


def _wait(reqs: list) -> None:
    for req in reqs:
        req.wait()


def run(rank: int, size: int) -> dict[str, list[float]]:
    """The demo: both rings and ``dist.all_reduce`` on the same tensors, side by side."""
    send = torch.arange(5, dtype=torch.float32) + 10 * rank
    recv = torch.zeros_like(send)
    allreduce(send, recv)
    print_line("Rank ", rank, " has data ", recv[0])  # the tutorial's line: the sum of every rank's
    ring = ring_allreduce(send, torch.zeros_like(send))
    reference = send.clone()
    dist.all_reduce(reference)
    print(
        f"Rank {rank}: tutorial ring {recv.tolist()}, bandwidth-optimal ring {ring.tolist()}, "
        f"dist.all_reduce {reference.tolist()}"
    )
    return {"tutorial": recv.tolist(), "ring": ring.tolist(), "all_reduce": reference.tolist()}


def main(argv: list[str] | None = None) -> int:
    from tutorial_impl import cli  # the CLI's launcher, not the tutorial's

    parser = argparse.ArgumentParser(
        prog="python -m tutorial_impl ring",
        description="4.5 the tutorial's ring allreduce(send, recv), the bandwidth-optimal ring "
        "and dist.all_reduce on the same tensors (benchmark: python -m tutorial_impl bench ring)",
    )
    cli.add_launch_arguments(parser)
    args = cli.parse_launch_args(parser, argv)
    return cli.exit_status(lambda: cli.launch(run, args.world_size, args.backend, args.timeout))


if __name__ == "__main__":
    run_main(main)
