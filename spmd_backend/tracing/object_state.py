"""The plain state of modules and of the optimizer object that a step's key holds.

A traced graph bakes in the Python settings the modules' code reads (``self.scale``, a dropout's
``p``, a config object's flags, an activation held as ``self.act``) and the hooks torch runs
around them; a custom optimizer's own attributes likewise. :func:`module_state` collects, per
module, its plain attributes (``training`` included; public lists, dicts and sets of plain
values up to :data:`MAX_KEYED_CONTAINER` entries; functions by identity) and hook ids, then the
plain attributes of the non-module objects the modules hold (a transformers config, a
namespace of options), :data:`MAX_HELD_DEPTH` objects deep, then the global module hooks.
:func:`optimizer_state_hooks` and :func:`optimizer_attributes` do the same for the optimizer
object. :class:`~spmd_backend.tracing.key.StepKey` holds the results and explains changes.

Guarantees: reads ``vars()`` only (no property or ``__getattr__`` runs); deterministic order;
hashable results.
"""

from __future__ import annotations

import collections
import functools
import types
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from spmd_backend.tracing.key import user_hooks
from spmd_backend.tracing.values import PLAIN_TYPE_SET, hashable, is_plain, numpy_scalar


def _hook_ids(module: nn.Module) -> tuple:
    return (
        tuple(user_hooks(module._forward_pre_hooks)), tuple(module._forward_hooks),
        tuple(module._backward_pre_hooks), tuple(module._backward_hooks),
    )


#: attribute types that are never plain and never hold plain settings (module internals)
_SKIPPED_TYPES = frozenset({dict, collections.OrderedDict, list, set})


#: longest public list or dict attribute keyed by value (longer ones are metadata: id2label)
MAX_KEYED_CONTAINER = 256


#: levels of objects followed from a module (``self.opts.deep.scale`` is two)
MAX_HELD_DEPTH = 3


_NO_KEY = object()


def _plain_item(value: Any, depth: int) -> Any:
    """``value`` keyed by value if it is plain, a numpy scalar or a container of such (nested
    up to three levels), else ``_NO_KEY``."""
    if is_plain(value):
        return value
    scalar = numpy_scalar(value)
    if scalar is not None:
        return scalar
    if depth < 3 and type(value) in (list, dict, set, tuple):
        contents = _plain_container(value, depth + 1)
        return _NO_KEY if contents is None else contents
    return _NO_KEY


def _plain_container(value: Any, depth: int = 0) -> tuple | None:
    """A list, dict or set of plain values (``self.mix = [0.3, 0.7]``,
    ``self.cfg = {"scale": 2}``, ``self.skip = {"head"}``, nested ones such as
    ``{"scales": [1, 2]}``, numpy scalars) as a hashable tuple; None when it holds anything
    else or is long. (Until 2026-11-28 nested containers and numpy scalars were not keyed and
    a change replayed the old value, hunt 45.)"""
    if len(value) > MAX_KEYED_CONTAINER:
        return None
    t = type(value)
    if t is not dict and t not in (list, set, tuple):
        return None
    entries = value.items() if t is dict else ((None, v) for v in value)
    items = []
    for k, v in entries:  # stops at the first entry it cannot key (a module's _parameters)
        key = _plain_item(k, depth)
        item = _plain_item(v, depth)
        if key is _NO_KEY or item is _NO_KEY:
            return None
        items.append((key, item) if t is dict else item)
    if t is dict:
        return ("dict", tuple(items))
    return ("set", frozenset(items)) if t is set else (t.__name__, tuple(items))


def _attributes(obj: Any) -> tuple[tuple, list[tuple[str, Any]]]:
    """``obj``'s plain attributes (public lists and dicts of plain values included), and the
    other attributes worth a look (objects)."""
    plain: list[tuple[str, Any]] = []
    others: list[tuple[str, Any]] = []
    for k, v in vars(obj).items():
        t = type(v)
        if t in PLAIN_TYPE_SET:
            plain.append((k, v))
        elif t in _SKIPPED_TYPES:
            # a list or dict of numbers, public or private (``self._w = [0.5]``), is a setting
            # the forward may read; a module's own bookkeeping (``_parameters``, hooks) holds
            # other objects and is not keyed here
            contents = _plain_container(v)
            if contents is not None:
                plain.append((k, contents))
            continue
        elif is_plain(v):
            plain.append((k, v))
        elif (scalar := numpy_scalar(v)) is not None:
            plain.append((k, scalar))
        elif t is tuple and (contents := _plain_container(v)) is not None:  # holding a list
            plain.append((k, contents))
        elif _is_function(v):
            # an activation or helper held as an attribute (``self.act = F.gelu``): swapping
            # it changes the graph; keyed by identity
            plain.append((k, ("function", v)))
        else:
            others.append((k, v))
    return tuple(plain), others


def _is_function(value: Any) -> bool:
    return isinstance(value, (types.FunctionType, types.BuiltinFunctionType, types.MethodType,
                              functools.partial))


def plain_attributes(obj: Any) -> tuple:
    return _attributes(obj)[0]


def _is_attribute_object(value: Any) -> bool:
    """A non-module object hanging off a module whose plain attributes a forward may read (a
    transformers config, a dataclass of options)."""
    if isinstance(value, (nn.Module, torch.Tensor, tuple, type)) or callable(value):
        return False
    try:
        vars(value)
    except TypeError:
        return False
    return True


def module_state(modules: Sequence[tuple[str, nn.Module]]) -> tuple:
    """Per module of ``modules`` (``named_modules()`` of the root): (fqn, its class and plain
    attributes including ``training``, hook ids); then the plain attributes of the objects modules hold
    (a config), each once; then the global hooks."""

    rows = []
    seen: set[int] = set()
    pending: list[tuple[str, Any, int]] = []
    for name, mod in modules:
        plain, others = _attributes(mod)
        # the class too: a parameter-free submodule swapped for another with the same
        # attributes (ReLU for SiLU, hunt 45) must not replay the old one's graph
        rows.append((name, (("__class__", type(mod)), *plain), _hook_ids(mod)))
        for attr, value in others:
            if id(value) not in seen and _is_attribute_object(value):
                seen.add(id(value))
                pending.append((f"{name}.{attr}" if name else attr, value, 1))
    held = []
    for label, obj, depth in pending:  # grows while walked: objects held by held objects
        plain, others = _attributes(obj)
        held.append((label, plain))
        if depth >= MAX_HELD_DEPTH:
            continue
        for attr, value in others:
            if id(value) not in seen and _is_attribute_object(value):
                seen.add(id(value))
                pending.append((f"{label}.{attr}", value, depth + 1))
    return (tuple(rows), tuple(held), global_module_hooks())


#: torch.nn.modules.module's global hook dicts (``register_module_forward_hook``, ...)
GLOBAL_MODULE_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks",
                       "_global_backward_pre_hooks", "_global_backward_hooks")


def global_module_hooks() -> tuple[tuple[int, ...], ...]:
    """The handles of the global module hooks registered now, per kind."""
    from torch.nn.modules import module as module_mod

    return tuple(tuple(getattr(module_mod, n, ())) for n in GLOBAL_MODULE_HOOKS)


def optimizer_state_hooks(opt: torch.optim.Optimizer) -> tuple:
    from torch.optim import optimizer as optim_mod

    return (
        tuple(opt._optimizer_step_pre_hooks), tuple(opt._optimizer_step_post_hooks),
        tuple(optim_mod._global_optimizer_pre_hooks), tuple(optim_mod._global_optimizer_post_hooks),
        hashable(opt.defaults),
    )


#: torch.optim bookkeeping that never changes what a step computes: an LR scheduler's
#: "step was called" flag (set by the first step), the fused path's "devices checked" flag,
#: a warning's and a profiler label
_OPTIMIZER_BOOKKEEPING = frozenset({
    "_opt_called", "_need_device_dtype_check_for_fused", "_warned_capturable_if_run_uncaptured",
    "_zero_grad_profile_name",
})


def optimizer_attributes(opt: torch.optim.Optimizer) -> tuple:
    """The optimizer object's own plain attributes (a custom optimizer's ``self.k`` that its
    ``step()`` reads), without torch's bookkeeping."""
    return tuple((k, v) for k, v in plain_attributes(opt) if k not in _OPTIMIZER_BOOKKEEPING)
