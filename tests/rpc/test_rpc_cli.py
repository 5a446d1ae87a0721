"""``python -m tutorial_impl rpc``: every lesson on local workers, and bad input refused.

The demo prints what each lesson saw. The values checked here are closed-form: the
Counter's arithmetic, ``torch.add`` of ones, the design note's gradients for t1 = 1, t2 = 2,
t4 = 4 (dt1 = dt2 = t4, dt4 = t1 + t2), and one SGD and one Adagrad step on
``sum(a * b) + sum(a * a)`` with a = [1, -2], b = [0.5, 3], lr = 0.1.
Bad options are refused by argparse before any worker starts.
"""

from __future__ import annotations

import re

import pytest

from tutorial_impl import __main__ as entry
from tutorial_impl.rpc import demo

EXPECTED_LINES = [
    "   rpc_sync  -> [4.0, 4.0]",
    "   rpc_async -> ['[2.0, 2.0]', '[3.0, 3.0]'] (collect_all)",
    "   remote    -> an RRef owned by worker1, to_here() [4.0, 4.0]",
    "   proxies: rpc_sync +2 -> 12, rpc_async +3 -> 15, remote value() -> 15 (owned by worker1)",
    "   a to_here() copy +100 -> 115, the owner's object still 15",
    "   shared with worker2 (+4 -> 19), then +5 on the owner through local_value() -> 24",
    "   design note (t3 = t1 + t2 on worker1): dt1 [4.0, 4.0], dt2 [4.0, 4.0], dt4 [3.0, 3.0]",
    # a - 0.1 * (b + 2a) and b - 0.1 * a
    "4. DistributedOptimizer(SGD, lr=0.1), one step: a on worker1 -> [0.75, -1.9], "
    "b on worker2 -> [0.4, 3.2] (local optimizers on worker1, worker2)",
    # a - 0.1 * sign(b + 2a) and b - 0.1 * sign(a), Adagrad's first step
    "4. DistributedOptimizer(Adagrad, lr=0.1), one step: a on worker1 -> [0.9, -1.9], "
    "b on worker2 -> [0.4, 3.1] (local optimizers on worker1, worker2)",
    "   retry(attempts=3, backoff=0.05) after 2 transient failures -> 3.0",
    "7. async_execution: worker1 chained worker2's x + y with + z -> [3.0, 3.0]",
]


@pytest.mark.timeout(60)
def test_the_demo_runs_every_lesson_and_exits_0(capsys):
    assert demo.main(["--timeout", "30", "--rpc-timeout", "10"]) == 0
    out = capsys.readouterr().out
    for line in EXPECTED_LINES:
        assert line in out.splitlines(), line
    lessons = re.findall(r"^(\d)\. ", out, re.MULTILINE)
    assert sorted(set(lessons)) == [str(i) for i in range(1, 9)]
    # The lost reply made the retry run increment(1) at least twice.
    assert int(re.search(r"counter = (\d+)", out).group(1)) >= 2
    assert "all received the same weight: True" in out
    assert "the future is done: True" in out
    assert re.search(r"^3 workers, \d+\.\d s$", out, re.MULTILINE)


def test_help_describes_the_section(capsys):
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--world-size", "--rpc-timeout", "--timeout"):
        assert option in out


def test_the_cli_lists_the_section_before_the_hybrid_one(capsys):
    assert entry.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "  rpc " in out
    assert out.index("  rpc ") < out.index("  hybrid ")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--world-size", "2"], "--world-size must be at least 3, got 2"),
        (["--timeout", "0"], "--timeout must be a positive number of seconds, got 0.0"),
        (["--rpc-timeout", "-1"], "--rpc-timeout must be a positive number of seconds, got -1.0"),
    ],
)
def test_bad_input_is_refused_before_any_worker_starts(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        demo.main(argv)
    assert exit_info.value.code == 2
    assert f"error: {message}" in capsys.readouterr().err
