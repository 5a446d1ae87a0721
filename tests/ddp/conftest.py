"""The DDP course's warnings: a UserWarning raised while a lesson runs fails its test.

torch warns when code does something it considers a mistake (FSDP2's "returned a view
tensor", say), and a lesson must not teach a mistake. So every test in this folder runs
with ``error::UserWarning``, in the test and in its ranks (the harness hands a test's
filters to its ranks), except for the warnings named in ``EXPLAINED``: torch's own, raised
though the lesson does what it means, each with the reason. A new warning fails the test
that raised it, naming the rank; explain it here (and in the lesson) or fix the lesson.
"""

from __future__ import annotations

from pathlib import Path

import pytest

# message prefix (a regular expression, matched at the start) -> why the course allows it
EXPLAINED = {
    r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is "
    r"to load in a single process": (
        "lesson D11 loads a checkpoint in a process with no process group on purpose "
        "(dcp.load(..., no_dist=True)); torch 2.13 warns even when no_dist=True says so"
    ),
    r"Full backward hook is firing when gradients are computed with respect to module "
    r"outputs since no inputs require gradients": (
        "lessons D16, D17 and D19 count collectives with CommDebugMode, which tracks modules with "
        "backward hooks; their inputs (token ids, a batch) need no gradient"
    ),
}


def course_filters(explained: dict[str, str]) -> list[str]:
    """``filterwarnings`` arguments: UserWarnings are errors, the explained ones ignored
    (a later argument takes precedence over an earlier one)."""
    return ["error::UserWarning", *(f"ignore:{message}:UserWarning" for message in explained)]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if item.path.is_relative_to(here):
            item.add_marker(pytest.mark.filterwarnings(*course_filters(EXPLAINED)))
