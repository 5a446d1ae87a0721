"""A hang that cannot resolve: a rank has returned, and a peer waits in a collective of a
group the returned rank is in, one it never entered.

Waiting out the deadline then tells the user nothing new (60 s by default, where PyTorch's
own harness fails in milliseconds because the returned rank's process exits). The records
already say it: the returned rank's last collective of that group is behind the one its peer
waits in. So while some rank has returned and others still run, the runners ask now and then
(``POLL``: a passing test, whose ranks end together, never asks) for every rank's records and
its ``Standing`` (what it says of itself: its rank, its groups and their members, where its
rank function's thread is), and ``find`` decides. Forked and warm, ``supervise`` asks the
ranks (``records.ask``, SIGUSR2); under torchrun each waiting worker reads the returned
ranks' answers from the job's store and looks at itself (``torchrun``).

``find`` never gives a false verdict; a peer counts as stranded only if all of these hold:

* its newest collective is unfinished, and its rank function's thread is inside a call that
  can be that collective (``userops.can_be``: blocked in it, not computing beside an
  ``async_op`` work it may never wait for), or inside a functional collective's wait
  (``userops.in_functional_wait``: DTensor's ``redistribute``, an ``AsyncCollectiveTensor``'s
  first use) while that collective is its only unfinished one (so the work it waits for is
  that one, or one that has ended);
* that collective's group timeout is no shorter than the harness deadline (a shorter one
  ends the wait with an error the rank function may catch and go on from);
* the returned rank is a member of that group, as both ranks see it (the same name, the same
  members, each rank numbered as the harness numbers it: two worlds a test makes apart may
  both call their default group ``"0"``), and its last collective of the group, as recorded
  before it reported, is numbered below the one its peer waits in.

A peer that is only slow has not returned; a peer that waits in a collective of a group the
returned rank is not in fails the third condition: both still get their deadline.

Under torch's collective checker (``TORCH_DISTRIBUTED_DEBUG=DETAIL``: ``--check-collectives``)
a peer never reaches the collective: the checker first makes every rank of the group meet in a
monitored barrier, point-to-point and recorded nowhere, and only then issues (records and
counts) the collective. So ``entering`` decides from what each rank says of its checked groups
(``Checked``: how many collectives it has issued on each): a peer is stranded when its thread
is in a collective call, no collective of it is unfinished (it is not inside one the returned
rank may have entered), every group it is in is checked, with a timeout no shorter than the
deadline, and has the returned rank as a member (as both see it) that issued no more of the
group's collectives than the peer: the call it waits to enter is one the returned rank never
made. The group of the call is not in its stack, hence every group. A functional collective
(DTensor's) skips the checker's barrier: its record has no group name, and with one group the
counts decide (``inside_checked``).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from tutorial_impl.testing import words
from tutorial_impl.testing.diagnose.recorder import Record, collectives
from tutorial_impl.testing.diagnose.stacks import Frame, Place, frames_of, place
from tutorial_impl.testing.diagnose.userops import (
    COLLECTIVE_CALLS,
    can_be,
    in_functional_wait,
    user_op,
)

POLL = 0.3  # seconds between two looks, while some rank has returned and others run


@dataclass(frozen=True)
class Checked:
    """A group torch's collective checker wraps, as one rank sees it (``recorder.checked``)."""

    issued: int  # the collectives this rank has issued on it
    timeout_ms: int  # the group's timeout, which the checker's barrier waits at most


@dataclass(frozen=True)
class Standing:
    """What a rank says of itself beside its records."""

    rank: int | None  # its rank in its default group (None: it has none)
    groups: dict[str, tuple[int, ...]]  # each group it is in, by name: its members
    frames: tuple[Frame, ...] = ()  # its rank function's thread, most recent call first
    checked: dict[str, Checked] = dataclasses.field(default_factory=dict)  # by group name

    @property
    def where(self) -> Place | None:
        return place(list(self.frames))


def standing(thread: int | None, stop: str) -> Standing:
    """This rank's ``Standing`` now: ``thread`` is the ident of the thread that runs the rank
    function, whose frames are read down to the function named ``stop``."""
    import torch.distributed as dist

    from tutorial_impl.testing.diagnose.recorder import checked, members

    if not dist.is_available() or not dist.is_initialized():
        return Standing(None, {})
    frame = sys._current_frames().get(thread) if thread is not None else None
    wrapped = {name: Checked(*seen) for name, seen in checked().items()}
    return Standing(dist.get_rank(), members(), tuple(frames_of(frame, stop)), wrapped)


@dataclass(frozen=True)
class Stranded:
    """Who returned (and its last collective of the group), who waits in what."""

    left: dict[int, Record | None]  # rank -> its last collective of the group, if any
    waiting: dict[int, Record]  # rank -> the collective it waits in, named as the user called

    def line(self, early: bool, deadline: float) -> str:
        """``rank 1 returned after all_reduce #3; ranks 0, 2, 3 wait in all_reduce #4 at
        t.py:9, which rank 1 never entered: ...``."""
        gone = "; ".join(
            f"rank {r} returned " + (f"after {last.name}" if last else "before any collective")
            for r, last in sorted(self.left.items())
        )
        by_name: dict[str, list[int]] = {}
        for r, rec in sorted(self.waiting.items()):
            by_name.setdefault(rec.name + _at(rec), []).append(r)
        waits = "; ".join(f"{_ranks(rs)} {_verb(rs)} in {name}" for name, rs in by_name.items())
        who = "it" if len(self.left) > 1 else f"rank {next(iter(self.left))}"
        return words.stranded(gone, waits, who, deadline, early)


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _verb(ranks: Sequence[int]) -> str:
    return "waits" if len(ranks) == 1 else "wait"


def _at(rec: Record) -> str:
    where = rec.where
    return f" at {where.file}:{where.line}" if where else ""


def find(
    records: Mapping[int, Sequence[Record]],
    standings: Mapping[int, Standing],
    returned: Collection[int],
    running: Collection[int],
    deadline: float,
) -> Stranded | None:
    """The ranks of ``running`` stranded by a rank of ``returned`` (the module's rules), or
    None. ``records``: each rank's, those of a returned rank as they were when it reported."""
    left: dict[int, Record | None] = {}
    waiting: dict[int, Record] = {}
    for w in sorted(running):
        waits_in = blocked_in(w, records.get(w, ()), standings.get(w), deadline)
        if waits_in is None or not waits_in.group:  # none, or the checker's: no group name
            entered = (
                entering(w, records, standings, returned, deadline)
                if waits_in is None
                else inside_checked(w, waits_in, records, standings, returned)
            )
            if entered is not None:
                waiting[w] = entered[0]
                left.update(entered[1])
            continue
        members = standings[w].groups.get(waits_in.group, ())
        for r in sorted(returned):
            mine = standings.get(r)
            if r not in members or mine is None or mine.rank != r:
                continue
            if mine.groups.get(waits_in.group) != members:
                continue
            done = [c for c in collectives(records.get(r, ())) if c.group == waits_in.group]
            last = done[-1] if done else None
            if last is None or last.seq < waits_in.seq:
                left[r], waiting[w] = last, waits_in
                break
    return Stranded(left, waiting) if waiting else None


def blocked_in(
    rank: int, records: Sequence[Record], own: Standing | None, deadline: float
) -> Record | None:
    """The collective ``rank`` is blocked in, as far as its records and its thread say, and
    that only the harness deadline can end; named as the user called it. Else None."""
    if own is None or own.rank != rank:
        return None
    done = collectives(records)
    if not done or done[-1].completed:
        return None
    newest = done[-1]
    if newest.timeout_ms <= 0 or newest.timeout_ms < deadline * 1000:
        return None
    spot = own.where
    if spot is None:
        return None
    if can_be(spot.call, newest.op):
        called = user_op(spot.call, newest.op)
    elif in_functional_wait(own.frames) and [c for c in done if not c.completed] == [newest]:
        # A functional collective's wait (DTensor's redistribute): it waits for one of its
        # works, and the newest is the only one unfinished: that one, or one that has ended.
        called = ""
    else:
        return None
    frames = newest.frames or ((spot.file, spot.line, spot.func),)
    return dataclasses.replace(newest, frames=frames, called=called)


def entering(
    rank: int,
    records: Mapping[int, Sequence[Record]],
    standings: Mapping[int, Standing],
    returned: Collection[int],
    deadline: float,
) -> tuple[Record, dict[int, Record | None]] | None:
    """The collective ``rank`` waits to enter in torch's checker, that a rank of
    ``returned`` never made (the module's rules), and each such rank's last collective;
    else None."""
    own = standings.get(rank)
    if own is None or own.rank != rank or not own.groups or set(own.checked) != set(own.groups):
        return None
    spot = own.where
    mine = collectives(records.get(rank, ()))
    if spot is None or spot.call not in COLLECTIVE_CALLS or any(not c.completed for c in mine):
        return None
    if any(c.timeout_ms < deadline * 1000 for c in own.checked.values()):
        return None
    left = _behind(rank, own, records, standings, returned, strictly=False)
    if not left:
        return None
    only = next(iter(own.checked)) if len(own.checked) == 1 else None
    seq = own.checked[only].issued + 1 if only is not None else 0
    frames = ((spot.file, spot.line, spot.func),)
    return _named(rank, spot.call, seq, only, frames), left


def inside_checked(
    rank: int,
    waits_in: Record,
    records: Mapping[int, Sequence[Record]],
    standings: Mapping[int, Standing],
    returned: Collection[int],
) -> tuple[Record, dict[int, Record | None]] | None:
    """For ``rank`` blocked in collective ``waits_in`` that torch's checker recorded without a
    group name (one it did not check first: a functional collective's): stranded when its one
    group is checked and the returned rank issued fewer of that group's collectives."""
    own = standings[rank]
    if len(own.checked) != 1 or set(own.checked) != set(own.groups):
        return None  # which group it is cannot be told
    left = _behind(rank, own, records, standings, returned, strictly=True)
    name = next(iter(own.groups))
    named = dataclasses.replace(
        waits_in, group=name, group_desc="default_pg" if name == "0" else ""
    )
    return (named, left) if left else None


def _behind(
    rank: int,
    own: Standing,
    records: Mapping[int, Sequence[Record]],
    standings: Mapping[int, Standing],
    returned: Collection[int],
    strictly: bool,
) -> dict[int, Record | None]:
    """Each rank of ``returned`` that is a member of every group of ``own`` (as both see it)
    and issued fewer (``strictly``) or no more of its collectives than ``rank``: its last."""
    left = {}
    for r in sorted(returned):
        theirs = standings.get(r)
        if theirs is None or theirs.rank != r:
            continue
        if all(
            r in members
            and theirs.groups.get(name) == members
            and name in theirs.checked
            and (
                theirs.checked[name].issued < own.checked[name].issued
                if strictly
                else theirs.checked[name].issued <= own.checked[name].issued
            )
            for name, members in own.groups.items()
        ):
            left[r] = _last(r, collectives(records.get(r, ())), theirs, own)
    return left


def _last(rank: int, done: Sequence[Record], theirs: Standing, own: Standing) -> Record | None:
    """A returned rank's last collective of this call (None: it made none), numbered in the
    peer's group if it has one only (the checker's records carry no group name)."""
    if not done:
        return None
    only = next(iter(own.checked)) if len(own.checked) == 1 else None
    seq = theirs.checked[only].issued if only is not None else 0
    return _named(rank, done[-1].op, seq, only, ())


def _named(rank: int, op: str, seq: int, group: str | None, frames: tuple[Frame, ...]) -> Record:
    return Record(
        rank=rank,
        group=group or "",
        group_desc="default_pg" if group == "0" else "",
        seq=seq,
        op=op,
        p2p=False,
        input_sizes=(),
        input_dtypes=(),
        output_sizes=(),
        output_dtypes=(),
        state="scheduled",
        completed=False,
        frames=frames,
    )
