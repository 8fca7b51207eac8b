"""Optimizer-block surgery shared by passes: split one optimizer block into two.

Requires: an :class:`~spmd_backend.graph.optim.OptimizerBlock` of the graph (fused Adam/AdamW/
SGD or a foreach chain, functional or in-place). Guarantees: :func:`split_optimizer_block`
replaces every list op of the block (the fused kernel or each foreach op, and the step-count
increment) by two ops of the same kind, one over the parameters whose gradient is in
``gradients`` and one over the rest, at the original position; element uses are rewired
(new nodes inherit the annotation and a split fake value), so the two halves compute exactly
what the one block did. It returns the two new blocks (the second is ``None`` when every
gradient was selected) and raises :class:`~spmd_backend.errors.SpmdPassError` when none is.

::

    before:  _foreach_add_([s0, s1, s2], 1)   _fused_adam_([p0, p1, p2], [g0, g1, g2], ...)
    after:   _foreach_add_([s1], 1)  _foreach_add_([s0, s2], 1)
             _fused_adam_([p1], [g1], ...)  _fused_adam_([p0, p2], [g0, g2], ...)

The pass face is :func:`spmd_backend.passes.split_fused_optimizer`; other passes
(``iter_move_grads_and_optimizers``) call this function directly.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch
import torch.fx as fx

from spmd_backend.errors import SpmdPassError
from spmd_backend.graph import ops
from spmd_backend.graph.meta import inherit
from spmd_backend.graph.optim import OptimizerBlock, get_optimizer_blocks, list_length


def _split_value(value: object, idx: list[int], n: int) -> object:
    if isinstance(value, (list, tuple)) and len(value) == n:
        return [value[i] for i in idx]
    return value


def _split_val(val: object, idx: list[int], n: int) -> object:
    if isinstance(val, (list, tuple)):
        if len(val) == n and all(isinstance(v, torch.Tensor) for v in val):
            return [val[i] for i in idx]
        return type(val)(_split_val(v, idx, n) for v in val)
    return val


def _split_node(graph: fx.Graph, node: fx.Node, sel: list[int], rest: list[int]) -> tuple[fx.Node, fx.Node]:
    n = list_length(node)
    halves = []
    with graph.inserting_before(node):
        for idx in (sel, rest):
            args = tuple(_split_value(a, idx, n) for a in node.args)
            kwargs = {k: _split_value(v, idx, n) for k, v in node.kwargs.items()}
            new = graph.call_function(node.target, args, kwargs)
            inherit(new, node)
            if "val" in node.meta:
                new.meta["val"] = _split_val(node.meta["val"], idx, n)
            halves.append(new)
    position = {i: (0, p) for p, i in enumerate(sel)} | {i: (1, p) for p, i in enumerate(rest)}

    def getitem(src: fx.Node, index: int, like: fx.Node) -> fx.Node:
        with graph.inserting_after(src):
            g = graph.call_function(operator.getitem, (src, index))
        inherit(g, like)
        if "val" in like.meta:
            g.meta["val"] = like.meta["val"]
        return g

    for user in list(node.users):
        if not ops.is_getitem(user):
            raise SpmdPassError(f"split_optimizer_block: unexpected user {user.name} of {node.name}")
        k = int(user.args[1])
        inner = [v for v in user.users if ops.is_getitem(v)]
        if inner and len(inner) == len(user.users):  # tuple of lists (fused): user = list k
            half_lists = [getitem(h, k, user) for h in halves]
            for v in list(inner):
                half, p = position[int(v.args[1])]
                v.replace_all_uses_with(getitem(half_lists[half], p, v))
                graph.erase_node(v)
        else:  # list (foreach): user = element k
            half, p = position[k]
            user.replace_all_uses_with(getitem(halves[half], p, user))
        graph.erase_node(user)
    graph.erase_node(node)
    return halves[0], halves[1]


def _block_of(graph: fx.Graph, node: fx.Node) -> OptimizerBlock | None:
    for block in get_optimizer_blocks(graph):
        if node in block.nodes:
            return block
    return None


def split_optimizer_block(
    gm: object, block: OptimizerBlock, gradients: Iterable[fx.Node]
) -> tuple[OptimizerBlock, OptimizerBlock | None]:
    """Split ``block`` of ``gm`` (a graph module or an ``fx.Graph``) over ``gradients``; see the
    module docstring."""
    graph: fx.Graph = gm if isinstance(gm, fx.Graph) else gm.graph  # type: ignore[attr-defined]
    wanted = set(gradients)
    grads = block.gradients
    sel = [i for i, g in enumerate(grads) if g in wanted]
    rest = [i for i, g in enumerate(grads) if g not in wanted]
    if not sel:
        raise SpmdPassError(
            f"split_optimizer_block: none of the given gradients is read by {block.optim.optim_node.name}"
        )
    if not rest:
        return block, None
    n = block.length
    for node in block.nodes:
        if list_length(node) != n:
            raise SpmdPassError(
                f"split_optimizer_block: {node.name} has {list_length(node)} elements, "
                f"the block has {n}; cannot split it consistently"
            )
    firsts: list[fx.Node] = []
    seconds: list[fx.Node] = []
    for node in block.nodes:
        a, b = _split_node(graph, node, sel, rest)
        firsts.append(a)
        seconds.append(b)
    with_sel = _block_of(graph, firsts[0])
    without = _block_of(graph, seconds[0])
    if with_sel is None or without is None:
        raise SpmdPassError("split_optimizer_block: the split halves are not optimizer blocks")
    return with_sel, without
