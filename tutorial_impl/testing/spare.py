"""EXPERIMENT: pre-formed fresh worlds (TUTORIAL_IMPL_SPARE=1).

The next call's world is forked and joins its group while the current call runs; it serves one
call and is killed, as fresh ranks are. Formed for the key of the last call, used only when
the next call has the same key (world size, backend, init method, deadline, env, the
parent's environment, path and directory).
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tutorial_impl.testing import call as _call
from tutorial_impl.testing import forkserver, supervise, torchenv
from tutorial_impl.testing import rank as _rank
from tutorial_impl.testing.call import Call, RankSpec
from tutorial_impl.testing.rendezvous import AgentStore

ON = os.environ.get("TUTORIAL_IMPL_SPARE") == "1"


def key_of(call: Call) -> tuple[Any, ...]:
    return (
        call.world_size,
        call.backend,
        call.init_method,
        call.deadline,
        tuple(sorted(call.env.items())),
        call.debug_rank,
        call.coverage is not None,
        tuple(sorted(os.environ.items())),
        tuple(sys.path),
        os.getcwd(),
    )


@dataclass(eq=False)
class Spare:
    key: tuple[Any, ...]
    procs: list[supervise.Proc]
    store: Any
    home: Path
    rank_env: list[dict[str, str]]

    def close(self) -> None:
        supervise.LIVE.kill(self.procs)
        self.store.close()
        shutil.rmtree(self.home, ignore_errors=True)


def form(call: Call, key: tuple[Any, ...]) -> Spare:
    store = AgentStore(timeout=call.deadline)
    home = Path(tempfile.mkdtemp(prefix="spare-world-"))
    ctx = forkserver.context()
    started: list[supervise.Proc] = []
    rank_env = [store.rank_env(r, call.world_size) for r in range(call.world_size)]
    try:
        for r in range(call.world_size):
            spec = _call.rank_spec(call, r, home, rank_env[r], harness_env=store.harness_env())
            spec.payload = b""
            parent_end, rank_end = ctx.Pipe(duplex=True)
            process = ctx.Process(target=spare_rank_main, args=(spec, rank_end), daemon=True)
            process.start()
            rank_end.close()
            supervise.LIVE.add(process.pid)
            started.append(
                supervise.Proc(r, process, parent_end, Path(spec.log_path), Path(spec.stack_path))
            )
    except BaseException:
        supervise.LIVE.kill(started)
        store.close()
        shutil.rmtree(home, ignore_errors=True)
        raise
    return Spare(key, started, store, home, rank_env)


def hand_over(spare: Spare, call: Call, work: Path) -> list[supervise.Proc]:
    """Give ``call`` to the spare's ranks: their files move into ``work``, each gets its task."""
    for p in spare.procs:
        spec = _call.rank_spec(call, p.rank, work, spare.rank_env[p.rank])
        for old, new in ((p.log_path, spec.log_path), (p.stack_path, spec.stack_path)):
            os.replace(old, new)  # the rank's open files follow
        p.log_path, p.stack_path = Path(spec.log_path), Path(spec.stack_path)
        p.conn.send_bytes(pickle.dumps(spec))
    return spare.procs


def spare_rank_main(start: RankSpec, conn: Any) -> None:
    try:
        imported_with = _rank.enter_rank(start)
        failure = None
        try:
            torchenv.apply_in_rank(imported_with, start.env)
            if start.backend is not None:
                _rank.init_process_group(start)
        except BaseException as exc:  # noqa: BLE001 - the task's failure, as in a fresh rank
            failure = exc
        task = pickle.loads(conn.recv_bytes())
        task.env = {**start.env, **task.env}
        _rank.take_task(task)
        if failure is not None:
            from tutorial_impl.testing import outcome as _o
            import time

            report = _o.Report(_o.from_exception(failure), os.getpid(), time.time())
            conn.send_bytes(pickle.dumps(report))
        else:
            _rank.run_task(task, imported_with, join_group=False, send=conn.send_bytes)
        while True:
            signal.pause()
    finally:
        os._exit(0)


class Spares:
    """At most one spare world, for the key of the last call."""

    def __init__(self) -> None:
        self.spare: Spare | None = None
        self.last: tuple[Any, ...] | None = None

    def take(self, call: Call) -> Spare | None:
        if not ON or call.debug_rank is not None or call.stream is not None:
            return None
        key = key_of(call)
        spare, self.spare = self.spare, None
        if spare is not None and (spare.key != key or not all(p.process.is_alive() for p in spare.procs)):
            spare.close()
            spare = None
        repeat = key == self.last
        self.last = key
        if repeat or spare is not None:
            self.next_key = key
        else:
            self.next_key = None
        return spare

    def prepare_next(self, call: Call) -> None:
        if ON and getattr(self, "next_key", None) is not None and self.spare is None:
            self.spare = form(call, self.next_key)

    def close(self) -> None:
        if self.spare is not None:
            self.spare.close()
            self.spare = None


SPARES = Spares()
