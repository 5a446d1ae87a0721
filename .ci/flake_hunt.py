"""Run an end-to-end command many times under CPU load and count its failures.

A flake is a bug, and the end-to-end paths (torchrun jobs, the CLI, pytest runs that are
interrupted or killed, the stress test) are where timing bugs hide: on a quiet machine they
pass, beside two busy processes they fail one run in ten. This script reproduces the busy
machine on purpose and counts:

    python .ci/flake_hunt.py --preset torchrun-train --runs 100          # 2 burners by default
    python .ci/flake_hunt.py --preset torchrun-hybrid --runs 20
    python .ci/flake_hunt.py --preset e2e --runs 10                      # pytest -m slow
    python .ci/flake_hunt.py --preset suite --runs 10 --load 0           # pytest -n auto
    python .ci/flake_hunt.py --runs 50 -- python -m tutorial_impl p2p    # any command
    tox -e flakes -- --preset torchrun-train --runs 100

Each run carries a mark in its environment, which every process it starts inherits (also
torchrun's workers, which leave the run's session), so afterwards every live process with
that mark is a leftover: it is reported as a leak, then killed. A run fails if it exits
non-zero, runs past ``--timeout``, or leaks. The log of every failed run is kept under
``--log-dir`` and its last lines are printed. The exit status is 1 if any run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

from tutorial_impl.testing import proctable

PRESETS = {
    "torchrun-train": "{py} -m torch.distributed.run --standalone --nproc_per_node=2 "
    "-m tutorial_impl train --epochs 1 --samples 256",
    "torchrun-hybrid": "{py} -m torch.distributed.run --standalone --nproc_per_node=4 "
    "-m tutorial_impl hybrid --epochs 1",
    "e2e": "{py} -m pytest -m slow -p no:cacheprovider -q",
    "suite": "{py} -m pytest -n auto -p no:cacheprovider -q",
}
# What a failure looked like before, worth naming when it is seen again.
SIGNATURES = {
    "terminate called": "gloo thread at interpreter exit (process.exit_process)",
    "Duplicate GPU detected": "two ranks on one GPU",
    "EADDRINUSE": "port race",
    "Address already in use": "port race",
}
BURN = "while True: pass"


MARK = "FLAKE_HUNT_RUN"  # in each run's environment, inherited by all it starts


def one_run(cmd: list[str], log: Path, timeout: float, env: dict[str, str]) -> dict:
    run_id = uuid.uuid4().hex
    start = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**env, MARK: run_id}
        )
    try:
        code: int | None = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        code = None
    except KeyboardInterrupt:
        proctable.kill_marked(MARK, run_id)
        proc.wait()
        raise
    wall = time.monotonic() - start
    if code is None:
        proctable.kill_marked(MARK, run_id)
        proc.wait()
    # Leftovers: a clean command has ended every process it started when it exits. Give
    # processes that are already dying (SIGKILLed, unmapping memory) a moment to go.
    leaked = proctable.wait_until_unmarked(MARK, run_id, timeout=2.0)
    proctable.kill_marked(MARK, run_id)
    text = log.read_text(errors="replace")
    seen = [why for sig, why in SIGNATURES.items() if sig in text]
    return {"code": code, "wall": wall, "leaked": leaked, "signatures": seen}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run a command many times under CPU load and count failures and leaks.",
        epilog="presets: " + "; ".join(f"{k}: {v}" for k, v in PRESETS.items()),
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), help="a known end-to-end command")
    parser.add_argument("--runs", type=int, default=20, help="how many runs (default 20)")
    parser.add_argument(
        "--load", type=int, default=2, help="CPU-bound busy processes beside each run (default 2)"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument("--python", default=sys.executable, help="interpreter for presets")
    parser.add_argument("--log-dir", default="flake-logs", help="where failed runs' logs stay")
    parser.add_argument("--json", default=None, help="write the counts to this file")
    parser.add_argument("--stop-on-failure", action="store_true", help="stop at the first one")
    parser.add_argument("command", nargs="*", help="the command to run (after --)")
    args = parser.parse_args(argv)
    if bool(args.preset) == bool(args.command):
        parser.error("give exactly one of --preset NAME or -- COMMAND ...")
    if args.runs < 1 or args.load < 0 or args.timeout <= 0:
        parser.error("--runs must be >= 1, --load >= 0 and --timeout > 0")
    cmd = PRESETS[args.preset].format(py=args.python).split() if args.preset else args.command
    name = args.preset or Path(cmd[0]).name
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    burners = [
        subprocess.Popen([sys.executable, "-c", BURN], start_new_session=True)
        for _ in range(args.load)
    ]
    print(f"{name}: {args.runs} runs of: {' '.join(cmd)}", flush=True)
    print(f"beside {args.load} CPU-bound processes on {os.cpu_count()} cores", flush=True)
    failures, leaks, walls = 0, 0, []
    try:
        for i in range(1, args.runs + 1):
            log = log_dir / f"{name}-{i}.log"
            r = one_run(cmd, log, args.timeout, env)
            walls.append(r["wall"])
            ok = r["code"] == 0 and not r["leaked"]
            leaks += bool(r["leaked"])
            how = "ok" if ok else ("TIMEOUT" if r["code"] is None else f"FAILED exit {r['code']}")
            if r["leaked"] and r["code"] == 0:
                how = "LEAKED"
            extra = f"  [{'; '.join(r['signatures'])}]" if r["signatures"] and not ok else ""
            print(f"run {i}/{args.runs}: {how} in {r['wall']:.1f} s{extra}", flush=True)
            if ok:
                log.unlink()
                continue
            failures += 1
            for pid, line in r["leaked"]:
                print(f"    left behind: {pid} {line[:120]}")
            tail = log.read_text(errors="replace").splitlines()[-15:]
            print("    " + "\n    ".join(tail) + f"\n    (whole log: {log})", flush=True)
            if args.stop_on_failure:
                break
    finally:
        for b in burners:
            b.kill()
            b.wait()
    runs = len(walls)
    summary = {
        "name": name,
        "command": cmd,
        "runs": runs,
        "failures": failures,
        "leaks": leaks,
        "load": args.load,
        "wall_p50_s": round(statistics.median(walls), 2),
        "wall_max_s": round(max(walls), 2),
    }
    print(
        f"{name}: {runs} runs, {failures} failed, {leaks} leaked processes; "
        f"wall p50 {summary['wall_p50_s']} s, max {summary['wall_max_s']} s "
        f"(load {args.load})"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
