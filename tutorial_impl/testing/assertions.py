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

Values may be tensors (compared on the CPU, shape and dtype included), numpy arrays and
scalars (compared the same way, with numpy), numbers, nested lists, tuples and dicts of
them, or any other picklable object (compared with ``==``).
Closeness is ``torch.testing.assert_close``'s, with its default tolerances per dtype, but
computed here with plain tensor ops: ``assert_close`` itself imports torch's DTensor and
sympy on first use, 1-2 s of CPU in every rank that calls it.
"""

from __future__ import annotations

import sys
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
    its defaults for the dtype when ``rtol`` and ``atol`` are not given (both or neither).
    Integer and boolean tensors must be equal.
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


# torch.testing.assert_close's default (rtol, atol) per dtype; others: float32's.
_DEFAULT_TOLERANCES = {
    "float16": (1e-3, 1e-5),
    "bfloat16": (1.6e-2, 1e-5),
    "float32": (1.3e-6, 1e-5),
    "float64": (1e-7, 1e-7),
    "complex64": (1.3e-6, 1e-5),
    "complex128": (1e-7, 1e-7),
}


def _mismatch(a: Any, b: Any, rtol: Any, atol: Any, where: str = "") -> str | None:
    """Why ``a`` differs from ``b`` (``where`` inside the value), or None if they agree."""
    import torch

    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return _tensor_mismatch(a, b, rtol, atol, where)
    if type(a) is not type(b):
        return f"{where or 'value'}: type {type(a).__name__} != {type(b).__name__}"
    if _is_numpy(a):
        return _array_mismatch(a, b, rtol, atol, where)
    if isinstance(a, (int, float, complex)) and not isinstance(a, bool):
        dtype = (
            torch.complex128
            if isinstance(a, complex)
            else torch.float64
            if isinstance(a, float)
            else torch.int64
        )
        a, b = torch.tensor(a, dtype=dtype), torch.tensor(b, dtype=dtype)
        return _tensor_mismatch(a, b, rtol, atol, where)
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{where or 'value'}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            why = _mismatch(x, y, rtol, atol, f"{where}[{i}]")
            if why:
                return why
        return None
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return f"{where or 'value'}: keys {sorted(map(repr, a))} != {sorted(map(repr, b))}"
        for key in a:
            why = _mismatch(a[key], b[key], rtol, atol, f"{where}[{key!r}]")
            if why:
                return why
        return None
    try:
        equal = bool(a == b)
    except Exception as exc:  # noqa: BLE001 - an __eq__ that raises is a difference too
        return f"{where or 'value'}: comparing raised {exc!r}"
    return None if equal else f"{where or 'value'}: not equal (==)"


def _tensor_mismatch(a: Any, b: Any, rtol: Any, atol: Any, where: str) -> str | None:
    import torch

    name = where or "tensor"
    if a.shape != b.shape:
        return f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    if a.dtype != b.dtype:
        return f"{name}: dtype {a.dtype} != {b.dtype}"
    if a.dtype.is_floating_point or a.dtype.is_complex:
        if rtol is None:
            rtol, atol = _DEFAULT_TOLERANCES.get(str(a.dtype).split(".")[-1], (1.3e-6, 1e-5))
        ok = torch.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
    else:
        ok = a == b
    if bool(ok.all()):
        return None
    bad = int((~ok).sum())
    diff = (
        (a.to(torch.float64) - b.to(torch.float64)).abs() if not a.is_complex() else (a - b).abs()
    )
    diff = torch.where(ok, torch.zeros_like(diff), diff.nan_to_num(nan=float("inf")))
    worst = int(diff.flatten().argmax())
    index = _unravel(worst, tuple(a.shape))
    return (
        f"{name}: {bad} of {a.numel()} elements differ; greatest absolute difference "
        f"{float(diff.flatten()[worst]):g} at index {index}"
    )


def _is_numpy(value: Any) -> bool:
    """A numpy array or scalar (``np.float32(1)``). numpy is not imported for this: a value
    that is one was made by numpy, already loaded."""
    np = sys.modules.get("numpy")
    return np is not None and isinstance(value, (np.ndarray, np.generic))


def _array_mismatch(a: Any, b: Any, rtol: Any, atol: Any, where: str) -> str | None:
    """``_tensor_mismatch`` for numpy: shape, dtype, then the values (NaN equal to NaN, NaT
    to NaT), naming the first element that differs. ``a == b`` alone is no verdict: on two
    arrays it is an array, whose truth value numpy refuses."""
    np = sys.modules["numpy"]
    name = where or ("array" if isinstance(a, np.ndarray) else "value")
    a, b = np.asarray(a), np.asarray(b)  # a numpy scalar: a 0-d array
    if a.shape != b.shape:
        return f"{name}: shape {a.shape} != {b.shape}"
    if a.dtype != b.dtype:
        return f"{name}: dtype {a.dtype} != {b.dtype}"
    numeric = a.dtype.kind in "biufc"
    try:
        if a.dtype.kind in "fc":
            if rtol is None:
                rtol, atol = _DEFAULT_TOLERANCES.get(a.dtype.name, (1.3e-6, 1e-5))
            ok = np.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
        else:  # integers and booleans exactly; strings, objects, dates with their ==
            ok = np.asarray(a == b, dtype=bool)
            if a.dtype.kind in "mM":
                ok |= np.isnat(a) & np.isnat(b)
    except Exception as exc:  # noqa: BLE001 - elements whose == raises differ too
        return f"{name}: comparing raised {exc!r}"
    if ok.shape != a.shape:  # e.g. object elements whose == is no single truth value
        return f"{name}: comparing gave no verdict per element"
    if bool(ok.all()):
        return None
    bad = int((~ok).sum())
    first = tuple(int(i) for i in np.argwhere(~ok)[0])
    text = f"{name}: {bad} of {a.size} elements differ, the first at index {first}"
    if numeric:
        wide = np.complex128 if a.dtype.kind == "c" else np.float64
        with np.errstate(invalid="ignore", over="ignore"):  # inf - inf: counted as inf
            diff = np.abs(a.astype(wide) - b.astype(wide))
        diff = np.where(ok, 0.0, np.nan_to_num(diff, nan=np.inf, posinf=np.inf))
        worst = tuple(int(i) for i in np.unravel_index(int(diff.argmax()), a.shape))
        text += f"; greatest absolute difference {float(diff[worst]):g} at index {worst}"
    return text


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The index of element ``flat`` of a row-major tensor of ``shape`` (``torch.unravel_index``
    would import sympy: seconds in a fresh rank)."""
    index = []
    for size in reversed(shape):
        flat, i = divmod(flat, size)
        index.append(i)
    return tuple(reversed(index))


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
