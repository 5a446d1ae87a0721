"""``python -m tutorial_impl bench ddp-rpc``: the DDP + RPC benchmark's driver.

PyTorch's ``benchmark_ddp_rpc.py`` starts 8 trainers, 8 parameter servers and a master,
times each trainer's epochs, and prints their percentiles. The workers live in
``ddp_rpc_workers.py`` (read that first: they are the hybrid tutorial's world, sized up and
timed); this module starts them through the test harness, turns what the master collected
into the table (``stats.py``) and prints it the way the original does, with an Info section
first. Its figures count from the launch of the workers; it also says how long the command
had been running before that (starting Python, importing torch).

The harness is what makes any topology safe to start: the parent process owns the
rendezvous store on a port the kernel picked, the workers are forked from a warm forkserver
(one ``import torch`` for all 17 instead of 17), their output is relayed live as progress,
and the run has a deadline after which every worker's stack is dumped and all are killed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, fields
from typing import Any, TextIO

import torch

from tutorial_impl.bench import ddp_rpc_workers, report
from tutorial_impl.bench.ddp_rpc_workers import OPTIMIZERS, BenchConfig, run_worker
from tutorial_impl.bench.stats import Row, format_table, summarize
from tutorial_impl.cli import failure_report
from tutorial_impl.rpc.hybrid_model import HIDDEN, NUM_CLASSES
from tutorial_impl.rpc.hybrid_world import master_rank
from tutorial_impl.testing import RankError, run_ranks
from tutorial_impl.testing.forkserver import server


def run_benchmark(
    cfg: BenchConfig, progress: TextIO | None = None, t0: float | None = None
) -> dict[str, Any]:
    """Start the workers, wait for them, and return the measurements (see ``to_json``).

    The workers' progress lines are relayed to ``progress`` (default: stderr) as they come.
    Every time in the result counts from ``t0`` (``time.time()``; default: now, the launch).
    """
    progress = sys.stderr if progress is None else progress
    cfg.check()
    # Have the rank forkserver import this module (torch.distributed.rpc, optim, ...) once,
    # instead of every one of the workers importing it after the fork. It only takes effect
    # if no rank was started yet in this process (true for the CLI).
    server.add_preload([ddp_rpc_workers.__name__])
    t0 = time.time() if t0 is None else t0
    print(
        f"starting {cfg.world_size} workers ({cfg.trainers} trainers, "
        f"{cfg.parameter_servers} parameter servers, 1 master)...",
        file=progress,
        flush=True,
    )
    results = run_ranks(
        run_worker,
        cfg,
        t0,
        world_size=cfg.world_size,
        backend=None,
        timeout=cfg.timeout,
        stream=progress,
        stream_prefix=False,
    )
    report = results[master_rank(cfg)]
    trainers = report["trainers"]
    rows = summarize({n: (r["seconds"], r["samples"]) for n, r in trainers.items()})
    return {
        "config": asdict(cfg),
        "torch": torch.__version__,
        "join_s": report["joined"] - t0,
        "startup_s": max(r["ready"] for r in trainers.values()) - t0,
        "wall_s": time.time() - t0,
        "rows": rows,
    }


def to_json(result: dict[str, Any]) -> dict[str, Any]:
    rows: list[Row] = result["rows"]
    return {**result, "rows": {row.name: row.as_dict() for row in rows}}


def build_parser() -> argparse.ArgumentParser:
    d = BenchConfig()
    p = argparse.ArgumentParser(
        prog="python -m tutorial_impl bench ddp-rpc",
        description="PyTorch Distributed Benchmark (DDP and RPC): trainers look up embeddings "
        "on every parameter server and train a DDP-replicated MLP; epochs are timed.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = p.add_argument
    # Each dest is a BenchConfig field. The original's option names work too (--number-ps).
    add("--trainers", "--number-trainers", type=int, default=d.trainers, help="trainers")
    add(
        "--parameter-servers",
        "--number-ps",
        type=int,
        default=d.parameter_servers,
        help="parameter servers, each with a whole table",
    )
    add(
        "--num-embeddings",
        "--number-embeddings",
        type=int,
        default=d.num_embeddings,
        help="rows of the EmbeddingBag on each server",
    )
    add("--embedding-dim", type=int, default=d.embedding_dim, help="columns of each table")
    add("--warmup", "--warmup-cycles", type=int, default=d.warmup, help="untimed epochs first")
    add("--epochs", type=int, default=d.epochs, help="timed epochs")
    add("--iterations", type=int, default=d.iterations, help="batches an epoch")
    # The batch shape: two uniform ranges, as in the original's batch generator.
    shape = {"nargs": 2, "type": int, "metavar": ("MIN", "MAX")}
    add(
        "--batch-indices",
        dest="indices",
        default=d.indices,
        help="indices in a batch, uniform in [MIN, MAX]",
        **shape,
    )
    add(
        "--bag-size",
        default=d.bag_size,
        help="indices in a bag (a sample), uniform in [MIN, MAX]",
        **shape,
    )
    add("--seed", type=int, default=d.seed, help="seeds the weights and every trainer's batches")
    add("--device", choices=("cpu", "cuda"), default=d.device, help="where the MLPs run")
    add(
        "--optimizer",
        choices=tuple(OPTIMIZERS),
        default=d.optimizer,
        help="DistributedOptimizer's SGD on each owner: the original's TorchScript functional "
        "SGD (compiled once per trainer on every server) or the plain Python one",
    )
    add("--rpc-threads", type=int, default=d.rpc_threads, help="TensorPipe threads a worker")
    add("--rpc-timeout", type=float, default=d.rpc_timeout, help="seconds for any one RPC")
    add("--timeout", type=float, default=d.timeout, help="seconds for the whole run")
    add("--json", metavar="PATH", help="also write the results as JSON")
    add("--plot", metavar="PATH", help="box plot of the epoch times (needs matplotlib)")
    add(
        "--spawn-baseline",
        action="store_true",
        help="also time starting one fresh interpreter per worker, as mp.spawn does",
    )
    return p


def _check_writable(parser: argparse.ArgumentParser, option: str, path: str | None) -> None:
    """Refuse an output path that cannot be written, before any worker starts."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        parser.error(f"{option} {path}: is a directory, not a file")
    if not os.path.isdir(folder):
        parser.error(f"{option} {path}: there is no directory {folder}")
    if not os.access(folder, os.W_OK):
        parser.error(f"{option} {path}: cannot write in {folder}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Say what cannot work before 17 processes start, not after the run.
    if args.plot and not report.have_matplotlib():
        parser.error("--plot needs matplotlib, which is not installed (pip install matplotlib)")
    _check_writable(parser, "--json", args.json)
    _check_writable(parser, "--plot", args.plot)
    # Every option's dest is the name of a BenchConfig field (the pairs as tuples).
    values = {f.name: getattr(args, f.name) for f in fields(BenchConfig)}
    cfg = BenchConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})
    try:
        cfg.check()
    except ValueError as exc:
        parser.error(str(exc))

    print(report.info_section())
    width = cfg.parameter_servers * cfg.embedding_dim
    print(
        "\n---------- PyTorch Distributed Benchmark (DDP and RPC) ----------\n\n"
        f"{cfg.trainers} trainers, {cfg.parameter_servers} parameter servers, 1 master; "
        f"EmbeddingBag({cfg.num_embeddings}, {cfg.embedding_dim}) on each server; "
        f"MLP {'-'.join(map(str, (width, *HIDDEN, NUM_CLASSES)))} on {cfg.device}; "
        f"{cfg.optimizer} SGD\n"
        f"{cfg.iterations} iterations an epoch; {cfg.warmup} warm-up + {cfg.epochs} timed epochs",
        flush=True,
    )
    launch = time.time()
    try:
        result = run_benchmark(cfg, t0=launch)
    except RankError as exc:
        # A worker failed, crashed or ran past --timeout: the harness has killed them all and
        # its message says which one and where (stacks, the workers' output).
        print(
            f"\nbenchmark failed: {failure_report(exc, cfg.timeout, '--timeout')}", file=sys.stderr
        )
        return 1
    rows = result["rows"]
    print("\n" + format_table(rows))
    epoch_p50 = rows[-1].percentiles()["p50"]
    started = report.process_start_time()
    before = f"{launch - started:.2f} s" if started is not None else "an unknown time"
    print(
        f"\nstart-up: {result['startup_s']:.2f} s (all workers joined RPC after "
        f"{result['join_s']:.2f} s); iteration p50: {1000 * epoch_p50 / cfg.iterations:.1f} ms; "
        f"wall: {result['wall_s']:.2f} s\n(counted from the launch of the workers; this "
        f"process had been running {before} before it, starting Python and importing torch)"
    )
    if args.spawn_baseline:
        base = report.spawn_baseline(cfg.world_size)
        result["spawn_baseline_s"] = base
        print(
            f"baseline: {cfg.world_size} fresh interpreters importing torch.distributed.rpc "
            f"at once: {base:.2f} s (our whole start-up is {result['startup_s'] / base:.2f}x that)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(to_json(result), f, indent=2)
        print(f"results written to {args.json}")
    if args.plot:
        title = f"{cfg.trainers} trainers, {cfg.parameter_servers} PS: epoch times"
        trainers = {row.name: row.epoch_seconds for row in rows}
        report.plot_epoch_times(trainers, args.plot, title)
        print(f"plot written to {args.plot}")
    return 0
