"""torch's flight recorder, read as typed records: what each rank's collectives were.

torch 2.13 records every collective of a gloo (or NCCL) group in a ring buffer of the
process, on by default (the last 2000; ``TORCH_FR_BUFFER_SIZE`` sets how many, ``0`` turns
it off). torch reads the variable once per process, when the first group is made (or the
first dump asked for): ``enable`` must come before that, and a forked rank's first group is
its own (the forkserver makes none). ``torch._C._distributed_c10d._dump_fr_trace()`` returns
the buffer as a pickle of plain dicts, lists and strings; ``parse`` turns its entries into
``Record``s, so a test can read them (``dump``), and the parent can read a rank's dump
without torch (``load``). ``desync.explain`` turns every rank's records into one line.

A record is one collective of one group, numbered per group as torch numbers them
(``collective_seq_id``: the ``#17`` of a headline). On gloo its ``state`` stays
``"scheduled"`` (gloo does not time its work) and ``completed`` says whether the work has
finished (``retired``); gloo records no point-to-point call. A dump can be taken from
another thread while the rank's main thread waits inside a collective (the wait releases
the GIL). A rank that was killed leaves no dump. Nothing here imports torch at import
time. The recorder's cost per small all_reduce: docs/faults.md.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tutorial_impl.testing.diagnose.stacks import Frame, Place, place
from tutorial_impl.testing.faults.plan import collective_name

ENV = "TORCH_FR_BUFFER_SIZE"
DEFAULT_ENTRIES = 2000  # torch 2.13's own default


def enable(entries: int = DEFAULT_ENTRIES) -> bool:
    """Have torch record the last ``entries`` collectives of this process, unless the
    variable is set already (a user's ``0`` stands). Call it before the process's first
    group; returns whether recording is on as far as the variable says."""
    os.environ.setdefault(ENV, str(entries))
    return os.environ[ENV].strip() not in ("", "0")


@dataclass(frozen=True)
class Record:
    """One collective of one rank, as its flight recorder saw it."""

    rank: int  # the rank whose recorder this is (its rank in the default group)
    group: str  # the group's name ("0" for the default group), as ``group.group_name``
    group_desc: str  # "default_pg", or what ``new_group(group_desc=...)`` said
    seq: int  # the collective's number in its group (1-based; p2p numbered apart)
    op: str  # "all_reduce", "broadcast", ... (torch's profiling name, backend prefix cut)
    p2p: bool
    input_sizes: tuple[tuple[int, ...], ...]
    input_dtypes: tuple[str, ...]  # torch's names: "Float", "Half", "Long", ...
    output_sizes: tuple[tuple[int, ...], ...]
    output_dtypes: tuple[str, ...]
    state: str  # "scheduled", "started" or "completed" (gloo: always "scheduled")
    completed: bool  # the work has finished (``retired``, or state "completed")
    frames: tuple[Frame, ...] = ()  # where it was called, most recent call first
    created_ns: int = 0  # when it was recorded (time.time_ns(): a warm world's test start)
    timeout_ms: int = 0  # the group's timeout for it (0: not recorded)
    called: str = ""  # the user's call, where torch records it as another op (``userops``)

    @property
    def name(self) -> str:
        """``all_reduce #17`` (and its group unless it is the default one); the call alone
        where its number is not known (``seq`` 0: ``stranded``'s checked groups)."""
        if self.seq == 0:
            return self.called or self.op
        return collective_name(self.called or self.op, self.seq, self.group, self.group_desc)

    @property
    def where(self) -> Place | None:
        """The innermost line of user code that called it, if the stack was recorded."""
        return place(list(self.frames))

    @property
    def inputs(self) -> str:
        """``[4] Float``, ``[2, 3] Float, [4] Half``: what went in, for a mismatch."""
        parts = [
            f"{list(s)} {d}" for s, d in zip(self.input_sizes, self.input_dtypes, strict=False)
        ]
        return ", ".join(parts) or "no tensor"


def _sizes(value: Any) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(n) for n in size) for size in value or ())


def _frames(value: Any) -> tuple[Frame, ...]:
    return tuple((f["filename"], int(f["line"]), f["name"]) for f in value or ())


def parse(trace: Mapping[str, Any], rank: int) -> list[Record]:
    """The records of a flight-recorder dump (unpickled), oldest first."""
    records = []
    for entry in trace.get("entries", ()):
        name, desc = entry["process_group"]
        p2p = bool(entry.get("is_p2p", False))
        records.append(
            Record(
                rank=rank,
                group=str(name),
                group_desc=str(desc),
                seq=int(entry["p2p_seq_id" if p2p else "collective_seq_id"]),
                op=str(entry["profiling_name"]).rpartition(":")[2],
                p2p=p2p,
                input_sizes=_sizes(entry.get("input_sizes")),
                input_dtypes=tuple(entry.get("input_dtypes") or ()),
                output_sizes=_sizes(entry.get("output_sizes")),
                output_dtypes=tuple(entry.get("output_dtypes") or ()),
                state=str(entry.get("state", "")),
                completed=bool(entry.get("retired")) or entry.get("state") == "completed",
                frames=_frames(entry.get("frames")),
                created_ns=int(entry.get("time_created_ns") or 0),
                timeout_ms=int(entry.get("timeout_ms") or 0),
            )
        )
    return records


def dump_bytes(stacks: bool = True) -> bytes:
    """This process's flight-recorder buffer, as torch pickles it (``stacks``: with where
    each collective was called)."""
    from torch._C._distributed_c10d import _dump_fr_trace

    return _dump_fr_trace(includeCollectives=True, includeStackTraces=stacks)


def load(raw: bytes, rank: int) -> list[Record]:
    """The records of a dump ``dump_bytes`` wrote (in any process: no torch needed)."""
    return parse(pickle.loads(raw), rank)


def dump(rank: int, stacks: bool = True) -> list[Record]:
    """This rank's records now, oldest first."""
    return load(dump_bytes(stacks), rank)


def members() -> dict[str, tuple[int, ...]]:
    """Every group this process is in, by name: its ranks (numbered as in the default group),
    for ``desync.explain``, which cannot tell from records alone who should have recorded."""
    import torch.distributed as dist

    names = dist.distributed_c10d._world.pg_names
    return {name: tuple(dist.get_process_group_ranks(pg)) for pg, name in names.items()}


def checked() -> dict[str, tuple[int, int]]:
    """Every group of this process that torch's collective checker wraps
    (``TORCH_DISTRIBUTED_DEBUG=DETAIL``, what ``--check-collectives`` sets), by name: how many
    collectives this rank has issued on it, and its timeout in ms. The checker makes every
    rank of the group meet (a monitored barrier, point-to-point: recorded nowhere) before the
    group's collective is issued and counted, so a rank waiting there has no record of it.
    Nothing while the recorder is off: a collective in progress would leave no record either."""
    import torch
    import torch.distributed as dist

    found: dict[str, tuple[int, int]] = {}
    if os.environ.get(ENV, str(DEFAULT_ENTRIES)).strip() in ("", "0"):
        return found
    for pg, name in dist.distributed_c10d._world.pg_names.items():
        for device in ("cpu", "cuda"):
            try:
                backend = pg._get_backend(torch.device(device))
            except RuntimeError:  # no backend for that device in this group
                continue
            if type(backend).__name__ == "_ProcessGroupWrapper":
                timeout = backend.options._timeout.total_seconds()
                found[name] = (pg._get_sequence_number_for_group(), int(timeout * 1000))
                break
    return found


def collectives(records: Sequence[Record], group: str | None = None) -> list[Record]:
    """The collectives (not point-to-point) of ``records``, of one group if named (its name
    or description)."""
    return [r for r in records if not r.p2p and (group is None or group in (r.group, r.group_desc))]
