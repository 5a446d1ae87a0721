"""Imported inside the rank forkserver only, after its fixed preloads and before
``forkserver.ready``: what the run's test files import, imported once, guarded.

A rank imports its test module again (``lookup``), and with it everything that module imports:
the library under test, a second or more of CPU in every rank of every test. So the server
imports it first, once, and every rank forked afterwards finds it loaded. Which modules: the
imports at module level of the test files pytest will collect (``importscan``), described by
the plan the parent put in the server's environment (``PLAN_ENV``, removed here at once: no
rank sees it; ``preload.plan`` builds it).

**Guarded.** A user's module is not the harness's to trust: multiprocessing's own preload
loop swallows only ``ImportError``, and any other exception would kill the server; worse, a
module that starts a thread, initialises CUDA (or loads its driver) or starts a process at
import would leave every rank forked from a server that cannot be forked safely. So the
candidates are first imported in a throwaway child forked from the server (``probe``), which
reports, module by module, what each import did; only the modules that raised nothing and
left no thread (Python's or any other), no CUDA and no process are then imported in the
server itself, its output silenced, and checked again. A module whose import does not end
within ``PROBE_TIMEOUT`` seconds, or ends the child, is dropped with the reason, and the
probe goes on with the next. What the server preloaded and dropped, and why, goes to the
plan's report file (``forkserver.RankServer.report``; dropped modules are named in pytest's
summary). Probing costs the modules' import time once more, once per session, never per
rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from tutorial_impl.testing import proctable
from tutorial_impl.testing.forkserver import importscan
from tutorial_impl.testing.forkserver.server import PLAN_ENV
from tutorial_impl.testing.rank.main import die_with_parent

PROBE_TIMEOUT = 60.0  # seconds one module's import may take in the probe
Verdict = tuple[str, str] | None  # ("failed" or "dropped", why), or None: fine to preload


def _state() -> dict[str, Any]:
    """What an import could change that a forkserver must not have."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    tasks = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []
    return {
        "threads": {t.ident: t.name for t in threading.enumerate()},
        "tasks": len(tasks),
        "cuda": bool(cuda is not None and cuda.is_initialized()) or _cuda_driver(torch),
        "children": set(proctable.own_children()),
    }


def _cuda_driver(torch: Any) -> bool:
    """Whether the CUDA driver is loaded here: ``torch.cuda.is_available()`` loads it without
    initialising torch's CUDA, and a process forked after that cannot use CUDA. Only asked of
    a CUDA build of torch (reading the memory map costs a millisecond or so)."""
    if not getattr(getattr(torch, "version", None), "cuda", None):
        return False
    try:
        with open("/proc/self/maps") as maps:
            return "libcuda.so" in maps.read()
    except OSError:
        return False


def _harm(before: dict[str, Any], after: dict[str, Any]) -> str | None:
    started = [name for ident, name in after["threads"].items() if ident not in before["threads"]]
    if started:
        return f"started a thread at import ({', '.join(started)})"
    if after["tasks"] > before["tasks"]:
        return "started a thread outside Python at import"
    if after["cuda"] and not before["cuda"]:
        return "initialised CUDA at import (a process forked after that cannot use CUDA)"
    if after["children"] - before["children"]:
        return "started a process at import"
    return None


def import_one(module: str, names: list[str]) -> Verdict:
    """Import ``module`` as ``from module import names`` would (``import module`` without
    names); what went wrong (``failed``: an ImportError, ``raised``: another exception,
    ``unsafe``: imported, but harmful in a forkserver), or None."""
    before = _state()
    try:
        __import__(module, fromlist=names)
    except ImportError as exc:  # missing here: the ranks will say so if they need it
        return "failed", f"{type(exc).__name__}: {exc}"[:500]
    except BaseException as exc:  # noqa: BLE001 - SystemExit, KeyboardInterrupt included
        return "raised", f"raised {type(exc).__name__} at import: {exc}"[:500]
    harm = _harm(before, _state())
    return None if harm is None else ("unsafe", harm)


def probe(imports: list[tuple[str, list[str]]], timeout: float) -> dict[str, Verdict]:
    """What importing each of ``imports``, in order, does in a child forked from here."""
    verdicts: dict[str, Verdict] = {}
    rest = list(imports)
    while rest:
        answered, trouble = _probe_in_child(rest, timeout)
        verdicts.update(answered)
        if trouble is None:
            break
        stuck = rest[len(answered)][0]  # the one being imported when the child stopped
        verdicts[stuck] = ("dropped", trouble)
        rest = rest[len(answered) + 1 :]
    return verdicts


def _probe_in_child(rest: list[tuple[str, list[str]]], timeout: float) -> tuple[dict, str | None]:
    read_fd, write_fd = os.pipe()
    server = os.getpid()
    pid = os.fork()
    if pid == 0:  # the probe: its answers, one line per module, then gone
        try:
            os.close(read_fd)
            die_with_parent(server)  # a probe stuck in an import dies with the server
            _silence()
            for module, names in rest:
                line = json.dumps([module, import_one(module, names)]) + "\n"
                os.write(write_fd, line.encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    try:
        return _answers(read_fd, pid, len(rest), timeout)
    finally:
        os.close(read_fd)


def _answers(fd: int, pid: int, count: int, timeout: float) -> tuple[dict, str | None]:
    """The probe's verdicts as they come; why it stopped early (or None)."""
    answered: dict[str, Verdict] = {}
    buffer = b""
    waiter = select.poll()
    waiter.register(fd, select.POLLIN)
    while len(answered) < count:
        if not waiter.poll(timeout * 1000):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return answered, f"its import did not end within {timeout:g} s"
        chunk = os.read(fd, 65536)
        if not chunk:
            status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            return answered, f"its import ended the process (exit status {status})"
        *lines, buffer = (buffer + chunk).split(b"\n")
        for line in lines:
            module, verdict = json.loads(line)
            answered[module] = tuple(verdict) if verdict else None
    os.waitpid(pid, 0)
    return answered, None


def _silence() -> None:
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    os.close(null)


@contextlib.contextmanager
def _silenced() -> Iterator[None]:
    """fds 1 and 2 to /dev/null meanwhile: a banner printed at import is not the server's."""
    try:
        saved = os.dup(1), os.dup(2)
    except OSError:  # no such fds to silence
        yield
        return
    _silence()
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)


def preload(plan: dict[str, Any]) -> dict[str, Any]:
    """Scan the test files (and put their directories on ``sys.path`` as pytest does), import
    ``rank_preload``'s modules, guarded; then probe the files' imports and import what is
    safe here. The report: ``preloaded``; ``dropped`` and
    ``unsafe`` (imported as ``rank_preload`` asked, or though the probe found nothing), each
    module with the reason; ``failed``: the test files' imports that raised ImportError."""
    started = time.monotonic()
    report: dict[str, Any] = {"preloaded": [], "failed": {}, "dropped": {}, "unsafe": {}}
    if plan.get("sys_path"):
        sys.path[:] = plan["sys_path"]  # the parent's, as the ranks will have it
    found = importscan.scan(plan["test_files"]) if plan["test_files"] else importscan.Scan()
    mode = plan["test_files"]["importmode"] if plan["test_files"] else None
    for path in found.paths:  # as pytest puts them there to import the test files
        if path not in sys.path and mode in ("prepend", "append"):
            sys.path.insert(0 if mode == "prepend" else len(sys.path), path)
    with _silenced():
        for module in plan["rank_preload"]:
            _file(report, module, import_one(module, []), named=True)
    imports = [(m, names) for m, names in found.imports.items() if m not in report["dropped"]]
    probed = probe(imports, plan.get("probe_timeout", PROBE_TIMEOUT))
    with _silenced():
        for module, names in imports:
            verdict = probed.get(module)
            if verdict is None:
                _file(report, module, import_one(module, names))
            else:  # never imported here
                report["failed" if verdict[0] == "failed" else "dropped"][module] = verdict[1]
    return {**report, "files": found.files, "seconds": round(time.monotonic() - started, 3)}


def _file(report: dict[str, Any], module: str, verdict: Verdict, named: bool = False) -> None:
    """Put ``module``, just imported here, where its verdict says (``named``: the user asked
    for it by name: a module missing is worth saying then)."""
    kind, why = verdict or ("", "")
    if kind in ("", "unsafe") and module not in report["preloaded"]:
        report["preloaded"].append(module)
    if kind == "failed" and not named:
        report["failed"][module] = why
    elif kind:
        report["dropped" if kind != "unsafe" else "unsafe"][module] = why


def main() -> None:
    raw = os.environ.pop(PLAN_ENV, None)
    if not raw:
        return  # no plan (run_ranks outside pytest): the fixed preloads only
    plan = json.loads(raw)
    try:
        report = preload(plan)
    except Exception as exc:  # noqa: BLE001 - a server that preloads less still serves
        report = {"preloaded": [], "dropped": {"(the preload)": f"failed: {exc!r}"}}
    tmp = f"{plan['report']}.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(report, f)
        os.replace(tmp, plan["report"])  # a reader never sees half of it
    except OSError:
        pass  # nobody to tell: the parent's summary stays empty


main()
