"""Lesson 6, backend options and failure: thread pools, timeouts, remote errors, retries.

The reference claims: ``init_rpc`` takes a ``BackendType`` and backend options; TensorPipe's
are ``num_worker_threads`` and ``rpc_timeout`` (and a call may pass its own ``timeout=``). And:
RPC never retries a call, because it cannot know whether the call is idempotent; the
application must retry, with reasonable backoff.

First, in this process, the options and our checks of bad input. Then one world of three
workers (``failures_lesson``) where worker1 has only two worker threads and worker2 hosts the
failing services; worker0 drives. Read in order: the options, what ``num_worker_threads``
bounds, a call that times out, an exception raised remotely, ``retry`` against a worker that
fails its first calls, and why a non-idempotent call must not be retried. Last, no worker
process outlives the world (checked in the OS process table).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed.rpc as rpc

from tutorial_impl.rpc import options, retry
from tutorial_impl.rpc.workers import check_timeout, init_worker, rpc_options, shutdown_worker
from tutorial_impl.testing import proctable

RPC_TIMEOUT = 10.0
SHORT = 0.3  # the per-call timeout of calls that are meant to time out
THREADS = {1: 2}  # worker1 runs at most two requests at once; the others keep the default 16

# --- Options, checked in this process ---------------------------------------------------


def test_options_carry_the_timeout_and_the_thread_pool():
    opts = rpc_options(rpc_timeout=5.0, num_worker_threads=4)
    assert isinstance(opts, rpc.RpcBackendOptions)  # each backend subclasses it
    assert (opts.rpc_timeout, opts.num_worker_threads) == (5.0, 4)
    assert [b.name for b in rpc.BackendType] == ["TENSORPIPE"]  # the one backend on torch 2.x


def test_a_device_map_says_where_cuda_tensors_land_on_each_callee():
    # Only options here; sending CUDA tensors with them is in test_rpc_gpu.py.
    opts = rpc_options(device_maps={"worker1": {"cuda:0": "cuda:1"}})
    assert opts.device_maps == {"worker1": {torch.device("cuda:0"): torch.device("cuda:1")}}
    assert rpc_options().device_maps == {}  # none by default: CPU tensors only


@pytest.mark.parametrize("seconds", [0, -1.0, math.nan])
def test_a_timeout_that_bounds_nothing_is_refused(seconds):
    with pytest.raises(ValueError, match="rpc_timeout must be a positive number of seconds"):
        rpc_options(rpc_timeout=seconds)


def test_why_we_check_torch_reads_zero_as_no_timeout_at_all():
    assert rpc.TensorPipeRpcBackendOptions(rpc_timeout=0).rpc_timeout == 0  # accepted: no timeout
    with pytest.raises(RuntimeError, match="RPC Timeout must be non-negative"):
        rpc.TensorPipeRpcBackendOptions(rpc_timeout=-1)


def test_zero_worker_threads_is_refused():
    with pytest.raises(ValueError, match="num_worker_threads must be at least 1, got 0"):
        rpc_options(num_worker_threads=0)


def test_check_timeout_names_what_it_checked():
    assert check_timeout(0.5) == 0.5
    with pytest.raises(ValueError, match="--timeout must be a positive number of seconds"):
        check_timeout(-2, "--timeout")


# --- retry, checked in this process -----------------------------------------------------


def test_retry_backs_off_exponentially_and_stops_at_the_first_success():
    outcomes = [RuntimeError("lost"), RuntimeError("lost"), "ok"]
    slept: list[float] = []

    def call() -> str:
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    assert retry.retry(call, attempts=5, backoff=0.1, sleep=slept.append) == "ok"
    assert slept == [0.1, 0.2]  # backoff, then twice that; no sleep after the success
    assert outcomes == []


def test_retry_gives_up_with_the_last_error_and_never_retries_other_errors():
    slept: list[float] = []
    errors = iter([RuntimeError("first"), RuntimeError("second")])

    def failing() -> None:
        raise next(errors)

    with pytest.raises(RuntimeError, match="second"):
        retry.retry(failing, attempts=2, backoff=0.1, sleep=slept.append)
    assert slept == [0.1]

    def buggy() -> None:
        raise ValueError("a bug, not a network problem")

    with pytest.raises(ValueError):
        retry.retry(buggy, attempts=3, backoff=0.1, sleep=slept.append)
    assert slept == [0.1]  # not retried


@pytest.mark.parametrize(
    "attempts, backoff, message",
    [(0, 0.1, "attempts must be at least 1, got 0"), (2, -1.0, "backoff must be >= 0")],
)
def test_retry_refuses_bad_arguments(attempts, backoff, message):
    with pytest.raises(ValueError, match=message):
        retry.retry(lambda: None, attempts=attempts, backoff=backoff)


# --- The world, and the rank functions only these tests use ------------------------------


def counted_call(service: str, *args: object, first_timeout: float = RPC_TIMEOUT):
    """A retryable call to worker2 that counts its attempts. The first attempt waits for its
    reply ``first_timeout`` seconds, the others RPC_TIMEOUT."""
    attempts = []

    def call():
        timeout = first_timeout if not attempts else RPC_TIMEOUT
        attempts.append(timeout)
        return rpc.rpc_sync("worker2", getattr(retry, service), args=args, timeout=timeout)

    return call, attempts


def failures_lesson(rank: int, world_size: int, pid_dir: str) -> dict:
    proctable.record_self(pid_dir, f"worker{rank}")
    init_worker(rank, world_size, RPC_TIMEOUT, num_worker_threads=THREADS.get(rank, 16))
    report: dict = {}
    if rank == 0:
        report["rpc_timeout"] = rpc.get_rpc_timeout()
        report["peak"] = {
            "worker1": options.concurrency_probe("worker1", calls=4, seconds=0.1),
            "worker2": options.concurrency_probe("worker2", calls=4, seconds=0.2),
        }
        report["timeout"] = options.call_past_its_timeout("worker2", SHORT)
        report["callee_finished"] = rpc.rpc_sync("worker2", options.finished, args=("timeout",))

        try:
            rpc.rpc_sync("worker2", retry.raise_remotely, args=(7,))
        except ValueError as exc:
            report["remote_error"] = str(exc)
        try:
            rpc.rpc_async("worker2", retry.raise_remotely, args=(8,)).wait()
        except ValueError as exc:
            report["remote_error_async"] = str(exc)

        # A worker that fails its first two calls: three attempts succeed, two do not.
        slept: list[float] = []
        for attempts in (3, 2):
            rpc.rpc_sync("worker2", retry.fail_first, args=(2,))
            call, made = counted_call("flaky_add", 1.0, 2.0)
            try:
                outcome = retry.retry(call, attempts, backoff=0.05, sleep=slept.append)
            except RuntimeError as exc:
                outcome = str(exc).splitlines()[1]  # the remote error, after "On WorkerInfo..."
            seen = rpc.rpc_sync("worker2", retry.calls_seen)
            report[f"flaky_{attempts}"] = (outcome, len(made), seen)
        report["flaky_slept"] = slept

        # A reply lost after the work was done: retrying repeats the work.
        for service, args in (("increment", (1,)), ("put", ("lr", 0.1))):
            rpc.rpc_sync("worker2", retry.lose_next_reply)
            call, made = counted_call(service, *args, first_timeout=SHORT)
            outcome = retry.retry(call, attempts=3, backoff=0.05)
            rpc.rpc_sync("worker2", retry.release_lost_replies)
            report[service] = (outcome, len(made))
        report["counter"] = rpc.rpc_sync("worker2", retry.counter)
    shutdown_worker(RPC_TIMEOUT)
    return report


@pytest.fixture(scope="module")
def world(rpc_worlds) -> tuple[list[dict], str]:
    pid_dir = str(rpc_worlds.directory("failures-pids"))
    return rpc_worlds.run(failures_lesson, pid_dir, world_size=3, backend=None, timeout=30), pid_dir


@pytest.fixture(scope="module")
def report(world) -> dict:
    return world[0][0]


def test_the_default_timeout_is_the_one_in_the_options(report):
    assert report["rpc_timeout"] == RPC_TIMEOUT


def test_num_worker_threads_bounds_the_requests_run_at_once(report):
    # Four one-tenth-second calls at once: worker1 (two threads) ran two side by side,
    # worker2 (sixteen) more than two.
    assert report["peak"]["worker1"] == 2
    assert report["peak"]["worker2"] > 2


def test_a_call_past_its_timeout_raises_within_a_bound(report):
    timeout = report["timeout"]
    assert f"RPC ran for more than set timeout ({SHORT * 1000:.0f} ms)" in timeout["error"]
    # Not before the deadline, and nowhere near the minute the callee would have taken.
    assert SHORT * 0.9 <= timeout["waited"] < 5.0


def test_the_callee_is_not_told_the_caller_gave_up(report):
    # Its function went on running and returned only when released, after the timeout.
    assert report["callee_finished"] > report["timeout"]["raised_at"]


def test_a_remote_exception_comes_back_with_its_type_and_the_remote_traceback(report):
    for row, text in ((7, report["remote_error"]), (8, report["remote_error_async"])):
        assert "On WorkerInfo(id=2, name=worker2):" in text
        assert f"ValueError('row {row} is not in the table')" in text
        assert "in raise_remotely" in text  # worker2's stack, as text
        assert 'raise ValueError(f"row {row} is not in the table")' in text


def test_retry_gets_through_a_worker_that_fails_its_first_calls(report):
    # (outcome, attempts made, calls the worker saw)
    assert report["flaky_3"] == (3.0, 3, 3)
    assert report["flaky_2"] == ("RuntimeError('transient failure 2 of 2')", 2, 2)
    assert report["flaky_slept"] == [0.05, 0.1, 0.05]  # 0.05, 0.1 in the first run


def test_retrying_a_call_that_is_not_idempotent_repeats_its_effect(report):
    # The first increment ran but its reply was lost (the caller gave up after SHORT); the
    # retry ran it again. The caller asked for +1 once; the counter moved twice. The framework
    # cannot tell this call from an idempotent one, which is why it never retries.
    outcome, attempts = report["increment"]
    assert attempts == 2
    assert report["counter"] == outcome == 2


def test_retrying_an_idempotent_call_is_harmless(report):
    outcome, attempts = report["put"]
    assert attempts == 2
    assert outcome == {"lr": 0.1}  # the same table as after one put


def test_no_worker_process_is_left(world):
    _, pid_dir = world
    assert set(proctable.recorded(pid_dir)) == {"worker0", "worker1", "worker2"}
    assert proctable.wait_until_gone(pid_dir) == {}
