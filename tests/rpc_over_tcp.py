"""This suite's ranks run RPC over TCP only: TensorPipe's ``uv`` transport, without the
shared-memory one torch adds beside it by default.

TensorPipe's shared-memory transport runs a reactor thread in every RPC agent that polls
for work in a ``sched_yield`` loop for as long as the agent lives. On this suite's 2-core
machine those threads took 7.3% of all CPU samples of a ``pytest -n auto`` run (``perf
record -a``), competing with every other test. Measured on the RPC lessons and the DDP + RPC
benchmark's tests (``tests/rpc`` and ``tests/bench/test_bench_ddp_rpc.py`` under ``-n 3``,
``.ci/cpu_tree.py``, two alternating pairs): 33.9 and 38.0 s of CPU with it, 26.7 and 21.8 s
without; 17.5 and 19.3 s of wall time against 16.4 and 13.6.

A ``TensorPipeRpcBackendOptions`` given no ``_transports`` gets ``["uv"]``; one that names
its transports keeps them. Messages, RRefs, distributed autograd and timeouts are the same
over either transport; what differs is the words of a lost connection (shared memory:
"eof", TCP: "EOF: end of file"), so lesson T8, which quotes them, keeps torch's defaults
(``KEEP``, set in its ranks' environment). So do the CLI demos, fresh interpreters
(``test_rpc_cli.py``, ``test_hybrid_cli.py``): the default transport stays proven end to
end. Imported once in
the rank forkserver (``rank_preload`` in ``pyproject.toml``), so every rank of this suite
has it; nothing in ``tutorial_impl`` knows, and a learner's run keeps torch's defaults.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch.distributed.rpc as rpc

KEEP = "TUTORIAL_SUITE_TORCH_RPC_TRANSPORTS"  # set in a rank's environment: torch's defaults
_init = rpc.TensorPipeRpcBackendOptions.__init__


@functools.wraps(_init)
def _over_tcp_unless_named(self: Any, *args: Any, _transports: Any = None, **kwargs: Any) -> None:
    if _transports is None and not os.environ.get(KEEP):
        _transports = ["uv"]
    _init(self, *args, _transports=_transports, **kwargs)


rpc.TensorPipeRpcBackendOptions.__init__ = _over_tcp_unless_named
