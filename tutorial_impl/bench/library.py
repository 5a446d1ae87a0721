"""A library's distributed tests, per test: the harness against a spawn pool made once.

A real library's suite (torchmetrics, say) tests its distributed code with a ``spawn`` Pool of
N workers made at session start: each worker imports the library once, joins one process
group, and every test sends its rank body with ``pool.starmap``. Ported to the harness, every
fresh rank is a new process: if it had to import the library itself, each test would pay the
library's import in every rank (467 ms a test against 42 ms in the pool, measured on
torchmetrics). The harness's forkserver imports what the test files import
(``testing/forkserver/probe.py``), so a fresh rank starts with the library loaded, with no
setting. This benchmark measures that on a suite of its own, written to a temporary
directory:

* ``heavylib``: a package whose import is heavy (``--heavy``, default ``torch._dynamo``: about
  a second of CPU here) and metrics as a metrics library has them: ``nn.Module``s with states,
  a ``forward`` that gives the batch's value, a ``compute`` that all-gathers every rank's;
* the same test three ways, ``--tests`` tests each, all in one pytest session: in the pool
  (``test_pool``; its workers started by ``--pool-start-method``, spawn by default, or
  forked by the harness's own forkserver: ``harness``), on
  fresh ranks without any preload setting (``test_fresh``) and in a warm world
  (``test_warm``), in blocks of 5 tests of one way, the ways in turn (so that the three see
  the same load as it changes): ``pool_ms``, ``fresh_ms``, ``warm_ms``, and ``fresh_ratio``
  / ``warm_ratio`` against ``pool_ms``;
* then the fresh tests again in a session of their own with ``-o
  rank_preload_test_imports=false`` (``--unpreloaded-tests`` tests; 0 for none):
  ``unpreloaded_ms``, what each test cost before, and ``unpreloaded_ratio``.

A test's cost is the median time from its start to the next test's start, where the next is
of the same way (pytest's steps between two tests included, and what a test leaves to do
after it: a warm world's check, fresh ranks' exit), leaving out the first of each way (it
makes the pool, starts the forkserver and the warm world). The tests are shaped like
torchmetrics' ``_class_test`` (``--batches`` batches of 32 per rank, as its
``NUM_BATCHES``), without its TorchScript check. ``pool_cpu_ms``, ``fresh_cpu_ms`` and
``warm_cpu_ms`` are what a test costs in CPU, every process of the session counted (the
pytest process, the pool's workers, the forkserver, the ranks, the exited ones too), and
their ratios to the pool's ``fresh_cpu_ratio``, ``warm_cpu_ratio``: what other jobs on a
shared machine do not change much. A session pays once what a test of its way needs first:
``pool_start_ms`` (the pool made, a session fixture, and its first call's extra) and
``fresh_start_ms`` (the first fresh test's extra: the forkserver's start, its torch and the
test files' imports); ``pool_suite_s`` and ``fresh_suite_s`` are a suite of ``--tests`` such
tests run one way, its start included, as the issue's own table has a session's wall time
beside a test's, and ``fresh_suite_ratio`` their ratio (it tends to ``fresh_ratio`` as a
suite grows). ``preloaded`` lists what the forkserver
imported for the suite (its report), and ``load_average`` the 1-minute load after the runs.

    python -m tutorial_impl bench library [--tests 20] [--world-size 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tutorial_impl.bench.report import write_json

LIBRARY = '''"""A library-shaped package: a heavy import, then metrics the tests call."""
import torch
import torch.distributed as dist
{heavy}


class Metric(torch.nn.Module):
    """A metric as a metrics library has it: states with defaults, ``forward`` gives the
    batch's value and accumulates, ``compute`` gathers every rank's states first."""

    def __init__(self):
        super().__init__()
        self._defaults = {{}}
        for name in self.state_names:
            self._defaults[name] = torch.zeros((), dtype=torch.float64)
            self.register_buffer(name, torch.zeros((), dtype=torch.float64), persistent=False)

    def reset(self):
        for name, default in self._defaults.items():
            setattr(self, name, default.clone())

    def forward(self, preds, target):
        kept = {{name: getattr(self, name) for name in self._defaults}}
        self.reset()
        self.update(preds, target)
        batch = self.value()
        for name, old in kept.items():
            setattr(self, name, old + getattr(self, name))
        return batch

    def compute(self):
        kept = {{name: getattr(self, name) for name in self._defaults}}
        if dist.is_available() and dist.is_initialized():
            for name, mine in kept.items():
                setattr(self, name, gather_all_tensors(mine).sum(0))
        value = self.value()
        for name, old in kept.items():
            setattr(self, name, old)
        return value


def gather_all_tensors(tensor):
    """Every rank's ``tensor``, stacked: the shapes first, then the data padded to the
    largest (ranks may hold states of different sizes)."""
    world = dist.get_world_size()
    shape = torch.tensor(tensor.shape, dtype=torch.long)
    shapes = [torch.zeros_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape)
    gathered = [torch.zeros_like(tensor) for _ in range(world)]
    dist.all_gather(gathered, tensor.contiguous())
    return torch.stack(gathered)


class MeanSquaredError(Metric):
    state_names = ("total", "count")

    def update(self, preds, target):
        self.total += ((preds - target) ** 2).sum()
        self.count += target.numel()

    def value(self):
        return self.total / self.count


class MeanAbsoluteError(MeanSquaredError):
    def update(self, preds, target):
        self.total += (preds - target).abs().sum()
        self.count += target.numel()


class Accuracy(Metric):
    state_names = ("right", "count")

    def update(self, preds, target):
        self.right += (preds.argmax(-1) == target).sum()
        self.count += target.numel()

    def value(self):
        return self.right / self.count
'''

POOL = '''"""The pool's side, as a library's suite has it: workers that join one group at start."""
from datetime import timedelta

import torch
import torch.distributed as dist

import heavylib  # the workers import the library once, when the pool is made


def setup_ddp(rank, world_size, store_file):
    torch.set_num_threads(1)  # as the harness's ranks
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=60))
'''

CONFTEST = """import json, multiprocessing, os, time

import pytest

from pool_setup import setup_ddp

STAMPS = []
POOL_MADE = []  # seconds the pool took to make (its workers' start, imports and group)
WORLD = {world}


def context(start):
    if start != "harness":
        return multiprocessing.get_context(start)
    from tutorial_impl.testing.forkserver import server as forkserver

    return forkserver.context()  # workers forked by the harness's forkserver, torch loaded


@pytest.fixture(scope="session")
def pool(tmp_path_factory):
    store_file = tmp_path_factory.mktemp("pool") / "store"  # a fresh file: no port to pick
    made = time.perf_counter()
    pool = context("{start}").Pool(WORLD)
    pool.starmap(setup_ddp, [(rank, WORLD, str(store_file)) for rank in range(WORLD)])
    POOL_MADE.append(time.perf_counter() - made)
    yield pool
    pool.terminate()


def pytest_collection_modifyitems(items):
    # Blocks of 5 tests of one way, the ways in turn: the three see the same load as it
    # changes, and each test follows one of its own way (whose leftovers it pays for).
    def key(item):
        i = item.callspec.params["i"] if hasattr(item, "callspec") else 1e9
        return i // 5, item.originalname, i

    items.sort(key=key)


def tree_cpu():
    # CPU seconds of this process and of every process under it, the exited ones too (the
    # forkserver's reaped ranks): what the other jobs on the machine do not add to.
    total, todo = 0, [os.getpid()]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{{pid}}/stat") as f:
                total += sum(map(int, f.read().rsplit(")", 1)[1].split()[11:15]))
            for task in os.listdir(f"/proc/{{pid}}/task"):
                with open(f"/proc/{{pid}}/task/{{task}}/children") as f:
                    todo += map(int, f.read().split())
        except (OSError, ValueError):
            pass  # gone meanwhile
    return total / os.sysconf("SC_CLK_TCK")


@pytest.fixture(autouse=True)
def stamp(request):
    STAMPS.append((request.node.originalname, time.perf_counter(), tree_cpu()))


def pytest_sessionfinish(session):
    from tutorial_impl.testing.forkserver import server as forkserver

    with open(os.environ["BENCH_STAMPS"], "w") as f:
        report = forkserver.SERVER.report()
        json.dump({{"stamps": STAMPS, "report": report, "pool_made_s": sum(POOL_MADE)}}, f)
"""

# One test as a metrics library writes it (torchmetrics' ``_class_test``): inputs made in the
# test and given to every rank; each rank copies and pickles its metric, feeds its share of
# the batches, checking each batch's value against a reference, then checks the value synced
# over every rank against the reference on all the batches. The same test three ways.
TESTS = """import copy
import os
import pickle
from functools import partial

import numpy as np
import pytest
import torch

from heavylib import Accuracy, MeanAbsoluteError, MeanSquaredError

BATCHES, BATCH, CLASSES, WORLD = {batches}, 32, 5, {world}
ROUNDS = range(int(os.environ.get("BENCH_TESTS", "0")))  # a pool worker needs none


def mse(preds, target):
    return np.mean((preds - target) ** 2)


def mae(preds, target):
    return np.mean(np.abs(preds - target))


def accuracy(preds, target):
    return np.mean(preds.argmax(-1) == target)


CASES = [(MeanSquaredError, mse), (MeanAbsoluteError, mae), (Accuracy, accuracy)]


def inputs(i):
    metric_class, reference = CASES[i % len(CASES)]
    generator = torch.Generator().manual_seed(i)
    if metric_class is Accuracy:
        preds = torch.rand(BATCHES, BATCH, CLASSES, generator=generator)
        target = torch.randint(CLASSES, (BATCHES, BATCH), generator=generator)
    else:
        preds, target = torch.rand(BATCHES, BATCH, generator=generator), torch.rand(BATCHES, BATCH)
    return preds, target, metric_class, reference


def class_test(rank, world_size, preds, target, metric_class, reference):
    metric = metric_class()
    clone = copy.deepcopy(metric)
    assert clone is not metric and type(clone) is type(metric)
    metric = pickle.loads(pickle.dumps(metric))
    for i in range(rank, BATCHES, world_size):
        batch_value = metric(preds[i], target[i])
        assert np.allclose(batch_value.numpy(), reference(preds[i].numpy(), target[i].numpy()))
    assert hash(metric)
    assert metric.state_dict() == {{}}
    result = metric.compute()
    every = preds.flatten(0, 1).numpy(), target.flatten(0, 1).numpy()
    assert np.allclose(result.numpy(), reference(*every))
    return result.item()


def agree(results):
    assert len(results) == WORLD and len(set(results)) == 1


@pytest.mark.parametrize("i", ROUNDS)
def test_pool(i, pool):
    preds, target, metric_class, reference = inputs(i)
    test = partial(class_test, preds=preds, target=target, metric_class=metric_class,
                   reference=reference)
    agree(pool.starmap(test, [(rank, WORLD) for rank in range(WORLD)]))


@pytest.mark.world_size(WORLD)
@pytest.mark.parametrize("i", ROUNDS)
def test_fresh(i, run_ranks):
    agree(run_ranks(class_test, *inputs(i)))


@pytest.mark.world_size(WORLD)
@pytest.mark.warm_world
@pytest.mark.parametrize("i", ROUNDS)
def test_warm(i, run_ranks):
    agree(run_ranks(class_test, *inputs(i)))


def test_zz_end():
    pass  # its start ends the last test's time
"""
WAYS = ("pool", "fresh", "warm")


def write_suite(
    work: Path, heavy: list[str], world_size: int, batches: int = 2, start: str = "spawn"
) -> None:
    """The library and its tests (``batches`` batches per rank), the pool's conftest (its
    workers started by ``start``), an empty pytest.ini (no settings)."""
    (work / "heavylib").mkdir()
    imports = "\n".join(f"import {name}" for name in heavy)
    (work / "heavylib" / "__init__.py").write_text(LIBRARY.format(heavy=imports))
    (work / "pool_setup.py").write_text(POOL)
    (work / "conftest.py").write_text(CONFTEST.format(world=world_size, start=start))
    (work / "pytest.ini").write_text("[pytest]\n")
    text = TESTS.format(world=world_size, batches=batches * world_size)
    (work / "test_library.py").write_text(text)


def run_session(work: Path, tests: int, *args: str) -> dict[str, Any]:
    """One pytest session in ``work``: each test file's start stamps, the forkserver's report."""
    stamps = work / "stamps.json"
    stamps.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
    command += ["-p", "tutorial_impl.testing.plugin", "--rank-timeout", "120", *args]
    env = {**os.environ, "BENCH_STAMPS": str(stamps), "BENCH_TESTS": str(tests)}
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_ADDOPTS", "PYTEST_CURRENT_TEST"):
        env.pop(name, None)
    done = subprocess.run(command, cwd=work, env=env, capture_output=True, timeout=900)
    if done.returncode != 0 or not stamps.exists():
        raise RuntimeError(f"the suite failed:\n{done.stdout.decode()[-4000:]}")
    return json.loads(stamps.read_text())


def per_test_ms(stamps: list[list[Any]], way: str) -> float:
    """The median milliseconds from the start of one ``test_<way>`` to the start of the next
    when that is one too, the first such gap left out (it made the pool, started the
    forkserver, the warm world)."""
    name = f"test_{way}"
    pairs = zip(stamps, stamps[1:], strict=False)
    gaps = [(b[1] - a[1]) * 1e3 for a, b in pairs if a[0] == b[0] == name][1:]
    if not gaps:
        raise ValueError("need at least 3 tests of a way: the first gap is left out")
    return statistics.median(gaps)


def start_ms(stamps: list[list[Any]], way: str) -> float:
    """What the first ``test_<way>`` cost beyond a test of its way: the forkserver's start
    (its torch and the test files' imports) for fresh ranks, a pool's first call for the
    pool (whose making, a session fixture, comes before any test's stamp: ``pool_made_s``)."""
    name = f"test_{way}"
    pairs = zip(stamps, stamps[1:], strict=False)
    first = next((b[1] - a[1]) * 1e3 for a, b in pairs if a[0] == name)
    return max(0.0, first - per_test_ms(stamps, way))


def per_test_cpu_ms(stamps: list[list[Any]], way: str) -> float:
    """CPU milliseconds a ``test_<way>`` costs, every process of the session counted: each
    block of that way's tests from its first test's start to the next block's, its first
    block left out; all of them summed, over the tests they hold. The kernel counts a
    process's CPU in ticks (10 ms here): a figure worth reading needs tens of tests."""
    blocks, start, count = [], None, 0
    for i, (name, _, cpu) in enumerate(stamps):
        if name == f"test_{way}" and (i == 0 or stamps[i - 1][0] != name):
            start, count = cpu, 0
        if name == f"test_{way}":
            count += 1
            if i + 1 < len(stamps) and stamps[i + 1][0] != name:
                blocks.append((stamps[i + 1][2] - start, count))
    counted = blocks[1:]
    if not counted:
        raise ValueError("need at least 2 blocks of a way: the first is left out")
    return sum(c for c, _ in counted) / sum(n for _, n in counted) * 1e3


def measure(
    tests: int,
    world_size: int,
    heavy: list[str],
    unpreloaded_tests: int,
    batches: int = 2,
    start: str = "spawn",
) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-library-") as tmp:
        work = Path(tmp)
        write_suite(work, heavy, world_size, batches, start)
        run = run_session(work, tests)
        pool, fresh, warm = (per_test_ms(run["stamps"], way) for way in WAYS)
        pool_start = run.get("pool_made_s", 0.0) * 1e3 + start_ms(run["stamps"], "pool")
        fresh_start = start_ms(run["stamps"], "fresh")
        cpu = {way: per_test_cpu_ms(run["stamps"], way) for way in WAYS}
        unpreloaded = None
        if unpreloaded_tests:
            off = ["-o", "rank_preload_test_imports=false", "-k", "fresh or zz_end"]
            before = run_session(work, unpreloaded_tests, *off)
            unpreloaded = per_test_ms(before["stamps"], "fresh")
    return {
        "tests": tests,
        "world_size": world_size,
        "batches": batches,
        "pool_start_method": start,
        "pool_ms": pool,
        "fresh_ms": fresh,
        "warm_ms": warm,
        "fresh_ratio": fresh / pool,
        "warm_ratio": warm / pool,
        # A suite of ``tests`` such tests run one way, its start included (the issue's own
        # table has both: a session's wall time, a test's): a pool is made, a forkserver
        # started, once per session, so the per-test ratio is where a long suite tends.
        "pool_start_ms": pool_start,
        "fresh_start_ms": fresh_start,
        "pool_suite_s": (pool_start + tests * pool) / 1e3,
        "fresh_suite_s": (fresh_start + tests * fresh) / 1e3,
        "fresh_suite_ratio": (fresh_start + tests * fresh) / (pool_start + tests * pool),
        "unpreloaded_ms": unpreloaded,
        "unpreloaded_ratio": None if unpreloaded is None else unpreloaded / pool,
        **{f"{way}_cpu_ms": cpu[way] for way in WAYS},
        "fresh_cpu_ratio": cpu["fresh"] / cpu["pool"] if cpu["pool"] else None,
        "warm_cpu_ratio": cpu["warm"] / cpu["pool"] if cpu["pool"] else None,
        "preloaded": (run["report"] or {}).get("preloaded", []),
        "load_average": os.getloadavg()[0],
    }


def show(figures: dict) -> None:
    pool = figures["pool_ms"]
    print(f"world {figures['world_size']}, {figures['tests']} tests a way, median per test:")
    print(f"  spawn pool made once per session   {pool:8.1f} ms")
    print(f"  fresh ranks, no preload setting    {figures['fresh_ms']:8.1f} ms  "
          f"{figures['fresh_ratio']:5.2f}x the pool")  # fmt: skip
    print(f"  warm worlds                        {figures['warm_ms']:8.1f} ms  "
          f"{figures['warm_ratio']:5.2f}x the pool")  # fmt: skip
    made, started = figures["pool_start_ms"] / 1e3, figures["fresh_start_ms"] / 1e3
    print(f"  a suite of {figures['tests']} such tests, its start included: pool "
          f"{figures['pool_suite_s']:.2f} s (made in {made:.2f} s), fresh "
          f"{figures['fresh_suite_s']:.2f} s (the forkserver started in {started:.2f} s): "
          f"{figures['fresh_suite_ratio']:.2f}x")  # fmt: skip
    cpu = ", ".join(f"{way} {figures[f'{way}_cpu_ms']:.1f} ms" for way in WAYS)
    print(f"  CPU a test, every process: {cpu}")
    if figures["unpreloaded_ms"] is not None:
        print(f"  fresh, test imports not preloaded  {figures['unpreloaded_ms']:8.1f} ms  "
              f"{figures['unpreloaded_ratio']:5.2f}x the pool")  # fmt: skip
    print(f"  preloaded by the forkserver: {', '.join(figures['preloaded']) or 'nothing'}")


INT_OPTIONS = (  # (option, default, help)
    ("--tests", 20, "tests per way (at least 6: two blocks of 5, the first left out)"),
    ("--world-size", 2, "ranks (and pool workers) per test"),
    ("--batches", 2, "batches of 32 each rank feeds a metric per test (torchmetrics': 2)"),
    ("--unpreloaded-tests", 5, "fresh tests without the test files' imports preloaded (0: none)"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tutorial_impl bench library",
        description="A library-shaped suite per test: a spawn pool made once per session, "
        "fresh ranks with no preload setting, warm worlds (one pytest session).",
    )
    for option, default, text in INT_OPTIONS:
        parser.add_argument(option, type=int, default=default, help=text)
    parser.add_argument("--heavy", default="torch._dynamo", help="what the library imports")
    parser.add_argument(
        "--pool-start-method",
        choices=("spawn", "forkserver", "fork", "harness"),
        default="spawn",
        help="how the pool's workers start (the suites the issue measured: spawn; harness: "
        "forked by the harness's forkserver); once per session, it changes no test's cost",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.tests < 6 or args.unpreloaded_tests in (1, 2) or args.unpreloaded_tests < 0:
        raise SystemExit("--tests must be at least 6, --unpreloaded-tests 0 or at least 3")
    if args.world_size < 1 or args.batches < 1:
        raise SystemExit("--world-size and --batches must be positive")
    figures = measure(
        args.tests,
        args.world_size,
        args.heavy.split(),
        args.unpreloaded_tests,
        args.batches,
        args.pool_start_method,
    )
    show(figures)
    write_json(figures, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
