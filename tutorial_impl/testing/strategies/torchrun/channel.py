"""Under torchrun: the channel between the workers of a job, through the job's own store.

The ranks talk through the job's key-value store (torchrun's agent hosts it), never through
the process group, so a stuck collective cannot block them (``Channel``); every wait on it
has a deadline. Values of any size go through: the store's server drops a client whose
message is over 8 MiB (and that client's every later call then fails), so a larger value is
cut into pieces (``CHUNK``). Cutting was chosen over files beside the store: the ranks of a
job need not share a file system (nodes), and the store is already there; a 100 MB result
goes through in pieces in about 0.3 s (docs/torchrun.md). ``Heartbeats`` say which workers
are still there; a worker leaving says how (``Departure``), or its watcher says it for it
(``watcher``). ``job.Job`` holds one channel for the session.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass
from typing import Any

from tutorial_impl.testing.faults.inject import Fired
from tutorial_impl.testing.rank import outcome as _o
from tutorial_impl.testing.settings.timing import HEARTBEAT_LOST, STORE_POLL_MAX, STORE_POLL_MIN
from tutorial_impl.testing.strategies.torchrun.launch import Launch

# ``CRASHED/RANK``: set by the watcher of a worker whose session ended without a word and not
# with 0 (``watcher``): the agent, not the reporter's own exit, ends the job (``crashed``).
CRASHED = "crashed"


@dataclass(frozen=True)
class Departure:
    """A worker leaving in the middle of the session, as it tells its peers before it goes:
    its exit status (``os._exit``'s code, or minus the signal a fault kills it with), when,
    and the faults that fired on it (``faults.Fired``)."""

    status: int
    at: float
    fired: tuple[Fired, ...] = ()

    @property
    def outcome(self) -> _o.Lost | _o.Killed:
        return _o.Killed(-self.status) if self.status < 0 else _o.Lost(self.status)


# TCPStore's server drops a client whose message is over 8 MiB (its libuv backend's limit),
# and every later call of that client then fails: a value over this goes in pieces.
CHUNK = 4 << 20
_WHOLE, _PIECES = b"=", b"#"  # the first byte of a stored value: the value, or a count


class Channel:
    """Keys in the job's store, under this session's own prefix; no wait without a deadline.

    ``publish(key, obj)`` writes ``key/RANK``; ``collect(key, timeout)`` reads every rank's,
    polling (a blocking ``wait`` would hold the store client's lock, and the watchdog thread
    shares the client), and returns those that arrived in time. A worker that has said it is
    leaving (``silence``) writes nothing more: its peers have judged it gone, and a late
    answer from its other threads must not contradict that.

    Values of any size (``_put``): one over ``CHUNK`` bytes is stored as pieces, then a head
    that counts them, so a head that is there means every piece is. The pieces of a
    ``publish`` are deleted by their writer when the next ``gather`` completes (a rank
    publishes there only after reading them), so that a session's large results do not pile
    up in the agent's memory.
    """

    def __init__(self, launch: Launch, store: Any) -> None:
        import torch.distributed as dist

        self.launch = launch
        prefix = f"tutorial-impl-pytest/{launch.run_id}/{launch.restart}/"
        self._store = dist.PrefixStore(prefix, store)
        self.silent = False
        self._pieces: list[str] = []  # of this rank's publishes since the last gather
        self._read: list[str] = []  # of those before: read by all once the next completes

    def publish(self, key: str, obj: Any) -> None:
        """``key/RANK`` = ``obj``, pickled (or ``obj`` itself, if it is pickled already)."""
        if not self.silent:
            data = obj if isinstance(obj, bytes) else _dumps(obj)
            self._pieces += self._put(f"{key}/{self.launch.rank}", data)

    def set(self, key: str, obj: Any = True) -> None:
        if not self.silent:
            self._put(key, pickle.dumps(obj))

    def silence(self) -> None:
        self.silent = True

    def has(self, key: str) -> bool:
        return bool(self._store.check([key]))

    def get(self, key: str) -> Any:
        return pickle.loads(self._take(key))

    def _put(self, name: str, data: bytes) -> list[str]:
        """Store ``data`` under ``name``, in pieces if it is large; the pieces' keys."""
        if len(data) <= CHUNK:
            self._store.set(name, _WHOLE + data)
            return []
        pieces = [f"{name}#{i}" for i in range(0, len(data), CHUNK)]
        for piece in pieces:
            start = int(piece.rpartition("#")[2])
            self._store.set(piece, data[start : start + CHUNK])
        self._store.set(name, _PIECES + str(len(data)).encode())  # last: all is there
        return pieces

    def _take(self, name: str) -> bytes:
        head = self._store.get(name)
        if head[:1] == _WHOLE:
            return head[1:]
        size = int(head[1:])
        return b"".join(self._store.get(f"{name}#{i}") for i in range(0, size, CHUNK))

    def collect(
        self, key: str, timeout: float, heartbeats: Heartbeats | None = None
    ) -> dict[int, Any]:
        """Every rank's ``key``, waiting at most ``timeout`` s, and not for ranks whose
        heartbeat is lost; missing ranks are absent."""
        keys = {r: f"{key}/{r}" for r in range(self.launch.world_size)}
        stop = time.monotonic() + timeout
        pause = STORE_POLL_MIN
        while True:
            if self._store.check(list(keys.values())) or time.monotonic() > stop:
                break
            if heartbeats is not None:
                missing = [r for r, name in keys.items() if not self._store.check([name])]
                if missing and all(heartbeats.lost(r) for r in missing):
                    break
            time.sleep(pause)
            pause = min(pause * 2, STORE_POLL_MAX)
        found = {}
        for rank, name in keys.items():
            if self._store.check([name]):
                found[rank] = pickle.loads(self._take(name))
        return found

    def crashed(self) -> bool:
        """Whether the watcher of a worker said its session crashed (``CRASHED``)."""
        return any(self.has(f"{CRASHED}/{r}") for r in range(self.launch.world_size))

    def gather(
        self, key: str, obj: Any, timeout: float, heartbeats: Heartbeats | None = None
    ) -> dict[int, Any]:
        self.publish(key, obj)
        found = self.collect(key, timeout, heartbeats)
        if len(found) == self.launch.world_size:  # every rank is past the gather before
            for piece in self._read:
                self._store.delete_key(piece)
            self._read, self._pieces = self._pieces, []
        return found

    def add(self, key: str, amount: int) -> int:
        return int(self._store.add(key, amount))


class Heartbeats:
    """Which workers of the job are still there, judged by counters in the store.

    ``beat`` (the session's watchdog thread calls it every ``HEARTBEAT`` s) bumps this
    worker's counter; ``lost(rank)`` is True once rank's counter has not moved for
    ``HEARTBEAT_LOST`` s by this worker's own clock (no clocks are compared across hosts)."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.seen: dict[int, tuple[int, float]] = {}  # rank -> (counter, when it last moved)

    def beat(self) -> None:
        self.channel.add(f"alive/{self.channel.launch.rank}", 1)

    def departure(self, rank: int) -> Departure | None:
        """How ``rank`` said it was leaving, if it did (``Job.leave``)."""
        key = f"exited/{rank}"
        return self.channel.get(key) if self.channel.has(key) else None

    def lost(self, rank: int) -> bool:
        if rank == self.channel.launch.rank:
            return False
        if self.channel.has(f"exited/{rank}"):
            return True
        count = self.channel.add(f"alive/{rank}", 0)
        now = time.monotonic()
        last = self.seen.get(rank)
        if last is None or last[0] != count:
            self.seen[rank] = (count, now)
            return False
        return now - last[1] > HEARTBEAT_LOST

    def lost_ranks(self) -> list[int]:
        return [r for r in range(self.channel.launch.world_size) if self.lost(r)]

    def outcome(self, rank: int) -> _o.Lost | _o.Killed:
        """How a lost rank ended: as it said when it left, else lost without a word."""
        departure = self.departure(rank)
        return departure.outcome if departure is not None else _o.Lost(None)

    def how(self, rank: int) -> str:
        """How a lost rank ended, in words."""
        return self.outcome(rank).how


def _dumps(obj: Any) -> bytes:
    from tutorial_impl.testing.rank.main import dumps_on_cpu

    return dumps_on_cpu(obj)
