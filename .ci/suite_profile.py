"""Where the suite's time goes: wall and CPU per test and per module, every process counted.

    python .ci/suite_profile.py                                  # the whole suite, top 20
    python .ci/suite_profile.py --top 40 -- tests/harness        # a part of it
    python .ci/suite_profile.py --json profile.json              # every test's figures
    python .ci/suite_profile.py --budget .ci/suite_budget.json   # CI: growth since the last figure
    python .ci/suite_profile.py --budget .ci/suite_budget.json --update   # record new figures

The suite runs once, serially (``-p no:xdist``), inside a control group of its own (cgroup v1
``cpuacct`` or v2 ``cpu``, made here as root): the group's CPU counter counts every process
the run starts, wherever it sits in the process tree (the rank forkserver's ranks, torchrun's
workers, pytest runs in a subprocess, their grandchildren). The figure for a test is the
counter's change from its setup's start to its teardown's end, so it holds every process
that ran meanwhile; a process a test leaves running is charged to the tests after it. Where no
group can be made (not root, no cgroup file system), the run's total is still exact
(``PR_SET_CHILD_SUBREAPER``, as ``.ci/cpu_tree.py`` counts) but a test's figure counts the
pytest process alone, and the report says so.

Serial figures are what a test costs, not when it runs: under ``pytest -n auto`` the same CPU
is spread over three workers. The budget file holds each module's CPU from the last
``--update``; ``--budget`` prints the modules whose CPU grew by more than ``--grow`` (a
fraction, 0.25) plus ``--slack`` seconds (1.0), and new modules over ``--slack``. It is a
report: it exits 0 unless ``--strict`` is given.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

PR_SET_CHILD_SUBREAPER = 36
ROOT = Path(__file__).resolve().parent.parent
ENV_OUT = "SUITE_PROFILE_OUT"  # where the plugin half of this file writes its rows
ENV_COUNTER = "SUITE_PROFILE_COUNTER"  # the cgroup file it reads, or "" for the process alone


# -- the plugin half: loaded into the profiled pytest with `-p suite_profile` ------------------


def _cpu_now(counter: str) -> float:
    if not counter:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    text = Path(counter).read_text()
    if counter.endswith("cpuacct.usage"):  # v1: nanoseconds
        return int(text) / 1e9
    for line in text.splitlines():  # v2 cpu.stat: usage_usec N
        key, _, value = line.partition(" ")
        if key == "usage_usec":
            return int(value) / 1e6
    raise RuntimeError(f"no usage_usec in {counter}")


class _Recorder:
    def __init__(self, out: str, counter: str) -> None:
        self.out, self.counter, self.rows = out, counter, []

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        wall0, cpu0 = time.monotonic(), _cpu_now(self.counter)
        yield
        self.rows.append(
            {
                "test": item.nodeid,
                "module": item.nodeid.split("::")[0],
                "wall": time.monotonic() - wall0,
                "cpu": _cpu_now(self.counter) - cpu0,
            }
        )

    def pytest_unconfigure(self, config) -> None:
        Path(self.out).write_text(json.dumps(self.rows))


def pytest_configure(config) -> None:
    out = os.environ.get(ENV_OUT)
    if out and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_Recorder(out, os.environ.get(ENV_COUNTER, "")))


# -- the script half --------------------------------------------------------------------------


def make_group() -> tuple[Path | None, str]:
    """A fresh cgroup holding this process, and its CPU counter file; (None, "") if none."""
    name = f"suite-profile-{os.getpid()}"
    for base, counter in (
        (Path("/sys/fs/cgroup/cpuacct"), "cpuacct.usage"),
        (Path("/sys/fs/cgroup/unified"), "cpu.stat"),
        (Path("/sys/fs/cgroup"), "cpu.stat"),
    ):
        group = base / name
        try:
            group.mkdir()
            (group / "cgroup.procs").write_text(str(os.getpid()))
            _cpu_now(str(group / counter))
        except OSError:
            try:
                group.rmdir()
            except OSError:
                pass
            continue
        return group, str(group / counter)
    return None, ""


def leave_group(group: Path | None) -> None:
    if group is None:
        return
    (group.parent / "cgroup.procs").write_text(str(os.getpid()))
    for _ in range(50):  # the group's last processes may still be exiting
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.1)


def run_suite(pytest_args: list[str]) -> tuple[list[dict], dict]:
    group, counter = make_group()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        env = dict(os.environ, **{ENV_OUT: out, ENV_COUNTER: counter})
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(ROOT / ".ci"), env.get("PYTHONPATH")])
        )
        cmd = [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "suite_profile", "-q"]
        cmd += ["-p", "no:randomly", "-p", "no:cacheprovider", *pytest_args]
        wall0 = time.monotonic()
        cpu_group0 = _cpu_now(counter) if counter else 0.0
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
        tail: list[str] = []
        failed: list[str] = []  # pytest's -ra lines for failures and errors, to print
        for line in proc.stdout:
            tail = (tail + [line.rstrip()])[-3:]
            if line.startswith(("FAILED tests/", "ERROR tests/")):  # not a pytester run's
                failed.append(line.rstrip())
        proc.wait()
        while True:  # reap every orphan the run left (the forkserver, torchrun's workers)
            try:
                os.wait()
            except ChildProcessError:
                break
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        total = {
            "wall": time.monotonic() - wall0,
            "cpu": (_cpu_now(counter) - cpu_group0) if counter else usage.ru_utime + usage.ru_stime,
            "per_test_cpu": "every process (cgroup)" if counter else "the pytest process alone",
            "exit": proc.returncode,
            "last_line": tail[-1] if tail else "",
            "failed": failed,
        }
        rows = json.loads(Path(out).read_text()) if os.path.exists(out) else []
    leave_group(group)
    return rows, total


def by_module(rows: list[dict]) -> dict[str, dict]:
    mods: dict[str, dict] = {}
    for row in rows:
        mod = mods.setdefault(row["module"], {"wall": 0.0, "cpu": 0.0, "tests": 0})
        mod["wall"] += row["wall"]
        mod["cpu"] += row["cpu"]
        mod["tests"] += 1
    return mods


def table(title: str, items: list[tuple[str, dict]], top: int) -> str:
    lines = [f"{title}", f"{'cpu s':>7} {'wall s':>7} {'tests':>5}  name"]
    for name, fig in sorted(items, key=lambda kv: -kv[1]["cpu"])[:top]:
        lines.append(f"{fig['cpu']:7.2f} {fig['wall']:7.2f} {fig.get('tests', 1):5d}  {name}")
    return "\n".join(lines)


def budget_report(mods: dict[str, dict], budget: dict[str, float], grow: float, slack: float):
    flagged = []
    for name, fig in sorted(mods.items()):
        before = budget.get(name)
        if before is None:
            if fig["cpu"] > slack:
                flagged.append(f"new module {name}: {fig['cpu']:.2f} s of CPU")
        elif fig["cpu"] > before * (1 + grow) + slack:
            flagged.append(f"{name}: {before:.2f} -> {fig['cpu']:.2f} s of CPU")
    return flagged


ORDER = ".ci/suite_order.json"  # the root conftest hands the dearest tests out first
DEAR = 0.5  # seconds of CPU: the tests the order file names (the rest keep their order)


def write_order(rows: list[dict], path: Path) -> int:
    """Each test's CPU over ``DEAR``, dearest first, for ``pytest -n``'s order; how many."""
    dear = sorted((r for r in rows if r["cpu"] >= DEAR), key=lambda r: -r["cpu"])
    path.write_text(json.dumps({r["test"]: round(r["cpu"], 2) for r in dear}, indent=1) + "\n")
    return len(dear)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--json", help="write every test's and module's figures here")
    parser.add_argument("--budget", help="a JSON of module -> CPU seconds to compare with")
    parser.add_argument(
        "--update", action="store_true", help="write this run's figures to --budget"
    )
    parser.add_argument("--grow", type=float, default=0.25)
    parser.add_argument("--slack", type=float, default=1.0)
    parser.add_argument("--strict", action="store_true", help="exit 1 when a module is flagged")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments")
    args = parser.parse_args(argv)
    rows, total = run_suite(args.pytest_args)
    mods = by_module(rows)
    print(
        table(
            f"The {args.top} dearest tests (serial run)", [(r["test"], r) for r in rows], args.top
        )
    )
    print()
    print(table(f"The {args.top} dearest modules", list(mods.items()), args.top))
    print()
    print(
        f"suite_profile: {len(rows)} tests, {total['cpu']:.1f} s of CPU, {total['wall']:.1f} s of "
        f"wall time serially (a test's CPU counts {total['per_test_cpu']}); pytest said: "
        f"{total['last_line']}"
    )
    for line in total["failed"]:
        print(f"suite_profile: {line}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"total": total, "tests": rows, "modules": mods}, indent=1)
        )
    flagged: list[str] = []
    if args.budget:
        path = Path(args.budget)
        if args.update:
            path.write_text(
                json.dumps({k: round(v["cpu"], 2) for k, v in sorted(mods.items())}, indent=1)
                + "\n"
            )
            print(f"suite_profile: wrote {len(mods)} modules' CPU to {path}")
            order = write_order(rows, ROOT / ORDER)
            print(f"suite_profile: wrote {order} tests' CPU to {ORDER} (xdist's order)")
        else:
            flagged = budget_report(mods, json.loads(path.read_text()), args.grow, args.slack)
            verdict = "\n  ".join(flagged) if flagged else "none"
            print(
                f"suite_profile: modules over budget (+{args.grow:.0%} + {args.slack} s): {verdict}"
            )
    return 1 if (args.strict and flagged) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
