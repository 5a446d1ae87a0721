"""``python -m tutorial_impl rpc``: every lesson of the RPC reference, on local workers.

worker0 drives; the other workers only serve requests, which is how RPC programs look: one
``init_rpc`` and one ``shutdown`` per process, and in between, whatever the callers ask. Each
lesson prints a line or two of what it saw. Under torchrun
(``torchrun --nproc_per_node=3 -m tutorial_impl rpc``) each process runs its own worker.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed.rpc as rpc

from tutorial_impl.dist_tuto.process import under_torchrun
from tutorial_impl.rpc import autograd, batching, calls, options, retry
from tutorial_impl.rpc.rrefs import rref_tour
from tutorial_impl.rpc.workers import (
    check_timeout,
    init_worker,
    shutdown_with_work_in_flight,
    shutdown_worker,
)

MIN_WORKERS = 3  # a driver, a callee, and a third worker to share RRefs with
SHORT = 0.3  # seconds: the timeout of the calls that are meant to time out


def say(*lines: str) -> None:
    sys.stdout.write("".join(line + "\n" for line in lines))
    sys.stdout.flush()


def fmt(t: torch.Tensor) -> str:
    return str([round(v, 4) for v in t.flatten().tolist()])


def lesson_calls() -> None:
    seen = calls.three_calls("worker1", "worker2")
    say(
        "1. The three calls: torch.add(ones(2), k) on other workers",
        f"   rpc_sync  -> {fmt(seen['rpc_sync'])}",
        f"   rpc_async -> {[fmt(v) for v in seen['rpc_async']]} (collect_all)",
        f"   remote    -> an RRef owned by {seen['remote'].owner_name()}, "
        f"to_here() {fmt(seen['remote_value'])}",
    )
    story = calls.driver("worker1", "worker2", torch.tensor([0, 1, 2, 3]), torch.tensor([0, 2]))
    say(
        f"   driver: created the table on {story['table_owner']} with remote, never fetched it; "
        f"{story['trainer']} looked up 2 bags there: {fmt(story['bags'])}",
    )


def lesson_rrefs() -> None:
    seen = rref_tour("worker1", "worker2")
    say(
        "2. RRef to a Counter(10) created on worker1",
        f"   owner {seen['owner']}, is_owner here {seen['is_owner']}, "
        f"local_value here: RuntimeError ({seen['local_value_error'].split('. ')[-1]})",
        f"   proxies: rpc_sync +2 -> {seen['rpc_sync']}, rpc_async +3 -> {seen['rpc_async']}, "
        f"remote value() -> {seen['remote_value']} (owned by {seen['remote_owner']})",
        f"   a to_here() copy +100 -> {seen['copy_after_increment']}, "
        f"the owner's object still {seen['owner_after_copy_increment']}",
        f"   shared with worker2 (+4 -> {seen['third']['after_increment']}), "
        f"then +5 on the owner through local_value() -> {seen['on_owner']['after_increment']}",
    )


def lesson_autograd() -> None:
    t1, t2, t4 = (torch.full((2,), v, requires_grad=True) for v in (1.0, 2.0, 4.0))
    grads = autograd.design_note_example("worker1", t1, t2, t4)
    for worker, w in (("worker1", 0.5), ("worker2", -2.0)):
        rpc.rpc_sync(worker, autograd.set_weight, args=(torch.tensor(w),))
    x = torch.tensor([0.1, 0.2], requires_grad=True)
    chain = autograd.chain_backward(x, ["worker1", "worker2"])
    say(
        "3. Distributed autograd",
        f"   design note (t3 = t1 + t2 on worker1): dt1 {fmt(grads['t1'])}, "
        f"dt2 {fmt(grads['t2'])}, dt4 {fmt(grads['t4'])}",
        f"   worker0 -> worker1 -> worker2: dx {fmt(chain['x'])}, "
        f"dw1 {fmt(chain['worker1'])}, dw2 {fmt(chain['worker2'])}",
    )


# torch.distributed.optim takes seconds to import and only the workers use it: the two lessons
# that need it import it themselves, so that the launching process never does.
HEAVY = ["tutorial_impl.rpc.optimizer", "tutorial_impl.rpc.remote_module"]


def lesson_optimizer() -> None:
    from tutorial_impl.rpc import optimizer

    for name, cls in (("SGD", torch.optim.SGD), ("Adagrad", torch.optim.Adagrad)):
        a = rpc.remote("worker1", optimizer.parameter, args=([1.0, -2.0],))
        b = rpc.remote("worker2", optimizer.parameter, args=([0.5, 3.0],))
        opt = optimizer.distributed_step([a, b], cls, lr=0.1)
        say(
            f"4. DistributedOptimizer({name}, lr=0.1), one step: a on worker1 -> "
            f"{fmt(a.to_here())}, b on worker2 -> {fmt(b.to_here())} "
            f"(local optimizers on {', '.join(optimizer.optimizer_owners(opt))})"
        )


def lesson_remote_module() -> None:
    from tutorial_impl.rpc import remote_module

    seen = remote_module.remote_module_tour("worker1", torch.ones(2, 3))
    say(
        f"5. RemoteModule(Linear(3, 2)) on {seen['module_owner']}: forward {fmt(seen['forward'])}",
        f"   parameters(): ValueError ({seen['parameters_error']})",
        f"   one SGD step through remote_parameters(): bias {fmt(seen['parameters_before'][1])}"
        f" -> {fmt(seen['parameters_after'][1])}",
    )


def lesson_options_and_failures() -> None:
    peak = options.concurrency_probe("worker1", calls=8, seconds=0.05)
    late = options.call_past_its_timeout("worker1", timeout=SHORT)
    try:
        rpc.rpc_sync("worker1", retry.raise_remotely, args=(7,))
    except ValueError as exc:  # the callee's exception type, with its traceback as text
        where = next(line for line in str(exc).splitlines() if "raise_remotely" in line)
    rpc.rpc_sync("worker1", retry.fail_first, args=(2,))
    total = retry.retry(lambda: rpc.rpc_sync("worker1", retry.flaky_add, args=(1.0, 2.0)), 3, 0.05)
    rpc.rpc_sync("worker1", retry.lose_next_reply)
    count = retry.retry(lambda: rpc.rpc_sync("worker1", retry.increment, args=(1,), timeout=SHORT))
    rpc.rpc_sync("worker1", retry.release_lost_replies)
    say(
        f"6. TensorPipe options: rpc_timeout {rpc.get_rpc_timeout():g} s; 8 calls at once, "
        f"worker1 ran {peak} side by side (num_worker_threads)",
        f"   a 60 s call with timeout={SHORT}: {late['error'].split(':')[-1].strip()} "
        f"after {late['waited']:.2f} s",
        "   a ValueError raised on worker1 comes back as a ValueError, with worker1's "
        f"traceback (worker1 prints it too): ...{where.strip()[-40:]}",
        f"   retry(attempts=3, backoff=0.05) after 2 transient failures -> {total}",
        f"   increment(1) retried after its reply was lost: counter = {count} "
        "(which is why RPC itself never retries)",
    )


def lesson_batching(world_size: int) -> None:
    ones = torch.ones(2)
    chained = rpc.rpc_sync(
        "worker1", batching.async_add_chained, args=("worker2", ones, ones, ones)
    )
    trainers = [f"worker{i}" for i in range(1, world_size)]
    ps = rpc.RRef(batching.BatchUpdateParameterServer(len(trainers), 2, lr=0.1, seed=0))
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 2, generator=g), torch.ones(4, 1)) for _ in trainers]
    futures = [
        rpc.rpc_async(t, batching.train_batch, args=(ps, x, y))
        for t, (x, y) in zip(trainers, batches, strict=True)
    ]
    afters = [fut.wait()["after"] for fut in futures]
    same = all(torch.equal(a[0], afters[0][0]) for a in afters)
    say(
        f"7. async_execution: worker1 chained worker2's x + y with + z -> {fmt(chained)}",
        f"   batch update: {len(trainers)} trainers pushed, one averaged SGD step, "
        f"all received the same weight: {same} {fmt(afters[0][0])}",
    )


def demo_worker(rank: int, world_size: int, rpc_timeout: float) -> None:
    """What every process runs: join, (worker0 only) the lessons, leave."""
    name = init_worker(rank, world_size, rpc_timeout, num_worker_threads=4)
    if name != "worker0":
        shutdown_worker(rpc_timeout)  # serve until everyone has called shutdown
        return
    say(f"RPC demo: {world_size} workers on TensorPipe; worker0 drives, the others serve")
    lesson_calls()
    lesson_rrefs()
    lesson_autograd()
    lesson_optimizer()
    lesson_remote_module()
    lesson_options_and_failures()
    lesson_batching(world_size)
    left = shutdown_with_work_in_flight("worker1", 0.2, rpc_timeout)
    say(
        "8. rpc_async(worker1, slow_work 0.2 s) never waited for, then rpc.shutdown(): "
        f"it returned {left['shutdown_returned'] - left['work_finished']:.3f} s after the "
        f"work finished; the future is done: {left['future_done']}"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tutorial_impl rpc",
        description="The Distributed RPC Framework reference, lesson by lesson, on local "
        "workers: rpc_sync/rpc_async/remote, RRef, distributed autograd, "
        "DistributedOptimizer, RemoteModule, TensorPipe options and failures, "
        "async_execution and batching, graceful shutdown.",
    )
    parser.add_argument(
        "--world-size", type=int, default=MIN_WORKERS, help=f"workers (at least {MIN_WORKERS})"
    )
    parser.add_argument(
        "--rpc-timeout", type=float, default=20.0, help="seconds, the default of every RPC"
    )
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds for the whole demo")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.world_size < MIN_WORKERS:
        parser.error(f"--world-size must be at least {MIN_WORKERS}, got {args.world_size}")
    for option, value in (("--rpc-timeout", args.rpc_timeout), ("--timeout", args.timeout)):
        try:
            check_timeout(value, option)
        except ValueError as exc:
            parser.error(str(exc))

    if under_torchrun():
        demo_worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args.rpc_timeout)
        return 0

    from tutorial_impl import cli  # the CLI's launcher, not the tutorial's

    start = time.perf_counter()
    # Every worker imports these: the server the local workers are forked from imports them
    # once instead.
    cli.add_preload([__name__, *HEAVY])
    status = cli.exit_status(
        lambda: cli.run_local(
            demo_worker, args.rpc_timeout, world_size=args.world_size, timeout=args.timeout
        )
    )
    if status == 0:
        say(f"{args.world_size} workers, {time.perf_counter() - start:.1f} s")
    return status
