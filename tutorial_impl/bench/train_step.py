"""A training step as a user's test: DDP over two Linears and AdamW, two steps, with no setting.

The commonest distributed test a user writes builds ``DistributedDataParallel``, takes an
optimizer step and compares the ranks. Its first use of an optimizer or of DDP makes torch
import ``torch._dynamo`` (some 800 modules, 1.3-1.9 s of CPU), which a rank pays for itself
unless its forkserver holds it already (``testing/forkserver/importscan.py``: ``LAZY``). So the
row measures that test as a stranger meets it: a throwaway project of one test file, no ini, no
conftest, only the installed package, run in a fresh ``pytest`` (times from its JUnit XML):

* **fresh**: every test on new ranks, the step test and a plain one (one all_reduce) in turn,
  ``tests`` of each after a first test that waits for the forkserver (not counted);
* **warm**: the same session under ``--warm-worlds``;
* **spawn**: ``torch.multiprocessing.spawn`` running the same step in fresh interpreters, per
  test (``spawn_repeats`` of them);
* **MultiProcessTestCase**: torch's own base class for distributed tests, the same step as
  ``spawn_repeats`` test methods, each spawning its ranks (and their import of the test module).

``bench harness`` runs it (``--train-step-tests`` of each kind per world size; 0: none). JSON
keys, medians in milliseconds: ``train_step_ms`` and ``train_plain_ms`` (fresh),
``train_step_warm_ms`` and ``train_plain_warm_ms``, ``train_spawn_ms``, ``train_mptc_ms``;
ratios: ``train_step_vs_plain`` (fresh step / fresh plain: goal within 3),
``train_warm_vs_work`` (warm step / (fresh step - fresh plain), the step's work without the
world's start: goal within 2), ``train_spawn_ratio`` and ``train_mptc_ratio`` (spawn's and
MultiProcessTestCase's step / the harness's fresh step); ``train_warm_summary``, the session's
warm-world line; None for each with no tests.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tutorial_impl.bench.harness import time_spawn

STEP = """
def train_step(rank, world_size):
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.ones(4, 8) * (rank + 1)).sum().backward()
        optimizer.step()
    return [round(p.detach().sum().item(), 5) for p in model.parameters()]
"""
HEADER = """
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
"""
TEST_FILE = (
    HEADER
    + STEP
    + """

def plain(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def test_0_first(run_ranks):  # waits for the forkserver: not counted
    assert run_ranks(plain, world_size={world_size}) == [{total}] * {world_size}


@pytest.mark.parametrize("kind", [k for _ in range({tests}) for k in ("step", "plain")])
def test_train(run_ranks, kind):
    if kind == "plain":
        assert run_ranks(plain, world_size={world_size}) == [{total}] * {world_size}
    else:
        first, *others = run_ranks(train_step, world_size={world_size})
        assert all(other == first for other in others)  # DDP kept the ranks in step
"""
)
MPTC_FILE = (
    HEADER
    + """
from torch.testing._internal.common_distributed import MultiProcessTestCase
"""
    + STEP
    + """

class TrainStep(MultiProcessTestCase):
    world_size = {world_size}

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def _step(self):
        store = dist.FileStore(self.file_name, self.world_size)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size)
        train_step(self.rank, self.world_size)
        dist.destroy_process_group()


for i in range({tests}):
    setattr(TrainStep, f"test_step_{{i}}", TrainStep._step)
"""
)
TIMEOUT = 900.0  # seconds for one session: a loaded machine imports torch slowly
KEYS = (
    "train_step_ms", "train_plain_ms", "train_step_warm_ms", "train_plain_warm_ms",
    "train_spawn_ms", "train_mptc_ms", "train_step_vs_plain", "train_warm_vs_work",
    "train_spawn_ratio", "train_mptc_ratio", "train_warm_summary",
)  # fmt: skip
HELP = "DDP + AdamW step tests (and as many plain ones) per session, fresh and warm (0: none)"


def session(work: Path, file: str, *options: str) -> tuple[dict[str, list[float]], str]:
    """Run ``file`` in a fresh pytest in ``work``: each test's JUnit milliseconds by its
    name without the parameter's index, and the session's output."""
    xml = work / "junit.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", file]
    command += ["-o", "junit_family=xunit2", f"--junitxml={xml}", *options]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    done = subprocess.run(command, cwd=work, env=env, capture_output=True, timeout=TIMEOUT)
    output = done.stdout.decode(errors="replace")
    if done.returncode != 0:
        raise RuntimeError(f"the training-step session failed:\n{output[-3000:]}")
    times: dict[str, list[float]] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        times.setdefault(kind(case.get("name", "")), []).append(float(case.get("time")) * 1e3)
    return times, output


def kind(name: str) -> str:
    """A test's name without its index: ``test_train[step3]`` (pytest numbers repeated
    parameters), ``test_step_3`` (the MultiProcessTestCase methods) are ``test_train[step]``
    and ``test_step``."""
    return re.sub(r"\d+\]$", "]", re.sub(r"_\d+$", "", name))


def _spawn_rank(rank: int, world_size: int, host: str, port: int, step: str) -> None:
    """A fresh interpreter (``harness.time_spawn``): join the parent's store and take the
    same step."""
    torch.set_num_threads(1)  # as the harness's ranks
    store = dist.TCPStore(host, port, world_size, is_master=False,
                          timeout=timedelta(seconds=120))  # fmt: skip
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    names: dict[str, Any] = {}
    exec(HEADER + step, names)  # the test file's own step, nothing of the harness's
    names["train_step"](rank, world_size)
    dist.destroy_process_group()


def measure(world_size: int, count: int, spawn_repeats: int) -> dict[str, Any]:
    """The row's figures for ``world_size``: ``count`` tests of each kind a session."""
    if not count:
        return dict.fromkeys(KEYS)
    total = world_size * (world_size + 1) / 2
    with tempfile.TemporaryDirectory(prefix="bench-train-step-") as work:
        Path(work, "test_train.py").write_text(
            TEST_FILE.format(world_size=world_size, total=total, tests=count)
        )
        fresh, _ = session(Path(work), "test_train.py")
        warm, output = session(Path(work), "test_train.py", "--warm-worlds")
        Path(work, "test_mptc.py").write_text(
            MPTC_FILE.format(world_size=world_size, tests=spawn_repeats)
        )
        mptc, _ = session(Path(work), "test_mptc.py")
    summary = re.search(r"warm worlds: [^\n]*", output)
    return figures(
        fresh, warm, time_spawn(world_size, spawn_repeats, _spawn_rank, (STEP,)),
        mptc.get("test_step", []),
        summary.group(0) if summary else None,
    )  # fmt: skip


def figures(
    fresh: dict[str, list[float]],
    warm: dict[str, list[float]],
    spawn: list[float],
    mptc: list[float],
    summary: str | None,
) -> dict[str, Any]:
    """The row from each test's milliseconds (``session``'s names)."""
    med = statistics.median
    step, plain = med(fresh["test_train[step]"]), med(fresh["test_train[plain]"])
    step_warm = med(warm["test_train[step]"])
    spawn_ms = med(spawn) if spawn else None
    mptc_ms = med(mptc) if mptc else None
    return {
        "train_step_ms": step,
        "train_plain_ms": plain,
        "train_step_warm_ms": step_warm,
        "train_plain_warm_ms": med(warm["test_train[plain]"]),
        "train_spawn_ms": spawn_ms,
        "train_mptc_ms": mptc_ms,
        "train_step_vs_plain": step / plain,
        "train_warm_vs_work": step_warm / max(step - plain, 1e-3),
        "train_spawn_ratio": spawn_ms / step if spawn_ms else None,
        "train_mptc_ratio": mptc_ms / step if mptc_ms else None,
        "train_warm_summary": summary,
    }


def harness_line(world_size: int, fig: dict[str, Any]) -> str:
    if fig["train_step_ms"] is None:
        return f"world {world_size}: training step: not run"
    spawn = (
        f"spawn {fig['train_spawn_ms']:7.0f} ms ({fig['train_spawn_ratio']:5.1f}x), "
        f"MultiProcessTestCase {fig['train_mptc_ms']:7.0f} ms ({fig['train_mptc_ratio']:5.1f}x)"
        if fig["train_spawn_ms"]
        else "spawn: not run"
    )
    return (
        f"world {world_size}: DDP+AdamW step test {fig['train_step_ms']:6.1f} ms fresh "
        f"({fig['train_step_vs_plain']:4.1f}x the plain test's {fig['train_plain_ms']:5.1f}), "
        f"{fig['train_step_warm_ms']:6.1f} ms warm ({fig['train_warm_vs_work']:4.1f}x fresh "
        f"minus start); {spawn}"
    )
