"""The ring benchmark (``tutorial_impl/bench/ring.py``): its arithmetic, and a tiny real run.

The benchmark claims to measure the tutorial ring, the bandwidth-optimal ring and gloo's own
all_reduce side by side, and to report bandwidths and ratios (with the ratio bytes alone
predict, N/2). The figures themselves are not tested (timings on a shared machine prove
nothing); what must be right is what the script computes from them and what it writes.

Read in this order: parsing sizes; the expected ratio; bandwidth and ratios from hand-made
rows (checked by hand); a tiny real run and its JSON; bad arguments.
"""

from __future__ import annotations

import json

import pytest

from tutorial_impl.bench import ring as bench


@pytest.mark.parametrize(
    ("text", "size"), [("4K", 4096), ("64KiB", 65536), ("16M", 16 << 20), ("100", 100)]
)
def test_parse_size(text, size):
    assert bench.parse_size(text) == size


@pytest.mark.parametrize("text", ["", "K", "3", "1.5M", "-4K"])
def test_parse_size_refuses_nonsense(text):
    with pytest.raises(Exception, match="size"):
        bench.parse_size(text)


def test_expected_ratio_is_n_over_2():
    """(N-1)*K bytes for the tutorial ring over 2(N-1)/N*K for the optimal one."""
    for n in (2, 3, 4, 8):
        assert bench.expected_tutorial_ratio(n) == pytest.approx(n / 2)


def test_bandwidth_and_ratios_from_hand_made_rows():
    rows = [
        {"world_size": 4, "bytes": 2_000_000, "algorithm": "gloo", "median_ms": 10.0},
        {"world_size": 4, "bytes": 2_000_000, "algorithm": "ring", "median_ms": 8.0},
        {"world_size": 4, "bytes": 2_000_000, "algorithm": "tutorial", "median_ms": 20.0},
    ]
    bench.add_ratios(rows)
    # 2 MB in 10 ms is 0.2 GB/s; in 8 ms 0.25 GB/s.
    assert [r["algbw_gbps"] for r in rows] == pytest.approx([0.2, 0.25, 0.1])
    assert [r["ratio_to_gloo"] for r in rows] == pytest.approx([1.0, 0.8, 2.0])
    assert bench.tutorial_vs_ring(rows) == [(4, 2_000_000, 2.0, 2.5)]
    table = bench.format_table(rows)
    assert bench.format_size(2_000_000) == "2000000 B"  # not a whole number of KiB
    assert bench.format_size(16 << 20) == "16 MiB"
    assert "expected 2.00x, measured 2.50x" in table


def test_tiny_run_writes_the_promised_json(tmp_path, capsys):
    path = tmp_path / "ring.json"
    argv = ["--sizes", "4K", "64K", "--world-sizes", "2", "--repeats", "2", "--json", str(path)]
    assert bench.main(argv) == 0
    rows = json.loads(path.read_text())
    assert {(r["bytes"], r["algorithm"]) for r in rows} == {
        (size, name) for size in (4096, 65536) for name in ("gloo", "ring", "tutorial")
    }
    for r in rows:
        assert r["world_size"] == 2 and r["repeats"] == 2
        assert 0 < r["min_ms"] <= r["median_ms"]
        assert r["cpu_ms"] > 0  # every call costs some CPU, on every rank
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / r["median_ms"] / 1e6)
    gloo = {r["bytes"]: r["median_ms"] for r in rows if r["algorithm"] == "gloo"}
    for r in rows:
        assert r["ratio_to_gloo"] == pytest.approx(r["median_ms"] / gloo[r["bytes"]])
        # the ring rows also say what the ring costs without its layout check
        if r["algorithm"] == "ring":
            unchecked = r["unchecked_median_ms"] / gloo[r["bytes"]]
            assert r["unchecked_ratio_to_gloo"] == pytest.approx(unchecked)
            assert r["unchecked_cpu_ms"] > 0
        else:
            assert "unchecked_median_ms" not in r
    out = capsys.readouterr().out
    assert "world 2,   64 KiB: expected 1.00x, measured" in out


def test_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--repeats", "0"])
    assert "--repeats must be at least 1" in capsys.readouterr().err
