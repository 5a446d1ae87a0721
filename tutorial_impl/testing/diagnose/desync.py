"""Every rank's flight-recorder records in, one line out: why the ranks are not together.

``explain`` compares the ranks' records group by group (the default group first), collective
number by collective number, and names the first place they part:

* **different collectives at one number**: ``ranks 0, 2, 3 wait in all_reduce #17; rank 1
  waits in broadcast #17: the ranks are in different collectives``;
* **the same collective with other tensors**: ``ranks 0, 1 are in all_reduce #17 with
  different inputs: rank 0 [4] Float, rank 1 [5] Float``;
* **a rank behind**: ``rank 0 waits in all_reduce #17; rank 1 never reached #17 (its last:
  broadcast #16)``; a rank with no records at all ``left no record`` (it died: a killed
  process dumps nothing);
* **all in one collective**, none behind: ``ranks 0, 1 wait in all_reduce #17: every rank
  reached it`` (the hang is inside the collective, not between the ranks).

It returns None when every rank's records agree and every collective finished. A rank's
records may start later than another's (the recorder keeps the last N): only numbers every
rank still holds are compared. Where the recorder kept the stack, the line says where the
call was (``at test_x.py:12``). Pure: records in, a string out (``recorder`` makes them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from tutorial_impl.testing import words
from tutorial_impl.testing.diagnose.recorder import Record, collectives
from tutorial_impl.testing.diagnose.stacks import Place
from tutorial_impl.testing.diagnose.userops import user_op

DEFAULT_DESC = "default_pg"
# Collectives whose inputs may differ from rank to rank: the root's list against nothing, a
# rank's own split sizes.
UNEVEN = frozenset({"scatter", "gather", "all_to_all", "all_to_all_single", "alltoall_base"})


def _ranks(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _in(ranks: Sequence[int], records: Sequence[Record]) -> str:
    """``ranks 0, 2 wait in all_reduce #17 at t.py:9`` (``called`` if every one finished)."""
    one = len(ranks) == 1
    if all(r.completed for r in records):
        verb = "called"
    else:
        verb = "waits in" if one else "wait in"
    where = next((r.where for r in records if r.where), None)
    at = f" at {where.file}:{where.line}" if where else ""
    return f"{_ranks(ranks)} {verb} {records[0].name}{at}"


def placed(
    records: Mapping[int, Sequence[Record]], where: Mapping[int, Place]
) -> dict[int, list[Record]]:
    """``records`` with each rank's unfinished collective placed where its stack says the
    rank is (``where``, from ``diagnose.stacks``): for records dumped without their stacks; and
    named as the user called it where torch records it as another op (``userops``)."""
    out = {}
    for rank, recs in records.items():
        recs = list(recs)
        spot = where.get(rank)
        if spot is not None and recs and not recs[-1].completed:
            last = recs[-1]
            frames = last.frames or ((spot.file, spot.line, spot.func),)
            recs[-1] = dataclasses.replace(last, frames=frames, called=user_op(spot.call, last.op))
        out[rank] = recs
    return out


def waiting(records: Mapping[int, Sequence[Record]]) -> frozenset[int]:
    """The ranks whose newest collective has not finished: they wait inside one."""
    return frozenset(
        r for r, recs in records.items() if (done := collectives(recs)) and not done[-1].completed
    )


def _groups(records: Mapping[int, Sequence[Record]]) -> list[str]:
    """Every group named in the records, the default group first, then by name."""
    names = {(r.group_desc != DEFAULT_DESC, r.group) for rs in records.values() for r in rs}
    return [name for _, name in sorted(names, key=lambda k: (k[0], len(k[1]), k[1]))]


def explain(
    records: Mapping[int, Sequence[Record]],
    world_size: int | None = None,
    members: Mapping[str, Sequence[int]] | None = None,
    mismatch_only: bool = False,
) -> str | None:
    """One line on where the ranks part (see the module's doc), or None if nowhere.
    ``mismatch_only``: only ranks in different collectives, or in one with different
    inputs (beside a failure, a rank behind is its consequence, not news).

    ``records`` maps each rank to its records (``recorder.dump`` or ``load``); a rank of
    ``world_size`` absent from it left no record. ``members`` maps a group's name to its
    ranks (``recorder.members``): without it, a group other than the default one has the
    ranks that recorded something on it, and a member that never did goes unnamed."""
    ranks = sorted(range(world_size) if world_size is not None else records)
    silent = [r for r in ranks if r not in records]  # no dump at all (killed, or no answer)
    for group in _groups(records):
        held = {r: collectives(records.get(r, ()), group) for r in ranks}
        is_default = any(rec.group_desc == DEFAULT_DESC for rs in held.values() for rec in rs)
        named = set((members or {}).get(group, ()))
        # Every rank of the world is in the default group: one that answered with no record
        # of it never reached its first collective.
        members_here = [r for r in ranks if held[r] or r in named or is_default]
        line = _explain_group({r: held[r] for r in members_here}, silent, mismatch_only)
        if line:
            return line
    return None


def _explain_group(
    held: Mapping[int, Sequence[Record]], silent: Sequence[int], mismatch_only: bool = False
) -> str | None:
    """The first number at which the ranks of one group part, in words (or None)."""
    by_seq = {r: {rec.seq: rec for rec in recs} for r, recs in held.items() if r not in silent}
    if not any(by_seq.values()):
        return None
    start = max(min(seqs) for seqs in by_seq.values() if seqs)
    end = max(max(seqs) for seqs in by_seq.values() if seqs)
    for n in range(start, end + 1):
        present = {r: seqs[n] for r, seqs in by_seq.items() if n in seqs}
        behind = [r for r in by_seq if n not in by_seq[r]]
        line = _parted(n, present, behind if not mismatch_only else [], by_seq, silent)
        if line:
            return line
    if mismatch_only:
        return None
    last = {r: seqs[max(seqs)] for r, seqs in by_seq.items() if seqs}
    if silent or not all(rec.completed for rec in last.values()):
        return _stuck(last, silent)
    return None


def _parted(
    n: int,
    present: dict[int, Record],
    behind: list[int],
    by_seq: Mapping[int, Mapping[int, Record]],
    silent: Sequence[int],
) -> str | None:
    """What differs at collective number ``n``: the op, the inputs, or who reached it."""
    kinds: dict[tuple[str, str], list[int]] = {}
    for rank, rec in present.items():
        kinds.setdefault((rec.op, "" if rec.op in UNEVEN else rec.inputs), []).append(rank)
    ops = {op for op, _ in kinds}
    if len(ops) > 1:
        parts = sorted(kinds.values(), key=lambda rs: (-len(rs), rs))
        said = "; ".join(_in(rs, [present[r] for r in rs]) for rs in parts)
        return f"{said}: {words.DIFFERENT_COLLECTIVES}"
    if len(kinds) > 1:
        shown = ", ".join(f"rank {r} {present[r].inputs}" for r in sorted(present))
        name = next(iter(present.values())).name
        return f"{_ranks(list(present))} are in {name} with different inputs: {shown}"
    if behind and any(not rec.completed for rec in present.values()):
        waiting = sorted(present)
        said = _in(waiting, [present[r] for r in waiting])
        lasts = []
        for r in sorted(behind):
            earlier = [s for s in by_seq[r] if s < n]
            its = f" (its last: {by_seq[r][max(earlier)].name})" if earlier else ""
            lasts.append(f"rank {r} never reached #{n}{its}")
        return "; ".join([said, *lasts, *_silent(silent)])
    return None


def _silent(silent: Sequence[int]) -> list[str]:
    return [f"{_ranks(silent)} left no record (a killed rank dumps nothing)"] if silent else []


def _stuck(last: Mapping[int, Record], silent: Sequence[int]) -> str:
    """Where each rank that recorded stopped, when the scan found no parting: usually one
    collective every rank reached and none finished."""
    at: dict[int, list[int]] = {}
    for rank, rec in last.items():
        at.setdefault(rec.seq, []).append(rank)
    said = "; ".join(_in(rs, [last[r] for r in rs]) for _, rs in sorted(at.items()))
    if silent:
        return "; ".join([said, *_silent(silent)])
    if len(at) == 1 and len(last) > 1:
        return f"{said}: every rank reached it (the hang is inside the collective)"
    return said
