"""What a traced graph bakes in, and why a new call cannot reuse it.

A compiled step is valid only for the facts its trace depended on. Those facts are split in two:

* :class:`StepKey` (hashable, computed on every call by
  :meth:`~spmd_backend.tracing.binding.StepBinding.key`) holds what is always relevant: the
  identity of the module and optimizer, every tensor's shape/dtype/device/requires_grad, the
  optimizer state's structure, the argument tree's structure, every module's mode, plain
  attributes and hooks and the optimizer's hooks, defaults and plain attributes
  (:mod:`~spmd_backend.tracing.object_state`: ``model.eval()``, a swapped ``self.act``, a
  custom optimizer's Python counter), the process-wide flags that change what gets traced
  (grad mode, autocast, deterministic algorithms, default dtype, SDPA backends, float32 matmul
  precision), and the plain values the step function reads from its globals and closure
  (:mod:`~spmd_backend.tracing.free_values`: a global loss scale, ``args.clip``).
* :class:`Guard` values are what the trace was seen to *read*: non-lifted optimizer
  hyper-parameters (``eps``, ``amsgrad``, ...) and non-tensor entries of argument dicts. A value
  the step never read (a dataset's ``idx``) is in neither, so changing it reuses the graph.

:meth:`StepKey.explain` and :meth:`Guard.describe` say in one line what changed.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from spmd_backend.tracing.values import hashable

#: set (True) on a hook spmd_backend itself installs on a user's module (pending_work.py): the
#: step key and the free-value walk skip such hooks, which read nothing the trace depends on
INTERNAL_HOOK_ATTR = "_spmd_backend_internal_hook"


def user_hooks(hooks: dict) -> dict:
    """``hooks`` (a module's hook dict) without spmd_backend's own."""
    if not hooks:
        return hooks
    return {k: h for k, h in hooks.items() if not getattr(h, INTERNAL_HOOK_ATTR, False)}


def layout(t: torch.Tensor, symbolic: bool = False) -> Any:
    """How a tensor argument is laid out, as far as a trace depends on it: "contiguous", or
    its strides (a slice of a wider tensor, a transpose, channels_last). A trace on one layout
    can fail on another (a ``view`` of a transposed batch); until 2026-11-28 a batch of the
    traced shape with other strides failed the compiled call instead of retracing. Where some
    dims are traced ``symbolic``ally the strides hold their sizes, so the layout is its
    structure instead: the dims from outermost to innermost, the broadcast (stride 0) dims, and
    which neighbouring dims a ``view`` could merge."""
    if t.is_contiguous():
        return "contiguous"
    strides = t.stride()
    if not symbolic:
        return tuple(strides)
    order = tuple(sorted(range(t.dim()), key=lambda d: -strides[d]))
    mergeable = tuple(strides[d] == strides[d + 1] * t.shape[d + 1] for d in range(t.dim() - 1))
    return ("order", order, tuple(d for d in range(t.dim()) if strides[d] == 0), mergeable)


# ------------------------------------------------------------------ process-wide flags
def _sdp_flags() -> tuple:
    b = torch.backends.cuda
    return (b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled(),
            b.cudnn_sdp_enabled())


_CONTEXT_PROBES: tuple[tuple[str, Any], ...] = (
    ("torch.is_grad_enabled()", torch.is_grad_enabled),
    ("torch.is_inference_mode_enabled()", torch.is_inference_mode_enabled),
    ("autocast on cpu (enabled, dtype)",
     lambda: (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))),
    ("autocast on cuda (enabled, dtype)",
     lambda: (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))),
    ("torch.is_autocast_cache_enabled()", torch.is_autocast_cache_enabled),
    ("torch.are_deterministic_algorithms_enabled() (enabled, warn_only)",
     lambda: (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())),
    ("torch.get_default_dtype()", torch.get_default_dtype),
    ("the SDPA backends (flash, mem_efficient, math, cudnn)", _sdp_flags),
    # Inductor bakes the matmul precision (TF32 on GPUs) into the kernels it generates
    ("torch.get_float32_matmul_precision()", torch.get_float32_matmul_precision),
    # a TorchFunctionMode entered around the call rewrites what the trace records (hunt 45:
    # one doubling F.linear around later calls was ignored by the replay); keyed by class and
    # attributes
    ("the active TorchFunctionModes",
     lambda: tuple(hashable(m) for m in torch.overrides._get_current_function_mode_stack())),
)


def global_context() -> tuple:
    """The process-wide flags a trace depends on, in :data:`_CONTEXT_PROBES` order."""
    return tuple(probe() for _, probe in _CONTEXT_PROBES)


# ------------------------------------------------------------------ key and guards
@dataclass(frozen=True)
class Guard:
    """A value the trace read, with where it lives; the graph is reused only while it holds."""

    #: "group" (optimizer param group entry) | "sign" (the sign of a lifted hyper-parameter the
    #: step compared with zero) | "arg" (flat argument leaf)
    kind: str
    where: tuple  # ("group"/"sign": (group, key[, element])) | ("arg": (leaf index,))
    label: str
    value: Any

    def current(self, binding: Any) -> Any:
        if self.kind == "arg":
            return binding.leaf_key(self.where[0])
        group = binding.optimizer.param_groups[self.where[0]]
        if self.where[1] not in group:
            return ("missing",)
        value = group[self.where[1]]
        if len(self.where) == 3 and self.where[2] is not None:
            value = value[self.where[2]] if isinstance(value, (list, tuple)) else value
        if self.kind == "sign":
            return _sign(value)
        return hashable(value)

    def holds(self, binding: Any) -> bool:
        return self.current(binding) == self.value

    def describe(self, binding: Any) -> str:
        if self.kind == "sign":
            return (
                f"{self.label} (lifted; the step tests it against zero) changed from "
                f"{_SIGNS.get(self.value)} to {_SIGNS.get(self.current(binding))}"
            )
        now = self.current(binding)
        hint = number_hint(self.value, now) if self.kind == "arg" else ""
        return f"{self.label} (read by the step) changed from {fmt(self.value)} to {fmt(now)}{hint}"


_SIGNS = {-1: "a negative value", 0: "zero", 1: "a positive value", None: "a non-number"}


def _sign(value: Any) -> int | None:
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        value = value.item()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (value > 0) - (value < 0)
    return None


@dataclass(frozen=True)
class StepKey:
    """Everything a traced graph bakes in apart from its guards; see the module docstring."""

    module: int
    optimizer: int | None
    params: tuple
    grads: tuple
    buffers: tuple
    #: per buffer, the buffer whose memory holds it and the offset there
    #: (:mod:`spmd_backend.tracing.buffer_views`)
    buffer_views: tuple
    groups: tuple
    state: tuple
    optimizer_hooks: tuple
    optimizer_attrs: tuple
    args_spec: Any
    args: tuple
    modules: tuple
    aux: tuple
    context: tuple
    #: ``(label, value)`` of the plain values the step function reads from its globals, closure
    #: and the objects they hold (see :mod:`spmd_backend.tracing.free_values`)
    free_values: tuple = ()

    def explain(self, other: StepKey, binding: Any = None) -> str:
        """A one-line reason why ``other`` (the new call) cannot reuse this key's graph."""
        for f in fields(self):
            old, new = getattr(self, f.name), getattr(other, f.name)
            if old == new:
                continue
            why = _EXPLAIN.get(f.name, lambda o, n, b: None)(old, new, binding)
            if why:
                return why
            return _LABELS.get(f.name, f"{f.name} changed")
        return "no difference"


_LABELS = {
    "module": "a different module was passed",
    "optimizer": "a different optimizer was passed",
    "buffer_views": "which buffers share memory changed",
    "groups": "the optimizer's param groups changed (parameters or keys)",
    "optimizer_hooks": "the optimizer's hooks or defaults changed",
    "args_spec": "the structure of the arguments changed",
    "aux": "a GradScaler's settings or state changed",
}


def fmt(spec: Any) -> str:
    if isinstance(spec, tuple) and len(spec) in (5, 6) and spec[0] == "tensor":
        shape, dtype, device, rg = spec[1:5]
        dims = [d[1] if isinstance(d, tuple) else d for d in shape]
        lay = spec[5] if len(spec) == 6 else "contiguous"
        strides = ("" if lay == "contiguous" else f", layout={lay}" if lay[:1] == ("order",)
                   else f", strides={list(lay)}")
        return f"tensor(shape={dims}, dtype={dtype}, device={device}, requires_grad={rg}{strides})"
    if isinstance(spec, tuple) and len(spec) == 2 and spec[0] == "const":
        return repr(spec[1])
    return repr(spec)


def _first_diff(old: Sequence[Any], new: Sequence[Any]) -> int | None:
    for i, (a, b) in enumerate(zip(old, new)):
        if a != b:
            return i
    return None


def _explain_tensors(field: str) -> Any:
    what = {"params": "parameter", "grads": "the gradient of", "buffers": "buffer",
            "state": "the optimizer state of"}[field]

    def explain(old: tuple, new: tuple, binding: Any) -> str | None:
        if binding is None:
            return None
        names = binding.buffer_names if field == "buffers" else binding.param_names
        if len(old) != len(new):
            return f"the module's {field} changed (count {len(old)} -> {len(new)})"
        i = _first_diff(old, new)
        if i is None:
            return None
        a, b = old[i], new[i]
        if field in ("params", "buffers"):  # (id, shape, dtype, device, requires_grad)
            if a[0] != b[0]:
                return f"{what} {names[i][0]!r} was replaced by another tensor"
            a, b = ("tensor",) + a[1:], ("tensor",) + b[1:]
        if field == "state":
            number = _state_number_change(a, b)
            if number:
                return f"{what} {names[i][0]!r}: {number}"
        return f"{what} {names[i][0]!r} changed from {fmt(a)} to {fmt(b)}"

    return explain


def _state_number_change(old: Any, new: Any) -> str:
    """For one parameter's optimizer state (``(key, spec)`` pairs) in which only a Python
    number changed: which, and what to do (empty otherwise)."""
    if not (isinstance(old, tuple) and isinstance(new, tuple) and len(old) == len(new)):
        return ""
    changed = [(ka, va, vb) for (ka, va), (kb, vb) in zip(old, new) if ka != kb or va != vb]
    if len(changed) != 1:
        return ""
    k, a, b = changed[0]
    if isinstance(a, bool) or not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return ""
    return (f"{k!r}, a Python number, changed from {a!r} to {b!r}. A number in optimizer state "
            "is a constant of the graph, so an optimizer that counts in Python (a custom or "
            "third-party one) retraces on every call: keep it a tensor (state['step'] = "
            "torch.tensor(0.0), incremented in place, as torch.optim does), or compile the "
            'step with torch.compile(step, backend="spmd"), which takes such a number as an '
            "input")


def _explain_args(old: tuple, new: tuple, binding: Any) -> str | None:
    if binding is None or len(old) != len(new):
        return None
    i = _first_diff(old, new)
    if i is None:
        return None
    return (f"argument {binding.arg_paths()[i]} changed from {fmt(old[i])} to {fmt(new[i])}"
            f"{number_hint(old[i], new[i])}{shape_hint(old[i], new[i])}")


def shape_hint(old: Any, new: Any) -> str:
    """For a tensor argument whose sizes alone changed: how to trace those dims symbolically,
    so one graph serves every size (empty otherwise)."""
    specs = [s for s in (old, new) if isinstance(s, tuple) and len(s) in (5, 6) and s[0] == "tensor"]
    if len(specs) != 2 or specs[0][2:5] != specs[1][2:5] or len(specs[0][1]) != len(specs[1][1]):
        return ""
    dims = [d for d, (a, b) in enumerate(zip(specs[0][1], specs[1][1])) if a != b]
    if not dims:
        return ""
    if dims == [0]:
        return (" (a batch size that changes between calls: spmd_backend.compile(..., "
                "dynamic_batch=True) traces dim 0 of the tensor arguments symbolically, so one "
                "graph can serve every size; where the model fixes it, the log says so)")
    return (f" (sizes that change between calls, such as a padded sequence length: "
            f"spmd_backend.mark_dynamic(tensor, {dims}) on each call's tensor traces them "
            "symbolically, so one graph can serve every size; where the model fixes them, the "
            "log says so)")


def number_hint(old: Any, new: Any) -> str:
    """For an argument that changed from one Python number to another: how to make it a graph
    input instead of a constant (empty otherwise)."""
    values = [s[1] if isinstance(s, tuple) and len(s) == 2 and s[0] == "const" else s
              for s in (old, new)]
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
        return ""
    return (" (a Python number is a constant of the graph: pass one that changes from call to "
            "call as a tensor, e.g. torch.tensor(x), and it is an input instead)")


def _explain_modules(old: tuple, new: tuple, binding: Any) -> str | None:
    (rows_a, held_a, hooks_a), (rows_b, held_b, hooks_b) = old, new
    if len(rows_a) != len(rows_b):
        return f"the module tree changed ({len(rows_a)} -> {len(rows_b)} submodules)"
    mode = _explain_mode(rows_a, rows_b)
    if mode:
        return mode
    for (name, attrs_a, h_a), (name_b, attrs_b, h_b) in zip(rows_a, rows_b):
        label = name or "<root>"
        if name != name_b:
            return f"submodule {label!r} was replaced by {name_b!r}"
        if attrs_a != attrs_b:
            return _attr_change(label, dict(attrs_a), dict(attrs_b))
        if h_a != h_b:
            return f"the hooks of module {label!r} changed"
    for (label, attrs_a), (_, attrs_b) in zip(held_a, held_b):
        if attrs_a != attrs_b:
            return _attr_change(label, dict(attrs_a), dict(attrs_b))
    if len(held_a) != len(held_b):
        return "the objects held by the modules changed"
    if hooks_a != hooks_b:
        return "the global module hooks changed"
    return None


def _explain_mode(rows_a: tuple, rows_b: tuple) -> str | None:
    """``model.train()``/``model.eval()`` (every module switched) or the modules that did."""
    modes = {True: "train", False: "eval"}
    switched = []
    for (name, attrs_a, _), (_, attrs_b, _) in zip(rows_a, rows_b):
        a, b = dict(attrs_a).get("training"), dict(attrs_b).get("training")
        if a != b:
            switched.append((name or "<root>", a, b))
    if not switched:
        return None
    if len(switched) == len(rows_a) and len({(a, b) for _, a, b in switched}) == 1:
        _, a, b = switched[0]
        return f"the model switched from {modes[a]} to {modes[b]} mode (model.{modes[b]}())"
    names = ", ".join(repr(n) for n, _, _ in switched[:4]) + (" ..." if len(switched) > 4 else "")
    _, a, b = switched[0]
    what = "module" if len(switched) == 1 else f"{len(switched)} modules"
    return f"{what} {names} switched from {modes.get(a)} to {modes.get(b)} mode"


def _attr_value(value: Any) -> str:
    """An attribute's key value as the user wrote it (a keyed list or dict as one)."""
    if isinstance(value, tuple) and len(value) == 2 and value[0] in ("list", "dict"):
        return repr(list(value[1]) if value[0] == "list" else dict(value[1]))
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "set":
        return repr(set(sorted(value[1], key=repr)))
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "function":
        fn = value[1]
        name, mod = getattr(fn, "__qualname__", None), getattr(fn, "__module__", None)
        if isinstance(fn, types.BuiltinFunctionType):
            name = fn.__name__  # torch's builtins: ``_VariableFunctionsClass.relu``
        return f"{mod}.{name}" if name and mod else repr(fn)
    return repr(value)


def _first_change(a: dict, b: dict, keys: Sequence[Any]) -> tuple[Any, Any, Any] | None:
    """The first of ``keys`` whose value differs between ``a`` and ``b``: (key, old, new),
    a missing entry as ``"<unset>"``."""
    for k in keys:
        old, new = a.get(k, "<unset>"), b.get(k, "<unset>")
        if old != new:
            return k, old, new
    return None


def _attr_change(label: str, a: dict, b: dict) -> str:
    change = _first_change(a, b, sorted(set(a) | set(b), key=str))
    if change is None:
        return f"the attributes of {label!r} changed"
    k, old, new = change
    return f"attribute {label}.{k} changed from {_attr_value(old)} to {_attr_value(new)}"


def _explain_optimizer_attrs(old: tuple, new: tuple, binding: Any) -> str | None:
    label = f"<optimizer {type(binding.optimizer).__name__}>" if binding is not None else "<optimizer>"
    return _attr_change(label, dict(old), dict(new))


def _explain_context(old: tuple, new: tuple, binding: Any) -> str | None:
    i = _first_diff(old, new)
    if i is None:
        return None
    return f"{_CONTEXT_PROBES[i][0]} changed from {old[i]!r} to {new[i]!r}"


def _explain_groups(old: tuple, new: tuple, binding: Any) -> str | None:
    if len(old) != len(new):
        return f"the optimizer's param groups changed (count {len(old)} -> {len(new)})"
    for g, (a, b) in enumerate(zip(old, new)):
        if a[0] != b[0]:
            return f"the parameters of optimizer param_groups[{g}] changed"
        if a[1] != b[1]:
            return (
                f"the keys of optimizer param_groups[{g}] changed "
                f"({sorted(set(a[1]) ^ set(b[1]))})"
            )
        if a[2] != b[2]:
            return f"the lifted hyper-parameters of optimizer param_groups[{g}] changed type"
    return None


def _explain_free_values(old: tuple, new: tuple, binding: Any) -> str | None:
    a, b = dict(old), dict(new)
    change = _first_change(a, b, [*a, *(k for k in b if k not in a)])
    if change is None:
        return None
    label, was, now = change
    return f"{label} changed from {fmt(was)} to {fmt(now)}"


_EXPLAIN = {
    "params": _explain_tensors("params"),
    "grads": _explain_tensors("grads"),
    "buffers": _explain_tensors("buffers"),
    "state": _explain_tensors("state"),
    "args": _explain_args,
    "modules": _explain_modules,
    "optimizer_attrs": _explain_optimizer_attrs,
    "context": _explain_context,
    "groups": _explain_groups,
    "free_values": _explain_free_values,
}
