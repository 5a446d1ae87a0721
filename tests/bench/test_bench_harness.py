"""The harness benchmark (``tutorial_impl/bench/harness.py``) on a tiny run.

The benchmark claims the harness starts a test's ranks tens of times faster than
``mp.spawn``, measured in the same run. No speed is asserted here (timings belong in the
benchmark's output, not in a test that a busy machine could fail); the figures only have to
be real, positive and consistent, and the JSON has the promised shape and arithmetic.

Read in this order: a tiny run and its JSON, then nonsense arguments.
"""

from __future__ import annotations

import json

import pytest

from tutorial_impl.bench import first_test, harness, recorder_cost, train_step


@pytest.mark.slow
def test_bench_writes_medians_and_their_ratio(tmp_path, capsys):
    """World size 1 keeps it cheap: the spawn side still starts a fresh interpreter."""
    path = tmp_path / "harness.json"
    argv = ["--repeats", "2", "--spawn-repeats", "1", "--world-sizes", "1", "--json", str(path)]
    # No torchrun job here (two more interpreters, seconds of the suite's CPU): the figure is
    # None then, and the benchmark's own runs measure it (docs/benchmarks.md).
    argv += ["--collectives", "1", "--torchrun-tests", "0"]  # 1: the least accepted
    # One round of the recorder's three worlds, one SIGKILL: the rows, not their precision.
    argv += ["--recorder-rounds", "1", "--recorder-calls", "5", "--kill-runs", "1"]
    # No fresh sessions (each imports torch twice): the row's arithmetic is checked below.
    argv += ["--first-test-runs", "0", "--train-step-tests", "0"]
    assert harness.main(argv) == 0
    figures = json.loads(path.read_text())
    assert list(figures) == ["1"]  # keyed by world size, as a string (JSON keys are)
    row = figures["1"]
    assert set(row) == {
        *("harness_ms", "spawn_ms", "ratio"),
        *("collective_us", "checked_collective_us", "check_ratio"),  # the price of checking
        *("warm_ms", "warm_speedup", "replace_ms", "load_average"),  # warm worlds
        *("audit_ms", "audit_cost", "torchrun_ms"),  # --warm-audit's price; under torchrun
        *recorder_cost.HARNESS_KEYS,  # the flight recorder off, on, and DETAIL
        *("kill_verdict_ms", "kill_verdict_runs_ms", "kill_verdict_running"),
        *first_test.HARNESS_KEYS,  # a session's first test: not run, None
        *train_step.KEYS,  # a training step's test: not run, None
    }
    assert {row[key] for key in (*first_test.HARNESS_KEYS, *train_step.KEYS)} == {None}
    assert row["harness_ms"] > 0 and row["spawn_ms"] > 0
    # A spawn starts a fresh interpreter per rank (a second and more here), a harness call
    # forks its ranks (tens of ms): a spawn that measured nothing would not be dearer.
    assert row["spawn_ms"] > row["harness_ms"]
    assert row["ratio"] == pytest.approx(row["spawn_ms"] / row["harness_ms"])
    assert row["collective_us"] > 0 and row["checked_collective_us"] > 0
    assert row["check_ratio"] == pytest.approx(row["checked_collective_us"] / row["collective_us"])
    # A warm world's test, against a fresh one of the same run; a poisoned world's price.
    assert row["warm_ms"] > 0 and row["replace_ms"] > 0 and row["load_average"] >= 0
    assert row["warm_speedup"] == pytest.approx(row["harness_ms"] / row["warm_ms"])
    assert row["audit_cost"] == pytest.approx(row["audit_ms"] / row["warm_ms"])
    # Under --warm-audit each call runs warm and then on fresh ranks: dearer than warm alone.
    assert row["audit_ms"] > row["warm_ms"]
    assert row["torchrun_ms"] is None
    # Each ratio is its round's (one round: the median of one), on/off and DETAIL/off.
    [one] = row["fr_rounds"]
    assert row["fr_recorder_ratio"] == pytest.approx(one["on_us"] / one["off_us"])
    assert row["fr_detail_cpu_ratio"] == pytest.approx(one["detail_cpu_us"] / one["off_cpu_us"])
    assert row["fr_detail_us"] == one["detail_us"] > 0
    # The kill: one run, its time from the SIGKILL (written by the rank) to the verdict, in a
    # world of one: no peer was left running.
    assert row["kill_verdict_runs_ms"] == [row["kill_verdict_ms"]]
    assert 0 < row["kill_verdict_ms"] < 60_000 and row["kill_verdict_running"] == [0]
    printed = capsys.readouterr().out
    assert f"harness {row['harness_ms']:7.1f} ms" in printed  # the same figures, printed
    assert f"ratio {row['ratio']:6.1f}x" in printed
    assert f"check {row['check_ratio']:5.1f}x" in printed
    assert f"warm    {row['warm_ms']:7.1f} ms" in printed
    assert f"on/off {row['fr_recorder_ratio']:5.3f}x" in printed
    assert f"DETAIL/off {row['fr_detail_ratio']:5.1f}x" in printed
    assert f"SIGKILL to verdict {row['kill_verdict_ms']:6.1f} ms" in printed
    assert "world 1: first test of a session: not run" in printed
    assert "world 1: training step: not run" in printed


def test_the_first_test_row_is_the_median_of_each_way_and_their_difference():
    times = {"early": [900.0, 700.0, 800.0], "late": [4000.0, 2000.0, 3000.0]}
    row = first_test.figures(times)
    assert row == {
        "first_test_ms": 800.0,
        "first_test_late_ms": 3000.0,
        "first_test_saved_ms": 2200.0,
        "first_test_runs_ms": times,
    }
    assert set(row) == set(first_test.HARNESS_KEYS)
    line = first_test.harness_line(2, row)
    assert "first test of a session   0.80 s" in line and "by the test   3.00 s" in line
    assert "saved  2.20 s" in line and "medians of 3 pairs" in line


def test_the_training_step_row_is_medians_and_ratios_of_each_way():
    fresh = {"test_train[step]": [300.0, 100.0, 200.0], "test_train[plain]": [50.0, 60.0, 40.0]}
    warm = {"test_train[step]": [30.0, 20.0, 40.0], "test_train[plain]": [5.0, 15.0, 10.0]}
    row = train_step.figures(fresh, warm, [3000.0, 5000.0], [8000.0], "warm worlds: 1 started")
    assert row == {
        "train_step_ms": 200.0,
        "train_plain_ms": 50.0,
        "train_step_warm_ms": 30.0,
        "train_plain_warm_ms": 10.0,
        "train_spawn_ms": 4000.0,
        "train_mptc_ms": 8000.0,
        "train_step_vs_plain": 4.0,
        "train_warm_vs_work": pytest.approx(30.0 / 150.0),  # warm against fresh minus start
        "train_spawn_ratio": 20.0,
        "train_mptc_ratio": 40.0,
        "train_warm_summary": "warm worlds: 1 started",
    }
    assert set(row) == set(train_step.KEYS)
    line = train_step.harness_line(2, row)
    assert "DDP+AdamW step test  200.0 ms fresh ( 4.0x the plain test's  50.0)" in line
    assert "30.0 ms warm ( 0.2x fresh minus start)" in line
    assert "spawn    4000 ms ( 20.0x), MultiProcessTestCase    8000 ms ( 40.0x)" in line
    # the JUnit names, without their index: pytest's of repeated parameters, and the methods'
    assert train_step.kind("test_train[step12]") == "test_train[step]"
    assert train_step.kind("test_train[plain]") == "test_train[plain]"
    assert train_step.kind("test_step_3") == "test_step" != train_step.kind("test_0_first")


def test_a_torchrun_jobs_figure_is_the_time_from_each_tests_start_to_the_next():
    assert harness.gaps_ms([10.0, 10.25, 11.0]) == pytest.approx([250.0, 750.0])
    assert harness.gaps_ms([10.0]) == []  # one test: no gap to measure


def test_bench_refuses_nonsense_arguments(capsys):
    with pytest.raises(SystemExit, match="at least 1"):
        harness.main(["--repeats", "0"])
    with pytest.raises(SystemExit, match="--collectives"):
        harness.main(["--collectives", "0"])
    with pytest.raises(SystemExit, match="--torchrun-tests"):
        harness.main(["--torchrun-tests", "1"])
    for option, value in (("--recorder-rounds", "-1"), ("--recorder-calls", "0")):
        with pytest.raises(SystemExit, match="--recorder-calls 1"):
            harness.main([option, value])
    with pytest.raises(SystemExit, match="--kill-runs"):
        harness.main(["--kill-runs", "-1"])
    # 0 rounds, 0 runs and 2 torchrun tests are allowed: the next check (before any run) speaks
    zeros = ["--recorder-rounds", "0", "--kill-runs", "0", "--world-sizes", "0"]
    for torchrun_tests in ("0", "2"):
        with pytest.raises(SystemExit, match="--world-sizes must be positive"):
            harness.main([*zeros, "--torchrun-tests", torchrun_tests])
    with pytest.raises(SystemExit):  # argparse's exit, naming the option, before any run
        harness.build_parser().parse_args(["--first-test-runs", "-1"])
    assert "--first-test-runs: must be 0 (none) or more, not -1" in capsys.readouterr().err
    assert harness.build_parser().parse_args([]).first_test_runs == 3
    with pytest.raises(SystemExit):
        harness.build_parser().parse_args(["--train-step-tests", "-1"])
    assert "--train-step-tests: must be 0 (none) or more, not -1" in capsys.readouterr().err
    assert harness.build_parser().parse_args(["--train-step-tests", "0"]).train_step_tests == 0
    assert harness.build_parser().parse_args([]).train_step_tests == 6
