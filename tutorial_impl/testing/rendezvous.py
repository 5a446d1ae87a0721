"""Race-free rendezvous: the parent owns the store, the ranks only connect to it.

Every process group starts with a *rendezvous*: the ranks meet at a key-value store to
exchange addresses. The tutorial's template hard-codes ``MASTER_PORT=29500`` and lets rank 0
host that store. Under ``pytest -n auto`` that is how suites break: two tests pick the same
port (EADDRINUSE), or a harness "finds a free port", closes it, and another process grabs it
before rank 0 binds it again.

We do what ``torchrun`` does instead. Its *agent* (the parent of the ranks) hosts a
``TCPStore`` and sets ``TORCHELASTIC_USE_AGENT_STORE=True``; every rank then connects to that
store as a client and nobody binds a port but the agent. Our parent binds its ``TCPStore`` to
port 0, so the kernel hands out a free port atomically and there is nothing to race for.
Because all three of the tutorial's init methods (``env://``, ``tcp://`` and RPC's ``tcp://``)
go through the same torch helper that honours that variable, they all rendezvous on the
parent's store. ``file://`` needs no port at all: a fresh file in the test's tmp dir.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

INIT_METHODS = ("env", "tcp", "file")

_file_counter = itertools.count()


class AgentStore:
    """A ``TCPStore`` server owned by the parent process, on a port the kernel picks.

    The store outlives every rank, so a rank that exits early (or crashes) never takes the
    rendezvous down with it, which is what happens when rank 0 hosts the store.
    """

    def __init__(self, host: str = "127.0.0.1", timeout: float = 60.0) -> None:
        import torch.distributed as dist  # here, not at import: the pytest plugin imports us

        avoid_reverse_dns_stalls()  # before the store's first lookup: see its docstring
        self.host = host
        self._store: Any = dist.TCPStore(
            host,
            0,  # port 0: the kernel assigns a free port while binding; no probe, no race
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout),
        )
        self.port: int = self._store.port

    def rank_env(self, rank: int, world_size: int) -> dict[str, str]:
        """The environment ``torchrun`` would give this rank (single node)."""
        return {
            "MASTER_ADDR": self.host,
            "MASTER_PORT": str(self.port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            # Make env:// and tcp:// rendezvous connect to our store as clients instead of
            # having rank 0 start a second server on MASTER_PORT.
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": "0",
            **dns_env(),
        }

    def close(self) -> None:
        # Dropping the last reference stops the server thread and frees the port.
        self._store = None

    def __enter__(self) -> AgentStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def agents_store(timeout: float) -> Any:
    """A rendezvous store for the agents of a multi-node torchrun job, hosted by the caller
    (a test) on a port the kernel picks: the agents join it as clients with
    ``--rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:PORT --rdzv-conf=is_host=0``, so no agent
    has to guess a free port (the "external rendezvous store" of a real cluster)."""
    import torch.distributed as dist

    avoid_reverse_dns_stalls()
    return dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        multi_tenant=True,
        timeout=timedelta(seconds=timeout),
    )


# What torch's TCPStore needs from glibc's resolver here (see ``avoid_reverse_dns_stalls``).
DNS_WORKAROUND = {"RES_OPTIONS": "use-vc"}
_dns_applied = False


def avoid_reverse_dns_stalls() -> None:
    """Send the harness's DNS queries over TCP (``RES_OPTIONS=use-vc``) unless set already.

    torch's TCPStore looks up a host *name* for every peer address it connects or accepts,
    only to put it in log messages; for 127.0.0.1 (seen as ``::ffff:127.0.0.1``) that is a
    DNS query. On the 2-core machine this suite is timed on, the DNS server drops about one
    UDP query in thirteen, and glibc waits 5 s before it retries: measured, one group in ~12
    took 5 s instead of ~40 ms, which dwarfs everything else the harness costs. Over TCP a
    query is either answered or refused at once (refused there: the lookup fails and c10d
    logs the numeric address instead, with one warning line per process that
    ``supervise`` drops from rank output).

    Scoped to the harness: ``AgentStore`` calls this when it first starts a store (pytest,
    the CLI and a script alike), and the ranks get the variable in their environment
    (``AgentStore.rank_env``). Installing the package changes nothing in a project that
    never starts ranks, and even then its ``os.environ`` stays as it was: the setting goes
    into the C environment only (``putenv``), where glibc reads it, and ``res_init`` makes
    glibc re-read it in case this process has resolved a name before.
    """
    global _dns_applied
    if _dns_applied or "RES_OPTIONS" in os.environ:
        return  # a user's own setting wins
    _dns_applied = True
    for name, value in DNS_WORKAROUND.items():
        os.putenv(name, value)
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).__res_init()  # ``res_init`` is a macro for it in <resolv.h>
        except (OSError, AttributeError):
            pass  # not glibc: its resolver reads the environment when it starts, if at all


def dns_env() -> dict[str, str]:
    """The workaround for a rank's environment, unless the user chose their own setting."""
    return {} if "RES_OPTIONS" in os.environ else dict(DNS_WORKAROUND)


def init_method_url(kind: str, tmp_dir: str | os.PathLike[str] | None = None) -> str:
    """The ``init_method`` URL of one of the tutorial's three init methods, inside a rank.

    ``env`` and ``tcp`` read MASTER_ADDR/MASTER_PORT, which the harness set to its store.
    ``file`` needs a *fresh* file for every init (a FileStore file that already holds keys
    from an earlier group confuses the next one), so each call names a new file.
    """
    if kind == "env":
        return "env://"
    if kind == "tcp":
        return f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    if kind == "file":
        if tmp_dir is None:
            raise ValueError("init method 'file' needs a directory shared by all ranks")
        # All ranks must agree on the name, so it depends on a per-process counter that
        # advances identically on every rank (one call per init), never on the pid.
        name = Path(tmp_dir) / f"rendezvous-{next(_file_counter)}"
        return f"file://{name}"
    raise ValueError(f"unknown init method {kind!r}; expected one of {', '.join(INIT_METHODS)}")


def rpc_init_method() -> str:
    """``init_method`` for ``TensorPipeRpcBackendOptions`` inside a rank.

    RPC keys live under their own ``rpc_prefix_N`` in the store, so RPC and a process
    group can share the parent's store without colliding (file:// would need two files).
    Under ``torchrun`` this is the agent's store, exactly as in the harness.
    """
    return f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
