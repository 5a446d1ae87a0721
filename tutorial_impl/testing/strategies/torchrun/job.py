"""A torchrun job as its pytest workers see it: where this worker stands, the job's store
and the process group the harness manages on it.

``torchrun --nnodes=2 --nproc-per-node=2 -m pytest`` starts four pytest processes, each one a
rank of the job (``launch``: where each stands). ``Job`` holds what the session shares
between its tests:

* **A channel that a stuck collective cannot block** (``channel.Channel``): the ranks talk
  through the job's own key-value store (torchrun's agent hosts it), never through the
  process group, and every wait on it has a deadline; values of any size go through.
* **Heartbeats** (``channel.Heartbeats``): every worker bumps a counter of its own in the
  store every ``HEARTBEAT`` s; a worker whose counter stood still for ``HEARTBEAT_LOST`` s
  has exited (or is frozen), and the others stop waiting for it and name it, instead of
  waiting minutes.
* **A watcher** (``watcher``): the process torchrun started forks first thing; the session
  runs in the child, and the parent tells the others at once how the session ended if it
  crashed (``rank 1 was killed by signal SIGSEGV``).
* **A fresh process group after any failure** (``Job.group``): a failed call may have left
  collectives half done, so the next call destroys the job's group and makes a new one on
  the same store, with the timeout of ``timing.group_timeout``.

The runner is ``torchrun`` (one ``run_ranks`` call), the pytest side
``strategies.torchrun.session``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from tutorial_impl.testing import backends
from tutorial_impl.testing.faults.inject import Fired
from tutorial_impl.testing.rendezvous import avoid_reverse_dns_stalls, reserve_port
from tutorial_impl.testing.settings.timing import REPORT_WAIT, STORE_POLL_MAX, group_timeout
from tutorial_impl.testing.strategies.torchrun import watcher
from tutorial_impl.testing.strategies.torchrun.channel import Channel, Departure, Heartbeats
from tutorial_impl.testing.strategies.torchrun.launch import Launch

__all__ = ["Channel", "Departure", "Heartbeats", "Job"]  # the channel's names, as before


class Job:
    """The launched job: its store, the channel, and the default process group we manage.

    Every rank calls ``group`` (or ``no_group``) at the same point of the same test, so the
    decisions here, taken from outcomes every rank agreed on, are the same on every rank.
    """

    def __init__(self, launch: Launch, timeout: float) -> None:
        import torch
        import torch.distributed as dist

        watcher.watch(launch)  # first: from here on this process is the session's own
        avoid_reverse_dns_stalls()
        self.launch = launch
        # The agent's store (a client of it), or, without an agent store, the one rank 0
        # hosts on MASTER_PORT as env:// would; kept for the whole session either way.
        self.store = dist.TCPStore(
            launch.master_addr,
            launch.master_port,
            world_size=launch.world_size,
            is_master=launch.rank == 0 and not launch.agent_store,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout),
        )
        self.channel = Channel(launch, self.store)
        self.heartbeats = Heartbeats(self.channel)
        self.pid = os.getpid()
        self.real_exit = _ending(os._exit)
        os._exit = self._exit_mid_session  # type: ignore[assignment]
        if torch.cuda.is_available() and torch.cuda.device_count() > launch.local_rank:
            torch.cuda.set_device(launch.local_rank)  # one worker per GPU, as torchrun means
        self.calls = 0  # run_ranks calls so far: the same count on every rank (lockstep)
        self.generation = 0  # process groups made so far
        self.current: tuple[str, float, str] | None = None  # backend, timeout, debug level
        self.pg: Any = None  # the default group we made
        self.dirty = False  # the last call failed: its group is not reused
        self.abandoned: list[threading.Thread] = []  # rank functions still running
        self.in_call = False  # a run_ranks call is on: it keeps its own deadline
        # Rank 0 only, set by the call running now: ends that call's function as an exit
        # (``_exit_mid_session``); ``ending`` then says why the session stops after the test.
        self.end_call: Callable[[int], None] | None = None
        self.ending: str | None = None
        self.stale: list[Any] = []  # MASTER_PORTs reserved for failed backend=None calls

    def _exit_mid_session(self, code: int) -> None:
        """``os._exit`` called by a test while the session runs, in this worker (a child it
        forked just exits): leave as ``leave`` says, then end non-zero: a worker that leaves
        in the middle of the job has failed it, and its agent must see that (one whose
        worker exits 0 waits for the others in torchelastic's exit barrier, minutes).

        Rank 0 is the exception: it writes the job's report, so nobody would report the test
        its function left. Called from a rank function of rank 0, the function ends here as
        an exit (``end_call``; the thread stays parked, as if its process were gone), the
        test fails with it on every rank, and the session stops after that test. Elsewhere
        on rank 0 (a test's body, a fixture) it exits at once: no report is coming."""
        if os.getpid() != self.pid:
            self.real_exit(code)
        end_call = self.end_call
        if end_call is not None and threading.current_thread() is not threading.main_thread():
            end_call(code)
            while True:  # parked until the worker exits at the session's end (daemon thread)
                time.sleep(3600)
        self.leave(code)
        if self.launch.rank != 0:
            self.await_report()
        self.real_exit(code or 1)

    def leave(self, status: int, fired: tuple[Fired, ...] = ()) -> None:
        """Tell the other ranks at once, through the store, that this worker is leaving
        (``Departure``), then say nothing more (``Channel.silence``). Once only."""
        if self.channel.silent:
            return
        try:
            departure = Departure(status, time.time(), fired)
            self.channel.set(f"exited/{self.launch.rank}", departure)
        except Exception:  # noqa: BLE001 - the store is gone: the heartbeat tells the rest
            pass
        self.channel.silence()

    def await_report(self) -> None:
        """Wait (at most ``REPORT_WAIT`` s) until rank 0's report is written: the agent
        stops every worker as soon as one has gone, and rank 0 must not be cut off."""
        try:
            stop = time.monotonic() + REPORT_WAIT
            while not self.channel.has("done") and time.monotonic() < stop:
                time.sleep(STORE_POLL_MAX)
        except Exception:  # noqa: BLE001 - the store is gone: nothing to wait for
            pass

    def group(self, backend: str, timeout: float) -> None:
        """Make sure the default group has ``backend``, is clean, and times out at ``timeout``."""
        import torch
        import torch.distributed as dist

        wanted = (backend, timeout, os.environ.get("TORCH_DISTRIBUTED_DEBUG", ""))
        if self.current == wanted and not self.dirty and self._ours():
            return
        self.no_group()
        dist.set_debug_level_from_env()  # --check-collectives: DETAIL wraps the new group
        if backends.uses_nccl(backend):
            torch.cuda.set_device(self.launch.local_rank)  # LOCAL_RANK's GPU, as torchrun means
        self.generation += 1
        dist.init_process_group(
            backend=backend,
            store=dist.PrefixStore(f"tutorial-impl-world-{self.generation}", self.store),
            rank=self.launch.rank,
            world_size=self.launch.world_size,
            # Behind the harness deadline, which must see a hang first (and take the stacks);
            # short enough that a collective abandoned then ends by itself.
            timeout=group_timeout(timeout),
        )
        self.current = wanted
        self.pg = dist.group.WORLD
        self.dirty = False

    def _ours(self) -> bool:
        """The default group is still the one we made (a test may destroy or replace it)."""
        import torch.distributed as dist

        return dist.is_initialized() and dist.group.WORLD is self.pg

    def no_group(self) -> None:
        """Leave the default group, if any (a ``backend=None`` test makes its own)."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        self.current = None

    def fresh_rendezvous(self, key: str, timeout: float) -> tuple[dict[str, str], Any]:
        """MASTER_ADDR/MASTER_PORT for a ``backend=None`` call (RPC, a test's own groups):
        a port rank 0 reserves for its own store, as the parent of forked ranks does. The
        caller also takes ``TORCHELASTIC_USE_AGENT_STORE`` away meanwhile, so that torch's
        ``env://`` makes rank 0 the host, as in a forked rank. Returns the reservation (rank
        0's; None elsewhere), to close once the call is over."""
        reserved = None
        if self.launch.rank == 0:
            reserved = reserve_port()
            self.channel.set(key, reserved.getsockname()[1])
        port = self._wait_for(key, timeout)
        return {"MASTER_ADDR": self.launch.master_addr, "MASTER_PORT": str(port)}, reserved

    def _wait_for(self, key: str, timeout: float) -> Any:
        stop = time.monotonic() + timeout
        while not self.channel.has(key):
            if time.monotonic() > stop:
                raise TimeoutError(f"rank 0 did not publish {key} within {timeout:g} s")
            time.sleep(STORE_POLL_MAX)
        return self.channel.get(key)


def _ending(exit_now: Callable[[int], Any]) -> Callable[[int], None]:
    """``os._exit`` for the session's own ends, which its watcher need not report."""

    def end(code: int) -> None:
        watcher.goodbye()
        exit_now(code)

    return end
