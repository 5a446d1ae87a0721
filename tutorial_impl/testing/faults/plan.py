"""A typed plan of what goes wrong, on which rank, at which point: the words of ``faults``.

A ``Fault`` names the ranks it strikes, the point (the ``at``-th collective of the rank,
optionally only those of one ``op`` and/or one ``group``; or the ``at``-th time the rank's
own code reaches ``faults.fault_point(step)``) and the action: ``Kill()`` (SIGKILL),
``Exit(code)``, ``Raise(message)``, ``Hang()`` (sleep until killed or the call is over),
``Delay(seconds)``, ``Close()`` (shut the rank's connections of its faulty groups: its
peers, and its own next collective, see "Connection closed by peer"). Every field is checked
when a fault is made (a ``ValueError`` naming the field); ``check_plan`` checks a plan
against a world size; ``encode``/``decode`` carry it through the environment variable
``TUTORIAL_IMPL_FAULTS`` as JSON, refusing an unknown action or field. A ``Point`` is where
a rank is: a collective (``all_reduce #3`` of a group) or a named step. Nothing here imports
torch (docs/faults.md)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any, ClassVar

ENV = "TUTORIAL_IMPL_FAULTS"  # a rank's plan, as ``encode`` writes it

# What a collective is called here: torch.distributed's own names for what each intercepted
# ProcessGroup method does (``faults.group.METHODS`` maps the methods onto these).
OPS = frozenset(
    "all_reduce all_reduce_coalesced broadcast reduce all_gather all_gather_into_tensor "
    "all_gather_coalesced all_gather_into_tensor_coalesced gather scatter reduce_scatter "
    "reduce_scatter_tensor reduce_scatter_tensor_coalesced all_to_all all_to_all_single "
    "barrier send recv".split()
)
P2P = frozenset({"send", "recv"})  # counted apart, as torch counts them (p2p_seq_id)
# torch 2.13's newer public names of two collectives: a fault may name either, and counts
# as the older name (what ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` now call).
ALIASES = {
    "all_gather_single": "all_gather_into_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
}


# --- actions ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Kill:
    """SIGKILL the rank: no result, no cleanup, its sockets closed by the kernel."""

    name: ClassVar[str] = "kill"


@dataclass(frozen=True)
class Exit:
    """``os._exit(code)``: as a crash that chose its exit code."""

    code: int = 1
    name: ClassVar[str] = "exit"

    def __post_init__(self) -> None:
        if type(self.code) is not int or not 0 <= self.code <= 255:
            raise ValueError(f"Exit(code): an exit code 0..255, got {self.code!r}")


@dataclass(frozen=True)
class Raise:
    """Raise ``InjectedFault(message)`` where the collective was called (through DDP's
    reducer or a functional collective too: the exception crosses torch's C++ unchanged)."""

    message: str = "injected fault"
    name: ClassVar[str] = "raise"

    def __post_init__(self) -> None:
        if not isinstance(self.message, str):
            raise ValueError(f"Raise(message): a str, got {self.message!r}")


@dataclass(frozen=True)
class Hang:
    """Sleep until killed, or the call is over (then raise): the deadline ends the run."""

    name: ClassVar[str] = "hang"


@dataclass(frozen=True)
class Delay:
    """Sleep ``seconds``, then go on into the collective."""

    seconds: float
    name: ClassVar[str] = "delay"

    def __post_init__(self) -> None:
        s = self.seconds
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not (0 < s < math.inf):
            raise ValueError(f"Delay(seconds): a positive finite number, got {s!r}")


@dataclass(frozen=True)
class Close:
    """Shut the rank's connections of its faulty groups (gloo's sockets to its peers, not
    the listening ones, not the rendezvous store's), then go on: this collective and every
    later one on those groups fail with "Connection closed by peer", on every rank."""

    name: ClassVar[str] = "close"


Action = Kill | Exit | Raise | Hang | Delay | Close
ACTIONS: dict[str, type] = {cls.name: cls for cls in (Kill, Exit, Raise, Hang, Delay, Close)}


# --- the plan -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    """On each rank of ``ranks``, at the ``at``-th (1-based) matching point, do ``action``.

    A point is a collective (of ``op`` only, on ``group`` only: a group's name or its
    description, e.g. ``"0"`` or ``"default_pg"``), or, with ``step``, the ``at``-th call of
    ``fault_point(step)``. Every field is checked here, naming the field.

    Strict: a fault its rank never reached fails the test (``faults.FaultNotFired``: the
    point was never reached, so the test proved nothing about it), unless ``optional``."""

    ranks: frozenset[int]
    action: Action
    at: int = 1
    op: str | None = None
    group: str | None = None
    step: str | None = None
    optional: bool = False  # True: a rank that never reaches the point is no failure

    def __post_init__(self) -> None:
        ranks = self.ranks
        if isinstance(ranks, int) and not isinstance(ranks, bool):
            ranks = frozenset({ranks})
        if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
            raise ValueError(f"Fault(ranks): a rank or a collection of ranks, got {ranks!r}")
        ranks = frozenset(ranks)
        if not ranks or any(type(r) is not int or r < 0 for r in ranks):
            raise ValueError(f"Fault(ranks): ranks are integers >= 0, got {sorted(ranks)!r}")
        object.__setattr__(self, "ranks", ranks)
        if not isinstance(self.action, tuple(ACTIONS.values())):
            names = ", ".join(c.__name__ for c in ACTIONS.values())
            raise ValueError(f"Fault(action): one of {names}, got {self.action!r}")
        if type(self.at) is not int or self.at < 1:
            raise ValueError(f"Fault(at): the 1-based count of the point, >= 1, got {self.at!r}")
        if self.op in ALIASES:
            object.__setattr__(self, "op", ALIASES[self.op])
        if self.op is not None and self.op not in OPS:
            raise ValueError(f"Fault(op): one of {', '.join(sorted(OPS))}; got {self.op!r}")
        for name in ("group", "step"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"Fault({name}): a non-empty str, got {value!r}")
        if self.step is not None and (self.op is not None or self.group is not None):
            raise ValueError("Fault(step): a fault at a step takes no op or group filter")
        if type(self.optional) is not bool:
            raise ValueError(f"Fault(optional): True or False, got {self.optional!r}")

    def matches(self, point: Point) -> bool:
        """Whether ``point`` is one this fault counts (its rank is checked by the caller)."""
        if self.step is not None or point.step is not None:
            return self.step == point.step
        if self.op is not None and self.op != point.op:
            return False
        return self.group is None or self.group in (point.group, point.group_desc)

    def __str__(self) -> str:
        ranks = ", ".join(map(str, sorted(self.ranks)))
        if self.step is not None:
            where = f"fault_point({self.step!r}) #{self.at}"
        else:
            where = f"{self.op or 'collective'} #{self.at}"
            where += f" on group {self.group}" if self.group else ""
        optional = " (optional)" if self.optional else ""
        return f"{self.action.name} on rank(s) {ranks} at {where}{optional}"


Plan = tuple[Fault, ...]


def check_plan(plan: Plan, world_size: int) -> Plan:
    """``plan`` as a tuple, or a ValueError naming the fault that strikes a rank the world of
    ``world_size`` does not have."""
    plan = tuple(plan)
    for i, fault in enumerate(plan):
        if not isinstance(fault, Fault):
            raise ValueError(f"fault {i} of the plan is not a Fault: {fault!r}")
        bad = sorted(r for r in fault.ranks if r >= world_size)
        if bad:
            raise ValueError(
                f"fault {i} ({fault}) names rank(s) {bad}, not ranks of a world of {world_size}"
            )
    return plan


def encode(plan: Plan) -> str:
    """The plan as the JSON ``decode`` reads (for ``TUTORIAL_IMPL_FAULTS``)."""
    out = []
    for fault in plan:
        entry: dict[str, Any] = {"ranks": sorted(fault.ranks), "at": fault.at}
        keys = ("op", "group", "step", "optional")
        entry.update({k: getattr(fault, k) for k in keys if getattr(fault, k)})
        entry["action"] = fault.action.name
        entry.update({f.name: getattr(fault.action, f.name) for f in fields(fault.action)})
        out.append(entry)
    return json.dumps(out)


def decode(text: str) -> Plan:
    """A plan from ``encode``'s JSON; a ValueError naming what is wrong (unknown action or
    field, a bad value)."""
    try:
        entries = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{ENV}: not JSON ({exc}): {text!r}") from None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ValueError(f"{ENV}: a JSON list of faults (objects), got {text!r}")
    plan = []
    for i, entry in enumerate(entries):
        try:
            plan.append(_decode_fault(dict(entry)))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{ENV}: fault {i}: {exc}") from None
    return tuple(plan)


def _decode_fault(entry: dict[str, Any]) -> Fault:
    kind = entry.pop("action", None)
    if kind not in ACTIONS:
        raise ValueError(f"unknown action {kind!r}; the actions are {', '.join(ACTIONS)}")
    cls = ACTIONS[kind]
    own = {f.name for f in fields(cls)}
    known = own | {"ranks", "at", "op", "group", "step", "optional"}
    unknown = sorted(set(entry) - known)
    if unknown:
        raise ValueError(f"unknown field(s) {unknown} of a {kind} fault")
    action = cls(**{k: entry.pop(k) for k in own if k in entry})
    ranks = entry.pop("ranks", None)
    if not isinstance(ranks, list):
        raise ValueError(f"a fault's ranks are a JSON list, got {ranks!r}")
    return Fault(ranks=frozenset(ranks), action=action, **entry)


# --- points --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Point:
    """A point a rank reached: a collective (``op`` #``seq`` of its group; p2p counted apart)
    or a named step (``step`` #``seq``)."""

    op: str | None
    seq: int
    group: str = ""
    group_desc: str = ""
    step: str | None = None

    def __str__(self) -> str:
        if self.step is not None:
            return f"fault_point({self.step!r}) #{self.seq}"
        return collective_name(self.op or "?", self.seq, self.group, self.group_desc)


def collective_name(op: str, seq: int, group: str, group_desc: str) -> str:
    """``all_reduce #3``, and the group when it is not the default one: ``... on group 1
    (mysub)``. One wording for the injector's messages and the recorder's explanations."""
    text = f"{op} #{seq}"
    if group_desc == "default_pg" or not (group or group_desc):
        return text
    return text + f" on group {group}" + (f" ({group_desc})" if group_desc else "")
