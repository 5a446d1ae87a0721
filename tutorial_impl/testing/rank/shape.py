"""How a rank function is called: its shape, read from its signature in the parent.

A rank function takes the rank first, then, if it has room, the world size; ``run_ranks``'s
positional arguments follow and ``fn_kwargs`` go by keyword::

    def f(rank): ...                          # f(rank, **fn_kwargs)
    def f(rank, world_size): ...              # f(rank, world_size, **fn_kwargs)
    def f(rank, world_size, a, b=1): ...      # f(rank, world_size, *args, **fn_kwargs)
    def f(rank, *, n): ...                    # keyword-only: fn_kwargs={"n": 3}
    def f(rank, n): ...                       # fn_kwargs={"n": 3}: n goes by keyword
    functools.partial(g, model, lr=0.1)       # g(model, rank, world_size, lr=0.1, ...)

The rule (``rank_params``): a function with ``*args``, or with two or more positional
parameters beside those ``fn_kwargs`` names, gets ``(rank, world_size, *args)`` (the shape
every rank function had before, kept for each that worked then); one with a single such
parameter gets ``(rank)``; one with none gets neither. A ``functools.partial`` of a
module-level function is read through: its bound arguments come first and travel, pickled,
with the call's own. The would-be call is then bound to the signature (``Signature.bind``):
what cannot be called (an argument missing, one too many, a keyword it has no parameter
for) is refused here, naming the function, the call and inspect's reason, before any rank
starts. Functions without a signature inspect can read (some builtins) get today's shape
unchecked, and so does a decorated function (``functools.wraps``) whose inner signature
does not bind: the decorator may supply arguments itself, as ``unittest.mock.patch`` does.

The decision travels as a number (``Call.rank_params``, ``RankSpec.rank_params``): how many
of ``(rank, world_size)`` come first; the rank puts the call together (``arguments``).
"""

from __future__ import annotations

import functools
import inspect
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

RANK_PARAMS = ("rank", "world_size")  # what a rank passes first, in this order
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


@dataclass(frozen=True)
class Shape:
    """A rank function's call, decided: the function a rank looks up (a partial's own
    function), what comes before the rank (a partial's arguments), how many of
    ``RANK_PARAMS`` follow, and every keyword (a partial's, then ``fn_kwargs``)."""

    target: Callable[..., Any]
    head: tuple[Any, ...]
    rank_params: int
    kwargs: dict[str, Any]


def unwrap(fn: Callable[..., Any]) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    """``fn`` without its ``functools.partial`` layers: the function, the arguments the
    layers bind first, their keywords (an outer layer's win, as calling it would)."""
    head: tuple[Any, ...] = ()
    keywords: dict[str, Any] = {}
    while isinstance(fn, functools.partial):
        head = fn.args + head
        keywords = {**fn.keywords, **keywords}
        fn = fn.func
    return fn, head, keywords


def decide(fn: Callable[..., Any], args: tuple[Any, ...], fn_kwargs: dict[str, Any]) -> Shape:
    """The call of ``fn`` in every rank, or a ``TypeError`` naming the function, the call
    it would get and why it cannot take it."""
    target, head, keywords = unwrap(fn)
    kwargs = {**keywords, **fn_kwargs}
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # none to read (a builtin): today's shape, unchecked
        return Shape(target, head, len(RANK_PARAMS), kwargs)
    n = rank_params(signature, fn_kwargs)
    try:
        signature.bind(*RANK_PARAMS[:n], *args, **fn_kwargs)
    except TypeError as exc:
        if hasattr(target, "__wrapped__"):  # read through a decorator, which may supply some
            return Shape(target, head, n, kwargs)  # (mock.patch does): called unchecked
        name = getattr(target, "__qualname__", repr(target))
        full = f"{getattr(target, '__module__', '?')}.{name}"
        shown = full if target is fn else f"functools.partial({full}, ...)"
        raise TypeError(
            f"rank function {shown}{signature} cannot be called as "
            f"{would_be(name, n, len(args), fn_kwargs)}: {exc}. A rank function takes "
            "(rank), (rank, world_size) or (rank, world_size, *args) first; fn_kwargs go "
            "by keyword"
        ) from None
    return Shape(target, head, n, kwargs)


def rank_params(signature: inspect.Signature, fn_kwargs: dict[str, Any]) -> int:
    """How many of ``RANK_PARAMS`` a function of ``signature`` takes first (see the rule
    above): its positional parameters, but those ``fn_kwargs`` name, up to two."""
    params = signature.parameters.values()
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return len(RANK_PARAMS)
    positional = [
        p
        for p in params
        if p.kind is p.POSITIONAL_ONLY or (p.kind in _POSITIONAL and p.name not in fn_kwargs)
    ]
    return min(len(RANK_PARAMS), len(positional))


def would_be(name: str, n: int, n_args: int, fn_kwargs: dict[str, Any]) -> str:
    """The call a rank would make, in words: ``f(rank, world_size, args[0], n=...)``."""
    given = [*RANK_PARAMS[:n], *(f"args[{i}]" for i in range(n_args))]
    given += [f"{key}=..." for key in fn_kwargs]
    return f"{name.rpartition('.')[2]}({', '.join(given)})"


def arguments(
    payload: bytes, rank_params: int, rank: int, world_size: int
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Inside a rank: the positional and keyword arguments of its function's call."""
    head, args, kwargs = pickle.loads(payload)
    return (*head, *(rank, world_size)[:rank_params], *args), kwargs
