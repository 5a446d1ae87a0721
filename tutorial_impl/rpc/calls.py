"""The three calls: ``rpc_sync``, ``rpc_async`` and ``remote``, and when each is the right one.

The reference's rule of thumb:

* ``rpc_sync`` when the caller cannot go on without the return value: it blocks until the
  value is back.
* ``rpc_async`` otherwise: it returns a ``Future`` at once, so several calls can be in flight
  together; ``fut.wait()`` (or ``torch.futures.collect_all`` for a list) when the value is
  needed.

``when_each_call_returns`` shows the difference rather than saying it: the caller's
``rpc_sync`` returns only after the callee's work has ended, and ``rpc_async`` returns while
the callee is still waiting for a go-ahead that only the caller can give.
* ``remote`` when something should be *created* on another worker and stay there: it returns
  an ``RRef`` (a reference to the value on its owner), never the value itself.

The reference's story for ``remote``: a driver sets up a parameter server and a trainer. It
creates the embedding table on the parameter server and hands the trainer a reference to it,
but never uses the table itself. ``rpc_sync``/``rpc_async`` would be wrong there, because they
always bring the return value back to the caller, now or later.

What a tensor argument costs (``what_arrives``): a tensor travels with its meta, so a view
arrives as a view with the same shape and stride (a transposed matrix stays transposed). But
what is sent is the tensor's *storage*, not just the elements the view shows. torch copies a
view before sending only when that saves a lot: its storage is at least 8 KiB *and* at least
twice the view's own bytes. So ten numbers sliced from a 4 MiB tensor send 40 bytes, while
ten numbers sliced from a 4 KiB one send all 4 KiB. ``view.clone()`` sends exactly the view.

Profiling (``profiled_call``): the autograd profiler records an RPC as an event named after
the call, the target by its operator's name (``rpc_sync#aten::add(worker0 -> worker1)`` for
``rpc_sync("worker1", torch.add, ...)``), with the callee's own operators reported back into
the caller's profile under it (``rpc_sync#aten::add(worker0 -> worker1)#remote_op:
aten::add``). That is the *legacy* profiler
(``torch.autograd.profiler_legacy.profile``), the one RPC's profiling support was built for:
the default (Kineto) profiler records only the caller's local operators.

TorchScript functions (``@torch.jit.script``) can also be RPC targets, and ``rpc_async`` can
be called from TorchScript; the reference marks that support as a prototype, and TorchScript
itself is deprecated in favour of ``torch.compile``: this course does not use it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import nn

from tutorial_impl.rpc.workers import slow_work


def three_calls(callee: str, other: str) -> dict[str, Any]:
    """``torch.add`` on other workers, once with each API (the reference's own example)."""
    x = torch.ones(2)
    # Blocks until worker ``callee`` has computed x + 3 and sent it back.
    synced = rpc.rpc_sync(callee, torch.add, args=(x, 3))
    # Two calls in flight at once, on two workers; collect_all gives one future for both.
    futures = [
        rpc.rpc_async(callee, torch.add, args=(x, 1)),
        rpc.rpc_async(other, torch.add, args=(x, 2)),
    ]
    done = torch.futures.collect_all(futures).wait()  # the same futures, each now complete
    # Runs on ``callee`` and stays there: what comes back is a reference, not a tensor.
    rref = rpc.remote(callee, torch.add, args=(x, 3))
    return {
        "rpc_sync": synced,
        "rpc_async": [fut.wait() for fut in done],
        "remote": rref,
        "remote_value": rref.to_here(),  # fetched only because this lesson asks for it
    }


# --- Who waits: rpc_sync blocks, rpc_async does not ----------------------------------------

_go_ahead = threading.Event()  # in the callee's process: set when its caller says go


def add_when_told(x: torch.Tensor, y: float, timeout: float = 60.0) -> torch.Tensor:
    """Runs on the callee: wait for the caller's ``go_ahead``, then return ``x + y``."""
    if not _go_ahead.wait(timeout):
        raise TimeoutError(f"no go-ahead within {timeout} s")
    _go_ahead.clear()  # ready for the next call
    return x + y


def go_ahead() -> None:
    """Runs on the callee, on another of its RPC threads: let ``add_when_told`` finish."""
    _go_ahead.set()


def when_each_call_returns(callee: str, seconds: float) -> dict[str, Any]:
    """``rpc_sync`` returns after the callee's work, ``rpc_async`` before it even starts.

    ``rpc_sync`` runs ``slow_work`` (``seconds`` of sleep) on ``callee``, which returns the
    time its work ended on ``time.monotonic()``, one clock for every process of a machine:
    the caller's own clock says when ``rpc_sync`` returned. Then ``rpc_async`` calls
    ``add_when_told``, which cannot finish before the caller sends ``go_ahead``; the caller
    looks at the future first, and only then sends it. Had ``rpc_async`` blocked like
    ``rpc_sync``, the caller would never get to send it: its call would fail at the RPC
    timeout, and the callee's wait would give up after its own 60 s.
    """
    called = time.monotonic()
    work_ended = rpc.rpc_sync(callee, slow_work, args=(seconds,))
    sync_returned = time.monotonic()
    future = rpc.rpc_async(callee, add_when_told, args=(torch.ones(2), 3))
    done_when_returned = future.done()  # the callee is waiting for us: it cannot be done
    rpc.rpc_sync(callee, go_ahead)  # the caller goes on working while the call is out
    return {
        "rpc_sync": {"called": called, "work_ended": work_ended, "returned": sync_returned},
        "rpc_async": {"done_when_returned": done_when_returned, "value": future.wait()},
    }


# --- The driver / parameter server / trainer story -------------------------------------


def make_table(num_embeddings: int, embedding_dim: int, seed: int) -> nn.EmbeddingBag:
    """The embedding table, built wherever this function runs (on the parameter server).

    Its rows are ``torch.randn`` of a seeded generator, so anyone can rebuild them to check.
    """
    table = nn.EmbeddingBag(num_embeddings, embedding_dim, mode="sum")
    rows = torch.randn(num_embeddings, embedding_dim, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        table.weight.copy_(rows)
    return table


def trainer_lookup(
    table: rpc.RRef[nn.EmbeddingBag], indices: torch.Tensor, offsets: torch.Tensor
) -> dict[str, Any]:
    """Runs on the trainer. It holds a reference to a table it neither created nor owns,
    and looks rows up *on the table's owner*: only the bags travel, never the table."""
    return {
        "bags": table.rpc_sync().forward(indices, offsets),
        "trainer": rpc.get_worker_info().name,
        "table_owner": table.owner_name(),
    }


def driver(
    ps: str,
    trainer: str,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    num_embeddings: int = 10,
    embedding_dim: int = 3,
    seed: int = 0,
) -> dict[str, Any]:
    """The driver's whole part: create the table on ``ps``, share it with ``trainer``."""
    table = rpc.remote(ps, make_table, args=(num_embeddings, embedding_dim, seed))
    seen = rpc.rpc_sync(trainer, trainer_lookup, args=(table, indices, offsets))
    return {**seen, "table": table}


def tensor_meta(t: torch.Tensor) -> dict[str, Any]:
    """Runs on the callee: what arrived (shape, stride, and the bytes of its storage)."""
    return {
        "shape": tuple(t.shape),
        "stride": t.stride(),
        "storage_bytes": t.untyped_storage().nbytes(),
    }


def what_arrives(callee: str) -> dict[str, dict[str, Any]]:
    """Send views to ``callee`` and report what each arrived as."""
    matrix = torch.arange(12.0).reshape(3, 4)
    big, small = torch.zeros(1 << 20), torch.zeros(1 << 10)  # 4 MiB and 4 KiB of float32
    sent = {
        "transposed": matrix.t(),  # shape (4, 3), stride (1, 4): a view of all 48 bytes
        "slice_of_big": big[:10],  # 40 bytes of a 4 MiB storage
        "slice_of_small": small[:10],  # 40 bytes of a 4 KiB storage
        "clone_of_small_slice": small[:10].clone(),
    }
    return {name: rpc.rpc_sync(callee, tensor_meta, args=(t,)) for name, t in sent.items()}


def profiled_call(callee: str) -> list[str]:
    """Profile one ``rpc_sync`` with the autograd profiler; the names of its events."""
    with torch.autograd.profiler_legacy.profile() as prof:
        rpc.rpc_sync(callee, torch.add, args=(torch.ones(2), 1))
    return [event.name for event in prof.function_events]
