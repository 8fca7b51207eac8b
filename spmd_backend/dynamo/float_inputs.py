"""Python floats Dynamo made graph inputs (a scheduler's lr, momentum, betas) kept as tensors.

A float the step reads that changed between calls (``group["lr"]`` under any per-step
scheduler) is made dynamic by Dynamo on its recompile: the graph takes it as a 0-dim float64
tensor input and ``.item()``s it into a SymFloat. Where the step hands that SymFloat to an op as
a Python number (``p.add_(grad, alpha=-lr)`` of SGD and RMSprop, ``torch._foreach_div_(bc, lr)``
of foreach Adam, ``buf.mul_(momentum)``, a fused kernel's ``lr``), AOTAutograd's tensorify pass
cannot turn it into tensor compute and specializes it. A per-step schedule then compiled a new
graph on every call, and the call was refused at Dynamo's recompile limit. Worse, where
tensorify turns *some* uses of a float into tensor compute and bakes the value into others, it
does so without restarting Dynamo, and the AOTAutograd cache then serves the graph with the
old value baked in to the next value's recompile (stock ``torch.compile`` too): a stale value.

:func:`tensorify_float_inputs` runs on Dynamo's graph, before AOTAutograd, and decides per float
input, all or nothing:

* every use it knows how to keep (the list below): each is rewritten to take a tensor twin of
  the SymFloat, ``ones(()) * s``, which tensorify turns into float64 tensor compute on the input
  (replaying ``-lr``, ``1 - beta``, ``lr * wd`` in IEEE double like Python) and counts as kept;
  the float stays a graph input and a schedule never recompiles;
* any other use (an op whose scalar semantics a tensor would change, a bfloat16 or float16
  operand, float arithmetic tensorify cannot replay): the float is specialized for the whole
  frame (``TensorifyState``, then a restart of Dynamo's analysis, as tensorify itself does): its
  value is baked into the graph and guarded, so a change recompiles, and at the recompile limit
  :mod:`spmd_backend.dynamo.audit` refuses the call before it runs. Never half of each.

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

Requires Dynamo's graph with ``example_value`` metadata (torch 2.13). Guarantees: a rewritten
node computes what it computed with the Python number, in the same dtype (the 0-dim-exponent
pow aside, as above), with the one-ulp ``alpha`` exception; no float is rewritten in some uses
and baked in others.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

log = logging.getLogger(__name__)

#: float arithmetic on a dynamic float that the twin replays (tensorify interprets its
#: expression): anything else bakes the float
_ARITHMETIC: frozenset = frozenset(
    {
        operator.neg, operator.add, operator.sub, operator.mul, operator.truediv, operator.pow,
        operator.abs, torch.sym_max, torch.sym_min, torch._sym_sqrt,
    }
)
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


def _value(arg: Any) -> Any:
    return arg.meta.get("example_value") if isinstance(arg, fx.Node) else arg


def _exact(arg: Any) -> bool:
    """A float32 or float64 tensor (operand) node."""
    value = _value(arg)
    return isinstance(value, torch.Tensor) and value.dtype in _EXACT_DTYPES


def _dtype(arg: fx.Node) -> torch.dtype:
    return _value(arg).dtype


def _device(arg: Any) -> torch.device | None:
    """Where a scalar operand of ``arg`` goes: None (left on the CPU, where the float input
    is) for a CPU tensor, else ``arg``'s device (one small copy per call; every op then sees
    its operands on one device)."""
    value = _value(arg)
    device = value.device if isinstance(value, torch.Tensor) else None
    return None if device is None or device.type == "cpu" else device


def _number(arg: Any) -> bool:
    return isinstance(arg, (int, float)) and not isinstance(arg, bool)


def _float_symbols(node: fx.Node) -> frozenset:
    value = node.meta.get("example_value")
    if not isinstance(value, torch.SymFloat):
        return frozenset()
    return frozenset(value.node.expr.free_symbols)


def _root_symbol(node: fx.Node) -> Any:
    """The float symbol of ``node`` when it is Dynamo's ``.item()`` of a float input (a 0-dim
    float64 placeholder) that is still dynamic; None otherwise."""
    if node.op != "call_method" or node.target != "item" or len(node.args) != 1:
        return None
    source = node.args[0]
    value = _value(source)
    if not (isinstance(source, fx.Node) and source.op == "placeholder"
            and isinstance(value, torch.Tensor) and value.dtype == torch.float64
            and value.dim() == 0):
        return None
    sym = node.meta.get("example_value")
    expr = getattr(getattr(sym, "node", None), "_expr", None)
    return expr if isinstance(sym, torch.SymFloat) and getattr(expr, "is_Symbol", False) \
        and expr in sym.node.expr.free_symbols else None


class _Rewriter:
    """One graph's plan: which dynamic floats are kept, and the rewrite of each use."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.graph = gm.graph
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
        real_args = fx.node.map_arg(args, _value)
        real_kwargs = fx.node.map_arg(kwargs, _value)
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

    def cast(self, sym: fx.Node, dtype: torch.dtype, device: torch.device | None = None,
             *, fresh: bool = False) -> fx.Node:
        """``sym``'s twin as a 0-dim tensor of ``dtype`` (on ``device`` if given), right after
        the twin. Shared between uses unless ``fresh`` (a copy a use may write to)."""
        twin = self.twin(sym)
        key = (twin, dtype, str(device) if device is not None else None)
        if fresh or key not in self.casts:
            value = _value(twin)
            same = value.dtype == dtype and (device is None or value.device == device)
            if same and not fresh:
                self.casts[key] = twin
            else:
                kwargs: dict[str, Any] = {"dtype": dtype}
                if device is not None:
                    kwargs["device"] = device
                if fresh:
                    kwargs["copy"] = True
                with self.graph.inserting_after(twin):
                    cast = self._call("call_method", "to", (twin,), kwargs)
                if fresh:
                    return cast
                self.casts[key] = cast
        return self.casts[key]

    # ------------------------------------------------------------------ plans
    def plan(self, node: fx.Node, syms: set[fx.Node]) -> Apply | None:
        """How to rewrite ``node``'s uses of the dynamic floats ``syms``; None when it is not
        a use this module keeps (the floats it uses are then baked)."""
        self.syms = syms
        if node.op == "call_method" and node.target in _METHODS:
            return self._binary(node, inplace=node.target.endswith("_"))
        if node.op == "call_method" and node.target == "lerp_":
            return self._lerp(node)
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
        if target is torch.ops.prims.fma.default:
            return self._fma(node)
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
        if alpha is not None and not _number(alpha):
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

    def _lerp(self, node: fx.Node) -> Apply | None:
        if len(node.args) != 3 or node.kwargs or not self._sym(node.args[2]) \
                or not (_exact(node.args[0]) and _exact(node.args[1])) \
                or _dtype(node.args[0]) != _dtype(node.args[1]):
            return None
        x, end, s = node.args
        return lambda: self._set(node, (x, end, self.cast(s, _dtype(x), _device(x))))

    def _scalar_base_pow(self, node: fx.Node) -> Apply | None:
        if len(node.args) != 2 or node.kwargs or not self._sym(node.args[0]) \
                or not _exact(node.args[1]):
            return None
        s, t = node.args
        dtype = torch.float64 if _value(t).dim() == 0 else _dtype(t)

        def keep() -> None:
            self._set(node, (self.cast(s, dtype, _device(t)), t))
            node.meta["example_value"] = self._fake_run(node.op, node.target, node.args, {})

        return keep

    def _foreach_scalar_base_pow(self, node: fx.Node) -> Apply | None:
        exponents = node.args[1] if len(node.args) == 2 else None
        if node.kwargs or not self._sym(node.args[0]) or not isinstance(exponents, (list, tuple)) \
                or not exponents or not all(_exact(e) for e in exponents) \
                or len({(_dtype(e), _value(e).dim() == 0) for e in exponents}) != 1:
            return None
        s, first = node.args[0], exponents[0]
        dtype = torch.float64 if _value(first).dim() == 0 else _dtype(first)

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
        value = _value(x)
        if not (isinstance(value, torch.Tensor) and value.dtype.is_floating_point):
            return None

        def keep() -> None:
            fill = self.cast(s, torch.float64, _device(x))
            with self.graph.inserting_before(node):
                empty = self._call("call_function", torch.empty_like, (x,))
                filled = self._call("call_method", "fill_", (empty, fill), value=_value(node))
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
            fresh = self.cast(node.args[0], dtype, device, fresh=True)  # the caller may write it
            node.replace_all_uses_with(fresh)
            self.graph.erase_node(node)

        return keep

    def _fma(self, node: fx.Node) -> Apply | None:
        """``prims.fma(x, s, y)``: Dynamo's form of ``y.addcdiv_(t1, t2, value=s)``."""
        if len(node.args) != 3 or node.kwargs or not self._sym(node.args[1]) \
                or not (_exact(node.args[0]) and _exact(node.args[2])) \
                or _dtype(node.args[0]) != _dtype(node.args[2]):
            return None
        x, s, y = node.args
        return lambda: self._set(node, (x, self.cast(s, _dtype(x), _device(x)), y))


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


def _describe(node: fx.Node) -> str:
    target = node.target if isinstance(node.target, str) else getattr(
        node.target, "__name__", str(node.target))
    return f"{target} ({node.name})"


def tensorify_float_inputs(gm: fx.GraphModule) -> int:
    """Keep the dynamic float inputs of ``gm`` (Dynamo's graph) graph inputs where every use
    can take a tensor, and bake the others (see the module docstring). Returns the number of
    uses rewritten; raises Dynamo's ``TensorifyScalarRestartAnalysis`` (Dynamo restarts the
    frame with those floats baked) when some float has a use this module does not keep."""
    graph = gm.graph
    roots = {s: n for n in graph.nodes if (s := _root_symbol(n)) is not None}
    if not roots:
        return 0
    ours = frozenset(roots)
    rewriter = _Rewriter(gm)
    syms: set[fx.Node] = set()  # SymFloat nodes computed from the dynamic floats
    baked: dict[Any, str] = {}  # float symbol -> the use that bakes it
    plans: list[Apply] = []
    for node in graph.nodes:
        symbols = _float_symbols(node)
        if symbols & ours:
            is_root = node.op == "call_method" and node.target == "item"
            arithmetic = node.op == "call_function" and node.target in _ARITHMETIC \
                and not node.kwargs and all(a in syms or _number(a) for a in node.args)
            if symbols <= ours and (is_root or arithmetic):
                syms.add(node)
            else:
                baked.update({s: _describe(node) for s in symbols & ours})
            continue
        used = [a for a in node.all_input_nodes if a in syms]
        if not used:
            continue
        apply = rewriter.plan(node, syms)
        if apply is None:
            for a in used:
                baked.update({s: _describe(node) for s in _float_symbols(a) & ours})
        else:
            plans.append(apply)
    if baked:
        _bake(roots, baked)
    for apply in plans:
        apply()
    if plans:
        graph.lint()
        gm.recompile()
    return len(plans)


#: float symbols this module had Dynamo bake, until the restarted compile is done
_BAKED: set[str] = set()


def forget_baked() -> None:
    """Drop this module's bake requests once the frame they were for has compiled (or
    failed): Dynamo keeps ``TensorifyState`` across frames, and symbol names repeat, so a float
    of a later frame (another step, a resume function) would be baked too and recompile on
    every value. Not before the restarted compile's AOTAutograd has run: its tensorify pass
    would find the baked float unrequested and restart again."""
    from torch._dynamo.symbolic_convert import TensorifyState

    for name in _BAKED:
        TensorifyState.force_specializations.discard(name)
    _BAKED.clear()


def _bake(roots: dict[Any, fx.Node], baked: dict[Any, str]) -> None:
    """Have Dynamo restart the frame with the floats ``baked`` as constants (what AOTAutograd's
    tensorify pass does for a float it cannot keep), before anything is rewritten."""
    from torch._dynamo.exc import TensorifyScalarRestartAnalysis
    from torch._dynamo.symbolic_convert import TensorifyState

    for symbol, use in baked.items():
        source = roots[symbol].args[0]
        log.info('backend="spmd": the float input %s is used by %s, which needs a Python '
                 "number: Dynamo bakes its value into the graph (a change recompiles)",
                 getattr(source, "target", source), use)
        if not TensorifyState.should_specialize(str(symbol)):
            _BAKED.add(str(symbol))  # one of tensorify's own requests is not ours to drop
        TensorifyState.specialize(str(symbol))
    raise TensorifyScalarRestartAnalysis
