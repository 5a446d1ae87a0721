"""2. Point-to-point communication (``tutorial_impl/dist_tuto/p2p.py``).

The tutorial claims ``send``/``recv`` move a tensor from one rank to another, blocking until
done (with gloo a ``send`` returns only after its receiver has called ``recv``), and that
``isend``/``irecv`` return at once with a request whose data is valid only after ``wait()``.
Rank 0 starts with zeros, adds one and sends; the others hold zeros until the data arrives.
So a receiver that reports 1.0 has really received it: nothing else could have changed its
buffer. Every rank returns its tensor, and every rank is checked.

Read in this order:

1. ``test_every_rank_ends_with_rank_0s_tensor``: both modes, worlds of 2 and 3.
2. ``test_prints_what_the_tutorial_prints``: the tutorial's own lines.
3. ``test_send_returns_only_after_the_receiver_called_recv``: what "blocking" means on gloo.
4. ``irecv_before_send`` + ``test_irecv_buffer_is_only_valid_after_wait``: the buffer of a
   posted ``irecv`` is still zero until the sender sends and ``wait`` returns.
5. ``test_isend_buffer_must_not_change_before_wait``: the sender's half of the rule.
6. ``test_a_ring_exchange_in_one_batch``: ``batch_isend_irecv``, where send-then-recv hangs.
7. The same on NCCL (skipped without GPUs), then the CLI.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tutorial_impl.dist_tuto import p2p

# One warm world serves this lesson's multi-rank tests
# (tutorial_impl/testing/strategies/warm/pool.py):
# each test still runs in a world that is as good as new, checked before reuse.
pytestmark = pytest.mark.warm_world


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("fn", [p2p.run_blocking, p2p.run_nonblocking], ids=["send", "isend"])
def test_every_rank_ends_with_rank_0s_tensor(run_ranks, fn, world_size):
    results = run_ranks(fn, world_size=world_size)
    # Every rank, sender included, must now hold the 1.0 that rank 0 made.
    assert [t.tolist() for t in results] == [[1.0]] * world_size
    # The printed line is the tutorial's, for every rank.
    for rank, out in enumerate(results.outputs):
        assert f"Rank  {rank}  has data  tensor(1.)" in out.splitlines()


def test_prints_what_the_tutorial_prints(run_ranks):
    """With two ranks the program is the tutorial's, and so is its output, line for line."""
    results = run_ranks(p2p.run_nonblocking)
    assert results.outputs[0].splitlines() == [
        "Rank 0 started sending",
        "Rank  0  has data  tensor(1.)",
    ]
    assert results.outputs[1].splitlines() == [
        "Rank 1 started receiving",
        "Rank  1  has data  tensor(1.)",
    ]


@pytest.mark.world_size(3)
def test_send_returns_only_after_the_receiver_called_recv(run_ranks):
    """Each receiver calls ``recv`` 0.1 s after rank 0 called its ``send``; the send waits.

    Every time is ``time.monotonic()``, one clock for all processes of a machine. Rank 0
    called each send before its receiver called ``recv`` (the premise: the receiver really
    was late; a note on another tag tells it the send is called, so a rank that started late
    is late all the same), and each send returned only after the receiver entered ``recv``,
    so it took the receiver's 0.1 s, for a message of one float: gloo sends no data before
    the receiver says its ``recv`` is posted (``p2p.run_send_waits_for_recv``). A transport
    that sent ahead (MPI's eager small messages) would have returned at once, while the
    receiver still slept.
    """
    sends, *recv_entered = run_ranks(p2p.run_send_waits_for_recv)
    assert len(sends) == len(recv_entered) == 2
    for dst, entered in enumerate(recv_entered, start=1):
        called, returned = sends[dst - 1]
        assert called < entered, f"rank {dst} was not late: the test shows nothing"
        assert returned >= entered, f"rank 0's send to rank {dst} returned before its recv"
        assert returned - called >= 0.1, f"rank 0's send to rank {dst} did not wait"


def irecv_before_send(rank: int, size: int) -> dict[str, object]:
    """Show that an ``irecv`` returns before any data exists: read its buffer only after wait.

    Each receiver posts its ``irecv`` first and only then tells rank 0 (with a blocking send on
    another tag) to go ahead; so at the moment we look, the data cannot have been sent yet.
    The request is not completed and the buffer still holds its old zeros; after ``wait()``
    it holds what rank 0 sent. Rank 0 sends ``10 + dst`` so every receiver's value is its own.
    """
    go, data = 1, 0  # tags: the "go ahead" message and the payload
    if rank == 0:
        sent = {}
        for dst in range(1, size):
            dist.recv(torch.zeros(1), src=dst, tag=go)  # wait until dst has posted its irecv
            payload = torch.tensor([10.0 + dst])
            req = dist.isend(payload, dst=dst, tag=data)
            req.wait()  # only now may we touch ``payload`` again
            sent[dst] = payload.item()
        return {"sent": sent}
    buffer = torch.zeros(1)
    req = dist.irecv(buffer, src=0, tag=data)
    done_before, value_before = req.is_completed(), buffer.item()
    dist.send(torch.ones(1), dst=0, tag=go)
    req.wait()
    return {
        "completed_before_wait": done_before,
        "value_before_wait": value_before,
        "completed_after_wait": req.is_completed(),
        "value_after_wait": buffer.item(),
    }


@pytest.mark.world_size(3)
def test_irecv_buffer_is_only_valid_after_wait(run_ranks):
    """An irecv returns at once, long before the data exists.

    Each receiver looks at its request and buffer *before* it lets rank 0 send (see
    ``irecv_before_send``): the request is not complete and the buffer still holds zeros.
    After ``wait()`` the request is complete and the buffer holds rank 0's value for it.
    """
    sender, *receivers = run_ranks(irecv_before_send)
    assert sender["sent"] == {1: 11.0, 2: 12.0}
    for rank, seen in enumerate(receivers, start=1):
        assert seen["completed_before_wait"] is False
        assert seen["value_before_wait"] == 0.0
        assert seen["completed_after_wait"] is True
        assert seen["value_after_wait"] == sender["sent"][rank]


def both_orders(rank, world_size):
    """The lesson twice in one world: the rule kept, then broken."""
    return {
        "kept": p2p.run_send_buffer_reuse(rank, world_size),
        "broken": p2p.run_send_buffer_reuse(rank, world_size, refill_before_wait=True),
    }


def test_isend_buffer_must_not_change_before_wait(run_ranks):
    """``isend`` does not copy: rank 0 meant to send 1.0 then 2.0 through one buffer.

    Refilled only after ``wait()``, rank 1 receives exactly that. Refilled before, the first
    message still leaves from the buffer after the refill (the receiver posts late, by
    protocol, not by chance), so rank 1 receives 2.0 twice: the rule is not pedantry.
    """
    sender, receiver = run_ranks(both_orders)
    assert sender["kept"] == sender["broken"] == [1.0, 2.0]  # what rank 0 meant to send
    assert receiver["kept"] == [1.0, 2.0]
    assert receiver["broken"] == [2.0, 2.0]


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_ring_exchange_in_one_batch(run_ranks, world_size):
    """``batch_isend_irecv``: each rank lists its send first and still gets its left
    neighbour's value, where a ``send`` then ``recv`` on every rank would wait in its send until
    the group's timeout (30 minutes by default) and then fail: lesson T8 measures it."""
    results = run_ranks(p2p.run_ring_exchange, world_size=world_size)
    assert results == [[float((rank - 1) % world_size)] * 2 for rank in range(world_size)]


@pytest.mark.dist_gpu(2)
@pytest.mark.dist_backend("nccl")
@pytest.mark.parametrize("fn", [p2p.run_blocking, p2p.run_nonblocking], ids=["send", "isend"])
def test_p2p_on_nccl_with_cuda_tensors(run_ranks, fn):
    assert [t.tolist() for t in run_ranks(fn)] == [[1.0], [1.0]]


@pytest.mark.dist_gpu(2)
@pytest.mark.dist_backend("nccl")
def test_a_ring_exchange_in_one_batch_on_nccl(run_ranks):
    """The same batch on two GPUs: one NCCL group of operations, a send and a receive."""
    assert run_ranks(p2p.run_ring_exchange) == [[1.0, 1.0], [0.0, 0.0]]


def test_cli_runs_both_modes(capsys):
    assert p2p.main(["--world-size", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out.count("Rank  1  has data  tensor(1.)") == 2  # once blocking, once non-blocking
    assert "Rank 1 started receiving" in out


def test_cli_refuses_a_world_of_one(capsys):
    with pytest.raises(SystemExit) as exit_info:
        p2p.main(["--world-size", "1"])
    assert exit_info.value.code == 2
    assert "--world-size must be at least 2, got 1" in capsys.readouterr().err
