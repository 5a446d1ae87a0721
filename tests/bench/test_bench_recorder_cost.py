"""The recorder benchmark's arithmetic (``bench/recorder_cost.py``): medians per condition and
the medians of each round's ratios, never a ratio of medians (a round is one stretch of the
machine's load, shared by its three worlds). No timing here: the figures are in
docs/faults.md.
"""

from __future__ import annotations

import pytest

from tutorial_impl.bench.recorder_cost import HARNESS_CONDITIONS, HARNESS_KEYS, summarize


def row(off: float, on: float, faulty: float, cpu: float = 1.0) -> dict[str, float]:
    return {
        "off_us": off,
        "on_us": on,
        "faulty_us": faulty,
        "off_cpu_us": off * cpu,
        "on_cpu_us": on * cpu,
        "faulty_cpu_us": faulty * cpu,
    }


def test_ratios_are_medians_of_each_rounds_ratio():
    # A loaded round doubles every figure: its ratios are the quiet rounds' own.
    rounds = [row(100, 110, 121), row(200, 220, 242, cpu=0.5), row(100, 100, 100)]
    out = summarize(rounds)
    assert out["off_us"] == 100 and out["on_us"] == 110 and out["faulty_us"] == 121
    assert out["recorder_ratio"] == pytest.approx(1.1)
    assert out["faulty_ratio"] == pytest.approx(1.1)
    assert out["off_cpu_us"] == 100 and out["recorder_cpu_ratio"] == pytest.approx(1.1)
    # One round where only "on" was slowed: the median of the ratios ignores it (1.0), where
    # the ratio of the medians would not (120 / 100).
    rounds = [row(100, 100, 100), row(100, 130, 130), row(120, 120, 120)]
    assert summarize(rounds)["recorder_ratio"] == pytest.approx(1.0)


def test_bench_harness_rows_add_detail_over_the_recorder_off():
    """``bench harness`` runs off, on and DETAIL: the recorder's ratio and DETAIL's, each
    against the recorder off, and no faulty group's (it was not run)."""
    rounds = [
        {"off_us": 100, "on_us": 105, "detail_us": 900, "off_cpu_us": 50, "on_cpu_us": 55,
         "detail_cpu_us": 600},
        {"off_us": 200, "on_us": 200, "detail_us": 1000, "off_cpu_us": 60, "on_cpu_us": 60,
         "detail_cpu_us": 300},
        {"off_us": 100, "on_us": 110, "detail_us": 700, "off_cpu_us": 50, "on_cpu_us": 50,
         "detail_cpu_us": 500},
    ]  # fmt: skip
    out = summarize(rounds, HARNESS_CONDITIONS)
    assert out["recorder_ratio"] == pytest.approx(1.05)  # of 1.05, 1.0, 1.1
    assert out["detail_ratio"] == pytest.approx(7.0)  # of 9, 5, 7
    assert out["detail_cpu_ratio"] == pytest.approx(10.0)  # of 12, 5, 10
    assert out["detail_us"] == 900 and "faulty_ratio" not in out
    assert {f"fr_{key}" for key in out} | {"fr_rounds"} == set(HARNESS_KEYS)
