"""The first tutorial's warnings: a UserWarning raised while a lesson runs fails its test.

The same rule as the DDP course's (``tests/ddp/conftest.py``, which says why): every test in
this folder runs with ``error::UserWarning``, in the test and in its ranks, except for the
warnings ``EXPLAINED`` names, each with the reason. These lessons raise none today.
"""

from __future__ import annotations

from pathlib import Path

import pytest

# message prefix (a regular expression, matched at the start) -> why the course allows it
EXPLAINED: dict[str, str] = {}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    filters = ["error::UserWarning", *(f"ignore:{m}:UserWarning" for m in EXPLAINED)]
    for item in items:
        if item.path.is_relative_to(here):
            item.add_marker(pytest.mark.filterwarnings(*filters))
