"""How each use of a dynamic float takes a tensor instead: the rewrites
:mod:`spmd_backend.dynamo.float_inputs` plans, all of a float's uses or none.

The uses kept, on float32 and float64 tensors only (where a 0-dim tensor of the operand's dtype
computes exactly what the Python number does; low-precision kernels round scalars differently
per op and per code path):

* ``x op s``, ``s op x``, in place or not, for ``+ - * /`` (``s / x`` as eager computes it,
  ``x.reciprocal() * s``) and the comparisons: the scalar as a 0-dim tensor of ``x``'s dtype;
  float arithmetic on ``s`` before that (``+ - * / **``, ``abs``, ``max``, ``min``,
  ``math.sqrt``) is replayed by the twin;
* ``x.add(y, alpha=s)`` / ``sub`` and ``_foreach_add(xs, ys, alpha=s)`` / ``_foreach_sub``, with
  ``x`` and ``y`` of one dtype: ``y * s`` added, which is what torch's optimizers do with a tensor
  lr under ``torch.compile``; the product is rounded where eager's fused multiply-add is not (at
  most one ulp of the update: SGD within 3e-8 of eager after 12 steps, RMSprop, which amplifies
  it, 7e-5 under OneCycleLR, measured 2026-11-28);
* ``_foreach_mul(xs, s)`` / ``_foreach_div`` (in place or not): their 0-dim tensor overloads;
* ``x.lerp_(end, s)``, ``prims.fma(x, s, y)`` (Dynamo's form of ``addcdiv_(value=s)``);
* ``s ** t`` and ``torch._foreach_pow(s, ts)``: a 0-dim exponent (an optimizer's step count)
  gets the float64 base and a float64 result, as the pipeline computes the same bias correction
  with a Python base (tracing/bias_corrections.py); a larger one the base in its dtype;
* ``torch.full_like(x, s)``: ``empty_like(x).fill_(s)`` (any floating dtype: ``fill_`` rounds
  the float64 tensor as it rounds the Python number);
* ``torch.scalar_tensor(s, dtype, device)`` (how the scope hands a dynamic lr to a fused kernel,
  :mod:`spmd_backend.dynamo.scope`): a fresh copy of the input in that dtype and device.

Requires Dynamo's graph with ``example_value`` metadata (torch 2.13). :meth:`UseRewriter.plan`
only inspects the graph; the rewrite it returns changes it. Guarantees: a rewritten node
computes what it computed with the Python number, in the same dtype (the 0-dim-exponent pow
aside, as above), with the one-ulp ``alpha`` exception.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

#: comparisons of a tensor with the float (``torch.where(g > s, ...)``): a 0-dim tensor of the
#: tensor's dtype compares as the Python number does
_COMPARISON_METHODS: frozenset = frozenset({"gt", "lt", "ge", "le", "eq", "ne"})
_COMPARISONS: frozenset = frozenset(
    {operator.gt, operator.lt, operator.ge, operator.le, operator.eq, operator.ne,
     torch.gt, torch.lt, torch.ge, torch.le, torch.eq, torch.ne}
)
#: binary tensor methods / functions whose operand may be a Python number or a 0-dim tensor
_METHODS: frozenset = frozenset({"add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_"})
_FUNCTIONS: frozenset = frozenset(
    {
        operator.add, operator.sub, operator.mul, operator.truediv,
        operator.iadd, operator.isub, operator.imul, operator.itruediv,
        torch.add, torch.sub, torch.mul, torch.div,
    }
)
_INPLACE_FUNCTIONS: frozenset = frozenset(
    {operator.iadd, operator.isub, operator.imul, operator.itruediv}
)
_ADDITIONS: frozenset = frozenset({"add", "add_", "sub", "sub_", torch.add, torch.sub})
#: foreach ops with a scalar second operand and a 0-dim tensor overload (not add: its tensor
#: overload reads the scalar with .item(), which AOTAutograd cannot trace)
_FOREACH_SCALAR: frozenset = frozenset(
    {torch._foreach_mul, torch._foreach_mul_, torch._foreach_div, torch._foreach_div_}
)
#: foreach ops taking ``alpha=`` with a second tensor list
_FOREACH_ALPHA: frozenset = frozenset(
    {torch._foreach_add, torch._foreach_add_, torch._foreach_sub, torch._foreach_sub_}
)
_EXACT_DTYPES: frozenset = frozenset({torch.float32, torch.float64})

Apply = Callable[[], None]


def value_of(arg: Any) -> Any:
    """The example value of a node (an argument that is not a node: itself)."""
    return arg.meta.get("example_value") if isinstance(arg, fx.Node) else arg


def _exact(arg: Any) -> bool:
    """A float32 or float64 tensor (operand) node."""
    value = value_of(arg)
    return isinstance(value, torch.Tensor) and value.dtype in _EXACT_DTYPES


def _dtype(arg: fx.Node) -> torch.dtype:
    return value_of(arg).dtype


def _device(arg: Any) -> torch.device | None:
    """Where a scalar operand of ``arg`` goes: None (left on the CPU, where the float input
    is) for a CPU tensor, else ``arg``'s device (one small copy per call; every op then sees
    its operands on one device)."""
    value = value_of(arg)
    device = value.device if isinstance(value, torch.Tensor) else None
    return None if device is None or device.type == "cpu" else device


def number(arg: Any) -> bool:
    """A Python int or float (not a bool)."""
    return isinstance(arg, (int, float)) and not isinstance(arg, bool)


class UseRewriter:
    """One graph's plan: which dynamic floats are kept, and the rewrite of each use."""

    def __init__(self, gm: fx.GraphModule, syms: set[fx.Node]) -> None:
        self.graph = gm.graph
        #: the SymFloat nodes computed from the dynamic floats (the planner adds to it)
        self.syms = syms
        self.twins: dict[fx.Node, fx.Node] = {}
        self.casts: dict[tuple[fx.Node, torch.dtype, str | None], fx.Node] = {}
        self.one: fx.Node | None = None

    # ------------------------------------------------------------------ nodes with metadata
    def _call(self, op: str, target: Any, args: tuple, kwargs: dict | None = None,
              *, value: Any = None) -> fx.Node:
        node = self.graph.create_node(op, target, args, kwargs or {})
        node.meta["example_value"] = value if value is not None \
            else self._fake_run(op, target, args, kwargs or {})
        return node

    @staticmethod
    def _fake_run(op: str, target: Any, args: tuple, kwargs: dict) -> Any:
        real_args = fx.node.map_arg(args, value_of)
        real_kwargs = fx.node.map_arg(kwargs, value_of)
        with _fake_mode_of((real_args, real_kwargs)):
            if op == "call_method":
                return getattr(real_args[0], target)(*real_args[1:], **real_kwargs)
            return target(*real_args, **real_kwargs)

    # ------------------------------------------------------------------ twins and casts
    def twin(self, node: fx.Node) -> fx.Node:
        """A float64 0-dim tensor node equal to SymFloat ``node``: ``ones(()) * node``, which
        AOTAutograd's tensorify pass rewrites into tensor compute on the graph input."""
        if node not in self.twins:
            if self.one is None:
                with self.graph.inserting_after(_last_placeholder(self.graph)):
                    self.one = self._call("call_function", torch.ones, ((),),
                                          {"dtype": torch.float64}, value=_fake_ones(self.graph))
            with self.graph.inserting_after(node):
                self.twins[node] = self._call("call_function", operator.mul, (self.one, node),
                                              value=_fake_ones(self.graph))
        return self.twins[node]

    def cast(self, sym: fx.Node, dtype: torch.dtype, device: torch.device | None = None) -> fx.Node:
        """``sym``'s twin as a 0-dim tensor of ``dtype`` (on ``device`` if given), shared by
        the uses that need the same."""
        twin = self.twin(sym)
        key = (twin, dtype, str(device) if device is not None else None)
        if key not in self.casts:
            value = value_of(twin)
            same = value.dtype == dtype and (device is None or value.device == device)
            self.casts[key] = twin if same else self._to(twin, dtype, device)
        return self.casts[key]

    def _to(self, twin: fx.Node, dtype: torch.dtype, device: torch.device | None,
            **extra: Any) -> fx.Node:
        """``twin.to(dtype, device, **extra)``, right after the twin."""
        kwargs: dict[str, Any] = {"dtype": dtype, **extra}
        if device is not None:
            kwargs["device"] = device
        with self.graph.inserting_after(twin):
            return self._call("call_method", "to", (twin,), kwargs)

    # ------------------------------------------------------------------ plans
    def plan(self, node: fx.Node) -> Apply | None:
        """How to rewrite ``node``'s uses of the dynamic floats (:attr:`syms`); None when it
        is not a use this module keeps (the floats it uses are then baked)."""
        if node.op == "call_method" and node.target in _METHODS:
            return self._binary(node, inplace=node.target.endswith("_"))
        if node.op == "call_method" and node.target == "lerp_":  # x.lerp_(end, s)
            return self._scalar_between_tensors(node, 2)
        if node.op == "call_method" and node.target in _COMPARISON_METHODS:
            return self._binary(node, inplace=False)
        if node.op != "call_function":
            return None
        target = node.target
        if target in _FUNCTIONS or target in _COMPARISONS:
            return self._binary(node, inplace=target in _INPLACE_FUNCTIONS)
        if target in (operator.pow, torch.pow):
            return self._scalar_base_pow(node)
        if target is torch._foreach_pow:
            return self._foreach_scalar_base_pow(node)
        if target in _FOREACH_SCALAR or target in _FOREACH_ALPHA:
            return self._foreach(node)
        if target is torch.full_like:
            return self._full_like(node)
        if target is torch.scalar_tensor:
            return self._scalar_tensor(node)
        if target is torch.ops.prims.fma.default:  # Dynamo's form of addcdiv_(value=s)
            return self._scalar_between_tensors(node, 1)
        return None

    def _sym(self, arg: Any) -> bool:
        return isinstance(arg, fx.Node) and arg in self.syms

    def _set(self, node: fx.Node, args: tuple, kwargs: dict | None = None,
             target: Any = None, op: str | None = None) -> None:
        node.args = args
        node.kwargs = kwargs or {}
        if target is not None:
            node.target = target
        if op is not None:
            node.op = op

    def _binary(self, node: fx.Node, *, inplace: bool) -> Apply | None:
        """``x op s``, ``s op x`` and ``x.add(y, alpha=s)``."""
        args, kwargs = list(node.args), dict(node.kwargs)
        if len(args) != 2 or set(kwargs) - {"alpha"}:
            return None
        alpha = kwargs.get("alpha")
        if self._sym(alpha):
            x, y = args
            if node.target not in _ADDITIONS or self._sym(x) or self._sym(y) \
                    or not (_exact(x) and _exact(y)) or _dtype(x) != _dtype(y):
                return None

            def keep_alpha() -> None:
                scale = self.cast(alpha, _dtype(y), _device(y))
                with self.graph.inserting_before(node):
                    product = self._call("call_function", operator.mul, (y, scale))
                self._set(node, (x, product))

            return keep_alpha
        if alpha is not None and not number(alpha):
            return None
        syms = [i for i, a in enumerate(args) if self._sym(a)]
        if len(syms) != 1 or not _exact(args[1 - syms[0]]) or (inplace and syms[0] == 0):
            return None
        i = syms[0]
        tensor = args[1 - i]

        def keep() -> None:
            scalar = self.cast(args[i], _dtype(tensor), _device(tensor))
            if i == 0 and node.target in (operator.truediv, torch.div):
                # eager's ``s / x`` is ``x.reciprocal() * s`` (Tensor.__rtruediv__)
                with self.graph.inserting_before(node):
                    inverse = self._call("call_method", "reciprocal", (tensor,))
                self._set(node, (inverse, scalar), kwargs, operator.mul, "call_function")
            else:
                new = list(args)
                new[i] = scalar
                self._set(node, tuple(new), kwargs)

        return keep

    def _scalar_between_tensors(self, node: fx.Node, at: int) -> Apply | None:
        """Three operands, ``s`` at ``at`` and two tensors of one exact dtype (``lerp_``'s
        weight, ``prims.fma(x, s, y)``): ``s`` as a 0-dim tensor of that dtype."""
        args = list(node.args)
        tensors = [a for i, a in enumerate(args) if i != at]
        if len(args) != 3 or node.kwargs or not self._sym(args[at]) \
                or not all(_exact(t) for t in tensors) or _dtype(tensors[0]) != _dtype(tensors[1]):
            return None

        def keep() -> None:
            args[at] = self.cast(args[at], _dtype(tensors[0]), _device(tensors[0]))
            self._set(node, tuple(args))

        return keep

    def _scalar_base_pow(self, node: fx.Node) -> Apply | None:
        if len(node.args) != 2 or node.kwargs or not self._sym(node.args[0]) \
                or not _exact(node.args[1]):
            return None
        s, t = node.args
        dtype = torch.float64 if value_of(t).dim() == 0 else _dtype(t)

        def keep() -> None:
            self._set(node, (self.cast(s, dtype, _device(t)), t))
            node.meta["example_value"] = self._fake_run(node.op, node.target, node.args, {})

        return keep

    def _foreach_scalar_base_pow(self, node: fx.Node) -> Apply | None:
        exponents = node.args[1] if len(node.args) == 2 else None
        if node.kwargs or not self._sym(node.args[0]) or not isinstance(exponents, (list, tuple)) \
                or not exponents or not all(_exact(e) for e in exponents) \
                or len({(_dtype(e), value_of(e).dim() == 0) for e in exponents}) != 1:
            return None
        s, first = node.args[0], exponents[0]
        dtype = torch.float64 if value_of(first).dim() == 0 else _dtype(first)

        def keep() -> None:
            base = self.cast(s, dtype, _device(first))
            self._set(node, ([base] * len(exponents), list(exponents)))
            node.meta["example_value"] = self._fake_run(node.op, node.target, node.args, {})

        return keep

    def _foreach(self, node: fx.Node) -> Apply | None:
        args, kwargs = list(node.args), dict(node.kwargs)
        if len(args) != 2 or set(kwargs) - {"alpha"} or not isinstance(args[0], (list, tuple)) \
                or not args[0] or not all(_exact(t) for t in args[0]) \
                or len({_dtype(t) for t in args[0]}) != 1 or any(self._sym(t) for t in args[0]):
            return None
        dtype, device = _dtype(args[0][0]), _device(args[0][0])
        alpha = kwargs.get("alpha")
        if self._sym(alpha):
            others = args[1]
            if node.target not in _FOREACH_ALPHA or not isinstance(others, (list, tuple)) \
                    or len(others) != len(args[0]) or not all(_exact(t) for t in others) \
                    or {_dtype(t) for t in others} != {dtype}:
                return None

            def keep_alpha() -> None:
                scale = self.cast(alpha, dtype, device)
                with self.graph.inserting_before(node):
                    product = self._call("call_function", torch._foreach_mul, (list(others), scale))
                self._set(node, (args[0], product))

            return keep_alpha
        if node.target not in _FOREACH_SCALAR or kwargs or not self._sym(args[1]):
            return None
        return lambda: self._set(node, (args[0], self.cast(args[1], dtype, device)))

    def _full_like(self, node: fx.Node) -> Apply | None:
        if len(node.args) != 2 or node.kwargs or not self._sym(node.args[1]):
            return None
        x, s = node.args
        value = value_of(x)
        if not (isinstance(value, torch.Tensor) and value.dtype.is_floating_point):
            return None

        def keep() -> None:
            fill = self.cast(s, torch.float64, _device(x))
            with self.graph.inserting_before(node):
                empty = self._call("call_function", torch.empty_like, (x,))
                filled = self._call("call_method", "fill_", (empty, fill), value=value_of(node))
            node.replace_all_uses_with(filled)
            self.graph.erase_node(node)

        return keep

    def _scalar_tensor(self, node: fx.Node) -> Apply | None:
        if len(node.args) != 1 or not self._sym(node.args[0]) \
                or set(node.kwargs) - {"dtype", "device"}:
            return None
        dtype = node.kwargs.get("dtype") or torch.get_default_dtype()
        device = node.kwargs.get("device")
        device = torch.device(device) if device is not None else None

        def keep() -> None:
            # a copy of its own: the caller may write it
            fresh = self._to(self.twin(node.args[0]), dtype, device, copy=True)
            node.replace_all_uses_with(fresh)
            self.graph.erase_node(node)

        return keep


def _fake_ones(graph: fx.Graph) -> torch.Tensor:
    """A fake float64 0-dim tensor in the fake mode of ``graph``'s example values."""
    for node in graph.nodes:
        value = node.meta.get("example_value")
        if hasattr(value, "fake_mode"):
            with value.fake_mode:
                return torch.ones((), dtype=torch.float64)
    raise RuntimeError("float_inputs: the graph has no fake example values")


def _fake_mode_of(tree: Any) -> Any:
    """The fake mode of the example values among ``tree``'s operands."""
    found: list[Any] = []
    fx.node.map_aggregate(tree, lambda v: found.append(v) if hasattr(v, "fake_mode") else None)
    if not found:
        raise RuntimeError("float_inputs: no fake tensor in the operands of a rewritten node")
    return found[0].fake_mode


def _last_placeholder(graph: fx.Graph) -> fx.Node:
    last = None
    for node in graph.nodes:
        if node.op != "placeholder":
            break
        last = node
    if last is None:
        raise RuntimeError("float_inputs: a graph with a float input has no placeholder")
    return last
