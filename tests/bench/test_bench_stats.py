"""The DDP + RPC benchmark's arithmetic: percentiles, throughput, the table (``bench/stats.py``).

What the benchmark claims (PyTorch's ``benchmark_ddp_rpc.py``): for each trainer and for all of
them, the 50th/75th/90th/95th percentile of the epoch times, each next to a throughput in a
column labelled ``epoch/sec``, which is really the last epoch's samples over that percentile.

What this module proves, in reading order: the percentiles equal numpy's (an independent
reference) on awkward inputs; the throughput counts every timed epoch, on inputs where the
original's last-epoch figure would differ; the "All" row pools the epochs and is the job's
throughput; the table labels its column ``samples/s``; the plot draws one box per trainer.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from tutorial_impl.bench import report, stats

SAMPLES = [
    [0.5],  # one epoch: every percentile is that epoch
    [0.3, 0.1],  # unsorted, even length
    [0.377, 0.384, 0.390, 0.396, 0.376, 0.401, 0.380],  # odd length, seed-figure-like
    [1.0, 1.0, 2.0, 2.0, 10.0],  # ties and an outlier
    list(np.random.default_rng(0).exponential(0.4, size=100)),  # 100 epochs, skewed
]


@pytest.mark.parametrize("values", SAMPLES, ids=lambda v: f"n{len(v)}")
@pytest.mark.parametrize("q", [0, *stats.PERCENTILES, 100])
def test_percentile_matches_numpy_linear(values, q):
    # numpy's default method, "linear", interpolates between the two closest ranks.
    expected = float(np.percentile(values, q, method="linear"))
    assert stats.percentile(values, q) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_percentile_refuses_what_has_no_answer():
    with pytest.raises(ValueError, match="empty"):
        stats.percentile([], 50)
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        stats.percentile([1.0], 101)


# Two trainers whose last epoch is unlike the others: a last-epoch throughput would be off.
PER_TRAINER = {
    "Trainer0": ([0.40, 0.42, 0.41, 0.90], [120, 118, 125, 40]),
    "Trainer1": ([0.39, 0.45, 0.43, 0.44], [119, 130, 121, 60]),
}


def test_throughput_counts_every_timed_epoch():
    rows = {row.name: row for row in stats.summarize(PER_TRAINER)}
    for name, (seconds, samples) in PER_TRAINER.items():
        expected = np.sum(samples) / np.sum(seconds)
        assert rows[name].samples_per_s == pytest.approx(expected)
        # The original's figure (last epoch's samples over the p50 epoch time) differs here,
        # so this check would catch that formula.
        last_epoch_figure = samples[-1] / np.percentile(seconds, 50)
        assert not math.isclose(rows[name].samples_per_s, last_epoch_figure, rel_tol=0.05)
        for q in stats.PERCENTILES:
            assert rows[name].percentiles()[f"p{q}"] == pytest.approx(np.percentile(seconds, q))


def test_all_row_pools_epochs_and_sums_samples():
    rows = stats.summarize(PER_TRAINER)
    assert [row.name for row in rows] == ["Trainer0", "Trainer1", "All"]
    everything = np.concatenate([s for s, _ in PER_TRAINER.values()])
    all_row = rows[-1]
    for q in stats.PERCENTILES:
        assert all_row.percentiles()[f"p{q}"] == pytest.approx(np.percentile(everything, q))
    # The job's throughput: every sample of every trainer, over the slowest trainer's time.
    total = sum(np.sum(n) for _, n in PER_TRAINER.values())
    slowest = max(np.sum(s) for s, _ in PER_TRAINER.values())
    assert all_row.samples == total
    assert all_row.samples_per_s == pytest.approx(total / slowest)


def test_summarize_refuses_mismatched_measurements():
    with pytest.raises(ValueError, match="Trainer0"):
        stats.summarize({"Trainer0": ([0.1, 0.2], [10])})
    with pytest.raises(ValueError, match="no trainer"):
        stats.summarize({})


def test_table_has_a_row_per_trainer_and_a_labelled_throughput():
    table = stats.format_table(stats.summarize(PER_TRAINER))
    lines = table.splitlines()
    assert "samples/s" in lines[0] and "epoch/sec" not in table
    assert lines[1].strip().startswith("Trainer0:") and lines[3].strip().startswith("All:")
    # The p50 of Trainer1, as printed, is numpy's to three decimals.
    assert f"{np.percentile(PER_TRAINER['Trainer1'][0], 50):7.3f}s" in lines[2]


# With the pictures (``tests/test_pictures.py``), on one xdist worker: matplotlib's import,
# about a second of CPU, is then paid once, not once in each worker that draws.
@pytest.mark.xdist_group("matplotlib")
def test_plot_draws_one_box_per_trainer(tmp_path):
    pytest.importorskip("matplotlib")  # optional: the benchmark runs without it
    path = tmp_path / "epochs.png"
    report.plot_epoch_times({n: s for n, (s, _) in PER_TRAINER.items()}, str(path), "t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
