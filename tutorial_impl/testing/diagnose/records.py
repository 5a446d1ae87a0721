"""Every rank's flight-recorder records, asked for at the moment it matters (as its stacks are).

At the deadline, or when a rank fails, the parent wants each live rank's collectives
(``recorder``): which one it waits in, which number, with what tensors. A dump needs Python,
and a rank's main thread is then blocked inside a C++ collective, where no Python signal
handler runs. So each rank keeps one daemon thread for it (``serve``): it waits in
``sigwait`` for SIGUSR2, then writes torch's dump (``recorder.dump_bytes``) to the file of
the task at hand (``answer_to``: ``rankN.fr`` beside ``rankN.stacks``), written whole under a
temporary name then renamed, so that a file that exists is complete. Beside it, written
first, what the rank says of itself (``stranded.Standing``: its rank, its groups' members,
where its main thread is), which ``ask_all`` returns too.

SIGUSR2 is blocked in the rank *before any other thread starts* (``serve`` is the rank's
first step after the fork, which leaves one thread): every thread torch or the user starts
later inherits the mask, so the signal reaches only ``sigwait``, never the default action
(which ends the process). A child process the rank forks or runs inherits the mask too: it
sees SIGUSR2 blocked (harmless unless it waits for that signal itself).

The dump leaves out where each collective was called: torch's first dump with stacks
imports ``torch._dynamo`` and ``torch._inductor`` (measured: 1.1 s of CPU, 3-4 s on a busy
machine, in every rank), while the faulthandler stacks the parent takes at the same moment
(``diagnose.stacks``) say where each waiting rank is (``desync.placed``).

The parent side, ``ask``: signal the live ranks, wait (at most ``budget``) for their files,
read them with ``recorder.load`` (no torch needed). A killed rank has no dump: it is absent.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

from tutorial_impl.testing.diagnose import recorder
from tutorial_impl.testing.diagnose.ask import LiveRank
from tutorial_impl.testing.diagnose.ask import ask as ask_ranks
from tutorial_impl.testing.diagnose.recorder import Record
from tutorial_impl.testing.diagnose.stranded import Standing, standing
from tutorial_impl.testing.settings.timing import DUMP_BUDGET

SIGNAL = signal.SIGUSR2
ENTRY = "_set_up_and_call"  # the harness frame below a rank function's own (``rank``)
_target: dict[str, str] = {}  # this rank's current dump file: {"path": ...}


def serve() -> None:
    """In a rank, first thing: block SIGUSR2, and start the thread that answers it. A
    handler that does nothing stands in for the default action (the end of the process)
    should the rank's code unblock the signal in its main thread."""
    signal.signal(SIGNAL, _ignore)
    signal.pthread_sigmask(signal.SIG_BLOCK, {SIGNAL})
    threading.Thread(target=_answer_forever, name="rank-records", daemon=True).start()


def _ignore(signum: int, frame: object) -> None:
    pass


def answer_to(path: str) -> None:
    """Write the next dumps to ``path`` (a warm rank: each test has its own file)."""
    _target["path"] = path


def _answer_forever() -> None:
    while True:
        signal.sigwait({SIGNAL})
        path = _target.get("path")
        if path is None:
            continue
        try:
            data = recorder.dump_bytes(stacks=False)  # stacks: see the module's doc
            said = pickle.dumps(standing(threading.main_thread().ident, ENTRY))
        except Exception:  # noqa: BLE001 - no group yet, or no recorder: nothing to say
            continue
        for target, content in ((_standing_path(path), said), (path, data)):  # the records last
            partial = f"{target}.{os.getpid()}.part"
            with open(partial, "wb") as out:
                out.write(content)
            os.replace(partial, target)


def ask(ranks: Iterable[LiveRank], budget: float = DUMP_BUDGET) -> dict[int, list[Record]]:
    """Each rank's records now: signal every rank of ``ranks`` still alive, wait for their
    dumps (at most ``budget`` s), and read them. A rank that could not answer (killed, still
    starting, no group yet) is absent."""
    return ask_all(ranks, budget)[0]


def ask_all(
    ranks: Iterable[LiveRank], budget: float = DUMP_BUDGET
) -> tuple[dict[int, list[Record]], dict[int, Standing]]:
    """As ``ask``, and what each rank said of itself with them (``stranded.Standing``)."""
    ranks = list(ranks)
    for r in ranks:
        _remove(r.records_path)  # an earlier answer is not this one
        _remove(_standing_path(r.records_path))
    asked = ask_ranks(ranks, SIGNAL, _all_exist, budget)
    found, said = {}, {}
    for r in asked:
        try:
            found[r.rank] = recorder.load(r.records_path.read_bytes(), r.rank)
            said[r.rank] = pickle.loads(_standing_path(r.records_path).read_bytes())
        except (OSError, EOFError, ValueError, KeyError, pickle.UnpicklingError):
            continue
    return found, said


def _all_exist(asked: Sequence[LiveRank]) -> bool:
    return all(r.records_path.exists() for r in asked)


def _standing_path(path: str | Path) -> Path:
    return Path(f"{path}.standing")


def own(rank: int, since_ns: int) -> list[Record] | None:
    """This rank's records of the call that began at ``since_ns`` (``this_test``), or None
    (no group, or no recorder)."""
    try:
        return this_test(recorder.dump(rank, stacks=False), since_ns)
    except Exception:  # noqa: BLE001 - no group, or no recorder: nothing to say
        return None


def this_test(records: list[Record], since_ns: int) -> list[Record]:
    """A warm rank's records of the test that started at ``since_ns``, numbered as a fresh
    world would number them: each group's collectives (and its point-to-point calls) from 1
    at the test's start, so a verdict reads the same in a warm world as in fresh ranks.

    A group's numbers only grow, so a number that does not is a new group of the same name
    (the default group made anew is ``"0"`` again): its count starts there. A test that made
    more collectives than the recorder keeps (2000) is numbered from its oldest one kept."""
    last: dict[tuple[str, bool], int] = {}  # each group's last number before the test
    out = []
    for rec in records:  # oldest first
        key = (rec.group, rec.p2p)
        if rec.created_ns < since_ns:
            last[key] = rec.seq
            continue
        before = last.get(key, 0)
        if rec.seq <= before:  # the group was made anew: this one counts from its start
            last[key] = before = 0
        out.append(dataclasses.replace(rec, seq=rec.seq - before))
    return out


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
