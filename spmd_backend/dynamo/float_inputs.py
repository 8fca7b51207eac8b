"""Python floats Dynamo made graph inputs (a scheduler's lr, momentum, betas) kept as tensors.

A float the step reads that changed between calls (``group["lr"]`` under any per-step
scheduler) is made dynamic by Dynamo on its recompile: the graph takes it as a 0-dim float64
tensor input and ``.item()``s it into a SymFloat. Where the step hands that SymFloat to an op as
a Python number (``p.add_(grad, alpha=-lr)`` of SGD and RMSprop, ``torch._foreach_div_(bc, lr)``
of foreach Adam, ``buf.mul_(momentum)``, a fused kernel's ``lr``), AOTAutograd's tensorify pass
cannot turn it into tensor compute and specializes it: Dynamo restarts the frame with the value
baked in. A per-step schedule then compiled a new graph on every call, and the call was refused
at Dynamo's recompile limit (stock ``torch.compile`` would run the step eagerly there).

:func:`tensorify_float_inputs` rewrites such uses on Dynamo's graph, before AOTAutograd, into
tensor compute on the input itself, so the value stays a graph input and a schedule never
recompiles:

* float arithmetic on the SymFloat (``-lr``, ``1 - beta``, ``lr * wd``) becomes the same
  arithmetic on the float64 tensor (IEEE double either way: the same value);
* a binary op taking it as its scalar operand (``mul_``, ``div``, ``x - s``, ``_foreach_mul_``,
  ``pow(s, step)``, ``lerp_(end, s)``...) takes the tensor instead, cast to the precision eager
  computes a Python scalar in (the operand's "opmath" dtype: float32 for float32, bfloat16 and
  float16); the result's dtype is kept;
* ``alpha=s`` of ``add``/``sub`` (and of ``_foreach_add_``/``_foreach_sub_``) becomes a product
  of the other operand and the tensor, which is what torch's own optimizers do with a tensor lr
  under ``torch.compile`` (``_foreach_mul(grads, -lr)``); the product is taken in the operand's
  opmath dtype (a bfloat16 gradient as float32), so it is rounded to the parameter's dtype once,
  but the float32 product itself is rounded where eager's fused multiply-add is not (at most
  one float32 ulp of the update: SGD within 3e-8 of eager after 12 steps, RMSprop, which
  amplifies it, within 7e-5 under OneCycleLR, measured 2026-11-28);
* ``torch.scalar_tensor(s, ...)`` (how the scope hands a dynamic lr to a fused kernel, see
  :mod:`spmd_backend.dynamo.scope`) becomes the input converted to the requested dtype/device.

A use it does not know is left alone (Dynamo then specializes the float and recompiles, as
before; :mod:`spmd_backend.dynamo.audit` refuses at the limit). Requires Dynamo's graph with
``example_value`` metadata (torch 2.13); guarantees that every rewritten node computes what it
computed with the Python number, in the same dtype, and that no SymFloat it rewrote away is used
afterwards (the ``item()`` calls are erased).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

#: binary tensor methods whose second operand may be a Python number or a 0-dim tensor
_METHODS: frozenset = frozenset({"add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_"})
_FUNCTIONS: frozenset = frozenset(
    {
        operator.add, operator.sub, operator.mul, operator.truediv,
        operator.iadd, operator.isub, operator.imul, operator.itruediv,
        torch.add, torch.sub, torch.mul, torch.div,
    }
)
#: foreach ops with a scalar second operand and a 0-dim tensor overload
_FOREACH_TENSOR: frozenset = frozenset(
    {
        torch._foreach_add, torch._foreach_add_, torch._foreach_mul, torch._foreach_mul_,
        torch._foreach_div, torch._foreach_div_,
    }
)
#: foreach subtraction of a scalar (no tensor overload): added negated, exactly the same
_FOREACH_SUB: dict = {torch._foreach_sub: torch._foreach_add, torch._foreach_sub_: torch._foreach_add_}
#: foreach ops taking ``alpha=`` with a second tensor list
_FOREACH_ALPHA: frozenset = frozenset(
    {torch._foreach_add, torch._foreach_add_, torch._foreach_sub, torch._foreach_sub_}
)
_INPLACE_FUNCTIONS: frozenset = frozenset(
    {operator.iadd, operator.isub, operator.imul, operator.itruediv}
)


def _value(arg: Any) -> Any:
    return arg.meta.get("example_value") if isinstance(arg, fx.Node) else arg


def _is_float_tensor(arg: Any) -> bool:
    value = _value(arg)
    return isinstance(value, torch.Tensor) and value.dtype.is_floating_point


def _device(arg: Any) -> torch.device | None:
    """The device a scalar operand of ``arg`` is put on: None (left on the CPU, where the
    float input is) for a CPU tensor, else ``arg``'s (one small copy per call, and every op
    then sees its operands on one device)."""
    value = _value(arg)
    device = value.device if isinstance(value, torch.Tensor) else None
    return None if device is None or device.type == "cpu" else device


def _opmath(dtype: torch.dtype) -> torch.dtype:
    """The dtype eager computes a Python scalar in for a tensor of ``dtype``."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class _Rewriter:
    """One graph's rewrite: the tensor twin of each rewritable SymFloat node, and the casts."""

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
        if value is None:
            value = self._fake_run(op, target, args, kwargs or {})
        node.meta["example_value"] = value
        return node

    def _fake_run(self, op: str, target: Any, args: tuple, kwargs: dict) -> Any:
        real_args = fx.node.map_arg(args, _value)
        real_kwargs = fx.node.map_arg(kwargs, _value)
        mode = _fake_mode_of((real_args, real_kwargs))
        with mode:
            if op == "call_method":
                return getattr(real_args[0], target)(*real_args[1:], **real_kwargs)
            return target(*real_args, **real_kwargs)

    # ------------------------------------------------------------------ twins
    def twin(self, node: fx.Node) -> fx.Node | None:
        """A float64 0-dim tensor node equal to SymFloat ``node`` (None: a specialized value).

        It is ``ones(()) * node``: AOTAutograd's tensorify pass rewrites that product into
        tensor compute on the graph input (replaying ``-lr``, ``1 - beta`` in float64, IEEE
        double like Python's arithmetic), which also tells it the float need not be
        specialized; a float it never sees in such an op is specialized even unused."""
        if node in self.twins:
            return self.twins[node]
        value = node.meta.get("example_value")
        if not isinstance(value, torch.SymFloat) or not value.node.expr.free_symbols:
            return None
        if self.one is None:
            with self.graph.inserting_after(_last_placeholder(self.graph)):
                self.one = self._call("call_function", torch.ones, ((),), {"dtype": torch.float64},
                                      value=_fake_ones(self.graph))
        with self.graph.inserting_after(node):
            twin = self._call("call_function", operator.mul, (self.one, node),
                              value=_fake_ones(self.graph))
        self.twins[node] = twin
        return twin

    def cast(self, sym: fx.Node, dtype: torch.dtype, device: torch.device | None = None) -> fx.Node:
        """``sym``'s twin as a 0-dim tensor of ``dtype`` (on ``device`` if given), inserted
        after the twin (so before every use of ``sym``)."""
        twin = self.twins[sym]
        key = (twin, dtype, str(device) if device is not None else None)
        if key not in self.casts:
            value = _value(twin)
            if value.dtype == dtype and (device is None or value.device == device):
                self.casts[key] = twin
            else:
                with self.graph.inserting_after(twin):
                    kwargs = {"dtype": dtype} if device is None else {"dtype": dtype, "device": device}
                    self.casts[key] = self._call("call_method", "to", (twin,), kwargs)
        return self.casts[key]

    # ------------------------------------------------------------------ uses
    def rewrite(self, node: fx.Node) -> bool:
        """Rewrite ``node``'s uses of SymFloats with twins; False when it is not one we know."""
        if node.op == "call_method" and node.target in _METHODS:
            return self._binary(node, inplace=node.target.endswith("_"))
        if node.op == "call_method" and node.target == "lerp_":
            return self._lerp(node)
        if node.op != "call_function":
            return False
        target = node.target
        if target in _FUNCTIONS:
            return self._binary(node, inplace=target in _INPLACE_FUNCTIONS)
        if target in (operator.pow, torch.pow):
            return self._scalar_base_pow(node)
        if target is torch._foreach_pow:
            return self._foreach_scalar_base_pow(node)
        if target is torch.full_like:
            return self._full_like(node)
        if target in _FOREACH_TENSOR or target in _FOREACH_SUB:
            return self._foreach(node)
        if target is torch.scalar_tensor:
            return self._scalar_tensor(node)
        if target is torch.ops.prims.fma.default:
            return self._fma(node)
        return False

    def _sym(self, arg: Any) -> bool:
        return isinstance(arg, fx.Node) and arg in self.twins

    def _binary(self, node: fx.Node, *, inplace: bool) -> bool:
        """``x op s``, ``s op x`` and ``x.add(y, alpha=s)``."""
        args = list(node.args)
        kwargs = dict(node.kwargs)
        if len(args) != 2 or set(kwargs) - {"alpha"}:
            return False
        alpha = kwargs.get("alpha")
        if self._sym(alpha):
            if self._sym(args[0]) or self._sym(args[1]) or not _is_float_tensor(args[1]) \
                    or node.target not in ("add", "add_", "sub", "sub_", torch.add, torch.sub):
                return False
            other = args[1]
            with self.graph.inserting_before(node):
                args[1] = self._call("call_function", operator.mul,
                                     (self._upcast(other), self._alpha(alpha, other)))
            del kwargs["alpha"]
        else:
            tensors = [i for i, a in enumerate(args) if _is_float_tensor(a)]
            syms = [i for i, a in enumerate(args) if self._sym(a)]
            if len(tensors) != 1 or len(syms) != 1 or (inplace and syms[0] == 0):
                return False
            tensor = args[tensors[0]]
            scalar = self.cast(args[syms[0]], _opmath(_value(tensor).dtype), _device(tensor))
            if syms[0] == 0 and node.target in (operator.truediv, torch.div):
                # eager's ``s / x`` is ``x.reciprocal() * s`` (Tensor.__rtruediv__), not a division
                with self.graph.inserting_before(node):
                    inverse = self._call("call_method", "reciprocal", (tensor,))
                node.target, node.op = operator.mul, "call_function"
                args = [inverse, scalar]
            else:
                args[syms[0]] = scalar
        return self._replace(node, tuple(args), kwargs, inplace=inplace)

    def _alpha(self, alpha: fx.Node, other: fx.Node) -> fx.Node:
        """The scale eager's ``add(x, other, alpha=s)`` multiplies ``other`` by: ``s`` rounded
        to ``other``'s dtype (CPU's kernels keep alpha in the tensor's own dtype, so a
        bfloat16 gradient is scaled by a bfloat16 lr), in the opmath dtype."""
        dtype = _value(other).dtype
        scale = self.cast(alpha, dtype, _device(other))
        if _opmath(dtype) == dtype:
            return scale
        return self._call("call_method", "to", (scale, _opmath(dtype)))

    def _upcast(self, tensor: fx.Node) -> fx.Node:
        """``tensor`` in its opmath dtype (a bfloat16 gradient as float32): its product with
        the scale is then rounded to its dtype once, where it is added, as eager's fused
        multiply-add does (inserted before the node being rewritten)."""
        dtype = _value(tensor).dtype
        if _opmath(dtype) == dtype:
            return tensor
        return self._call("call_method", "to", (tensor, _opmath(dtype)))

    def _lerp(self, node: fx.Node) -> bool:
        """``x.lerp_(end, s)``: the tensor weight must have ``x``'s dtype, which is eager's
        precision only for float32 and float64."""
        if len(node.args) != 3 or node.kwargs or not self._sym(node.args[2]) \
                or not _is_float_tensor(node.args[0]):
            return False
        dtype = _value(node.args[0]).dtype
        if _opmath(dtype) != dtype:
            return False
        weight = self.cast(node.args[2], dtype, _device(node.args[0]))
        return self._replace(node, (node.args[0], node.args[1], weight), {}, inplace=True)

    def _scalar_base_pow(self, node: fx.Node) -> bool:
        """``s ** step`` (an optimizer's bias correction): the float64 tensor as the base. A
        0-dim exponent then gives a float64 result, which is what the pipeline makes of the
        same pow with a Python base (tracing/bias_corrections.py upcasts it); a larger exponent
        gives eager's dtype, with the base rounded to it as eager does."""
        if len(node.args) != 2 or node.kwargs or not self._sym(node.args[0]) \
                or not _is_float_tensor(node.args[1]):
            return False
        node.args = (self.cast(node.args[0], torch.float64, _device(node.args[1])), node.args[1])
        node.meta["example_value"] = self._fake_run(node.op, node.target, node.args, {})
        return True

    def _foreach_scalar_base_pow(self, node: fx.Node) -> bool:
        """``torch._foreach_pow(s, steps)``: a list of the float64 base, as above."""
        exponents = node.args[1] if len(node.args) == 2 else None
        if node.kwargs or not self._sym(node.args[0]) or not isinstance(exponents, (list, tuple)) \
                or not all(_is_float_tensor(e) for e in exponents):
            return False
        base = self.cast(node.args[0], torch.float64, _device(exponents[0]))
        node.args = ([base] * len(exponents), list(exponents))
        node.meta["example_value"] = self._fake_run(node.op, node.target, node.args, {})
        return True

    def _full_like(self, node: fx.Node) -> bool:
        """``torch.full_like(x, s)`` is ``empty_like(x).fill_(s)``; ``fill_`` takes the float64
        tensor and rounds it to ``x``'s dtype as it rounds the Python number."""
        if len(node.args) != 2 or node.kwargs or not self._sym(node.args[1]) \
                or not _is_float_tensor(node.args[0]):
            return False
        with self.graph.inserting_before(node):
            empty = self._call("call_function", torch.empty_like, (node.args[0],))
            value = self.cast(node.args[1], torch.float64, _device(node.args[0]))
            filled = self._call("call_method", "fill_", (empty, value),
                                value=_value(node))
        node.replace_all_uses_with(filled)
        self.graph.erase_node(node)
        return True

    def _foreach(self, node: fx.Node) -> bool:
        args = list(node.args)
        kwargs = dict(node.kwargs)
        if len(args) != 2 or set(kwargs) - {"alpha"} or not isinstance(args[0], (list, tuple)):
            return False
        dtypes_seen = {_value(t).dtype for t in args[0] if _is_float_tensor(t)}
        if len(dtypes_seen) != 1 or not all(_is_float_tensor(t) for t in args[0]):
            return False
        opmath = _opmath(next(iter(dtypes_seen)))
        target = node.target
        alpha = kwargs.get("alpha")
        if self._sym(alpha):
            others = args[1]
            if target not in _FOREACH_ALPHA or not isinstance(others, (list, tuple)) \
                    or not all(_is_float_tensor(t) for t in others) \
                    or len({_value(t).dtype for t in others}) != 1:
                return False
            with self.graph.inserting_before(node):
                scale = self._alpha(alpha, others[0])
                upcast = [self._upcast(t) for t in others]
                args[1] = self._call("call_function", torch._foreach_mul, (upcast, scale))
            del kwargs["alpha"]
        elif self._sym(args[1]) and not kwargs and opmath in dtypes_seen:
            # a low-precision list: CPU's foreach kernels round some scalars to the list's
            # dtype and not others (mul, not add or div); left to Dynamo's specialization
            scalar = self.cast(args[1], opmath, _device(args[0][0]))
            if target in _FOREACH_SUB:
                with self.graph.inserting_before(node):
                    scalar = self._call("call_function", operator.neg, (scalar,))
                target = _FOREACH_SUB[target]
            args[1] = scalar
        else:
            return False
        inplace = target.__name__.endswith("_")
        return self._replace(node, tuple(args), kwargs, inplace=inplace, target=target)

    def _fma(self, node: fx.Node) -> bool:
        """``prims.fma(x, s, y)``: Dynamo's form of ``y.addcdiv_(t1, t2, value=s)`` (and of
        ``addcmul_``). ``s`` as a tensor of ``x``'s opmath dtype, as a Python number is."""
        if len(node.args) != 3 or node.kwargs or not self._sym(node.args[1]) \
                or not _is_float_tensor(node.args[0]) or self._sym(node.args[0]):
            return False
        scalar = self.cast(node.args[1], _opmath(_value(node.args[0]).dtype), _device(node.args[0]))
        return self._replace(node, (node.args[0], scalar, node.args[2]), {}, inplace=False)

    def _scalar_tensor(self, node: fx.Node) -> bool:
        if len(node.args) != 1 or not self._sym(node.args[0]) \
                or set(node.kwargs) - {"dtype", "device"}:
            return False
        dtype = node.kwargs.get("dtype") or torch.get_default_dtype()
        device = node.kwargs.get("device")
        value = self.cast(node.args[0], dtype, torch.device(device) if device is not None else None)
        node.replace_all_uses_with(value)
        self.graph.erase_node(node)
        return True

    def _replace(self, node: fx.Node, args: tuple, kwargs: dict, *, inplace: bool,
                 target: Any = None) -> bool:
        """Point ``node`` at the new operands; an out-of-place result whose dtype the tensor
        operand changed (a 0-dim low-precision operand) is cast back to eager's."""
        node.args = args
        node.kwargs = kwargs
        if target is not None:
            node.target = target
        if inplace:
            return True
        expected = _value(node)
        if not isinstance(expected, torch.Tensor):
            return True
        got = self._fake_run(node.op, node.target, node.args, node.kwargs)
        if got.dtype != expected.dtype:
            with self.graph.inserting_after(node):
                back = self._call("call_method", "to", (node, expected.dtype), value=expected)
            node.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)
            node.meta["example_value"] = got
        return True


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
    assert last is not None
    return last


def tensorify_float_inputs(gm: fx.GraphModule) -> int:
    """Rewrite ``gm`` (Dynamo's graph) so the dynamic float inputs it knows how to keep are
    used as tensors (see the module docstring). Returns the number of uses rewritten."""
    rewriter = _Rewriter(gm)
    rewritten = 0
    for node in list(rewriter.graph.nodes):
        syms = [a for a in node.all_input_nodes if _is_free_float(a)]
        if not syms or isinstance(node.meta.get("example_value"), torch.SymFloat):
            continue  # float arithmetic stays: the twin of its result replays it
        for sym in syms:
            rewriter.twin(sym)
        if rewriter.rewrite(node):
            rewritten += 1
    for cast in rewriter.casts.values():  # of uses left as they were
        if not cast.users and cast not in rewriter.twins.values():
            rewriter.graph.erase_node(cast)
    for twin in rewriter.twins.values():
        if not twin.users:
            rewriter.graph.erase_node(twin)
    if rewriter.one is not None and not rewriter.one.users:
        rewriter.graph.erase_node(rewriter.one)
    if rewritten:
        rewriter.graph.lint()
        gm.recompile()
    return rewritten


def _is_free_float(node: fx.Node) -> bool:
    """True for a SymFloat Dynamo has not specialized (a float input made dynamic)."""
    value = node.meta.get("example_value")
    return isinstance(value, torch.SymFloat) and bool(value.node.expr.free_symbols)
