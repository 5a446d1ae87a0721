"""The one protocol of the strategies (``strategies.protocol``), checked on values: no rank
is started.

One refusal rule for every strategy (its ``cannot``: data), the session's list and its
choice, the audit as a wrapper strategy, and ``verdict.decide`` called in one place only, by
``protocol.run``. The strategies' runs themselves are the conformance suite's.
"""

from __future__ import annotations

import ast
import io
from pathlib import Path
from types import SimpleNamespace

import pytest

import tutorial_impl
from tutorial_impl.testing import call
from tutorial_impl.testing.faults.plan import Fault, Kill
from tutorial_impl.testing.fixtures import Session, strategies_for
from tutorial_impl.testing.rank import outcome as _o
from tutorial_impl.testing.settings.config import Settings
from tutorial_impl.testing.strategies import protocol
from tutorial_impl.testing.strategies.forked import FORKED
from tutorial_impl.testing.strategies.torchrun.worker import NOT_HONOURED, Launched
from tutorial_impl.testing.strategies.warm import pool as warm
from tutorial_impl.testing.strategies.warm.audit import Audited
from tutorial_impl.testing.verdict import agree
from tutorial_impl.testing.verdict import decision as verdict
from tutorial_impl.testing.verdict.agree import WarmAuditError
from tutorial_impl.testing.verdict.errors import RankFailed, RankResults, RankSkipped

# A value away from the default of each field some strategy cannot honour.
SET = {
    "init_method": "tcp",
    "log_dir": "/tmp/ranks-here",
    "stream": io.StringIO(),
    "stream_prefix": False,
    "may_exit": {1},
    "debug_rank": 0,
}


def _strategies() -> list[protocol.Strategy]:
    return [FORKED, warm.WarmPool(), Launched(job=None)]  # type: ignore[arg-type]


def test_one_refusal_rule_for_every_strategy_names_the_field():
    plain = call.build(len)
    for strategy in _strategies():
        assert protocol.refusal(strategy, plain) is None, strategy.name
        for name, why in strategy.cannot.items():
            refusal = protocol.refusal(strategy, call.build(len, **{name: SET[name]}))
            assert refusal is not None and refusal.startswith(f"{name} cannot be honoured ")
            assert refusal.endswith(f"({name}: {why})"), refusal
    # Given at its default, a field asks for nothing a strategy must refuse.
    assert protocol.refusal(Launched(None), call.build(len, log_dir=None, may_exit=())) is None  # type: ignore[arg-type]
    both = protocol.refusal(Launched(None), call.build(len, stream_prefix=False, debug_rank=1))  # type: ignore[arg-type]
    assert both is not None and both.startswith("stream_prefix, debug_rank cannot be honoured")


def test_every_refused_field_is_a_field_of_the_call():
    fields = set(call.Call.__dataclass_fields__)
    for strategy in _strategies():
        assert set(strategy.cannot) <= fields, strategy.name
    assert set(NOT_HONOURED) | set(warm.NOT_WARM) <= set(SET)  # the test above tries each


def test_choose_takes_the_first_that_can_and_else_raises_the_last_refusal():
    pool = warm.WarmPool()
    assert protocol.choose([pool, FORKED], call.build(len)) is pool
    assert protocol.choose([pool, FORKED], call.build(len, may_exit={1})) is FORKED
    job = Launched(job=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^init_method cannot be honoured under torchrun"):
        protocol.choose([job], call.build(len, init_method="tcp"))


def _settings(warm_marker: bool | None = None, gpus: int = 0) -> Settings:
    return Settings(2, "gloo", 60.0, "env", gpus, True, warm=warm_marker)


def _session(warm_audit: bool = False, **options: object) -> tuple[Session, warm.WarmPool]:
    pool = warm.WarmPool()
    fields: dict[str, object] = dict(
        strategies=strategies_for(pool, warm_audit),
        default_deadline=60.0,
        init_method=None,
        warm_worlds=False,
        check_collectives=False,
        debug_rank=None,
    )
    return Session(**{**fields, **options}), pool  # type: ignore[arg-type]


def test_the_session_holds_a_list_and_picks_one():
    plain = call.build(len)
    session, pool = _session()
    assert session.strategies == (pool, FORKED)
    assert session.strategy(_settings(), plain) is FORKED  # warm not asked for
    assert session.strategy(_settings(warm_marker=True), plain) is pool
    assert session.strategy(_settings(warm_marker=True, gpus=1), plain) is FORKED
    warm_session, warm_pool = _session(warm_worlds=True)
    assert warm_session.strategy(_settings(), plain) is warm_pool
    assert warm_session.strategy(_settings(warm_marker=False), plain) is FORKED
    # --warm-audit wraps the warm strategy: the same choice, the same refusals.
    audited, audited_pool = _session(warm_audit=True)
    chosen = audited.strategy(_settings(warm_marker=True), plain)
    assert isinstance(chosen, Audited) and chosen.warm is audited_pool
    assert chosen.name == "warm" and chosen.cannot is warm.NOT_WARM
    assert (chosen.size, chosen.serial, chosen.own_ranks) == (None, True, True)
    assert audited.strategy(_settings(warm_marker=True), call.build(len, debug_rank=0)) is FORKED
    # What the face asks, declared by each strategy: fresh ranks run side by side.
    assert (FORKED.size, FORKED.serial, FORKED.own_ranks) == (None, False, True)
    assert (audited.size, audited.own_ranks) == (None, True)
    # Under torchrun, the job's is the only one, and its size is every test's.
    job = Launched(job=SimpleNamespace(launch=SimpleNamespace(world_size=3)))  # type: ignore[arg-type]
    audited.join(job)
    assert audited.strategies == (job,)
    assert audited.strategy(_settings(warm_marker=True), plain) is job
    assert (audited.size, audited.own_ranks, job.serial) == (3, False, True)


class _Heard:
    """A strategy that records what the session tells it."""

    name, cannot = "heard", {}

    def __init__(self) -> None:
        self.heard: list[object] = []

    def gather(self, call: call.Call) -> verdict.Finished:
        raise AssertionError("not run here")

    def test_ended(self, failed: bool) -> None:
        self.heard.append(failed)

    def close(self) -> None:
        self.heard.append("closed")


def test_the_session_tells_every_strategy_and_the_audit_passes_it_on():
    first, second = _Heard(), _Heard()
    session, _ = _session(strategies=(Audited(first, FORKED), second))  # type: ignore[arg-type]
    session.test_ended(True)
    session.test_ended(False)
    session.close()
    assert first.heard == second.heard == [True, False, "closed"]


def _finished(*outcomes: _o.Outcome, unfired: dict | None = None) -> verdict.Finished:
    reports = {r: _o.Report(o, 100 + r, float(r)) for r, o in enumerate(outcomes)}
    return verdict.Finished(len(outcomes), reports, sorted(reports), {}, 5.0, unfired=unfired or {})


RAISED = _o.Raised("ValueError", "boom", "Traceback...\nValueError: boom\n")
RUNS = [
    _finished(_o.Returned(1), _o.Returned(2)),
    _finished(_o.Returned(1), RAISED),
    _finished(_o.Returned(1), _o.Skipped("no data")),
    _finished(_o.XFailed("known"), _o.Returned(2)),
    _finished(_o.Returned(1), _o.Killed(9)),
    _finished(_o.Returned(1), _o.TimedOut(None)),
    _finished(_o.Returned(1), _o.Returned(2), unfired={1: ["a planned kill"]}),
]


@pytest.mark.parametrize("run", RUNS, ids=range(len(RUNS)))
def test_as_planned_is_exactly_a_run_decide_passes(run):
    """A warm world is kept after a run ``as_planned`` (its strategy does not decide)."""
    try:
        verdict.decide(run)
        passed = True
    except Exception:  # noqa: BLE001 - any verdict but a pass
        passed = False
    assert run.as_planned is passed


class _Gives:
    """A strategy whose gather gives a run prepared beforehand."""

    name, cannot = "gives", {}

    def __init__(self, finished: verdict.Finished) -> None:
        self.finished, self.calls = finished, 0

    def gather(self, call: call.Call) -> verdict.Finished:
        self.calls += 1
        return self.finished

    def test_ended(self, failed: bool) -> None: ...

    def close(self) -> None: ...


def test_run_decides_what_the_strategy_gathered():
    assert protocol.run(_Gives(RUNS[0]), call.build(len)) == [1, 2]
    with pytest.raises(RankFailed, match="rank 1 raised ValueError: boom"):
        protocol.run(_Gives(RUNS[1]), call.build(len))


def test_the_audit_wrapper_compares_the_two_verdicts():
    same = Audited(_Gives(RUNS[0]), _Gives(RUNS[0]))  # type: ignore[arg-type]
    assert protocol.run(same, call.build(len)) == [1, 2]
    assert same.fresh.calls == 1  # type: ignore[attr-defined]
    for warm_run, fresh_run in ((RUNS[0], RUNS[1]), (RUNS[2], RUNS[0])):
        differ = Audited(_Gives(warm_run), _Gives(fresh_run))  # type: ignore[arg-type]
        with pytest.raises(WarmAuditError, match="--warm-audit: the warm world's verdict"):
            protocol.run(differ, call.build(len))
    # The error names the warm run's outputs; its cause is the failure of either run.
    told = _finished(_o.Returned(1), RAISED)
    told.outputs = {0: "zero said this", 1: "one said that"}
    with pytest.raises(WarmAuditError) as failed_warm:
        protocol.run(Audited(_Gives(told), _Gives(RUNS[0])), call.build(len))  # type: ignore[arg-type]
    assert failed_warm.value.outputs == told.outputs
    assert isinstance(failed_warm.value.__cause__, RankFailed)
    with pytest.raises(WarmAuditError) as failed_fresh:
        protocol.run(Audited(_Gives(RUNS[0]), _Gives(told)), call.build(len))  # type: ignore[arg-type]
    assert isinstance(failed_fresh.value.__cause__, RankFailed)
    # Both fail alike: the warm run's own error is the verdict.
    with pytest.raises(RankFailed):
        protocol.run(Audited(_Gives(RUNS[1]), _Gives(RUNS[1])), call.build(len))  # type: ignore[arg-type]
    skipped = agree.Verdict(None, RankSkipped(1, "no data", {}))
    assert agree.agree(skipped, skipped) is skipped
    passed = agree.Verdict(RankResults([1]), None)
    assert isinstance(agree.agree(passed, skipped).error, WarmAuditError)


def _decide_calls(tree: ast.AST) -> int:
    """Calls of ``verdict.decide`` in a module: by the name imported from the verdict
    module, or as an attribute of that module."""
    imported = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and (node.module or "").endswith(("verdict", "verdict.decision"))
        for alias in node.names
        if alias.name == "decide"
    }
    modules = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
        if alias.name.endswith(("verdict", "decision"))
    }
    count = 0
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in imported:
            count += 1
        elif isinstance(f, ast.Attribute) and f.attr == "decide":
            count += isinstance(f.value, ast.Name) and f.value.id in modules
    return count


def test_decide_is_called_in_one_place():
    package = Path(tutorial_impl.__file__).parent
    calls = {}
    for path in sorted(package.rglob("*.py")):
        found = _decide_calls(ast.parse(path.read_text(), str(path)))
        if found:
            calls[path.relative_to(package).as_posix()] = found
    where = Path(protocol.__file__).relative_to(package).as_posix()
    assert calls == {where: 1}
    # The check sees both spellings of a call.
    assert _decide_calls(ast.parse("from x.verdict import decide\ndecide(r)")) == 1
    assert _decide_calls(ast.parse("from x import verdict as v\nv.decide(r)\nshape.decide(f)")) == 1


def test_a_plan_that_kills_rank_0_is_refused_under_torchrun_only():
    from tutorial_impl.testing.strategies.torchrun.worker import reporter_killed

    killing = call.build(len, faults=Fault(0, Kill()))
    assert protocol.refusal(FORKED, killing) is None
    refusal = reporter_killed(killing)
    assert refusal and refusal.startswith("faults cannot be honoured under torchrun")


def test_parent_and_rank_name_a_ranks_files_by_one_value(tmp_path):
    """``RankFiles``: the rank writes where the parent reads, whatever the file."""
    import pickle

    from tutorial_impl.testing.call import RankFiles, rank_spec
    from tutorial_impl.testing.strategies import supervise

    built = call.build(len, world_size=3)
    specs = [rank_spec(built, r, tmp_path, {}) for r in range(3)]
    kinds = ("log", "stacks", "records", "fault", "debugging")
    paths = [Path(getattr(s.files, kind)) for s in specs for kind in kinds]
    assert len(set(paths)) == 15 and all(p.parent == tmp_path for p in paths)
    for spec in specs:
        in_rank = pickle.loads(pickle.dumps(spec)).files  # what the rank unpickles
        assert in_rank == spec.files == RankFiles(tmp_path, spec.rank)
        proc = supervise.Proc(spec.rank, None, None, spec.files)  # type: ignore[arg-type]
        assert proc.stack_path == Path(in_rank.stacks)
        assert proc.records_path == Path(in_rank.records)
        assert str(in_rank.log).endswith(f"rank{spec.rank}.log")


class _Options:
    """A stand-in for pytest's parser: the plugin's option and ini names, as it adds them."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def getgroup(self, *args: object, **kwargs: object) -> _Options:
        return self

    def addoption(self, *flags: str, **kwargs: object) -> None:
        self.names.update(flag for flag in flags if flag.startswith("--"))

    def addini(self, name: str, *args: object, **kwargs: object) -> None:
        self.names.add(name)


def test_one_list_of_options_the_calls_fields():
    """Every field of a ``Call`` says where its value comes from (``call.Source``); every
    name a source gives is one the plugin or run_ranks has; every marker, option and ini
    value of the plugin sets a field or says what it decides instead."""
    import dataclasses
    import inspect

    from tutorial_impl.testing import plugin
    from tutorial_impl.testing.settings import config
    from tutorial_impl.testing.strategies.forked import run_ranks

    parser = _Options()
    plugin.pytest_addoption(parser)  # type: ignore[arg-type]
    markers = {spec.split("(")[0] for spec in config.MARKERS}
    markers = {config.DEPRECATED_MARKERS.get(name, name) for name in markers}
    signature = inspect.signature(run_ranks).parameters
    keywords = {n: p.default for n, p in signature.items() if p.kind is p.KEYWORD_ONLY}
    named: set[str] = set()
    for f in dataclasses.fields(call.Call):
        source = f.metadata["source"]
        users = [source.keyword, source.marker, source.option, source.ini]
        assert any(users) or source.harness, f"{f.name}: no source"
        assert source.marker is None or source.marker in markers, f.name
        assert {source.option, source.ini} - {None} <= parser.names, f.name
        assert source.keyword is None or source.keyword in keywords, f.name
        named.update(name for name in users if name)
    assert named | set(config.NOT_A_CALL_FIELD) == parser.names | markers | set(keywords)
    assert not named & set(config.NOT_A_CALL_FIELD)
    built = call.build(len)
    with pytest.raises(dataclasses.FrozenInstanceError):  # checked once, then only read
        built.world_size = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        call.SOURCES["deadline"].keyword = "deadline"  # type: ignore[misc]
    # run_ranks's signature (for help() and editors) says what the fields say.
    assert keywords == call.DEFAULTS
    assert call.OPTIONS == tuple(call.DEFAULTS)
