"""What one level inside a value is now: a fingerprint of a module global, for ``reuse``.

A warm rank compares each global of the user's modules before and after a test (``reuse``);
for a container, a tensor, an ``nn.Module``, an array, a generator or an object, the global's
identity says nothing of what is inside it. ``state_of`` reads one level inside, cheaply: a
key compared with ``==`` (sizes, versions, bytes, states) and the objects held, compared by
identity. What it cannot see (deeper levels, ``__slots__``-only objects) ``reuse`` lists.

``table`` reads a whole dict at once, for the namespaces ``reuse`` compares after every test
(torch's alone binds 1,500 names).
"""

from __future__ import annotations

import ctypes
import functools
import random
import struct
import sys
import sysconfig
import types
from collections.abc import Callable
from typing import Any

MAX_ITEMS = 10_000  # a larger container is compared by its size only
MAX_BYTES = 1 << 20  # a larger numpy array is not compared

State = tuple[Any, list[Any]]  # a key compared with ==, objects compared by identity (held)
Reader = Callable[[Any, str], "State | None"]
_READERS: dict[type, Reader] = {}  # by type: found once, through isinstance


def state_of(value: Any, module: str) -> State | None:
    """What one level inside ``value`` (a global of ``module``) is now; None: not compared."""
    kind = type(value)
    reader = _READERS.get(kind)
    if reader is None:
        reader = _READERS[kind] = _reader(kind)
    try:
        return reader(value, module)
    except Exception:  # noqa: BLE001 - an object that cannot be looked into is not compared
        return None


def _reader(kind: type) -> Reader:
    torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
    readers: list[tuple[Any, Reader]] = [
        (dict, lambda v, m: _sized(v, lambda: [*dict.keys(v), *dict.values(v)])),
        (list, lambda v, m: _sized(v, lambda: list.copy(v))),
        (set, lambda v, m: _sized(v, lambda: sorted(v, key=id))),
        (bytearray, lambda v, m: (bytes(v) if len(v) <= MAX_BYTES else len(v), [])),
        ((types.ModuleType, types.BuiltinFunctionType, types.MethodType), lambda v, m: None),
        ((type, types.FunctionType), lambda v, m: _attributes(v) if v.__module__ == m else None),
        (random.Random, lambda v, m: (v.getstate(), [])),
    ]
    if torch is not None:
        readers += [(torch.Tensor, _tensor), (torch.nn.Module, _nn_module)]
        readers += [(torch.Generator, lambda v, m: (bytes(v.get_state().numpy()), []))]
    if np is not None:
        readers += [(np.ndarray, _array)]
        readers += [(np.random.Generator, lambda v, m: (v.bit_generator.state, []))]
    return next((r for base, r in readers if issubclass(kind, base)), lambda v, m: _attributes(v))


def _sized(value: Any, items: Callable[[], list[Any]]) -> State:
    return len(value), (items() if len(value) <= MAX_ITEMS else [])


def _attributes(value: Any) -> State | None:
    names = getattr(value, "__dict__", None)
    if not isinstance(names, (dict, types.MappingProxyType)):
        return None
    return _sized(names, lambda: [*names.keys(), *names.values()])


def _tensor(value: Any, module: str) -> State:
    grad = value.grad if value.is_leaf else None  # a non-leaf's .grad warns
    return (value._version, value.requires_grad, getattr(grad, "_version", None)), [grad]


def _nn_module(value: Any, module: str) -> State:
    tensors = [*value.parameters(), *value.buffers()]
    grads = [t.grad for t in tensors]
    versions = [t._version for t in tensors + [g for g in grads if g is not None]]
    return (tuple(versions), tuple(m.training for m in value.modules())), [*tensors, *grads]


def _array(value: Any, module: str) -> State | None:
    if value.nbytes > MAX_BYTES or value.dtype.hasobject:
        return None
    return (value.shape, value.dtype.str, hash(value.tobytes())), []


# CPython 3.11-3.14's dict (default build, 64-bit): the keys object's address at byte 32 of
# the dict, the values' (a split table) at 40; the keys object holds, from byte 32 on, its
# index (1 << its byte 9 bytes), then its entries, as many as its bytes 24-32 say, of the
# kind its byte 10 says: 0, (hash, key, value); 1, (key, value); 2, split.
_ENTRY = {0: 24, 1: 16}
_NULL = bytes(8)
Table = tuple[int, bytes]  # the kind of a dict's table, and its entries


def table(d: dict[Any, Any]) -> Table | None:
    """``d``'s entries as CPython holds them: the kind of its table, and the addresses of
    each key and value, in order; None where that layout is not the one ``_trusted`` proved.

    Two reads are equal only if the same objects are bound to the same keys, in the same
    order, as long as the caller holds every key and value of the first (their addresses
    cannot be taken by other objects meanwhile). Why: compared through Python, a namespace
    touches each name and value object, each a cache miss once a test has run (0.3 ms for
    ``reuse``'s after each task); its table is one block of memory (0.1 ms)."""
    return _read(d) if _trusted() else None


def held(names: dict[Any, Any]) -> tuple[dict[Any, Any], Table | None, Version | None]:
    """A copy of ``names``, its ``table`` (valid as long as the copy, which holds every key
    and value of it) and its ``Version``, read first: a change meanwhile then shows as one."""
    tag = watch(names)
    return dict(names), table(names), tag


_TAG = 24  # where a dict's version tag is: after its object header and ma_used


class Version:
    """A dict's version tag as it is now, which CPython changes at every change of the dict
    (PEP 509: an entry rebound to another object, added or deleted), read in place: one
    machine word (0.1 us), where ``table`` reads every entry (torch's namespace: 36 KB, each
    line of it a cache miss after a test)."""

    __slots__ = ("_dict", "_word", "_seen")

    def __init__(self, d: dict[Any, Any]) -> None:
        self._dict = d  # held: the word read is inside it
        self._word = ctypes.c_uint64.from_address(id(d) + _TAG)
        self._seen = self._word.value

    def unchanged(self, d: dict[Any, Any]) -> bool:
        """Whether ``d`` is the dict watched and nothing was bound, added or deleted since."""
        return d is self._dict and self._word.value == self._seen


def watch(d: dict[Any, Any]) -> Version | None:
    """``d``'s ``Version``, or None where this interpreter was not proved to keep one
    (``_versioned``)."""
    return Version(d) if _versioned() else None


@functools.cache
def _versioned() -> bool:
    """Whether ``version`` reads a tag that changes with each change of a dict and with no
    other dict's: proved once per process, on a dict of str keys and one of other keys."""
    if not _trusted():
        return False

    def tag(d: dict[Any, Any]) -> int:
        return ctypes.c_uint64.from_address(id(d) + _TAG).value

    for d in ({f"name{i}": i for i in range(20)}, {i: i for i in range(20)}):
        key = next(iter(d))
        seen = [tag(d)]
        {}.update(other=1)  # another dict's change
        seen.append(tag(d))
        d[key] = object()  # rebound
        seen.append(tag(d))
        del d[key]
        seen.append(tag(d))
        d[key] = 0  # added
        seen.append(tag(d))
        if seen[0] != seen[1] or len(set(seen[1:])) != 4:
            return False
    return True


def _read(d: dict[Any, Any]) -> Table | None:
    pointers = ctypes.string_at(id(d) + 32, 16)  # the keys object's, the values' (split)
    if pointers[8:] != _NULL:
        return None
    keys = int.from_bytes(pointers[:8], sys.byteorder)
    header = ctypes.string_at(keys, 32)
    size = _ENTRY.get(header[10])
    if size is None:
        return None
    count = int.from_bytes(header[24:32], sys.byteorder)
    return header[10], ctypes.string_at(keys + 32 + (1 << header[9]), count * size)


@functools.cache
def _trusted() -> bool:
    """Whether ``_read`` reads this interpreter's dicts right: proved once per process on
    dicts of each kind (str keys, other keys, an entry deleted, empty) against ``id``."""
    if (
        sys.implementation.name != "cpython"
        or not (3, 11) <= sys.version_info[:2] <= (3, 14)
        or sysconfig.get_config_var("Py_GIL_DISABLED")
        or struct.calcsize("P") != 8
    ):
        return False
    names = {f"name{i}": object() for i in range(40)}
    del names["name3"]
    samples = (names, {**names, 7: object()}, {})
    return all(_pairs(_read(d)) == [(id(k), id(v)) for k, v in d.items()] for d in samples)


def _pairs(read: Table | None) -> list[tuple[int, int]] | None:
    """The (key, value) addresses of a ``_read``, its deleted entries left out."""
    if read is None:
        return None
    kind, entries = read
    words = struct.unpack(f"{len(entries) // 8}Q", entries)
    step = _ENTRY[kind] // 8  # the key and the value are an entry's last two words
    keys, values = words[step - 2 :: step], words[step - 1 :: step]
    return [(k, v) for k, v in zip(keys, values, strict=True) if k]
