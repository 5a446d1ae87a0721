"""What one level inside a value is now: a fingerprint of a module global, for ``reuse``.

A warm rank compares each global of the user's modules before and after a test (``reuse``);
for a container, a tensor, an ``nn.Module``, an array, a generator or an object, the global's
identity says nothing of what is inside it. ``state_of`` reads one level inside, cheaply: a
key compared with ``==`` (sizes, versions, bytes, states) and the objects held, compared by
identity. What it cannot see (deeper levels, ``__slots__``-only objects) ``reuse`` lists.
"""

from __future__ import annotations

import random
import sys
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
        (type, lambda v, m: _class(v) if v.__module__ == m else None),
        (types.FunctionType, lambda v, m: _attributes(v) if v.__module__ == m else None),
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


def _class(value: type) -> State:
    """A class's own attributes, but ``__slotnames__``: Python caches it on the class the first
    time one of its instances is pickled or copied, as a rank's result is when it goes back
    to the parent (a dataclass a lesson returns retired its world after each first test)."""
    names = {k: v for k, v in vars(value).items() if k != "__slotnames__"}
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
