"""The fresh-test profile (``tutorial_impl/bench/fresh_profile.py``): its arithmetic on stamps
of known value, and nonsense arguments refused.

No run here: a real one is a pytest session of its own whose forkserver imports the stamping
module (``rank_preload``), torch and the suite's heavy library again, seconds of CPU for the
suite. What a run needs of the harness is checked instead: every function its hooks stamp
or call still exists under its name (the strategy protocol's ``gather`` replaced ``run``, and
the benchmark failed at its conftest's import, with every test of this file passing). The
stamps below are what such a run writes, with round numbers: two tests counted
after one left out, two ranks each, and a rank of the left-out test that must not count.
"""

from __future__ import annotations

import pytest

from tutorial_impl.bench import fresh_profile

MS = 1_000_000  # ns
# A rank's CPU (ms) when it stamps each step; it is reaped at 15 ms.
RANK_CPU = {"forked": 1.0, "started": 2.0, "entered": 3.5, "resolved": 4.0, "arguments": 4.5}
RANK_CPU.update({"group": 7.0, "function": 12.0, "reported": 12.5})


def line(pid: int, label: str, at_ms: float, cpu_ms: float, extra: str = "") -> str:
    return f"{pid} {label} {round(at_ms * MS)} {round(cpu_ms * 1000)} 100 {extra}".rstrip()


def logs() -> tuple[str, str]:
    parent, ranks, server_cpu = [], [], 10.0
    for test in range(4):  # the last one only ends the third's time
        t0 = 100.0 * test
        parent.append(line(9, "test", t0, 10.0 * test))
        parent += [line(9, "run", t0 + 1, 10.0 * test + 1)]
        parent += [line(9, "start_end", t0 + s, 10.0 * test + 2) for s in (3, 5)]
        parent += [line(9, "supervise_end", t0 + 50, 10.0 * test + 4)]
        if test == 3:
            break
        for r in range(2):
            pid, cpu = 100 + 2 * test + r, 15.0 if test else 99.0  # the left-out test's: 99
            server_cpu += 2.0
            ranks.append(line(1, "server_fork", t0 + 5, server_cpu, f"child={pid} fork_us=2000"))
            for step, (label, rank_cpu) in enumerate(RANK_CPU.items()):
                ranks.append(line(pid, label, t0 + 6 + step, rank_cpu * (cpu / 15.0)))
            server_cpu += 0.5
            ranks.append(
                line(1, "reaped", t0 + 60, server_cpu, f"child={pid} cpu_us={cpu * 1e3:.0f}")
            )
    return "\n".join(parent), "\n".join(ranks)


def test_each_step_costs_what_its_rank_spent_since_the_step_before():
    parent, ranks = logs()
    figures = fresh_profile.summarize(fresh_profile.parse(parent), fresh_profile.parse(ranks), 1)
    assert figures["tests"] == 2 and figures["ranks"] == 4  # the left-out test's two: not
    steps = figures["steps"]
    assert steps == pytest.approx(
        {"forked": 1.0, "started": 1.0, "entered": 1.5, "resolved": 0.5, "arguments": 0.5}
        | {"group": 2.5, "function": 5.0, "reported": 0.5, "reaped": 2.5}
    )
    assert sum(steps.values()) == pytest.approx(15.0)  # the steps add up to the whole rank
    assert figures["at_ms"]["forked"] == pytest.approx(6.0)
    assert figures["at_ms"]["reported"] == pytest.approx(13.0)
    assert figures["rank_cpu_ms"] == pytest.approx(30.0)  # two ranks of 15 ms a test
    assert figures["fork_cpu_ms"] == pytest.approx(2.0)
    assert figures["server_cpu_ms"] == pytest.approx(5.0)  # 2.5 ms a rank, from its stamps
    assert figures["parent_cpu_ms"] == pytest.approx(10.0)
    assert figures["wall_ms"] == pytest.approx(100.0)
    assert figures["parent"]["start_end"] == pytest.approx([5.0, 2.0])  # the last request
    assert figures["parent"]["supervise_end"] == pytest.approx([50.0, 4.0])


def test_too_few_tests_and_nonsense_arguments_are_refused():
    parent, ranks = logs()
    with pytest.raises(ValueError, match="need at least 5 tests"):
        fresh_profile.summarize(fresh_profile.parse(parent), fresh_profile.parse(ranks))
    with pytest.raises(SystemExit, match="--tests must be at least 5"):
        fresh_profile.main(["--tests", "4"])
    with pytest.raises(SystemExit, match="--world-size positive"):
        fresh_profile.main(["--world-size", "0"])


@pytest.mark.parametrize("module, path, label", fresh_profile.PARENT_TARGETS)
def test_every_function_the_parents_hooks_stamp_exists(module, path, label):
    owner, name = fresh_profile.resolve_target(module, path)
    assert callable(getattr(owner, name)), (module, path)
    read = {key for key, _ in fresh_profile.PARENT_STEPS}  # each stamp is a milestone read
    assert {label, f"{label}_end"} & read, (label, read)


def test_every_function_the_rank_hooks_wrap_exists_and_is_named_in_them():
    from tutorial_impl.testing.rank import main as rank

    for name in fresh_profile.RANK_TARGETS:
        assert callable(getattr(rank, name)), name
        assert f"R.{name}" in fresh_profile.RANK_HOOKS, name
    with pytest.raises(AttributeError):  # a name the harness does not have is not found
        fresh_profile.resolve_target("tutorial_impl.testing.strategies.forked", "Forked.run")


def test_the_table_prints_each_step_and_milestone_with_its_figures(capsys):
    """What a user reads: every step of a rank and every milestone of the parent, in order,
    each with the figure summarize gave it (on the stamps above)."""
    parent, ranks = logs()
    figures = fresh_profile.summarize(fresh_profile.parse(parent), fresh_profile.parse(ranks), 1)
    figures |= {"world_size": 2, "total_cpu_ms": 42.0}
    fresh_profile.show(figures)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "2 fresh tests, 4 ranks, world 2"
    assert lines[1].split() == ["a", "rank,", "step", "by", "step", "CPU", "ms", "ends", "at", "ms"]
    rows = lines[2 : 2 + len(fresh_profile.STEPS)]
    for (label, text), row in zip(fresh_profile.STEPS, rows, strict=True):
        assert row.strip().startswith(text) and f"{figures['steps'][label]:7.2f}" in row, row
    milestones = lines[3 + len(fresh_profile.STEPS) : -2]
    assert [m.split()[0] for m in milestones] == list(figures["parent"])
    for row, (at, cpu) in zip(milestones, figures["parent"].values(), strict=True):
        assert row.split()[1:] == [f"{cpu:.2f}", f"{at:.1f}"], row
    assert lines[-1].startswith("  CPU a test: 42.0 ms (parent ")
