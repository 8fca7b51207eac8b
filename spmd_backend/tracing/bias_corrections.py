"""Optimizer bias corrections in float64: the one mechanism both front doors use.

Eager (non-capturable) optimizers compute bias corrections on Python doubles; their capturable
(tensor) form, which every traced step uses, computes ``beta ** step`` on the float32 step
tensor, where ``1 - 0.999 ** t`` loses five digits (a 1e-5 relative error in Adam's first
updates). :func:`upcast_bias_corrections` rewrites every ``scalar ** tensor`` whose exponent is
a 0-dim low-precision tensor (``aten.pow.Scalar``, ``aten._foreach_pow.ScalarAndTensor``: in an
optimizer these are exactly the bias corrections) to take the exponent in float64, and
re-derives the fake values of the 0-dim chain that follows, which stays float64 until it meets
the parameters (where the result is rounded to their dtype once, as in eager). A cast of the
chain back to float32 that an in-place op on a float32 temporary left (foreach Adam's
``_foreach_div_(bias_correction1, lr)`` with a float64 ``lr``) is dropped: it rounded foreach
Adam's step size of a float64 model to float32 (6e-8 off eager after three steps, verify 40).

Requires ``meta["val"]`` on the graph's nodes (fake tensors). Guarantees: only pow nodes and
their float64 descendants change; every node keeps a ``meta["val"]`` consistent with its
inputs; new nodes inherit the pow node's annotation. A graph without such a pow is unchanged.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from spmd_backend.graph.meta import inherit
from spmd_backend.graph.ops import SCALAR_POW_TARGETS
from spmd_backend.graph.utils import fake_mode_of, propagate_val

aten = torch.ops.aten


def _low_precision_scalar(node: object) -> bool:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return (
        isinstance(val, torch.Tensor) and val.dim() == 0 and val.is_floating_point()
        and val.dtype != torch.float64
    )


def _to_float64(graph: fx.Graph, e: fx.Node, pow_node: fx.Node, mode: Any) -> fx.Node:
    with graph.inserting_before(pow_node):
        cast = graph.call_function(aten._to_copy.default, (e,), {"dtype": torch.float64})
    propagate_val(cast, mode)
    if "spmd_phase" in pow_node.meta:
        inherit(cast, pow_node)
    return cast


def _spec(val: Any) -> Any:
    return [(t.dtype, tuple(t.shape)) if isinstance(t, torch.Tensor) else t
            for t in pytree.tree_leaves(val)]


def _recompute(node: fx.Node, mode: Any) -> bool:
    """Re-run ``node`` on its inputs' fake values; True when its value's dtypes/shapes changed."""
    if node.op != "call_function":
        return False
    old = node.meta.get("val")
    if node.target is operator.getitem:
        parent = node.args[0].meta.get("val")
        node.meta["val"] = parent[node.args[1]] if parent is not None else None
    else:
        propagate_val(node, mode)
    return _spec(node.meta["val"]) != _spec(old)


def upcast_bias_corrections(graph: fx.Graph) -> int:
    """Rewrite the graph's bias corrections to float64 (see the module docstring); returns the
    number of exponents upcast. The caller recompiles the graph module."""
    dirty: set[fx.Node] = set()
    count = 0
    mode = fake_mode_of(graph)
    if mode is None:
        return 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in SCALAR_POW_TARGETS:
            continue
        exponent = node.args[1]
        elems = list(exponent) if isinstance(exponent, (list, tuple)) else [exponent]
        if not any(_low_precision_scalar(e) for e in elems):
            continue
        new = [_to_float64(graph, e, node, mode) if _low_precision_scalar(e) else e for e in elems]
        count += sum(a is not b for a, b in zip(new, elems))
        node.args = (node.args[0], new if isinstance(exponent, (list, tuple)) else new[0],
                     *node.args[2:])
        dirty.add(node)
    if not dirty:
        return 0
    chain = _scalar_descendants(dirty)
    for node in list(graph.nodes):  # topological order: inputs are re-derived before their users
        if node in chain and _rounds_the_chain(node):
            # the write-back of an in-place op into a float32 temporary (foreach Adam's
            # ``_foreach_div_(bias_correction1, lr)``): the chain stays float64
            dirty.update(node.users)
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
        elif node in dirty and _recompute(node, mode):
            dirty.update(node.users)
    graph.lint()
    return count


def _scalar_descendants(roots: set[fx.Node]) -> set[fx.Node]:
    """``roots`` and every node reached from them through 0-dim values (or lists of them)."""
    def scalar(node: fx.Node) -> bool:
        leaves = pytree.tree_leaves(node.meta.get("val"))
        return bool(leaves) and all(isinstance(t, torch.Tensor) and t.dim() == 0 for t in leaves)

    seen, todo = set(roots), list(roots)
    while todo:
        for user in todo.pop().users:
            if user not in seen and scalar(user):
                seen.add(user)
                todo.append(user)
    return seen


def _rounds_the_chain(node: fx.Node) -> bool:
    """``node`` casts a float64 0-dim value of the upcast chain back to a lower float dtype."""
    if node.op != "call_function" or node.target is not aten._to_copy.default:
        return False
    source = node.args[0]
    val = source.meta.get("val") if isinstance(source, fx.Node) else None
    dtype = node.kwargs.get("dtype")
    return (isinstance(val, torch.Tensor) and val.dim() == 0 and val.dtype == torch.float64
            and isinstance(dtype, torch.dtype) and dtype.is_floating_point
            and dtype != torch.float64 and set(node.kwargs) <= {"dtype", "layout"})
