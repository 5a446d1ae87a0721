"""The porting guide's examples run as written: docs/porting.md, every "after", three ways.

A guide whose examples do not run sends a porting team back to the reference. So every code
block of ``docs/porting.md`` that calls ``run_ranks`` (the ported tests, and the shape every
port takes) becomes a test file of a stranger's project (no conftest, only the installed
plugin), and that project must pass them all, each block's tests counted: forked, with
``--warm-worlds`` (one pytest run each, in this process), and under torchrun (workers started
as torchrun starts them, ``torchrun_worker``): one job of 2 workers for the files of 2 ranks or
none, one of 4 for ``MultiProcessTestCase``'s port, whose world is 4, as the guide says to run
it. A GPU test skips where there is no GPU, the only skip allowed. The "before" blocks (pools,
``MultiProcessTestCase``, DeepSpeed, ``torchrun -m pytest``) need other harnesses or a
launcher, so they are only read.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from torchrun_worker import job_environment, pytest_as_a_torchrun_worker

from tutorial_impl.testing.rendezvous import agents_store

pytest_plugins = ["pytester"]

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "porting.md"
BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)
JOB_DEADLINE = 150.0
ARGS = ["-p", "no:cacheprovider", "-p", "no:randomly", "-q"]


def harness_examples() -> list[str]:
    return [code for code in BLOCK.findall(GUIDE.read_text()) if "run_ranks(" in code]


def size_of(code: str) -> int:
    """The job size a file's tests need: its world_size marker's, else 2."""
    sizes = {int(n) for n in re.findall(r"world_size\((\d+)\)", code)}
    assert len(sizes) <= 1, "one world size per example, so that one job runs it"
    return sizes.pop() if sizes else 2


def counts(code: str) -> tuple[int, int]:
    """(tests, of which skipped here): a dist_gpu test skips without enough GPUs."""
    marks = re.findall(r"((?:^@pytest\.mark\.\w+\(.*\)\n)*)^\s*def test\w*\(", code, re.MULTILINE)
    needs = [re.search(r"dist_gpu\((\d*)\)", m) for m in marks]
    gpus = torch.cuda.device_count()
    return len(marks), sum(1 for n in needs if n and int(n[1] or 1) > gpus)


@pytest.mark.slow
def test_every_ported_example_in_the_guide_passes_forked_warm_and_under_torchrun(
    pytester: pytest.Pytester, run_ranks
) -> None:
    # This session's rank forkserver starts now, with this session's plan: started by the
    # first run below, it would take that run's plan, and this session's later tests would get
    # its ranks (flags frozen by torch's common_utils). ``porting_preload`` (what the
    # MultiProcessTestCase port imports, it says why) is imported here, not at the top: a rank
    # imports its function's module, and this module's other ranks (the shared store's) would
    # each import torch's TestCase module with it (about 0.25 s of CPU a rank).
    import porting_preload

    assert run_ranks(porting_preload.has_the_preload, world_size=1, backend=None) == [True]
    examples = harness_examples()
    assert len(examples) >= 5, "the guide lost its examples"  # shape + four ports
    assert any(size_of(code) == 4 for code in examples), "MultiProcessTestCase's port is 4"
    files = {f"test_port_{i}": code for i, code in enumerate(examples)}
    pytester.makepyfile(**files)
    tests = sum(counts(code)[0] for code in examples)
    skipped = sum(counts(code)[1] for code in examples)
    # Forked and warm, in this process: the ranks come from this session's forkserver.
    for extra in ([], ["--warm-worlds"]):
        result = pytester.runpytest_inprocess(*ARGS, "-p", "no:xdist", *extra)
        result.assert_outcomes(passed=tests - skipped, skipped=skipped)
    # Warm, every test ran in a warm world, and no port left its world unfit for the next test.
    [line] = [line for line in result.stdout.lines if line.startswith("warm worlds:")]
    started, reuses, retired = map(int, re.findall(r"(\d+) (?:started|reuses|retired)", line))
    assert (started + reuses, retired) == (tests - skipped, 0), line
    # Under torchrun: one job per world size, each running the files of its size.
    for size in sorted({size_of(code) for code in examples}):
        names = [f"{name}.py" for name, code in files.items() if size_of(code) == size]
        ran = [counts(code) for code in examples if size_of(code) == size]
        store = agents_store(JOB_DEADLINE)
        workers = run_ranks(
            pytest_as_a_torchrun_worker,
            job_environment(store, size),
            str(pytester.path),
            [*ARGS, *names],
            world_size=size,
            backend=None,
            may_exit=set(range(size)),
            timeout=JOB_DEADLINE,
        )
        report = workers.outputs[0]
        expected = sum(t - s for t, s in ran)
        assert f"{expected} passed" in report, report
        assert "failed" not in report and "error" not in report, report
        assert [w.exitcode for w in workers] == [0] * size, workers.outputs


def two_shared_stores(rank: int, world_size: int) -> list[bool]:
    import torch.distributed as dist

    from tutorial_impl.testing import shared_store

    first, second = shared_store(), shared_store()
    first.set(f"rank-{rank}", "here")
    dist.barrier()
    seen = [first.check([f"rank-{r}"]) for r in range(world_size)]  # every rank's key
    return [*seen, not second.check([f"rank-{rank}"])]  # the second store is another, empty


def stores_after_an_uneven_test(rank: int, world_size: int) -> list[bool]:
    """Under torchrun one session serves every test: a test whose ranks asked for stores
    unevenly (it then failed) must not shift the next test's stores."""
    import torch.distributed as dist

    from tutorial_impl.testing import shared_store

    os.environ["PYTEST_CURRENT_TEST"] = "test_x.py::test_uneven (call)"
    for _ in range(1 + (rank == 0)):
        shared_store()
    os.environ["PYTEST_CURRENT_TEST"] = "test_x.py::test_next (call)"
    store = shared_store()
    store.set(f"rank-{rank}", "here")
    dist.barrier()
    return [store.check([f"rank-{r}"]) for r in range(world_size)]


def no_group(rank: int, world_size: int) -> None:
    from tutorial_impl.testing import shared_store

    shared_store()


def test_shared_store_is_one_store_per_call_and_ask_on_every_rank(run_ranks) -> None:
    """``shared_store`` (the port of ``self.file_name``): what one rank sets, every rank of the
    call sees; a second store of the same call is another; without the harness's group, the
    reason, before any group is waited for."""
    assert run_ranks(two_shared_stores) == [[True, True, True]] * 2
    assert run_ranks(stores_after_an_uneven_test) == [[True, True]] * 2
    with pytest.raises(Exception, match=r"shared_store\(\) shares the store of the harness's"):
        run_ranks(no_group, backend=None)
