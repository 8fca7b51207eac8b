"""Which nodes of a step graph share storage, which nodes write it, and how long a collective
reads its inputs (analysis only: nothing here mutates a graph).

Requires a plain ``fx.Graph`` of aten ops. Guarantees:

* :func:`alias_root` follows aten view ops (``view``, ``t``, ``detach``, ``slice``, and the
  ``getitem`` of a view that returns a list, such as ``split_with_sizes``) back to the node that
  owns the storage; two nodes alias exactly when their roots are the same node;
* :func:`written` names the nodes an op writes in place (the ``Tensor(a!)`` arguments of its
  schema: ``add_``, ``copy_``, foreach and fused optimizer kernels, ``all_reduce_``);
* :func:`readers` lists every op that reads a storage, through any of its views;
* :func:`read_end` is where an op stops reading its inputs: for a functional collective, the
  ``wait_tensor`` that completes it (the process group reads the input asynchronously until
  then: gloo's ``all_gather_into_tensor`` sends it from its own thread), for anything else the
  op itself.

A pass that mutates a node in place must check :func:`readers` up to :func:`read_end`, not the
direct users only (``tests/passes/test_remove_copy.py``: ASGD's averaging read a parameter shard
in place while its all_gather was still sending it).
"""

from __future__ import annotations

from collections import deque

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from spmd_backend.graph import ops


def _is_view_call(node: fx.Node) -> bool:
    target = node.target
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and target.is_view


def _view_parent(node: fx.Node) -> fx.Node | None:
    """The node whose storage ``node`` views (a view op's input; for the ``getitem`` of a
    list-returning view op, that op), or None when ``node`` owns its storage."""
    if _is_view_call(node):
        src = node.args[0] if node.args else None
        return src if isinstance(src, fx.Node) else None
    if ops.is_getitem(node):
        parent = node.args[0]
        if isinstance(parent, fx.Node) and _is_view_call(parent):
            return parent
    return None


def alias_root(node: fx.Node) -> fx.Node:
    """The node that owns ``node``'s storage (``node`` itself unless it is a view)."""
    while True:
        parent = _view_parent(node)
        if parent is None:
            return node
        node = parent


def _views_of(root: fx.Node) -> list[fx.Node]:
    """``root`` and every node that views it, directly or through other views."""
    out: list[fx.Node] = []
    seen: set[fx.Node] = set()
    queue: deque[fx.Node] = deque([root])
    while queue:
        node = queue.popleft()
        if node in seen:
            continue
        seen.add(node)
        out.append(node)
        queue.extend(u for u in node.users if _view_parent(u) is node)
    return out


def readers(root: fx.Node) -> list[fx.Node]:
    """Every op that reads ``root``'s storage through ``root`` or one of its views (the view ops
    themselves excluded; an op that also writes the storage is a reader too)."""
    views = _views_of(root)
    members = set(views)
    out: dict[fx.Node, None] = {}
    for v in views:
        for user in v.users:
            if user not in members:
                out.setdefault(user, None)
    return list(out)


def written(node: fx.Node) -> list[fx.Node]:
    """The nodes ``node`` writes in place (its schema's mutable arguments, list leaves too)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return []
    out: list[fx.Node] = []
    for i, arg in enumerate(target._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        out.extend(leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, fx.Node))
    return out


def waits_of(collective: fx.Node) -> list[fx.Node]:
    """The ``wait_tensor`` nodes that complete ``collective`` (through ``getitem`` for the
    coalesced ones)."""
    out: list[fx.Node] = []
    for user in collective.users:
        if ops.is_wait(user):
            out.append(user)
        elif ops.is_getitem(user):
            out.extend(u for u in user.users if ops.is_wait(u))
    return out


def read_end(node: fx.Node, order: dict[fx.Node, int]) -> int:
    """The position (in ``order``) up to which ``node`` reads its inputs: its last wait for a
    functional collective (the whole graph when it is never waited), else its own."""
    if ops.is_collective(node):
        waits = waits_of(node)
        return max((order[w] for w in waits), default=len(order))
    return order[node]


__all__ = ["alias_root", "read_end", "readers", "waits_of", "written"]
