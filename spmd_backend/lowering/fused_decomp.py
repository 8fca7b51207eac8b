"""Decompose fused optimizer kernels into per-parameter aten math, for Inductor.

Inductor has no lowering for ``_fused_adam``/``_fused_adamw``/``_fused_sgd``: it would call the
functional kernel, which clones every parameter, gradient and moment and then copies them back.
Written as per-parameter pointwise aten ops (what the kernel computes), the update becomes one
fused Inductor loop per parameter that reads and writes the state in place.

:func:`decompose_fused_optimizers` rewrites a graph (for lowering only: new nodes get no fake
values, AOTAutograd re-traces the graph anyway). Both forms are handled: a functional node's
results are rewired, an in-place node becomes the math plus ``copy_`` into its mutated lists.
Bias corrections are computed in float64 from the step tensors and rounded to the parameter
dtype, as the eager kernels do with their double scalars. AMP's arguments (a ``GradScaler``
hands a fused optimizer ``grad_scale`` and ``found_inf``) are computed as the kernels do: the
gradient is divided by ``grad_scale`` and the unscaled gradient is written back, and when
``found_inf`` is 1 nothing changes (every written tensor keeps its old value; the step counters
are decremented by the optimizer's own ops, outside the kernel). Before 2026-11-26 such nodes
were left to the kernel, whose in-place form Inductor could not re-trace: every AMP step with a
fused optimizer ran as the fx graph.

bfloat16 and float16 parameters are updated in float32 (their parameter, gradient and state are
read as float32 and the results rounded back to their own dtypes once), as the kernels compute
with such types: until 2026-11-27 the math ran in the parameter's dtype, where Adam's ``eps``
(1e-8) is 0 in float16, so a float16 parameter under ``Adam(fused=True)`` became nan wherever
its second moment was 0 (eager's kernel trained it), and a bfloat16 one drifted an ulp a step
from eager.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from spmd_backend.errors import SpmdGraphError
from spmd_backend.graph import ops

log = logging.getLogger(__name__)
aten = torch.ops.aten

_ADAM = {
    aten._fused_adam.default: (False, False),
    aten._fused_adam.tensor_lr: (False, False),
    aten._fused_adam_.default: (False, True),
    aten._fused_adam_.tensor_lr: (False, True),
    aten._fused_adamw.default: (True, False),
    aten._fused_adamw.tensor_lr: (True, False),
    aten._fused_adamw_.default: (True, True),
    aten._fused_adamw_.tensor_lr: (True, True),
}
_SGD = {
    aten._fused_sgd.default: False,
    aten._fused_sgd.tensor_lr: False,
    aten._fused_sgd_.default: True,
    aten._fused_sgd_.tensor_lr: True,
}


class _Emitter:
    """Emit aten calls into a graph at the current insertion point."""

    def __init__(self, graph: fx.Graph) -> None:
        self.graph = graph

    def __call__(self, target: object, *args: Any, **kwargs: Any) -> fx.Node:
        return self.graph.call_function(target, args, kwargs)


#: holds the definition of ``spmd_backend::adam_bias_corrections`` (kept alive here)
_LIBRARY = torch.library.Library("spmd_backend", "FRAGMENT")  # noqa: TOR901
_LIBRARY.define(
    "adam_bias_corrections(Tensor[] steps, Tensor lr, float beta1, float beta2) -> (Tensor, Tensor)"
)


def adam_bias_corrections(
    steps: list[torch.Tensor], lr: torch.Tensor, beta1: float, beta2: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``lr / (1 - beta1**t)`` and ``sqrt(1 - beta2**t)`` per step tensor, in float64.

    An opaque op on purpose: Inductor would otherwise inline this scalar math into every
    parameter's update loop and evaluate ``pow`` once per vector of every parameter. Defined
    through a plain ``Library`` kernel rather than ``torch.library.custom_op``, whose Python
    wrapper cost as much as the math (191 against 85 us per call for 10 steps on the
    development CPU): it runs once per parameter group on every step, on the host, so on a GPU
    it is part of a host-bound step's time. The math is eager's, bit for bit.
    """
    t = torch.stack([s if s.dim() == 0 else s.reshape(()) for s in steps]).to(torch.float64)
    step_size = lr.to(torch.float64).div(torch.pow(beta1, t).neg_().add_(1))
    return step_size, torch.pow(beta2, t).neg_().add_(1).sqrt_()


_LIBRARY.impl("adam_bias_corrections", adam_bias_corrections, "CompositeExplicitAutograd")


@torch.library.register_fake("spmd_backend::adam_bias_corrections")
def _adam_bias_corrections_fake(
    steps: list[torch.Tensor], lr: torch.Tensor, beta1: float, beta2: float
) -> tuple[torch.Tensor, torch.Tensor]:
    n = len(steps)
    device = steps[0].device if steps else lr.device
    return (
        torch.empty(n, dtype=torch.float64, device=device),
        torch.empty(n, dtype=torch.float64, device=device),
    )


def _bias_corrections(
    e: _Emitter, steps: list[fx.Node], *, lr: Any, beta1: float, beta2: float
) -> tuple[fx.Node, fx.Node]:
    """Per-parameter step sizes and ``sqrt(1 - beta2**t)``, computed once per group."""
    if not isinstance(lr, fx.Node):
        lr = e(aten.scalar_tensor.default, float(lr), dtype=torch.float64)
    out = e(torch.ops.spmd_backend.adam_bias_corrections.default, steps, lr, beta1, beta2)
    return e(operator.getitem, out, 0), e(operator.getitem, out, 1)


def _adam_one(
    e: _Emitter, p: fx.Node, g: fx.Node, m: fx.Node, v: fx.Node, vmax: fx.Node | None,
    step_size: fx.Node, bc2_sqrt: fx.Node, *, lr: Any, beta1: float, beta2: float,
    weight_decay: float, eps: float, maximize: bool, adamw: bool, dtype: torch.dtype,
) -> tuple[fx.Node, fx.Node, fx.Node, fx.Node | None]:
    if maximize:
        g = e(aten.neg.default, g)
    if weight_decay != 0:
        if adamw:
            decay = (
                e(aten.rsub.Scalar, e(aten.mul.Tensor, lr, weight_decay), 1)
                if isinstance(lr, fx.Node) else 1 - lr * weight_decay
            )
            p = e(aten.mul.Tensor, p, decay)
        else:
            g = e(aten.add.Tensor, g, p, alpha=weight_decay)
    m = e(aten.lerp.Scalar, m, g, 1 - beta1)
    v = e(aten.add.Tensor, e(aten.mul.Tensor, v, beta2), e(aten.mul.Tensor, g, g), alpha=1 - beta2)
    step_size = e(aten._to_copy.default, step_size, dtype=dtype)
    bc2_sqrt = e(aten._to_copy.default, bc2_sqrt, dtype=dtype)
    source = v
    if vmax is not None:
        vmax = e(aten.maximum.default, vmax, v)
        source = vmax
    denom = e(aten.add.Tensor, e(aten.div.Tensor, e(aten.sqrt.default, source), bc2_sqrt), eps)
    p = e(aten.sub.Tensor, p, e(aten.mul.Tensor, e(aten.div.Tensor, m, denom), step_size))
    return p, m, v, vmax


def _sgd_one(
    e: _Emitter, p: fx.Node, g: fx.Node, buf: fx.Node | None, *, lr: Any, momentum: float,
    dampening: float, nesterov: bool, weight_decay: float, maximize: bool, first: bool,
) -> tuple[fx.Node, fx.Node | None]:
    if maximize:
        g = e(aten.neg.default, g)
    if weight_decay != 0:
        g = e(aten.add.Tensor, g, p, alpha=weight_decay)
    if momentum != 0 and buf is not None:
        if first:
            buf = e(aten.clone.default, g)
        else:
            buf = e(aten.add.Tensor, e(aten.mul.Tensor, buf, momentum), g, alpha=1 - dampening)
        g = e(aten.add.Tensor, g, buf, alpha=momentum) if nesterov else buf
    step = e(aten.mul.Tensor, g, lr)
    return e(aten.sub.Tensor, p, step), buf


#: dtypes the kernels update in float32 (their "opmath" type)
_REDUCED = frozenset({torch.float16, torch.bfloat16})


def _dtype(node: fx.Node) -> torch.dtype | None:
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


class _Opmath:
    """Reads a parameter's tensors in the type its kernel computes in and rounds results back
    (a no-op for float32/float64, or where the graph holds no dtype)."""

    def __init__(self, e: _Emitter, param: fx.Node) -> None:
        self.e = e
        dtype = _dtype(param)
        self.dtype = dtype or torch.float32
        self.compute = torch.float32 if dtype in _REDUCED else self.dtype

    def up(self, node: fx.Node | None) -> fx.Node | None:
        if node is None or self.compute == self.dtype or _dtype(node) == self.compute:
            return node
        return self.e(aten._to_copy.default, node, dtype=self.compute)

    def down(self, new: fx.Node | None, like: fx.Node | None) -> fx.Node | None:
        """``new`` rounded to the dtype of the tensor ``like`` it replaces."""
        if new is None or like is None or self.compute == self.dtype:
            return new
        dtype = _dtype(like) or self.dtype
        return new if dtype == self.compute else self.e(aten._to_copy.default, new, dtype=dtype)


class _AmpScaling:
    """AMP's ``grad_scale`` and ``found_inf`` of one fused optimizer node, as its kernel
    applies them (either may be absent: then it changes nothing)."""

    def __init__(self, e: _Emitter, grad_scale: Any, found_inf: Any) -> None:
        self.e = e
        self.grad_scale = grad_scale
        self.scaled = grad_scale is not None
        # the kernels skip the whole update when found_inf == 1 (GradScaler writes 0 or 1)
        self.skip = e(aten.eq.Scalar, found_inf, 1.0) if found_inf is not None else None

    def unscale(self, g: fx.Node) -> fx.Node:
        return g if self.grad_scale is None else self.e(aten.div.Tensor, g, self.grad_scale)

    def keep_if_inf(self, new: fx.Node | None, old: fx.Node | None) -> fx.Node | None:
        if self.skip is None or new is None or old is None or new is old:
            return new
        return self.e(aten.where.self, self.skip, old, new)


def _lists(node: fx.Node, n: int) -> list[list[fx.Node]]:
    return [list(node.args[k]) for k in range(n)]


def _rewire(graph: fx.Graph, node: fx.Node, results: Sequence[Sequence[fx.Node | None]], inplace: bool) -> None:
    lists = _lists(node, len(results))
    if inplace:
        for dst_list, new_list in zip(lists, results):
            for dst, new in zip(dst_list, new_list):
                if new is not None and new is not dst:
                    graph.call_function(aten.copy_.default, (dst, new))
        return
    for user in list(node.users):  # getitem(node, k) -> getitem(., i)
        k = int(user.args[1])
        for inner in list(user.users):
            if not ops.is_getitem(inner):
                raise SpmdGraphError(f"decompose_fused_optimizers: unexpected use {inner.name} of {node.name}")
            i = int(inner.args[1])
            new = results[k][i] if results[k][i] is not None else lists[k][i]
            inner.replace_all_uses_with(new)
            graph.erase_node(inner)
        graph.erase_node(user)


def decompose_fused_optimizers(gm: fx.GraphModule) -> int:
    """Rewrite every fused optimizer node of ``gm`` into aten math; returns how many."""
    graph = gm.graph
    count = 0
    for node in list(graph.nodes):
        target = node.target
        if target not in _ADAM and target not in _SGD:
            continue
        kw = dict(node.kwargs)
        e = _Emitter(graph)
        with graph.inserting_before(node):
            amp = _AmpScaling(e, kw.get("grad_scale"), kw.get("found_inf"))
            if target in _ADAM:
                adamw, inplace = _ADAM[target]
                params, grads, ms, vs, vmaxes, steps = (list(a) for a in node.args[:6])
                new = [[], [], [], [], []]
                step_sizes, bc2_sqrts = _bias_corrections(
                    e, steps, lr=kw["lr"], beta1=kw["beta1"], beta2=kw["beta2"]
                )
                for i, (p, g, m, v) in enumerate(zip(params, grads, ms, vs)):
                    om = _Opmath(e, p)
                    vmax = vmaxes[i] if kw["amsgrad"] and vmaxes else None
                    ug = amp.unscale(om.up(g))
                    np_, nm, nv, nvmax = _adam_one(
                        e, om.up(p), ug, om.up(m), om.up(v), om.up(vmax),
                        e(aten.select.int, step_sizes, 0, i), e(aten.select.int, bc2_sqrts, 0, i),
                        lr=kw["lr"], beta1=kw["beta1"],
                        beta2=kw["beta2"], weight_decay=kw["weight_decay"], eps=kw["eps"],
                        maximize=kw["maximize"], adamw=adamw, dtype=om.compute,
                    )
                    new[0].append(amp.keep_if_inf(om.down(np_, p), p))
                    new[1].append(amp.keep_if_inf(om.down(ug, g), g) if amp.scaled else None)
                    new[2].append(amp.keep_if_inf(om.down(nm, m), m))
                    new[3].append(amp.keep_if_inf(om.down(nv, v), v))
                    if vmaxes:
                        new[4].append(amp.keep_if_inf(om.down(nvmax, vmaxes[i]), vmaxes[i]))
                _rewire(graph, node, new, inplace)
            else:
                inplace = _SGD[target]
                params, grads, bufs = (list(a) for a in node.args[:3])
                new = [[], [], []]
                for i, (p, g) in enumerate(zip(params, grads)):
                    om = _Opmath(e, p)
                    buf = bufs[i] if bufs else None
                    ug = amp.unscale(om.up(g))
                    np_, nb = _sgd_one(
                        e, om.up(p), ug, om.up(buf), lr=kw["lr"], momentum=kw["momentum"],
                        dampening=kw["dampening"], nesterov=kw["nesterov"],
                        weight_decay=kw["weight_decay"], maximize=kw["maximize"],
                        first=kw["is_first_step"],
                    )
                    new[0].append(amp.keep_if_inf(om.down(np_, p), p))
                    new[1].append(amp.keep_if_inf(om.down(ug, g), g) if amp.scaled else None)
                    if bufs:
                        new[2].append(amp.keep_if_inf(om.down(nb, buf), buf))
                _rewire(graph, node, new, inplace)
        graph.erase_node(node)
        count += 1
    if count:
        graph.lint()
        gm.recompile()
        log.debug("decomposed %d fused optimizer node(s) for lowering", count)
    return count

