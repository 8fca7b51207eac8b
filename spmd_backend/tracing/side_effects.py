"""Python state a traced step writes: replayed where eager's effect is an assignment, refused
elsewhere.

A compile-door trace runs the step's Python once and the graph replays its tensor operations
only. Whatever the step writes into Python state is done once, while tracing, and with
trace-time tensors (functional or fake tensors, meaningless after the trace): a module attribute
set in forward (``self.last_attention = attn``; torch's old-style ``weight_norm``,
``spectral_norm`` and pruning hooks set ``module.weight``), a key set in an argument dict
(``metrics["loss"] = loss.detach()``, ``labels = batch.pop("labels")``), a loss appended to a
global list. Each of these used to leave a trace tensor behind (or, in an argument dict, which
the trace sees as a copy, nothing at all), and no later call repeated it: silently.

:class:`StateSnapshot` records, before the user's step runs, shallow copies of

* the attribute dicts of the bound module tree,
* the argument containers the trace passes to the step (dicts, ``UserDict`` data, lists,
  dataclass instances: copies of the caller's, see :mod:`spmd_backend.tracing.tracked`),
* the containers, user objects and other modules outside the step that it can reach
  (:func:`~spmd_backend.tracing.free_values.mutable_objects`), a few levels deep, and the
  optimizer object's attributes.

:meth:`StateSnapshot.effects` compares after the step and returns :class:`Effects`:

* a module attribute of the bound tree set to a tensor the step computed: an output of the
  graph, assigned after each successful run (:class:`AttributeEffect`), as eager leaves it
  (the value, not its autograd history); set to a container of such tensors: refused in a
  module class of the user's, put back as it was in torch's or a library's (a recurrent
  layer's ``_flat_weights`` list, which torch refreshes itself);
* a buffer the step registers (``register_buffer`` in a first forward): registered with the
  graph's output after each successful run (:class:`BufferEffect`); a parameter or submodule it
  registers is refused (the optimizer could not hold it). A buffer it *rebinds* is
  :mod:`spmd_backend.tracing.rebound_buffers`' business;
* a key of an argument dict set to such a tensor or to a plain value, or deleted: done to the
  caller's dict of that call after each successful run (:class:`ItemEffect`);
* anything else that changed a container outside the step (a list append, a global dict's key, a
  set), put a trace tensor anywhere else (a user object's or the optimizer's attribute, a list
  inside a module attribute) or changed an argument list or dataclass: :class:`SpmdUsageError` naming where,
  after :meth:`StateSnapshot.restore` put every recorded container back.

Plain attribute values of modules and objects (``self.calls += 1``) are the step key's business:
the key holds them, so a step that changes one retraces (and says so).

Guarantees: reads only, until :meth:`StateSnapshot.restore`; never calls a property or a
``__getattr__``; a bounded walk (:data:`MAX_DEPTH` levels, :data:`MAX_ITEMS` items).
"""

from __future__ import annotations

import collections
import dataclasses
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake
from torch._subclasses.functional_tensor import FunctionalTensor

from spmd_backend.errors import SpmdUsageError
from spmd_backend.tracing.free_values import is_user_class
from spmd_backend.tracing.values import is_plain

#: container levels followed below a module attribute, an argument or an outside object
MAX_DEPTH = 3
#: items copied in all (a global list of a million numbers is compared by length only)
MAX_ITEMS = 200_000

#: a module's own bookkeeping: never the step's Python state
_MODULE_INTERNALS = frozenset({
    "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_backward_pre_hooks",
    "_backward_hooks", "_forward_hooks", "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs",
    "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks", "_is_full_backward_hook",
})

#: objects compared by identity only (their state is the trace's, the key's or torch's)
_OPAQUE = (torch.Tensor, nn.Module, torch.optim.Optimizer, type, types.ModuleType,
           types.FunctionType, types.MethodType)

#: how an argument container is reached from ``(args, kwargs)``: ("seq", i), ("map", key) or
#: ("attr", name) per level
Path = tuple[tuple[str, Any], ...]


def is_trace_tensor(value: Any) -> bool:
    """A tensor made by the trace (functional or fake): meaningless once the trace is over."""
    return isinstance(value, torch.Tensor) and (isinstance(value, FunctionalTensor) or is_fake(value))


def _holds_trace_tensor(value: Any, depth: int = 0) -> bool:
    if is_trace_tensor(value):
        return True
    if depth >= MAX_DEPTH:
        return False
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_holds_trace_tensor(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return any(_holds_trace_tensor(v, depth + 1) for v in dict.values(value))
    return False


@dataclass(frozen=True)
class AttributeEffect:
    """``modules[module].<name> = <graph output>`` after each successful run."""

    module: int
    name: str

    def apply(self, modules: Sequence[tuple[str, nn.Module]], value: Any) -> None:
        setattr(modules[self.module][1], self.name, value)


@dataclass(frozen=True)
class BufferEffect:
    """``modules[module].register_buffer(<name>, <graph output>, persistent)`` after each
    successful run (a buffer the step registered; an existing one is rebound)."""

    module: int
    name: str
    persistent: bool

    def apply(self, modules: Sequence[tuple[str, nn.Module]], value: Any) -> None:
        mod = modules[self.module][1]
        if self.name in mod._buffers:
            mod._buffers[self.name] = value
        else:
            mod.register_buffer(self.name, value, persistent=self.persistent)


@dataclass(frozen=True)
class ItemEffect:
    """``<argument container at path>[key] = value`` (or ``del``) on the caller's objects."""

    path: Path
    key: Any
    delete: bool = False

    def apply(self, original: tuple, value: Any = None) -> None:
        container: Any = original
        for kind, step in self.path:
            container = getattr(container, step) if kind == "attr" else container[step]
        if self.delete:
            if self.key in container:
                del container[self.key]
        else:
            container[self.key] = value


Effect = AttributeEffect | BufferEffect | ItemEffect


@dataclass
class Effects:
    """What to replay after each successful run of the graph."""

    #: effects whose value is a tensor the step computed, with that (trace) tensor
    tensors: list[tuple[Effect, torch.Tensor]] = field(default_factory=list)
    #: effects whose value is a constant (a plain value, a tensor from outside), or a deletion
    consts: list[tuple[Effect, Any]] = field(default_factory=list)


@dataclass
class _Record:
    label: str
    obj: Any
    kind: str  # "list" | "dict" | "set" | "vars"
    copy: Any


def _items(container: Any, kind: str) -> list[tuple[Any, Any]]:
    if kind == "list":
        return list(enumerate(container))
    if kind == "dict":
        return list(dict.items(container))  # the base method: a tracking dict records no read
    if kind == "vars":
        return list(vars(container).items())
    return []


def _kind(value: Any) -> str | None:
    """How to copy and compare ``value``: a container, the attributes of an object of the
    user's own classes (or a dataclass, a ``UserDict``), or None (compared by identity)."""
    if isinstance(value, list):
        return "list"
    if isinstance(value, dict):
        return "dict"
    if isinstance(value, set):
        return "set"
    if isinstance(value, collections.UserDict):
        return "vars"
    if isinstance(value, _OPAQUE) or is_plain(value) or callable(value):
        return None
    if (dataclasses.is_dataclass(value) or is_user_class(type(value))) \
            and hasattr(value, "__dict__"):
        return "vars"
    return None


def _copy(obj: Any, kind: str) -> Any:
    """A shallow copy: a dict of the items (a list's by index), a set as a set."""
    if kind == "list":
        return dict(enumerate(obj))
    if kind == "dict":
        return dict(dict.items(obj))
    if kind == "set":
        return set(obj)
    return dict(vars(obj))


class StateSnapshot:
    """Shallow copies of the Python state a step can write (see the module docstring)."""

    def __init__(
        self,
        modules: Sequence[tuple[str, nn.Module]],
        arguments: tuple,
        outside: Sequence[tuple[str, Any]],
        arg_label: Callable[[Path], str],
    ) -> None:
        self.modules = modules
        self.arguments = arguments
        self.arg_label = arg_label
        self.module_attrs = [dict(vars(m)) for _, m in modules]
        self.module_members = [(set(m._buffers), set(m._parameters), set(m._modules))
                               for _, m in modules]
        self.items = 0
        self.outside: list[_Record] = []
        bound = {id(m) for _, m in modules}
        for label, obj in outside:
            if id(obj) not in bound:
                self._record(label, obj, 0, self.outside, set())
        self.args: list[tuple[Path, _Record]] = []
        self._record_arguments(arguments, (), 0)

    # ------------------------------------------------------------------ before
    def _record(self, label: str, obj: Any, depth: int, into: list[_Record], seen: set[int]) -> None:
        whole = isinstance(obj, (nn.Module, torch.optim.Optimizer))
        kind = "vars" if whole else _kind(obj)
        if kind is None or id(obj) in seen or depth > MAX_DEPTH or self.items > MAX_ITEMS:
            return
        seen.add(id(obj))
        snap = _copy(obj, kind)
        self.items += len(snap)
        into.append(_Record(label, obj, kind, snap))
        if whole:
            return  # another module's or the optimizer's attributes: compared, not followed
        for k, v in _items(obj, kind):
            sub = f"{label}[{k!r}]" if kind in ("list", "dict") else f"{label}.{k}"
            self._record(sub, v, depth + 1, into, seen)

    def _record_arguments(self, node: Any, path: Path, depth: int) -> None:
        if depth > MAX_DEPTH:
            return
        if isinstance(node, collections.UserDict):
            self._record_arguments(node.data, path, depth)
            return
        kind = _kind(node) if not isinstance(node, tuple) else None
        if kind is not None and kind != "set":
            self.args.append((path, _Record(self.arg_label(path), node, kind, _copy(node, kind))))
        if isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                self._record_arguments(v, path + (("seq", i),), depth + 1)
        elif isinstance(node, dict):
            for k, v in dict.items(node):
                self._record_arguments(v, path + (("map", k),), depth + 1)
        elif kind == "vars" and dataclasses.is_dataclass(node):
            for f in dataclasses.fields(node):
                self._record_arguments(getattr(node, f.name), path + (("attr", f.name),),
                                       depth + 1)

    # ------------------------------------------------------------------ after
    def effects(self) -> Effects:
        """What the step wrote, as effects to replay; refuses (after :meth:`restore`) what
        cannot be replayed. Module attributes that hold a trace tensor are put back as they
        were before the step (the runs assign the replayed values)."""
        try:
            found = Effects()
            self._module_effects(found)
            self._argument_effects(found)
            self._outside_changes()
        except SpmdUsageError:
            self.restore()
            raise
        self.restore_modules(only_trace_tensors=True)
        return found

    def _module_effects(self, found: Effects) -> None:
        for i, ((name, mod), (buffers, params, children)) in enumerate(
                zip(self.modules, self.module_members)):
            prefix = name + "." if name else ""
            for attr in mod._parameters.keys() - params:
                raise _refusal(f"registers parameter {prefix}{attr} (create it in the "
                               "module's __init__, before the optimizer)")
            for attr in mod._modules.keys() - children:
                raise _refusal(f"registers submodule {prefix}{attr}")
            for attr in mod._buffers.keys() - buffers:
                value = mod._buffers[attr]
                effect = BufferEffect(i, attr, attr not in mod._non_persistent_buffers_set)
                if is_trace_tensor(value):
                    found.tensors.append((effect, value))
                else:
                    found.consts.append((effect, value))
        for i, ((name, mod), before) in enumerate(zip(self.modules, self.module_attrs)):
            for attr, value in vars(mod).items():
                if attr in _MODULE_INTERNALS or before.get(attr, _MISSING) is value:
                    continue
                where = f"attribute {name + '.' if name else ''}{attr} of the model"
                if is_trace_tensor(value):
                    found.tensors.append((AttributeEffect(i, attr), value))
                elif _holds_trace_tensor(value) and is_user_class(type(mod)):
                    # torch's own caches (an RNN's _flat_weights list) are refreshed by torch
                    # and get their value before the step back; the user's would be stale
                    raise _refusal(f"sets {where} to a {type(value).__name__} holding tensors "
                                   "it computed (only a tensor itself is written back)")

    def _argument_effects(self, found: Effects) -> None:
        for path, rec in self.args:
            after = dict(_items(rec.obj, rec.kind))
            if after.keys() == rec.copy.keys() and all(after[k] is rec.copy[k] for k in after):
                continue
            if rec.kind != "dict":
                what = "a list" if rec.kind == "list" else f"a {type(rec.obj).__name__}"
                raise _refusal(f"changes argument {rec.label}, {what} (only the keys of "
                               "argument dicts are written back)")
            for k in rec.copy.keys() - after.keys():
                found.consts.append((ItemEffect(path, k, delete=True), None))
            for k, v in after.items():
                if k in rec.copy and rec.copy[k] is v:
                    continue
                where = f"argument {self.arg_label(path + (('map', k),))}"
                if is_trace_tensor(v):
                    found.tensors.append((ItemEffect(path, k), v))
                elif is_plain(v) or (isinstance(v, torch.Tensor) and not _holds_trace_tensor(v)):
                    found.consts.append((ItemEffect(path, k), v))
                else:
                    raise _refusal(f"sets {where} to a {type(v).__name__} (only tensors and "
                                   "plain values are written back)")

    def _outside_changes(self) -> None:
        for rec in self.outside:
            if rec.kind == "set":
                if set(rec.obj) != rec.copy:
                    raise _refusal(f"changes {rec.label}, a set")
                continue
            after = dict(_items(rec.obj, rec.kind))
            for k, v in after.items():
                old = rec.copy.get(k, _MISSING)
                if old is v:
                    continue
                if rec.kind == "vars":
                    if _holds_trace_tensor(v):
                        raise _refusal(f"sets {rec.label}.{k} to a tensor it computed")
                    continue  # a plain attribute: the key's business
                if rec.kind == "list":
                    raise _refusal(f"appends to {rec.label}, a list" if old is _MISSING
                                   else f"changes item {k} of {rec.label}, a list")
                raise _refusal(f"sets key {k!r} of {rec.label}, a dict")
            if rec.kind != "vars" and len(after) != len(rec.copy):
                raise _refusal(f"removes items from {rec.label}, a {rec.kind}")

    # ------------------------------------------------------------------ undo
    def restore_modules(self, only_trace_tensors: bool = False) -> None:
        """Put the bound modules' attributes back as they were before the step: all of them, or
        only those that hold a trace tensor (which would outlive the trace; a plain value the
        step changed stays, as eager leaves it, and the key retraces on it)."""
        for (_, mod), before, (buffers, params, children) in zip(
                self.modules, self.module_attrs, self.module_members):
            for attr in mod._buffers.keys() - buffers:  # registered by the step
                del mod._buffers[attr]
                mod._non_persistent_buffers_set.discard(attr)
            for attr in mod._parameters.keys() - params:
                del mod._parameters[attr]
            for attr in mod._modules.keys() - children:
                del mod._modules[attr]
            state = vars(mod)
            for attr in [a for a in state if a not in _MODULE_INTERNALS]:
                if only_trace_tensors and not _holds_trace_tensor(state[attr]):
                    continue
                if attr not in before:
                    del state[attr]
                elif state[attr] is not before[attr]:
                    state[attr] = before[attr]

    def restore(self) -> None:
        """Put every recorded container and object back (the step is refused)."""
        self.restore_modules()
        for rec in self.outside:
            if rec.kind == "list":
                rec.obj[:] = [rec.copy[i] for i in range(len(rec.copy))]
            elif rec.kind == "dict":
                dict.clear(rec.obj)
                dict.update(rec.obj, rec.copy)
            elif rec.kind == "set":
                rec.obj.clear()
                rec.obj.update(rec.copy)
            else:
                state = vars(rec.obj)
                for k in [k for k in state if k not in rec.copy]:
                    del state[k]
                state.update(rec.copy)


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()


def _refusal(action: str) -> SpmdUsageError:
    return SpmdUsageError(
        f"spmd_backend.compile: the train step {action}. The compiled step runs the step's "
        "Python once, while tracing, and replays only its tensor operations, so this write "
        "would happen once (and a tensor it stores would be a stand-in of the trace). Return "
        "the value from the step and store it after the call (a module attribute or a key of "
        "an argument dict set to a tensor is written back after each call), or compile with "
        'torch.compile(step, backend="spmd"), which replays such writes. Nothing was changed.'
    )
