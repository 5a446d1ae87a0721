"""The porting guide's examples run as written: docs/porting.md, every "after" in one project.

A guide whose examples do not run sends a porting team back to the reference. So every code
block of ``docs/porting.md`` that calls ``run_ranks`` (the ported tests, and the shape every
port takes) becomes a test file of a stranger's project (no conftest, only the installed
plugin), and one pytest run of that project must pass them all: each block's tests, counted.
The "before" blocks (pools, ``MultiProcessTestCase``, DeepSpeed, ``torchrun -m pytest``) need
other harnesses or a launcher, so they are only read.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch  # noqa: F401 - the examples import torch; an in-process run must not import it again

pytest_plugins = ["pytester"]

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "porting.md"
BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def harness_examples() -> list[str]:
    return [code for code in BLOCK.findall(GUIDE.read_text()) if "run_ranks(" in code]


def test_every_ported_example_in_the_guide_passes(pytester: pytest.Pytester) -> None:
    examples = harness_examples()
    assert len(examples) >= 5, "the guide lost its examples"  # shape + four ports
    for i, code in enumerate(examples):
        pytester.makepyfile(**{f"test_port_{i}": code})
    tests = sum(len(re.findall(r"^\s*def test\w*\(", code, re.MULTILINE)) for code in examples)
    # In this process: the ranks come from the forkserver this session has already.
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:xdist", "-q")
    result.assert_outcomes(passed=tests)
