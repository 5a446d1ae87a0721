"""Where one fresh test's time and CPU go, step by step: ``bench library``'s fresh tests, stamped.

``bench library`` says what a fresh test costs against a spawn pool; this says where it goes.
It runs the fresh tests of the same suite (``library.write_suite``: world ``--world-size``,
``--tests`` of them, no preload setting of the suite's own) in one pytest session, with
stamps: each one the time (``perf_counter_ns``, one clock for every process), the process's
CPU so far (``getrusage``: user and kernel) and its minor page faults so far.

* **The parent** (the pytest process, from the suite's conftest): each test's start, and
  around the harness's steps (``Forked.run``, each rank's ``forked.start``: the request to
  the forkserver and its answer, ``supervise``, the kill).
* **The forkserver** (a module it imports through ``rank_preload``): each ``fork``'s CPU in
  the server, and each rank's whole CPU when it reaps it (``os.wait4``: its exit included).
* **Each rank** (the same module, wrapping ``rank``'s steps): the fork's return, the end of
  multiprocessing's start (the spec unpickled), ``enter_rank``, ``resolve`` (the test
  module), the arguments unpickled, ``init_process_group``, the function, the report.

Per rank, each step's CPU is the median over the ranks of the tests measured (the first
``SKIP`` tests left out: they start the forkserver); ``at_ms`` is when the step ended, from its
test's start (median). The totals per test: the parent's CPU, the server's, every rank's at
its reaping; ``wall_ms`` is the median time from one test's start to the next.

    python -m tutorial_impl bench fresh-profile [--tests 40] [--world-size 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from tutorial_impl.bench import library
from tutorial_impl.bench.report import write_json

SKIP = 3  # tests left out at the start
STAMP = """
import os, resource, time

def _opened(variable):
    return os.open(os.environ[variable], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

def stamp(label, extra=""):
    ru = resource.getrusage(resource.RUSAGE_SELF)
    cpu = round((ru.ru_utime + ru.ru_stime) * 1e6)
    line = f"{os.getpid()} {label} {time.perf_counter_ns()} {cpu} {ru.ru_minflt} {extra}\\n"
    os.write(_FD, line.encode())  # one write: lines of several processes never interleave
"""
RANK_HOOKS = f'''"""Stamps in the rank forkserver and its ranks (written by bench fresh-profile)."""
{STAMP}
import signal
from tutorial_impl.testing.rank import main as R

_FD = _opened("PROFILE_RANKS")
_fork, _enter, _resolve, _init = os.fork, R.enter_rank, R.resolve, R.init_process_group


def fork():  # in the forkserver
    before = resource.getrusage(resource.RUSAGE_SELF)
    pid = _fork()
    if pid == 0:
        stamp("forked")
    else:
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        stamp("server_fork", f"child={{pid}} fork_us={{round(cpu * 1e6)}}")
    return pid


def waitpid(pid, options):  # in the forkserver: each rank's CPU, its exit included
    got, status, ru = os.wait4(pid, options)
    if got:
        stamp("reaped", f"child={{got}} cpu_us={{round((ru.ru_utime + ru.ru_stime) * 1e6)}}")
    return got, status


def rank_main(spec, conn):  # rank.rank_main, stamped
    stamp("started")
    try:
        imported_with = _enter(spec)
        stamp("entered")

        def send(data):
            stamp("reported")
            conn.send_bytes(data)

        R.run_task(spec, imported_with, join_group=True, send=send)
        while True:
            signal.pause()
    finally:
        os._exit(0)


def resolve(ref):
    fn = _resolve(ref)
    stamp("resolved")

    def stamped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        finally:
            stamp("function")

    return stamped


def init_process_group(spec):
    stamp("arguments")
    _init(spec)
    stamp("group")


os.fork, os.waitpid = fork, waitpid
R.rank_main, R.resolve, R.init_process_group = rank_main, resolve, init_process_group
'''
# What the parent's hooks stamp, as (module, attribute path, label): a renamed function
# breaks the benchmark at once, so a test resolves each of them (``resolve_target``).
PARENT_TARGETS = (
    ("tutorial_impl.testing.strategies.forked", "Forked.gather", "run"),
    ("tutorial_impl.testing.strategies.forked", "start", "start"),
    ("tutorial_impl.testing.strategies.supervise", "supervise", "supervise"),
    ("tutorial_impl.testing.strategies.supervise", "LIVE.kill", "kill"),
)
# What the rank hooks wrap or call in ``tutorial_impl.testing.rank.main``.
RANK_TARGETS = ("enter_rank", "resolve", "init_process_group", "run_task", "rank_main")


def resolve_target(module: str, path: str) -> tuple[object, str]:
    """The object that holds ``path``'s last attribute, and that attribute's name."""
    import importlib

    owner: object = importlib.import_module(module)
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    getattr(owner, name)  # AttributeError: the harness renamed it, the hooks must follow
    return owner, name


PARENT_HOOKS = f"""
# --- bench fresh-profile: stamps in the pytest process ---
{STAMP}
import functools
from tutorial_impl.bench.fresh_profile import PARENT_TARGETS, resolve_target

_FD = _opened("PROFILE_PARENT")


def _stamped(owner, name, label):
    original = getattr(owner, name)

    @functools.wraps(original)
    def call(*args, **kwargs):
        stamp(label)
        try:
            return original(*args, **kwargs)
        finally:
            stamp(label + "_end")

    setattr(owner, name, call)


for _module, _path, _label in PARENT_TARGETS:
    _stamped(*resolve_target(_module, _path), _label)


@pytest.fixture(autouse=True)
def _profile_stamp(request):
    stamp("test", request.node.originalname)
"""
# A rank's steps, each ending at its stamp; "exit" ends at its reaping.
STEPS = (
    ("forked", "the fork's return, in the child"),
    ("started", "multiprocessing's start: the spec unpickled"),
    ("entered", "enter_rank: own group, death chain, log, environment"),
    ("resolved", "resolve: the test module"),
    ("arguments", "the arguments unpickled"),
    ("group", "init_process_group"),
    ("function", "the test's function"),
    ("reported", "the report pickled"),
    ("reaped", "sent, killed, exited"),
)


@dataclass(frozen=True)
class Stamp:
    pid: int
    label: str
    ns: int
    cpu_us: int
    faults: int
    extra: dict[str, str]


def parse(text: str) -> list[Stamp]:
    stamps = []
    for line in text.splitlines():
        pid, label, ns, cpu, faults, *rest = line.split()
        extra = dict(kv.split("=", 1) for kv in rest if "=" in kv)
        stamps.append(Stamp(int(pid), label, int(ns), int(cpu), int(faults), extra))
    return stamps


def summarize(parent: list[Stamp], ranks: list[Stamp], skip: int = SKIP) -> dict:
    """The figures (module docstring) from the parent's stamps and the forkserver's and
    ranks' stamps; tests ``skip`` and on, up to the last test's start, are counted."""
    tests = [s for s in parent if s.label == "test"]
    if len(tests) < skip + 2:
        raise ValueError(f"need at least {skip + 2} tests: the first {skip} are left out")
    window = [(a.ns, b.ns) for a, b in zip(tests[skip:], tests[skip + 1 :], strict=False)]
    start, end, n = window[0][0], window[-1][1], len(window)
    forks = [s for s in ranks if s.label == "server_fork" and start <= s.ns < end]
    server = [s for s in ranks if s.label in ("server_fork", "reaped") and s.ns < end]
    before = [s for s in server if s.ns < start]  # its CPU when the window opened: the last
    server = before[-1:] + [s for s in server if s.ns >= start]
    steps, at, totals = _rank_steps(ranks, window)
    return {
        "tests": n,
        "ranks": len(totals),
        "steps": {label: statistics.median(steps[label]) for label, _ in STEPS if steps[label]},
        "at_ms": {label: statistics.median(at[label]) for label in at},
        "parent": _parent_steps(parent, window),
        "fork_cpu_ms": statistics.median(int(s.extra["fork_us"]) / 1e3 for s in forks),
        # every rank forked meanwhile, each at the mean of those reaped (the last may not be)
        "rank_cpu_ms": statistics.mean(totals) * len(forks) / n,
        "server_cpu_ms": (server[-1].cpu_us - server[0].cpu_us) / 1e3 / n if server else 0.0,
        "parent_cpu_ms": (tests[skip + n].cpu_us - tests[skip].cpu_us) / 1e3 / n,
        "wall_ms": statistics.median((b - a) / 1e6 for a, b in window),
    }


def _rank_steps(ranks: list[Stamp], window: list[tuple[int, int]]) -> tuple[dict, dict, list]:
    """Each step's CPU and end (from its test's start), per rank forked in ``window`` and
    reaped; and each such rank's whole CPU."""
    reaped = {
        int(s.extra["child"]): int(s.extra["cpu_us"]) / 1e3 for s in ranks if s.label == "reaped"
    }
    by_pid: dict[int, dict[str, Stamp]] = defaultdict(dict)
    for s in ranks:
        by_pid[s.pid].setdefault(s.label, s)
    steps: dict[str, list[float]] = defaultdict(list)
    at: dict[str, list[float]] = defaultdict(list)
    totals = []
    for pid, own in by_pid.items():
        first = own.get("forked")
        if first is None or not window[0][0] <= first.ns < window[-1][1] or pid not in reaped:
            continue
        test_start = max(a for a, _ in window if a <= first.ns)
        before = 0.0
        for label, _ in STEPS[:-1]:
            if label in own:  # a rank killed as it reported may not stamp it
                steps[label].append(own[label].cpu_us / 1e3 - before)
                at[label].append((own[label].ns - test_start) / 1e6)
                before = own[label].cpu_us / 1e3
        steps["reaped"].append(reaped[pid] - before)
        totals.append(reaped[pid])
    return steps, at, totals


PARENT_STEPS = (  # the parent's milestones in a test: (label, which of its stamps)
    ("run", "first"),
    ("start_end", "last"),  # every rank requested from the forkserver and forked
    ("supervise_end", "first"),  # every report in
    ("kill_end", "first"),
    ("run_end", "first"),
)


def _parent_steps(parent: list[Stamp], window: list[tuple[int, int]]) -> dict[str, list[float]]:
    """Each milestone's median time and the parent's CPU from its test's start: [ms, ms]."""
    found: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for a, b in window:
        inside = [s for s in parent if a <= s.ns < b]
        test = next(s for s in inside if s.label == "test")
        for label, which in PARENT_STEPS:
            mine = [s for s in inside if s.label == label]
            if mine:
                s = mine[0] if which == "first" else mine[-1]
                found[label].append(((s.ns - a) / 1e6, (s.cpu_us - test.cpu_us) / 1e3))
    return {
        label: [statistics.median(x for x, _ in v), statistics.median(y for _, y in v)]
        for label, v in found.items()
    }


def measure(tests: int, world_size: int, heavy: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-fresh-profile-") as tmp:
        work = Path(tmp)
        library.write_suite(work, heavy, world_size)
        (work / "fresh_profile_hooks.py").write_text(RANK_HOOKS)
        (work / "pytest.ini").write_text("[pytest]\nrank_preload = fresh_profile_hooks\n")
        with open(work / "conftest.py", "a") as conftest:
            conftest.write(PARENT_HOOKS)
        logs = {"PROFILE_RANKS": work / "ranks.log", "PROFILE_PARENT": work / "parent.log"}
        os.environ.update({name: str(path) for name, path in logs.items()})
        try:
            library.run_session(work, tests, "-k", "fresh or zz_end")
        finally:
            for name in logs:
                os.environ.pop(name, None)
        figures = summarize(
            parse(logs["PROFILE_PARENT"].read_text()), parse(logs["PROFILE_RANKS"].read_text())
        )
    figures["total_cpu_ms"] = sum(figures[f"{who}_cpu_ms"] for who in ("parent", "server", "rank"))
    figures["world_size"], figures["load_average"] = world_size, os.getloadavg()[0]
    return figures


def show(figures: dict) -> None:
    print(
        f"{figures['tests']} fresh tests, {figures['ranks']} ranks, world {figures['world_size']}"
    )
    print(f"  {'a rank, step by step':54s} {'CPU ms':>7s} {'ends at ms':>10s}")
    for label, text in STEPS:
        cpu, at = figures["steps"].get(label), figures["at_ms"].get(label)
        print(f"  {text:54s} {cpu or 0:7.2f} {'' if at is None else f'{at:10.1f}'}")
    print(f"  {'the parent, since the test started':54s} {'CPU ms':>7s} {'at ms':>10s}")
    for label, (at, cpu) in figures["parent"].items():
        print(f"  {label:54s} {cpu:7.2f} {at:10.1f}")
    print(f"  forkserver: a fork {figures['fork_cpu_ms']:.2f} ms of CPU in the server")
    parts = ", ".join(
        f"{who} {figures[f'{who}_cpu_ms']:.1f}" for who in ("parent", "server", "rank")
    )
    total, wall = figures["total_cpu_ms"], figures["wall_ms"]
    print(f"  CPU a test: {total:.1f} ms ({parts}); wall {wall:.1f} ms a test")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tutorial_impl bench fresh-profile",
        description="Where a fresh test of bench library's suite spends its time and CPU.",
    )
    parser.add_argument(
        "--tests", type=int, default=40, help=f"fresh tests (the first {SKIP} left out)"
    )
    parser.add_argument("--world-size", type=int, default=2, help="ranks per test")
    parser.add_argument("--heavy", default="torch._dynamo", help="what the library imports")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    if args.tests < SKIP + 2 or args.world_size < 1:
        raise SystemExit(f"--tests must be at least {SKIP + 2}, --world-size positive")
    figures = measure(args.tests, args.world_size, args.heavy.split())
    show(figures)
    write_json(figures, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
