"""Assertions across ranks: the same verdict on every rank, and a failure that names names.

The comparison itself is tested here in this process (it is plain code over values); the
collective part, in ranks: every rank must raise the same error even when only one rank
holds a different value, which is what keeps such a failure from hanging the test.
"""

from __future__ import annotations

import sys

import pytest
import torch

from tutorial_impl.testing import (
    RankFailed,
    assert_close_across_ranks,
    assert_equal_across_ranks,
    run_ranks,
)
from tutorial_impl.testing.assertions import _mismatch

NAN = float("nan")


@pytest.mark.parametrize(
    ("a", "b", "rtol", "atol", "why"),
    [
        (torch.ones(3), torch.ones(3), 0.0, 0.0, None),
        (torch.tensor([1.0, NAN]), torch.tensor([1.0, NAN]), 0.0, 0.0, None),  # NaN == NaN
        (torch.ones(3), torch.ones(3) + 1e-9, None, None, None),  # float32 defaults
        (torch.ones(3), torch.ones(3) + 1e-3, None, None, "3 of 3 elements differ"),
        (torch.ones(3), torch.tensor([1.0, 1.5, 1.0]), 0.0, 0.0, "greatest absolute "),
        (torch.zeros(2, 3), torch.tensor([[0, 0, 0], [0, 9.0, 0]]), 0.0, 0.0, "at index (1, 1)"),
        (torch.zeros(2, 3), torch.zeros(3, 2), 0.0, 0.0, "shape (2, 3) != (3, 2)"),
        (torch.zeros(2), torch.zeros(2, dtype=torch.float64), 0.0, 0.0, "dtype torch.float32"),
        (torch.tensor([1, 2]), torch.tensor([1, 3]), 1.0, 1.0, "1 of 2 elements differ"),  # ints
        (1, 1.0, 0.0, 0.0, "type int != float"),
        (0.1 + 0.2, 0.3, 0.0, 0.0, "1 of 1 elements differ"),
        (0.1 + 0.2, 0.3, 1e-9, 1e-12, None),
        ({"a": [1, 2.0]}, {"a": [1, 2.5]}, 0.0, 0.0, "['a'][1]: 1 of 1"),
        ({"a": 1}, {"b": 1}, 0.0, 0.0, "keys"),
        ([1, 2], [1, 2, 3], 0.0, 0.0, "length 2 != 3"),
        ("adam", "sgd", 0.0, 0.0, "not equal (==)"),
    ],
)
def test_what_counts_as_a_difference(a, b, rtol, atol, why):
    got = _mismatch(a, b, rtol, atol)
    if why is None:
        assert got is None
    else:
        assert got is not None and why in got


def test_comparing_imports_nothing_heavy():
    """torch.testing.assert_close (and torch.unravel_index) import DTensor and sympy on
    first use: seconds in every fresh rank. The helpers' comparison must not."""
    heavy = [m for m in ("sympy", "torch.distributed.tensor") if m not in sys.modules]
    _mismatch(torch.zeros(2, 2), torch.ones(2, 2), 0.0, 0.0)
    _mismatch({"x": [1.0]}, {"x": [2.0]}, None, None)
    assert [m for m in heavy if m in sys.modules] == []


def verdict_of_every_rank(rank: int, world_size: int, odd_rank: int, how: str) -> str:
    """Only ``odd_rank`` holds another value; every rank returns the error it raised."""
    value = torch.full((2,), 7.0 if rank == odd_rank else 1.0)
    try:
        if how == "equal":
            assert_equal_across_ranks(value, name="weights")
        else:
            assert_close_across_ranks(value, rtol=1e-3, atol=1e-3, name="weights")
    except AssertionError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("how", ["equal", "close"])
def test_every_rank_raises_the_same_error_naming_the_odd_rank(run_ranks, how):
    """Rank 1 differs; ranks 0, 2 and 3 hold the same value. All four raise (none is left
    waiting in a later collective), with one message naming rank 1 and both values."""
    verdicts = run_ranks(verdict_of_every_rank, 1, how, world_size=4)
    assert len(set(verdicts)) == 1, verdicts
    text = verdicts[0]
    assert text.startswith(f"weights is not {how}")
    assert "rank(s) 1 disagree with rank(s) 0, 2, 3" in text
    assert "rank(s) 0, 2, 3: tensor([1., 1.])" in text
    assert "rank(s) 1: tensor([7., 7.])" in text
    assert "2 of 2 elements differ; greatest absolute difference 6" in text


def needs_a_group(rank: int, world_size: int) -> None:
    assert_equal_across_ranks(rank)


def test_without_a_process_group_the_helper_says_so():
    with pytest.raises(RankFailed, match="needs a process group"):
        run_ranks(needs_a_group, world_size=1, backend=None, timeout=30)


def test_tolerances_come_in_pairs():
    with pytest.raises(ValueError, match="both rtol and atol"):
        assert_close_across_ranks(1.0, rtol=1e-3)
