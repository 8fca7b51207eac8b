"""Containers that record what the traced step reads, so a graph is keyed on what it used.

A compiled graph bakes in every Python value the step read while it was traced. Keying the graph
on *every* non-tensor value the call received is safe but retraces on values the step never
looks at (a dataset's ``idx`` or ``source`` entry that changes every call). Like Dynamo's guards,
we record reads instead:

* :class:`ReadTrackingDict` stands in for a ``dict`` of the step's arguments during the trace and
  reports each key whose value is read (``d[k]``, ``d.get(k)``, iteration over values or items,
  ``**d`` and copies read everything). Keys, ``len`` and ``in`` read only the structure, which is
  part of the graph's key anyway.
* :func:`rebuild_tracked` rebuilds an argument tree with tracking dicts for the trace (only the
  dicts that hold a non-tensor leaf are replaced; ``UserDict`` subclasses such as transformers'
  ``BatchEncoding`` get a tracking ``.data``).
* :func:`adapt_user_dicts` makes ``UserDict`` arguments pytree mappings and dataclass instances
  pytree nodes of their fields (a dataclass field is read as an attribute, so its non-tensor
  values are keyed by value, never read-tracked).
* :class:`ReadRecorder` collects the reads as flat-leaf indices.

Requires nothing of the user's objects and never mutates them.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch


class ReadRecorder:
    """Flat-leaf indices the step read, group keys the optimizer read, and the lifted
    hyper-parameter slots it compared with zero."""

    def __init__(self) -> None:
        self.leaves: set[int] = set()
        self.group_keys: dict[int, set[str]] = {}
        self.zero_tests: set[tuple[int, str, int | None]] = set()

    def read_leaves(self, indices: list[int]) -> None:
        self.leaves.update(indices)

    def read_group_key(self, group: int, key: str) -> None:
        self.group_keys.setdefault(group, set()).add(key)

    def compared_with_zero(self, slot: tuple[int, str, int | None]) -> None:
        self.zero_tests.add(slot)


class ReadTrackingDict(dict):
    """A ``dict`` that reports the keys whose values are read (see the module docstring).

    ``on_read(key)`` is called for every value read; ``on_read_all()`` when the values are read
    in bulk. ``__iter__`` is overridden so CPython's dict-merge fast paths (``dict(d)``,
    ``{**d}``, ``f(**d)``) go through ``keys()`` and ``__getitem__``.
    """

    __slots__ = ("_on_read", "_on_read_all")

    def __init__(
        self, items: Any, on_read: Callable[[Any], None], on_read_all: Callable[[], None]
    ) -> None:
        super().__init__(items)
        self._on_read = on_read
        self._on_read_all = on_read_all

    def __getitem__(self, key: Any) -> Any:
        value = super().__getitem__(key)
        self._on_read(key)
        return value

    def get(self, key: Any, default: Any = None) -> Any:
        if super().__contains__(key):
            self._on_read(key)
        return super().get(key, default)

    def __iter__(self) -> Iterator[Any]:
        return iter(list(super().keys()))

    def values(self):  # type: ignore[override]
        self._on_read_all()
        return super().values()

    def items(self):  # type: ignore[override]
        self._on_read_all()
        return super().items()

    def pop(self, key: Any, *default: Any) -> Any:
        if super().__contains__(key):
            self._on_read(key)
        return super().pop(key, *default)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if super().__contains__(key):
            self._on_read(key)
        return super().setdefault(key, default)

    def copy(self) -> dict:
        self._on_read_all()
        return dict(super().items())

    def __copy__(self) -> dict:
        return self.copy()

    def __deepcopy__(self, memo: dict) -> dict:
        self._on_read_all()
        return copy.deepcopy(dict(super().items()), memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        self._on_read_all()
        return (dict, (dict(super().items()),))

    def __or__(self, other: Any) -> dict:
        self._on_read_all()
        return dict(super().items()) | other

    def __eq__(self, other: object) -> bool:
        self._on_read_all()
        return dict(super().items()) == other

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        self._on_read_all()
        return dict.__repr__(self)


def _is_tensor_free(node: Any) -> bool:
    return not isinstance(node, torch.Tensor)


def rebuild_tracked(
    tree: Any,
    leaf_paths: dict[int, tuple[Any, ...]],
    recorder: ReadRecorder,
) -> Any:
    """``tree`` with each dict that holds a non-tensor leaf replaced by a tracking copy.

    ``leaf_paths`` maps a flat-leaf index to its key path (``pytree.tree_flatten_with_path``
    entries' keys); a read of ``d[k]`` marks every leaf below ``d[k]`` as read. Other containers
    are kept as they are (their leaves count as read by whoever reads the container).
    """
    by_prefix: dict[tuple[Any, ...], list[int]] = collections.defaultdict(list)
    for index, path in leaf_paths.items():
        for cut in range(len(path) + 1):
            by_prefix[path[:cut]].append(index)

    def wrap(node: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(node, collections.UserDict):
            clone = copy.copy(node)
            clone.data = wrap(dict(node.data), path)
            return clone
        if type(node) is dict:
            children = {k: wrap(v, path + (_key_of(k),)) for k, v in node.items()}
            if all(isinstance(v, torch.Tensor) for v in children.values()):
                return children

            def on_read(k: Any, _path: tuple[Any, ...] = path) -> None:
                recorder.read_leaves(by_prefix.get(_path + (_key_of(k),), []))

            def on_read_all(_path: tuple[Any, ...] = path) -> None:
                recorder.read_leaves(by_prefix.get(_path, []))

            return ReadTrackingDict(children, on_read, on_read_all)
        if type(node) in (list, tuple):
            return type(node)(wrap(v, path + (_SeqKey(i),)) for i, v in enumerate(node))
        return node

    return wrap(tree, ())


class _SeqKey:
    """A sequence position in a key path (compared by index)."""

    __slots__ = ("idx",)

    def __init__(self, idx: int) -> None:
        self.idx = idx

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _SeqKey) and other.idx == self.idx

    def __hash__(self) -> int:
        return hash(("seq", self.idx))


def _key_of(k: Any) -> tuple[str, Any]:
    return ("map", k)


class RecordingGroup(dict):
    """An optimizer param group that reports which keys the step reads (see :class:`ReadRecorder`)
    and remembers which it writes (:attr:`written`: a Python update of the group, which no graph
    can replay), and which of those it writes outside ``optimizer.step()`` (:attr:`written_outside`:
    the step function's own code, a warmup setting ``lr``; ``in_step`` says where a write is)."""

    __slots__ = ("_in_step", "_report", "written", "written_outside")

    def __init__(self, items: Any, report: Callable[[str], None],
                 in_step: Callable[[], bool]) -> None:
        super().__init__(items)
        self._report = report
        self._in_step = in_step
        self.written: set[Any] = set()
        self.written_outside: set[Any] = set()

    def _wrote(self, key: Any) -> None:
        self.written.add(key)
        if not self._in_step():
            self.written_outside.add(key)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._wrote(key)
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        self._wrote(key)
        super().__delitem__(key)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        self._report(key)
        if key not in self:
            self._wrote(key)
        return super().setdefault(key, default)

    def pop(self, key: Any, *default: Any) -> Any:
        self._wrote(key)
        return super().pop(key, *default)

    def update(self, *args: Any, **kwargs: Any) -> None:
        new = dict(*args, **kwargs)
        for key in new:
            self._wrote(key)
        super().update(new)

    def __getitem__(self, key: Any) -> Any:
        self._report(key)
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self._report(key)
        return super().get(key, default)

    def __iter__(self) -> Iterator[Any]:
        return iter(list(super().keys()))

    def values(self):  # type: ignore[override]
        for k in super().keys():
            self._report(k)
        return super().values()

    def items(self):  # type: ignore[override]
        for k in super().keys():
            self._report(k)
        return super().items()

    def copy(self) -> dict:
        for k in super().keys():
            self._report(k)
        return dict(super().items())


def tree_key_path(path: tuple[Any, ...]) -> tuple[Any, ...]:
    """A pytree key path (``MappingKey``/``SequenceKey`` entries) in :func:`rebuild_tracked`'s form."""
    from torch.utils._pytree import MappingKey, SequenceKey

    out: list[Any] = []
    for entry in path:
        if isinstance(entry, MappingKey):
            out.append(_key_of(entry.key))
        elif isinstance(entry, SequenceKey):
            out.append(_SeqKey(entry.idx))
        else:
            out.append(entry)
    return tuple(out)


# ------------------------------------------------------------------ UserDict arguments
class _UserDictContext:
    """pytree context of a ``UserDict`` argument: compared by type and keys; keeps the object
    it came from so unflattening can return a copy of it (``BatchEncoding`` keeps its extras)."""

    __slots__ = ("original", "keys")

    def __init__(self, original: collections.UserDict, keys: tuple[Any, ...]) -> None:
        self.original = original
        self.keys = keys

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, _UserDictContext)
            and type(other.original) is type(self.original)
            and other.keys == self.keys
        )

    def __hash__(self) -> int:
        return hash((type(self.original), self.keys))

    def __repr__(self) -> str:
        return f"{type(self.original).__name__}{list(self.keys)}"


class UserDictArgument:
    """A ``UserDict`` (such as transformers' ``BatchEncoding``) seen by pytree as a mapping."""

    __slots__ = ("original",)

    def __init__(self, original: collections.UserDict) -> None:
        self.original = original


def _flatten_user_dict(node: UserDictArgument) -> tuple[list[Any], _UserDictContext]:
    keys = tuple(node.original.data.keys())
    return [node.original.data[k] for k in keys], _UserDictContext(node.original, keys)


def _flatten_user_dict_with_keys(node: UserDictArgument) -> tuple[list[tuple[Any, Any]], Any]:
    from torch.utils._pytree import MappingKey

    values, context = _flatten_user_dict(node)
    return [(MappingKey(k), v) for k, v in zip(context.keys, values)], context


def _unflatten_user_dict(values: Any, context: _UserDictContext) -> collections.UserDict:
    clone = copy.copy(context.original)
    clone.data = dict(zip(context.keys, values))
    return clone


def _register_node(cls: type, flatten: Callable[..., Any], unflatten: Callable[..., Any],
                   flatten_with_keys: Callable[..., Any]) -> None:
    """Register an argument wrapper with pytree once per process."""
    import torch.utils._pytree as pytree

    if cls not in pytree.SUPPORTED_NODES:
        pytree.register_pytree_node(cls, flatten, unflatten, flatten_with_keys_fn=flatten_with_keys)


# ------------------------------------------------------------------ dataclass arguments
class DataclassArgument:
    """A dataclass instance (a ``Batch(x, y, weight)``) seen by pytree as its fields: tensors
    become graph inputs, other fields are keyed by value (never read-tracked)."""

    __slots__ = ("original",)

    def __init__(self, original: Any) -> None:
        self.original = original


def _flatten_dataclass(node: DataclassArgument) -> tuple[list[Any], _UserDictContext]:
    names = tuple(f.name for f in dataclasses.fields(node.original))
    values = [adapt_user_dicts(getattr(node.original, n)) for n in names]
    return values, _UserDictContext(node.original, names)


def _flatten_dataclass_with_keys(node: DataclassArgument) -> tuple[list[tuple[Any, Any]], Any]:
    from torch.utils._pytree import GetAttrKey

    values, context = _flatten_dataclass(node)
    return [(GetAttrKey(n), v) for n, v in zip(context.keys, values)], context


def _unflatten_dataclass(values: Any, context: _UserDictContext) -> Any:
    clone = copy.copy(context.original)
    for name, value in zip(context.keys, values):
        object.__setattr__(clone, name, value)  # frozen dataclasses too
    return clone


def adapt_user_dicts(tree: Any) -> Any:
    """``tree`` with every ``UserDict`` and dataclass instance (not known to pytree) wrapped as
    a pytree node: a mapping, or the dataclass's fields."""
    import torch.utils._pytree as pytree

    if isinstance(tree, collections.UserDict) and type(tree) not in pytree.SUPPORTED_NODES:
        _register_node(UserDictArgument, _flatten_user_dict, _unflatten_user_dict,
                       _flatten_user_dict_with_keys)
        return UserDictArgument(tree)
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type) \
            and type(tree) not in pytree.SUPPORTED_NODES:
        _register_node(DataclassArgument, _flatten_dataclass, _unflatten_dataclass,
                       _flatten_dataclass_with_keys)
        return DataclassArgument(tree)
    if type(tree) in (list, tuple):
        return type(tree)(adapt_user_dicts(v) for v in tree)
    if type(tree) is dict:
        return {k: adapt_user_dicts(v) for k, v in tree.items()}
    return tree
