"""Race-free rendezvous: the harness's store is the parent's, ``MASTER_PORT`` is rank 0's.

Every process group starts with a *rendezvous*: the ranks meet at a key-value store to
exchange addresses. The tutorial's template hard-codes ``MASTER_PORT=29500`` and lets rank 0
host that store. Under ``pytest -n auto`` that is how suites break: two tests pick the same
port (EADDRINUSE), or a harness "finds a free port", closes it, and another process grabs it
before rank 0 binds it again.

So nobody here guesses a port; the kernel hands out every one (port 0), and two are in play:

* **The harness's own group** meets at a ``TCPStore`` the parent hosts (``AgentStore``), as
  torchrun's agent hosts one: while the harness makes *its* group, and only then, a rank's
  environment names that store and says ``TORCHELASTIC_USE_AGENT_STORE=True`` (torch's
  ``env://`` and ``tcp://`` handlers then connect as clients instead of having rank 0 start a
  server; ``harness_view``). The store outlives every rank, so a rank that dies never takes
  the rendezvous down with it.
* **The user's code** sees what plain torch sees in a process that ``mp.spawn`` started with
  ``MASTER_ADDR``/``MASTER_PORT`` set (``AgentStore.rank_env``): no ``TORCHELASTIC_*``
  variable, and ``MASTER_PORT`` a port the parent *reserved* for rank 0 (``reserve_port``:
  bound, never listening, ``SO_REUSEADDR``): the kernel gives it to no one else, and rank 0's
  own ``TCPStore`` server (which binds with ``SO_REUSEADDR`` too) can still take it. So
  ``init_process_group("gloo")`` on ``env://``, ``tcp://MASTER_ADDR:MASTER_PORT`` and RPC
  behave as torch documents them: rank 0 hosts the store when its code first asks (and
  stops when torch lets go of it: a store the harness kept alive would keep the first
  group's keys, and a group made again there could read the first group's addresses and
  fail in gloo's connect, "Connection refused"), the others
  connect; and a group on a port or file of the user's own is the user's business, as in
  plain torch. ``file://`` needs no port at all: a fresh file in the test's tmp dir.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import socket
import sys
from collections.abc import Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

INIT_METHODS = ("env", "tcp", "file")

_file_counter = itertools.count()


class AgentStore:
    """A ``TCPStore`` server owned by the parent process, on a port the kernel picks, for the
    harness's own group; and the port reserved for rank 0 (``MASTER_PORT``, the user's).

    The store outlives every rank, so a rank that exits early (or crashes) never takes the
    harness's rendezvous down with it, which is what happens when rank 0 hosts the store (as
    it does the user's, in plain torch and here alike).
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
        self._reserved: socket.socket | None = reserve_port()
        self.master_port: int = self._reserved.getsockname()[1]

    def rank_env(self, rank: int, world_size: int) -> dict[str, str]:
        """What the user's code finds in a rank's environment: ``torchrun``'s rendezvous
        variables (single node), ``MASTER_PORT`` the port reserved for rank 0."""
        return {
            "MASTER_ADDR": self.host,
            "MASTER_PORT": str(self.master_port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            **dns_env(),
        }

    def harness_env(self) -> dict[str, str]:
        """The rendezvous of the harness's own group (``harness_view``): this store, which
        every rank joins as a client, as torchrun's workers join their agent's."""
        return {
            "MASTER_ADDR": self.host,
            "MASTER_PORT": str(self.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        }

    def close(self) -> None:
        # Dropping the last reference stops the server thread and frees the port.
        self._store = None
        if self._reserved is not None:
            self._reserved.close()
            self._reserved = None

    def __enter__(self) -> AgentStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def reserve_port() -> socket.socket:
    """A port the kernel picks, kept for rank 0's store: a socket bound to it on every
    address (never listening) with ``SO_REUSEADDR``. While it is open, the kernel hands the
    port to no other bind of port 0 and refuses a bind of it without ``SO_REUSEADDR``; a
    ``TCPStore`` server binds with ``SO_REUSEADDR`` (libuv's and the legacy one), and may
    listen on it, since this socket never does. Close it when the ranks are gone."""
    reserved = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    reserved.bind(("", 0))
    return reserved


@contextlib.contextmanager
def harness_view(env: Mapping[str, str]) -> Iterator[None]:
    """``os.environ`` with ``env`` (``AgentStore.harness_env``) while the harness makes its
    group, then as it was: the user's code never sees the harness's store."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


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

    ``env`` and ``tcp`` read MASTER_ADDR/MASTER_PORT: the harness's store inside
    ``harness_view``, else the port rank 0 hosts.
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
    group can share rank 0's store without colliding (file:// would need two files).
    """
    return f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
