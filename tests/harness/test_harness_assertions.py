"""Assertions across ranks: the same verdict on every rank, and a failure that names names.

The comparison itself is tested here in this process (it is plain code over values); the
collective part, in ranks: every rank must raise the same error even when only one rank
holds a different value, which is what keeps such a failure from hanging the test.
"""

from __future__ import annotations

import sys

import numpy as np
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
        # numpy arrays, like tensors: == between two of them is an array, not a verdict.
        (np.array([1, 2]), np.array([1, 2]), 0.0, 0.0, None),
        (np.array([1.0, NAN]), np.array([1.0, NAN]), 0.0, 0.0, None),  # NaN == NaN
        (np.float32(NAN), np.float32(NAN), 0.0, 0.0, None),  # a numpy scalar too
        (np.ones(3, np.float32), np.ones(3, np.float32) + 1e-6, None, None, None),  # defaults
        (np.ones(3, np.float32), np.ones(3, np.float32) + 1e-3, None, None, "3 of 3 elements"),
        (np.array([1, 2]), np.array([1, 3]), 1.0, 1.0, "1 of 2 elements differ"),  # ints
        (
            np.zeros((2, 3)),
            np.array([[0, 5.0, 0], [0, 9.0, 0]]),
            0.0,
            0.0,
            "2 of 6 elements differ, the first at index (0, 1); "
            "greatest absolute difference 9 at index (1, 1)",
        ),
        (np.zeros(2), np.zeros(3), 0.0, 0.0, "shape (2,) != (3,)"),
        (np.zeros(2), np.zeros(2, np.float32), 0.0, 0.0, "dtype float64 != float32"),
        (np.array(["adam", "sgd"]), np.array(["adam", "sgdm"]), 0.0, 0.0, "at index (1,)"),
        ({"w": [np.array([1, 2])]}, {"w": [np.array([1, 2])]}, 0.0, 0.0, None),
        ({"w": [np.array([1, 2])]}, {"w": [np.array([1, 3])]}, 0.0, 0.0, "['w'][0]: 1 of 2"),
        (np.array([1, 2]), torch.tensor([1, 2]), 0.0, 0.0, "type ndarray != Tensor"),
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


# Which ranks disagree is decided by majority, not by comparing with rank 0: a comparison
# with rank 0 alone would blame the three agreeing ranks whenever rank 0 is the odd one.
# Each case: a name and the value of every rank of a world of 4.
SPLITS = {
    "rank 0 is the odd one": [7, 1, 1, 1],
    "three-way split": [1, 1, 5, 9],
    # numpy arrays (here in a dict) split the same way, and equal ones agree, NaN and all.
    "numpy, rank 3 odd": [{"w": np.array([1.0, NAN, x])} for x in (2.0, 2.0, 2.0, 4.0)],
    "numpy, all equal": [[np.array([1.0, NAN])]] * 4,
}


def verdicts_of_splits(rank: int, world_size: int) -> dict[str, str]:
    """Every rank runs every case, so every rank must reach the same verdict in each."""
    verdicts = {}
    for case, values in SPLITS.items():
        try:
            assert_equal_across_ranks(values[rank], name=case)
            verdicts[case] = "no error"
        except AssertionError as exc:
            verdicts[case] = str(exc)
    return verdicts


def test_the_majority_decides_who_disagrees(run_ranks):
    verdicts = run_ranks(verdicts_of_splits, world_size=4)
    assert all(v == verdicts[0] for v in verdicts), "every rank must reach the same verdict"
    odd_zero = verdicts[0]["rank 0 is the odd one"].splitlines()
    assert odd_zero[0].endswith("rank(s) 0 disagree with rank(s) 1, 2, 3")
    assert "  rank(s) 1, 2, 3: 1" in odd_zero and "  rank(s) 0: 7" in odd_zero
    # Three values: the largest class (ranks 0, 1) is the majority, and each of the other two
    # values gets a line of its own (not lumped together because both differ from rank 0).
    three = verdicts[0]["three-way split"].splitlines()
    assert three[0].endswith("rank(s) 2, 3 disagree with rank(s) 0, 1")
    assert "  rank(s) 2: 5" in three and "  rank(s) 3: 9" in three
    arrays = verdicts[0]["numpy, rank 3 odd"].splitlines()
    assert arrays[0].endswith("rank(s) 3 disagree with rank(s) 0, 1, 2")
    assert arrays[-1] == (
        "      ['w']: 1 of 3 elements differ, the first at index (2,); "
        "greatest absolute difference 2 at index (2,)"
    )
    assert verdicts[0]["numpy, all equal"] == "no error"


# The caller's tolerances must be the ones applied: each case is (name, value on rank 0,
# value on the other ranks, check, whether it must pass). The differences sit on both sides
# of each tolerance, so ignoring rtol/atol (and falling back to the dtype's defaults, or to
# exact equality) turns at least one verdict around.
TOLERANCE_CASES = [
    # 1e-4 apart: not equal, not within 1e-6, but within 1e-3.
    ("tiny, equal", 1.0, 1.0001, ("equal", None, None), False),
    ("tiny, tight", 1.0, 1.0001, ("close", 1e-6, 0.0), False),
    ("tiny, loose", 1.0, 1.0001, ("close", 1e-3, 0.0), True),
    # 0.5 apart: far outside float32's defaults, inside a tolerance of 100%.
    ("large, default", 1.0, 1.5, ("close", None, None), False),
    ("large, loose", 1.0, 1.5, ("close", 1.0, 0.0), True),
    # float64, 1e-9 apart: inside float64's default rtol (1e-7), outside a tighter one.
    ("float64, default", 1.0, 1.0 + 1e-9, ("close", None, None), True),
    ("float64, tight", 1.0, 1.0 + 1e-9, ("close", 1e-12, 0.0), False),
]


def verdicts_of_tolerances(rank: int, world_size: int) -> dict[str, bool]:
    passed = {}
    for name, on_zero, on_others, (how, rtol, atol), _ in TOLERANCE_CASES:
        dtype = torch.float64 if name.startswith("float64") else torch.float32
        value = torch.tensor([on_zero if rank == 0 else on_others], dtype=dtype)
        try:
            if how == "equal":
                assert_equal_across_ranks(value, name=name)
            else:
                assert_close_across_ranks(value, rtol=rtol, atol=atol, name=name)
            passed[name] = True
        except AssertionError:
            passed[name] = False
    return passed


def test_the_callers_tolerances_decide(run_ranks):
    """Through real ranks on both sides of each tolerance (a unit test of the comparison
    alone would not see a rank-side call that drops rtol/atol)."""
    expected = {name: ok for name, *_, ok in TOLERANCE_CASES}
    assert run_ranks(verdicts_of_tolerances) == [expected, expected]


def needs_a_group(rank: int, world_size: int) -> None:
    assert_equal_across_ranks(rank)


def test_without_a_process_group_the_helper_says_so():
    with pytest.raises(RankFailed, match="needs a process group"):
        run_ranks(needs_a_group, world_size=1, backend=None, timeout=30)


def test_tolerances_come_in_pairs():
    with pytest.raises(ValueError, match="both rtol and atol"):
        assert_close_across_ranks(1.0, rtol=1e-3)
