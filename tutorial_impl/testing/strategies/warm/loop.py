"""Inside a warm rank: its main loop, and the checks that keep its world as good as new.

A warm rank (``warm``) joins its world's process group once, then runs one test's function
after another (``rank.run_task``, the same capture as a fresh rank). Before each test it
gives back what a fresh rank would have (``reuse.Baseline.before_task``: random states,
torch's global flags, warnings filters, signal handlers, alarms); after each, it answers the
parent's question "is this world still as good as new?" with the first problem it sees, or
None: ``WorldCheck`` for the world's own state (process groups, RPC agent, threads, child
processes, unfinished point-to-point work, a barrier of the whole world) and
``reuse.Baseline.after_task`` for what a test may have changed and cannot be reset (module
globals, monkeypatched attributes, threads it started). Any problem, and the parent replaces
the world.
"""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

from tutorial_impl.testing import proctable
from tutorial_impl.testing.faults import inject
from tutorial_impl.testing.rank import leftovers, main, torchenv
from tutorial_impl.testing.rank import outcome as _o
from tutorial_impl.testing.rank.spec import RankSpec
from tutorial_impl.testing.settings.timing import CHECK_DEADLINE
from tutorial_impl.testing.strategies.warm import reuse


class WorldCheck:
    """What a warm rank's world looked like when it was made, to compare with after each
    test: its process groups, RPC agent, children and pending work (``reuse`` sees the rest:
    threads, module state, torch's flags)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        c10d = dist.distributed_c10d
        self.default = c10d._get_default_group() if dist.is_initialized() else None
        self.groups = set(c10d._world.pg_map)
        self.works: list[Any] = []  # this test's isend/irecv work (see ``_track_work``)
        _track_work(self.works)

    def begin(self) -> None:
        """A new test: no point-to-point work of its own yet."""
        self.works.clear()

    def leftovers(
        self,
        meanwhile: Callable[[], str | None] = lambda: None,
        killed: tuple[Any, ...] = (),
        all_returned: Callable[[float], bool] = lambda timeout: True,
    ) -> str | None:
        """What the last test left behind that a fresh world would not have, or None; else
        ``meanwhile``'s answer (the rank's other checks), which runs before the rank waits
        for the parent's word that every rank's function returned (``all_returned``, within
        the time given). ``killed``: the processes the test left running, which the rank
        killed before it reported (``leftovers``): the world is retired all the same, as a
        fresh one would have been with them (what else such a test left, nobody has looked
        at).

        Nothing here is a collective until every rank has returned: a rank that returned while
        a peer still waits in a collective it never entered must not answer it (a barrier
        would match a user's ``barrier``, and the stranded peer would pass). The peer stays
        stranded and the parent's verdict says so, as fresh ranks' would. Then a
        ``DeviceMesh``'s groups are destroyed (no peer uses them any more) and a barrier of
        the world meets only ranks that are out of the test (an un-waited collective still
        holds it up)."""
        import torch.distributed as dist

        c10d = dist.distributed_c10d
        default = c10d._get_default_group() if dist.is_initialized() else None
        if default is not self.default:
            return "the default process group was destroyed or replaced"
        extra = [g for g in c10d._world.pg_map if g not in self.groups]
        answer = self._left(killed) or meanwhile()
        if not all_returned(CHECK_DEADLINE):
            return f"the parent did not say within {CHECK_DEADLINE:g} s that every rank returned"
        try:
            left = _left_behind([g for g in extra if not _destroyed_if_a_meshs(dist, g)])
            if left or self.default is None:
                return left or answer
            dist.barrier(async_op=True).wait(timedelta(seconds=CHECK_DEADLINE))
        except Exception as exc:  # noqa: BLE001 - any failure means: not reusable
            return f"the world's barrier did not complete: {exc}"
        return answer

    def _left(self, killed: tuple[Any, ...]) -> str | None:
        """An RPC agent, child processes or point-to-point work the test left, or None."""
        if _rpc_agent_running():
            return "an RPC agent left running (rpc.shutdown)"
        children = [p.pid for p in killed]
        alive = proctable.own_children()  # none, the common case: one system call
        children += sorted(set(alive) - leftovers.helpers()) if alive else []
        if children:
            return f"child process(es) left running: {children}"
        pending = [w for w in self.works if not w.is_completed()]
        if pending:
            return (
                f"{len(pending)} isend/irecv never completed (a receive nobody sent to, or a "
                "send nobody received): it would take the next test's message"
            )
        return None


def _left_behind(groups: list[Any]) -> str | None:
    if groups:
        return f"{len(groups)} process group(s) left behind (destroy_process_group)"
    return None


def _destroyed_if_a_meshs(dist: Any, group: Any) -> bool:
    """Destroy ``group`` if torch made it for a ``DeviceMesh`` (its description says
    ``mesh_<dim>``): a mesh has no call that destroys it, so a test cannot, and its groups
    are part of the mesh the test built, gone with a fresh rank as they are here."""
    if not str(getattr(group, "group_desc", "")).startswith("mesh_"):
        return False
    dist.destroy_process_group(group)
    return True


def _track_work(works: list[Any]) -> None:
    """Record every point-to-point work a test starts (``isend``, ``irecv``, ``send``,
    ``recv``, ``batch_isend_irecv``, whoever calls them), so the check after it can ask
    whether any is still pending.

    gloo has no list of a group's pending operations to ask instead. A test that leaves an
    ``irecv`` unwaited, with no matching send, leaves it posted: in a fresh world it dies with
    its rank, but in a warm one it would swallow the next test's message from that peer.
    The methods of torch's ``ProcessGroup`` class are wrapped, not ``torch.distributed``'s
    functions: ``dist.P2POp`` accepts only the functions themselves (the pipelining
    schedules use it), and a function imported by name before the world started would not
    be seen."""
    from torch._C._distributed_c10d import ProcessGroup

    def tracked(original: Any) -> Any:
        def call(group: Any, *args: Any, **kwargs: Any) -> Any:
            work = original(group, *args, **kwargs)
            if work is not None:
                works.append(work)
            return work

        call.__wrapped__ = original  # type: ignore[attr-defined]
        call.__name__ = original.__name__
        call.__doc__ = original.__doc__
        return call

    for name in ("send", "recv", "recv_anysource"):
        original = getattr(ProcessGroup, name)
        setattr(ProcessGroup, name, tracked(getattr(original, "__wrapped__", original)))


ALL_RETURNED = "every rank returned"  # the parent's word to a warm rank (``pool``)


def _all_returned(conn: Connection, timeout: float) -> bool:
    """Whether the parent said, within ``timeout`` seconds, that every rank's function of
    the test returned (it has their reports): only then may this rank meet its peers."""
    return conn.poll(timeout) and pickle.loads(conn.recv_bytes()) == ALL_RETURNED


def _fault_fired() -> str | None:
    """A world in which a fault was injected is not reused, whatever the verdict: its group
    may be closed (``Close``), out of step (a ``Raise`` before one rank's collective) or
    short of a rank."""
    fired = inject.INJECTOR.fired
    return f"a fault was injected in this world: {fired[0][0]}" if fired else None


def _rpc_agent_running() -> bool:
    import torch.distributed.rpc as rpc

    return rpc.is_available() and rpc.api._is_current_rpc_agent_set()


def warm_rank_main(start: RankSpec, task: RankSpec, conn: Connection) -> None:
    """The body of a warm rank: join the world's group (``start``), then run ``task`` and
    every task after it, reporting each outcome and then the rank's own check."""
    try:
        imported_with = main.enter_rank(start)
        try:
            torchenv.apply_in_rank(imported_with, start.env)
            if start.backend is not None:
                main.init_process_group(start)
            world = WorldCheck()
            baseline = reuse.Baseline()  # after WorldCheck, whose tracking it then includes
            baseline.snapshot()
        except BaseException as exc:  # noqa: BLE001 - reported as the first test's failure
            report = _o.Report(_o.from_exception(exc), os.getpid(), time.time())
            conn.send_bytes(pickle.dumps(report))
            while True:
                time.sleep(3600)
        while True:
            task.env = {**start.env, **task.env}
            main.take_task(task)
            world.begin()
            report = main.run_task(
                task, imported_with, join_group=False, send=conn.send_bytes, baseline=baseline
            )
            # The test has been answered: the check and the next test's reset run while the
            # parent reports it and moves on (it reads the answer before the next task).
            problem = _fault_fired() or world.leftovers(
                baseline.check_then_reset, report.killed, lambda t: _all_returned(conn, t)
            )
            conn.send_bytes(pickle.dumps(problem))
            task = pickle.loads(conn.recv_bytes())  # EOF: the world is closed
    finally:
        os._exit(0)  # never run interpreter teardown (see rank.rank_main)
