"""Python values as entries of a step's cache key: what compares by value, and how.

:func:`hashable` turns an argument, a default or a guarded value into a hashable form that
compares equal exactly when a trace would agree: plain values as they are, tensors by their
spec (:func:`tensor_spec`), containers by their contents, numpy scalars by dtype and value,
``functools.partial`` by its function and settings, a plain object (``SimpleNamespace``,
``argparse.Namespace``, an options class) by its fields, and anything else by identity
(:class:`SameObject`, which holds the object so its ``id`` is never reused while the key lives).

Requires nothing beyond torch. Guarantees: never calls user code except ``vars()`` and numpy's
``item()``; never imports numpy.
"""

from __future__ import annotations

import enum
import functools
import types
from typing import Any

import torch

_PLAIN_TYPES = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device,
                torch.layout, torch.memory_format)
PLAIN_TYPE_SET = frozenset(_PLAIN_TYPES)


def tensor_spec(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.dtype, t.device, t.requires_grad)



# Computed for every call of a compiled step (the key), so these test an object's real type
# (``type``/``issubclass``) rather than ``isinstance``, which also asks the object for its
# ``__class__``: through a transformers config's ``__getattribute__`` that was a tenth of a
# GPT-2 step's key.
def is_plain(value: Any) -> bool:
    """A Python value a trace can bake in and a key can compare by value."""
    t = type(value)
    if t in PLAIN_TYPE_SET or issubclass(t, _PLAIN_TYPES) or issubclass(t, enum.Enum):
        return True
    if t is tuple or t is frozenset:
        return all(is_plain(v) for v in value)
    return False


def numpy_scalar(value: Any) -> tuple | None:
    """A numpy scalar (``np.float32(0.5)``, ``np.int64(3)``) keyed by its dtype and value, else
    None (without importing numpy)."""
    t = type(value)
    if t.__module__ == "numpy" and getattr(value, "shape", None) == () and hasattr(value, "item"):
        return ("numpy", str(value.dtype), value.item())
    return None


class SameObject:
    """An object a key compares by identity. The key holds it, so its ``id`` cannot be reused
    by another object while the key lives: keyed by the bare ``id``, a new
    ``functools.partial`` made each call at a freed address replayed another one's graph
    (hunt 45)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SameObject) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __repr__(self) -> str:
        return f"<{type(self.obj).__qualname__} object at {id(self.obj):#x}>"


#: attributes of an object argument keyed by value (a larger one is keyed by identity)
MAX_OBJECT_FIELDS = 64


def _object_fields(value: Any, depth: int) -> tuple | None:
    """The attributes of a plain object argument (``types.SimpleNamespace``,
    ``argparse.Namespace``, a user's options class) keyed by value, or None for anything else:
    keyed by identity only, a field changed in place replayed the old value's graph (hunt 45)."""
    if depth >= 4 or isinstance(value, (torch.nn.Module, torch.optim.Optimizer, type,
                                        types.ModuleType, types.FunctionType,
                                        types.MethodType, types.BuiltinFunctionType)):
        return None
    try:
        attrs = vars(value)
    except TypeError:
        return None
    if len(attrs) > MAX_OBJECT_FIELDS:
        return None
    return tuple((k, hashable(v, depth + 1)) for k, v in sorted(attrs.items()))


def hashable(value: Any, _depth: int = 0) -> Any:
    """``value`` in a hashable form that compares equal exactly when the trace would agree."""
    t = type(value)
    if t in PLAIN_TYPE_SET:
        return value
    if issubclass(t, torch.Tensor):
        return ("tensor",) + tensor_spec(value)
    if is_plain(value):
        return value
    if issubclass(t, (list, tuple)):
        return (t.__name__, tuple(hashable(v, _depth) for v in value))
    if issubclass(t, dict):
        return ("dict", tuple((hashable(k, _depth), hashable(v, _depth)) for k, v in value.items()))
    scalar = numpy_scalar(value)
    if scalar is not None:
        return scalar
    if t is functools.partial:  # its settings live in func/args/keywords, not in vars()
        return ("partial", hashable(value.func, _depth), hashable(value.args, _depth),
                hashable(value.keywords, _depth))
    fields = _object_fields(value, _depth)
    if fields is not None:
        return ("object", t.__qualname__, fields)
    return ("object", t.__qualname__, SameObject(value))
