"""Assertions across ranks: does every rank hold the same value (or close enough)?

Called *inside* a rank function, by every rank of the group, like a collective::

    def step(rank, world_size):
        model = train_one_step()
        assert_close_across_ranks(model.weight, rtol=1e-5, atol=1e-7)  # DDP kept them equal
        assert_equal_across_ranks(len(dataset))

Each rank sends its value to all the others (``all_gather_object``), so every rank holds
every value and reaches the same verdict. That is what keeps a failure from hanging the
test: were only the disagreeing ranks to raise, the others would go on to their next
collective and wait there for ranks that never come. Here every rank raises the same
``AssertionError``, which names the ranks that disagree with the majority and shows their
values, and the harness reports it with the rank's traceback.

Values may be tensors (compared on the CPU, shape and dtype included), numbers, or nested
lists, tuples and dicts of them (compared with ``torch.testing.assert_close``), or any other
picklable object (compared with ``==``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_REPR_LIMIT = 400  # characters of one rank's value shown in a failure


def assert_equal_across_ranks(value: Any, *, group: Any = None, name: str = "value") -> None:
    """Raise ``AssertionError`` on every rank unless ``value`` is exactly equal on all ranks.

    ``group`` is the process group to compare over (default: the whole world). NaNs in the
    same places count as equal.
    """
    __tracebackhide__ = True
    _agree(value, group, name, "equal", rtol=0.0, atol=0.0)


def assert_close_across_ranks(
    value: Any,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    group: Any = None,
    name: str = "value",
) -> None:
    """Raise ``AssertionError`` on every rank unless ``value`` is close on all ranks.

    Closeness is ``torch.testing.assert_close``'s: ``|a - b| <= atol + rtol * |b|``, with
    its dtype-based defaults when ``rtol`` and ``atol`` are not given (both or neither).
    """
    __tracebackhide__ = True
    if (rtol is None) != (atol is None):
        raise ValueError("give both rtol and atol, or neither (torch.testing's defaults)")
    _agree(value, group, name, "close", rtol=rtol, atol=atol)


def _agree(value: Any, group: Any, name: str, how: str, rtol: Any, atol: Any) -> None:
    __tracebackhide__ = True
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError(
            f"assert_{how}_across_ranks needs a process group; start the ranks with a backend "
            "(run_ranks' default) or call dist.init_process_group first"
        )
    values: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, _to_cpu(value), group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else range(len(values))

    def same(a: Any, b: Any) -> str | None:
        return _mismatch(a, b, rtol, atol)

    classes = _classes(list(zip(ranks, values, strict=True)), same)
    if len(classes) == 1:
        return
    raise AssertionError(_report(classes, name, how, rtol, atol, same))


def _to_cpu(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if type(value) in (list, tuple):
        return type(value)(_to_cpu(v) for v in value)
    if type(value) is dict:
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def _mismatch(a: Any, b: Any, rtol: Any, atol: Any) -> str | None:
    """Why ``a`` and ``b`` differ (torch.testing's explanation), or None if they agree."""
    import torch

    try:
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, equal_nan=True)
    except AssertionError as exc:
        return str(exc)
    except (TypeError, ValueError):  # not tensors or numbers: plain equality
        try:
            equal = bool(a == b)
        except Exception as exc:  # noqa: BLE001 - an __eq__ that raises is a difference too
            return f"comparing them raised {exc!r}"
        return None if equal else "not equal (==)"
    return None


def _classes(
    entries: list[tuple[int, Any]], same: Callable[[Any, Any], str | None]
) -> list[list[tuple[int, Any]]]:
    """Group ``(rank, value)`` entries by agreement with each group's first member,
    largest group first (ties: lowest rank first)."""
    classes: list[list[tuple[int, Any]]] = []
    for rank, value in entries:
        for members in classes:
            if same(members[0][1], value) is None:
                members.append((rank, value))
                break
        else:
            classes.append([(rank, value)])
    return sorted(classes, key=lambda members: (-len(members), members[0][0]))


def _report(
    classes: list[list[tuple[int, Any]]],
    name: str,
    how: str,
    rtol: Any,
    atol: Any,
    same: Callable[[Any, Any], str | None],
) -> str:
    majority, *others = classes
    odd = sorted(rank for members in others for rank, _ in members)
    tolerance = f" (rtol={rtol}, atol={atol})" if how == "close" and rtol is not None else ""
    lines = [
        f"{name} is not {how}{tolerance} across ranks: rank(s) {_names(odd)} disagree with "
        f"rank(s) {_names(r for r, _ in majority)}",
        f"  rank(s) {_names(r for r, _ in majority)}: {_short(majority[0][1])}",
    ]
    reference = majority[0][1]
    for members in others:
        lines.append(f"  rank(s) {_names(r for r, _ in members)}: {_short(members[0][1])}")
        why = same(members[0][1], reference) or ""
        lines.extend(f"      {line}" for line in why.strip().splitlines())
    return "\n".join(lines)


def _names(ranks: Any) -> str:
    return ", ".join(str(r) for r in ranks)


def _short(value: Any) -> str:
    text = repr(value)
    if len(text) > _REPR_LIMIT:
        text = text[:_REPR_LIMIT] + f"... ({len(text) - _REPR_LIMIT} more characters)"
    return text.replace("\n", "\n      ")
